"""A quantized matmul: codes of a weight in int8 (one scale per output row) or int4 (a scale
and a zero per group of inputs), and the product by them (`Packed`). Which weights of a model
are quantized, and the cache of their codes: engine/model/quant.py.

On a memory-bound machine a decoding step costs the bytes of weights it reads: int8 reads a
quarter of fp32, int4 an eighth (plus its scales). Who multiplies:

- on CPUs with AVX-512 VNNI, our kernels (engine/native): int8 activations per group of
  inputs (as llama.cpp's Q8_0), integer dot products, weights streamed once per call for all
  its rows (a verify of 4 rows costs about 1.2 rows), a row's bits its own; on CPUs with
  AMX-INT8, calls of many rows (prefills, int8 verifies) on its tiles, the same bits;
- elsewhere torch's: `aten._weight_int8pack_mm` (CPU, bf16 activations, one row at a time),
  `aten._weight_int4pack_mm_for_cpu` (CPU) or `aten._weight_int4pack_mm` (tinygemm, CUDA),
  groups of 128 inputs (64 or 32 where a layer is narrower);
- int8dyn: int8 weights and int8 activations (one scale per row) with `torch._int_mm`
  (oneDNN's integer GEMM), CPU only.

Measured on a 2-core AVX-512/AMX CPU, one thread, Qwen2-1.5B's shapes, bf16, a step after
512 tokens (`ahead bench engine --preset qwen2-1.5b --quant ...`): plain step int4 94 ms with
our kernels, 163 with torch's; int8 144 and 282 (bf16 unquantized 371; 446 before our
attention kernel). torch's kernels run one row at a time: a verify of 4 rows cost them
1.6-2x a plain step, and a 512-token prefill 6x bf16's.

Codes are round to nearest; int4 asymmetric, min-max per group.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import native

ACT = torch.bfloat16  # activations of torch's kernels


class QuantError(ValueError):
    """A quantization mode this model or device cannot run."""


class Packed:
    """x W^T + b with W quantized: the same call as `Dense`."""

    __slots__ = ("bias", "bias32", "codes", "group", "mode", "native", "native_group",
                 "out_features", "packed", "raw_scales", "scales")

    def __init__(self, mode: str, codes: Tensor, scales: Tensor, bias: Tensor | None,
                 group: int = 0) -> None:
        """codes: int8 [N, K] (int8), or [N, K / 2] uint8, two 4-bit codes a byte (int4);
        scales: [N] (int8) or [N, K / group, 2] scale and zero (int4), fp32."""
        self.mode, self.codes, self.group, self.bias = mode, codes, group, bias
        self.out_features, self.raw_scales = codes.shape[0], scales
        self.native = False  # our kernels (engine/native) multiply, else torch's
        cuda = codes.device.type == "cuda"
        in_features = codes.shape[1] * (2 if mode == "int4" else 1)
        self.native_group = group or native.group_for(in_features) or 0
        if not cuda and mode in ("int8", "int4") and native.available() and self.native_group:
            self._run_native(native.pack(mode, codes, scales, self.native_group))
            return
        if mode in ("int8", "int8dyn"):
            if cuda:
                raise QuantError(f"{mode} has no CUDA path here yet: use quant = \"int4\"")
            self.packed = codes.t() if mode == "int8dyn" else codes  # [K, N] for _int_mm
            self.scales = scales.float() if mode == "int8dyn" else scales.to(ACT)
        else:
            rows = -codes.shape[0] % 16  # the int4 layouts tile 16 outputs: zero rows pad
            q = F.pad(torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1),
                      (0, 0, 0, rows))
            scales = F.pad(scales, (0, 0, 0, 0, 0, rows))
            if cuda:  # tinygemm's layout: uint8 nibbles, then tiles
                self.packed = torch.ops.aten._convert_weight_to_int4pack(
                    (q[:, ::2] << 4 | q[:, 1::2]).contiguous(), 8)
            else:
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                    q.to(torch.int32), 1)
            self.scales = scales.transpose(0, 1).contiguous().to(ACT)  # [K / group, N, 2]

    def __call__(self, x: Tensor) -> Tensor:
        if self.native:
            return native.linear(x, self.packed, self.bias32, 4 if self.mode == "int4" else 8,
                                 self.out_features, self.native_group)
        if self.mode == "int8dyn":
            return self._dynamic(x)
        rows = x.reshape(-1, x.shape[-1]).to(ACT)
        if self.mode == "int8":
            y = torch.ops.aten._weight_int8pack_mm(rows, self.packed, self.scales)
        elif rows.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(rows, self.packed, self.group, self.scales)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group,
                                                           self.scales)
        y = y[:, :self.out_features].to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def top(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
        """y = self(x) and per row of it [...] its argmax, maximum and log-sum-exp (fp32),
        summed while our kernel stores y (wq.c `wq_linear_top`: a head's logits are not read
        again); None where our kernel does not run this eagerly in inference."""
        if not self.native or torch.compiler.is_compiling() or torch.is_grad_enabled() \
                or x.dtype not in (torch.float32, torch.bfloat16):  # (y as the kernel stores it)
            return None
        shape = x.shape[:-1]
        index = torch.empty(shape, dtype=torch.int64)
        top, lse = torch.empty(shape), torch.empty(shape)
        y = native.kernels().run_linear(x, self.packed, self.bias32,
                                        4 if self.mode == "int4" else 8, self.out_features,
                                        self.native_group, (index, lse, top))
        return y, index, top, lse

    @classmethod
    def laid_out(cls, mode: str, layout: Tensor, bias: Tensor | None, group: int,
                 out_features: int) -> Packed:
        """The product our kernels run from weights already in their layout (`native.pack`'s,
        with activation groups of `group` inputs: a cache's), used as they are."""
        self = cls.__new__(cls)
        self.mode, self.bias, self.out_features = mode, bias, out_features
        self.group, self.native_group = group if mode == "int4" else 0, group
        self.codes = self.raw_scales = layout.new_empty(0)
        self._run_native(layout)
        return self

    def _run_native(self, layout: Tensor) -> None:
        """Our kernels multiply, from `layout` (native.pack's)."""
        self.native, self.packed, self.scales = True, layout, layout.new_empty(0)
        self.bias32 = None if self.bias is None else self.bias.float().contiguous()

    def drop_codes(self) -> None:
        """Forget the codes where another form of them runs (`packed`): only a cache write
        needs them, which takes that form where it is our kernels' layout."""
        if self.packed is not self.codes:
            self.codes = self.raw_scales = self.codes.new_empty(0)

    def _dynamic(self, x: Tensor) -> Tensor:
        """int8 activations too, one scale per row (so a row's result is its own), and an
        integer matmul: int32 sums are exact in any order, so the kernel's blocking, and
        how many rows share the call, cannot change a bit; its weights are read once for all
        rows (a verify of several rows costs about one)."""
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = rows.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        acc = torch._int_mm(torch.round(rows / scale).to(torch.int8), self.packed)
        y = (acc.float() * scale * self.scales).to(x.dtype).view(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales))


