"""A weight's codes in our kernels' layout, made by encode.c in one pass over its values: the
bits of engine.model.codes.encode then engine.native.layout.pack, in a second or two for a
2B model's weights rather than the ~19 s those torch operators took."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from engine import native
from engine.native.layout import TILE, group_for


@functools.cache
def _fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.wq_encode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    return fn


def takes(weight: Tensor, mode: str) -> bool:
    """Whether `laid_out` takes this weight: int4 or int8, fp32 or bf16 on the CPU, its width
    a multiple of 32, where our kernels run."""
    return (mode in ("int4", "int8") and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.dtype in (torch.float32, torch.bfloat16)
            and group_for(weight.shape[1]) is not None and native.available())


def laid_out(weight: Tensor, mode: str) -> tuple[Tensor, int]:
    """(layout, activation group) of `weight` [N, K] quantized to `mode`, as
    `pack(mode, *encode(weight, mode)[:2], group)` makes them (for what `takes`)."""
    n, k = weight.shape
    group = group_for(k)
    assert group is not None and takes(weight, mode)
    w = weight.detach().contiguous()
    body = group * (8 if mode == "int4" else 16)
    out = torch.empty(-(-n // TILE), k // group, body + 4 * TILE, dtype=torch.uint8)
    if _fn()(w.data_ptr(), int(w.dtype == torch.bfloat16), n, k, 4 if mode == "int4" else 8,
             group, out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError(f"wq_encode: arguments it does not take ({mode}, {tuple(w.shape)})")
    return out, group
