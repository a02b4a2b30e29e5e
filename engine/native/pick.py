"""A draft head's greedy pick from torch (engine/decode/draft_vocab.py `DraftHead.greedy`):
its rows' 2-bit layout, made from their int4 one (encode.c `wq_coarse_from_int4`), and the
coarse pass over it followed by the candidates' tiles in int4 (wq.c `wq_draft_pick`)."""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from engine import native
from engine.native.layout import TILE

i64, ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _fns() -> tuple[Any, Any]:  # ctypes functions
    lib = native.kernels().lib
    coarse, pick = lib.wq_coarse_from_int4, lib.wq_draft_pick
    coarse.restype = None
    coarse.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int]
    pick.restype = ctypes.c_int
    pick.argtypes = [ptr, ptr, i64, i64, i64, ptr, i64, ctypes.c_int, i64, ctypes.c_int,
                     ptr, ptr, ptr]
    return coarse, pick


def coarse_layout(w: Tensor, group: int) -> Tensor:
    """The 2-bit layout (wq.c) of an int4 one [tiles, K / group, block]: each code rounded
    to one of four levels, each scale times 5."""
    tiles, groups, _ = w.shape
    out = w.new_empty(tiles, groups, group * TILE // 4 + 4 * TILE)
    w = w.contiguous()
    _fns()[0](w.data_ptr(), tiles, groups, group, out.data_ptr(), torch.get_num_threads())
    return out


def draft_pick(x: Tensor, coarse: Tensor, w: Tensor, n: int, group: int, tiles: int,
               prob: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per row of x [..., K] (fp32 or bf16), a greedy draft from a head of n rows, its 2-bit
    layout `coarse` and its int4 layout `w`: the coarse pass's best `tiles` tiles scored in
    int4, and the first largest of those. Returns the index, its logit and (`prob`) the
    log-sum-exp, [...] each."""
    rows = (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
    shape = x.shape[:-1]
    index = torch.empty(shape, dtype=torch.int64)
    top = torch.empty(shape)
    lse = torch.empty(shape) if prob else None
    if _fns()[1](coarse.data_ptr(), w.data_ptr(), n, x.shape[-1], group, rows.data_ptr(),
                 rows.numel() // max(x.shape[-1], 1), int(rows.dtype == torch.bfloat16), tiles,
                 torch.get_num_threads(), index.data_ptr(), top.data_ptr(),
                 None if lse is None else lse.data_ptr()) != 0:
        raise MemoryError("the draft pick could not allocate its scratch memory")
    return index, top, lse