class QuantLinear(nn.Module):
    """An nn.Linear whose weight is `Packed` (the module call sites stay as they are)."""

    def __init__(self, packed: Packed) -> None:
        super().__init__()
        self.packed = packed

    def forward(self, x: Tensor) -> Tensor:
        return self.packed(x)


def group_size(in_features: int) -> int:
    """Inputs per int4 group: GROUP, or the largest of 64, 32 that divides a narrower row
    (the kernels' activation groups are the same)."""
    group = native.group_for(in_features)
    if group is None:
        raise QuantError(f"int4 needs a layer width divisible by 32, not {in_features}")
    return group


def encode(weight: Tensor, mode: str) -> tuple[Tensor, Tensor, int]:
    """(codes, scales, group) of `weight` [N, K]: see `Packed`. Row blocks of ENCODE_ROWS at
    a time, so that the fp32 temporaries stay in cache (a 2B model's first load spent 24 s
    here on whole-matrix passes)."""
    parts = [_encode(block.float(), mode) for block in weight.split(ENCODE_ROWS)]
    codes, scales = (torch.cat([p[i] for p in parts]) for i in (0, 1))
    return codes, scales, 0 if mode in ("int8", "int8dyn") else group_size(weight.shape[1])


ENCODE_ROWS = 256


def _encode(w: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    # In place after the first operation: a fresh block-sized temporary for each step took
    # half of the time (a 2B model's first load: ~13 s -> ~6 s), for the same values.
    if mode in ("int8", "int8dyn"):
        scale = w.abs().amax(dim=1).clamp_(min=1e-12) / 127
        codes = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        return codes, scale
    group = group_size(w.shape[1])
    wg = w.view(w.shape[0], -1, group)  # [N, K / g, g]
    low, high = torch.aminmax(wg, dim=-1, keepdim=True)
    scale = ((high - low) / 15).clamp_(min=1e-12)
    q = (wg - low).div_(scale).round_().clamp_(0, 15).to(torch.uint8).view(w.shape[0], -1)
    # The kernels compute (q - 8) * scale + zero: the zero is the value of code 8.
    scales = torch.cat([scale, low + 8 * scale], dim=-1)  # [N, K / g, 2]
    return (q[:, ::2] | q[:, 1::2] << 4).contiguous(), scales


def decode(codes: Tensor, scales: Tensor, mode: str, group: int) -> Tensor:
    """The weight [N, K] (fp32) the codes stand for: what the kernels multiply by."""
    if mode in ("int8", "int8dyn"):
        return codes.float() * scales.float()[:, None]
    q = torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1, group).float()
    return ((q - 8) * scales[..., :1] + scales[..., 1:]).view(codes.shape[0], -1)
