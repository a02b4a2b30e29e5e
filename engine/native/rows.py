"""The row-wise kernels of rows.c from torch: RMSNorm (with the residual add before it), the
SwiGLU gate, rotary embeddings, and the argmax and log-sum-exp of logits.

They run where a step runs in bf16 on a CPU with our kernels, with no gradient to keep
(inference); elsewhere the callers' torch operators do. A compiled step calls them as
custom operators, so compiled and eager passes of one engine give the same bits.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch
from torch import Tensor

from engine import native

i64, ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _fns() -> tuple[Any, ...]:  # ctypes functions
    lib = native.kernels().lib
    norm, gate, rope, top = lib.rms_norm, lib.silu_mul, lib.rope, lib.argmax_lse
    out_gate, exp_diff = lib.sigmoid_mul, lib.exp_difference
    norm.restype = gate.restype = rope.restype = top.restype = out_gate.restype = None
    exp_diff.restype = None
    exp_diff.argtypes = [ptr, ptr, i64, ptr]
    out_gate.argtypes = [ptr, i64, ptr, i64, i64, i64, i64, i64, ptr]
    norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ctypes.c_float, ctypes.c_float,
                     ctypes.c_int, ptr]
    gate.argtypes = [ptr, i64, i64, i64, ptr]
    rope.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, ptr]
    top.argtypes = [ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ptr, ctypes.c_int]
    return norm, gate, rope, top, out_gate, exp_diff


def usable(x: Tensor) -> bool:
    """Whether these kernels take x: bf16 on the CPU, in inference, where the kernels run."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu"
            and not torch.is_grad_enabled() and native.available())


def takes_logits(x: Tensor) -> bool:
    """Whether `argmax_lse` takes these logits (fp32 or bf16, on the CPU, in eager
    inference, where the kernels run)."""
    return (x.dtype in (torch.float32, torch.bfloat16) and x.device.type == "cpu"
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and native.available())


def _rows(x: Tensor) -> Tensor:
    """x as rows of its last dim (a view where the strides allow), elements contiguous."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_layout(x: Tensor) -> tuple[Tensor, int, int]:
    """(t, stride, n): x's n rows of its last dim in t's memory, `stride` elements apart. A
    contiguous x (a decode step's usual case) is its own, with no view made: their torch
    calls cost more than the kernels for a decode row."""
    dim = x.shape[-1]
    if x.is_contiguous():
        return x, dim, x.numel() // max(dim, 1)
    rows = _rows(x)
    return rows, rows.stride(0), rows.shape[0]


def rms_norm(x: Tensor, weight: Tensor, offset: float, eps: float, upcast: bool,
             residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(h, y): h = x + residual (x itself without one), y its RMSNorm (see rows.c) by the
    bf16 `weight` (plus `offset` when `upcast`)."""
    if torch.compiler.is_compiling():
        return torch.ops.ahead.rms_norm(x, weight, offset, eps, upcast, residual)
    return _rms_norm(x, weight, offset, eps, upcast, residual)


def _rms_norm(x: Tensor, weight: Tensor, offset: float, eps: float, upcast: bool,
              residual: Tensor | None) -> tuple[Tensor, Tensor]:
    weight = weight.contiguous()
    rows, stride, n = _row_layout(x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    h, res, res_stride = x, None, 0
    if residual is not None:
        res, res_stride, _ = _row_layout(
            residual if residual.shape == x.shape else residual.expand(x.shape))
        h = torch.empty_like(out)
    _fns()[0](rows.data_ptr(), stride, None if res is None else res.data_ptr(), res_stride,
              None if res is None else h.data_ptr(), n, x.shape[-1], weight.data_ptr(), offset,
              eps, int(upcast), out.data_ptr())
    return h, out


def silu_mul(gu: Tensor) -> Tensor:
    """silu(g) * u for gu = [g | u] along its last dim, rounded as torch rounds each."""
    if torch.compiler.is_compiling():
        return torch.ops.ahead.silu_mul(gu)
    return _silu_mul(gu)


def _silu_mul(gu: Tensor) -> Tensor:
    rows, stride, n = _row_layout(gu)
    width = gu.shape[-1] // 2
    out = gu.new_empty(*gu.shape[:-1], width)
    _fns()[1](rows.data_ptr(), stride, n, width, out.data_ptr())
    return out


def sigmoid_mul(y: Tensor, gate: Tensor) -> Tensor | None:
    """y * sigmoid(gate) for y [B, S, H * D] (rows contiguous) and gate [B, S, H, D] (a view
    of QKV's rows: Qwen3.5's output gate), rounded as torch rounds each; None where the
    strides do not suit (torch's path then)."""
    bsz, seqlen, heads, dim = gate.shape
    if y.shape != (bsz, seqlen, heads * dim) or not y.is_contiguous() or gate.stride(-1) != 1 \
            or (bsz > 1 and gate.stride(0) != seqlen * gate.stride(1)) or gate.dtype != y.dtype:
        return None
    if torch.compiler.is_compiling():
        return torch.ops.ahead.sigmoid_mul(y, gate)
    return _sigmoid_mul(y, gate)


def _sigmoid_mul(y: Tensor, gate: Tensor) -> Tensor:
    bsz, seqlen, heads, dim = gate.shape
    out = torch.empty_like(y)
    _fns()[4](y.data_ptr(), heads * dim, gate.data_ptr(), gate.stride(1), gate.stride(2),
              bsz * seqlen, heads, dim, out.data_ptr())
    return out


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """`apply_rope` (model/layers.py) of x [B, S, H, D] by cos, sin [S, 1, R] or
    [B, S, 1, R], with torch's bits; None where the strides do not suit (torch's path then)."""
    bsz, seqlen, _, dim = x.shape
    rot = cos.shape[-1]
    if x.stride(-1) != 1 or (bsz > 1 and x.stride(0) != seqlen * x.stride(1)) \
            or cos.dtype != x.dtype or sin.dtype != x.dtype or rot % 2 or rot > dim:
        return None
    if torch.compiler.is_compiling():
        return torch.ops.ahead.rope(x, cos, sin)
    return _rope(x, cos, sin)


def rope_rows(cos: Tensor, sin: Tensor, bsz: int, seqlen: int) -> tuple[Tensor, Tensor]:
    """cos and sin ([S, 1, R] or [B, S, 1, R]) as rows.c's `rope` reads them: a row of R
    for each of the bsz * seqlen positions, contiguous."""
    rot = cos.shape[-1]
    if cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() \
            == bsz * seqlen * rot:  # a row of each a position already: no views
        return cos, sin
    c, s = (t.expand(bsz, seqlen, 1, rot).reshape(bsz * seqlen, rot) for t in (cos, sin))
    return c, s


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    bsz, seqlen, heads, dim = x.shape
    rot = cos.shape[-1]
    c, s = rope_rows(cos, sin, bsz, seqlen)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _fns()[2](x.data_ptr(), x.stride(1), x.stride(2), bsz * seqlen, heads, dim,
              c.data_ptr(), s.data_ptr(), rot, out.data_ptr())
    return out


def probability(top: Tensor, lse: Tensor) -> Tensor:
    """exp(top - lse): a draft's probability from its logit and the log-sum-exp of its
    logits, by rows.c's `exp_difference` where it runs (the bits mtp.c's chain rule gives
    it), else by torch."""
    if top.dtype != torch.float32 or lse.dtype != torch.float32 or top.shape != lse.shape \
            or not takes_logits(top) or not top.is_contiguous() or not lse.is_contiguous():
        return torch.exp(top - lse)
    out = torch.empty_like(top)
    _fns()[5](top.data_ptr(), lse.data_ptr(), top.numel(), out.data_ptr())
    return out


def argmax_lse(logits: Tensor) -> tuple[Tensor, Tensor]:
    """Per row of logits [..., V] (bf16 or fp32): the index of its first maximum (torch's
    argmax) and its log-sum-exp (fp32)."""
    index, lse, _ = _argmax_lse(logits, False)
    return index, lse


def argmax_max_lse(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`argmax_lse` and the maximum itself (fp32), so that the top token's probability,
    exp(max - lse), needs no gather of it."""
    index, lse, top = _argmax_lse(logits, True)
    assert top is not None
    return index, top, lse


def _argmax_lse(logits: Tensor, value: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    rows = _rows(logits)
    n, shape = rows.shape[0], logits.shape[:-1]
    index = torch.empty(shape, dtype=torch.int64)
    lse = torch.empty(shape, dtype=torch.float32)
    top = torch.empty(shape, dtype=torch.float32) if value else None
    _fns()[3](rows.data_ptr(), rows.stride(0), n, rows.shape[1],
              int(rows.dtype == torch.bfloat16), index.data_ptr(), lse.data_ptr(),
              None if top is None else top.data_ptr(), torch.get_num_threads())
    return index, lse, top


@torch.library.custom_op("ahead::rms_norm", mutates_args=())
def _rms_norm_op(x: Tensor, weight: Tensor, offset: float, eps: float, upcast: bool,
                 residual: Tensor | None) -> tuple[Tensor, Tensor]:
    h, y = _rms_norm(x, weight, offset, eps, upcast, residual)
    return (h.clone() if h is x else h), y  # a custom operator's outputs are its own


@_rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, offset: float, eps: float, upcast: bool,
      residual: Tensor | None) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("ahead::silu_mul", mutates_args=())
def _silu_mul_op(gu: Tensor) -> Tensor:
    return _silu_mul(gu)


@_silu_mul_op.register_fake
def _(gu: Tensor) -> Tensor:
    return gu.new_empty(*gu.shape[:-1], gu.shape[-1] // 2)


@torch.library.custom_op("ahead::sigmoid_mul", mutates_args=())
def _sigmoid_mul_op(y: Tensor, gate: Tensor) -> Tensor:
    return _sigmoid_mul(y, gate)


@_sigmoid_mul_op.register_fake
def _(y: Tensor, gate: Tensor) -> Tensor:
    return torch.empty_like(y)


@torch.library.custom_op("ahead::rope", mutates_args=())
def _rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return _rope(x, cos, sin)


@_rope_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x.new_empty(x.shape)
