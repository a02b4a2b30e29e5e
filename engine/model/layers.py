"""The dense decoder's small parts: RMSNorm, the SwiGLU MLP and rotary position embeddings.

Parameter names follow Hugging Face's Llama/Qwen modules so that trunk checkpoints load by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.model.config import FULL, SLIDING, ModelConfig
from engine.native import rows


class RMSNorm(nn.Module):
    """x / rms(x) * w; with `offset` (Qwen3.5) * (1 + w), w starting at 0."""

    def __init__(self, dim: int, eps: float, offset: bool = False, upcast: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.upcast = offset or upcast  # scale in fp32, then round
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        if self._native(x):
            return rows.rms_norm(x, self.weight, float(self.offset), self.eps, self.upcast)[1]
        if x.dtype == torch.float32 and not self.offset:  # one kernel, the same arithmetic
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32; scale in the input dtype (Llama, Qwen2/3) or in fp32 (Qwen3.5,
        # Gemma 4): the orders HF uses, so bf16 matches too.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.upcast:
            return (xf * (self.weight.float() + float(self.offset))).to(x.dtype)
        return self.weight * xf.to(x.dtype)

    def residual(self, x: Tensor, res: Tensor) -> tuple[Tensor, Tensor]:
        """(x + res, its norm): the residual add and the norm after it, one kernel where
        `rows` runs."""
        if self._native(x) and res.dtype == x.dtype:
            return rows.rms_norm(x, self.weight, float(self.offset), self.eps, self.upcast,
                                 res)
        h = x + res
        return h, self(h)

    def _native(self, x: Tensor) -> bool:
        """Whether rows.c normalises x (bf16 like the weight, in inference on the CPU)."""
        return rows.usable(x) and self.weight.dtype == x.dtype


def norm(cfg: ModelConfig, dim: int | None = None) -> RMSNorm:
    """The config's RMSNorm over `dim` (default: the hidden size)."""
    return RMSNorm(dim or cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset,
                   upcast=cfg.family == "gemma4")


class Dense:
    """x W^T + b with the weight as it is: a fused projection, or what `engine.model.quant`
    replaces with a quantized one (same call)."""

    __slots__ = ("bias", "weight")

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def deferred(self) -> bool:
        """Whether the weight is unmade (`fuse_linears` with `weights` False)."""
        return self.weight.is_meta


def fuse_linears(*linears: nn.Linear, weights: bool = True) -> Dense:
    """One weight (and bias) for several linear layers over the same input, so that they run
    as one matmul; the layers' own parameters become views into it (no memory is added, and
    loading, saving and training see them as before). `weights` False: the fused weight is
    left unmade (on the meta device, its shape and dtype) and the layers keep theirs, for
    engine.model.quant to replace the product with codes it may have on disk (`deferred`)."""
    with torch.no_grad():
        bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
        if not weights:
            first = linears[0].weight
            return Dense(torch.empty(sum(lin.out_features for lin in linears),
                                     first.shape[1], dtype=first.dtype, device="meta"), bias)
        weight = torch.cat([lin.weight for lin in linears])
        start = 0
        for lin in linears:
            end = start + lin.out_features
            lin.weight.data = weight[start:end]
            if bias is not None:
                lin.bias.data = bias[start:end]
            start = end
    return Dense(weight, bias)


SAME_PATH_ROW = 64  # elements: a whole number of any CPU's vectorised chunks (AVX-512 bf16: 64)


def same_path(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """fn (elementwise) with every element computed by the same kernel path. ATen's CPU
    loops run a contiguous tensor in vectorised chunks and its last numel % chunk elements
    in a scalar loop, which rounds exp, softplus or sigmoid differently (Sleef against libm):
    which rows fall in that tail depends on how many rows share the call (on AVX-512, every
    call whose size is not a multiple of 32 floats). Each row padded to a multiple of
    SAME_PATH_ROW elements leaves no tail."""
    pad = -x.shape[-1] % SAME_PATH_ROW
    return fn(F.pad(x, (0, pad)))[..., :x.shape[-1]] if pad else fn(x.contiguous())


class MLP(nn.Module):
    FUSED = ("gate_proj", "up_proj")  # one matmul once fused

    def __init__(self, cfg: ModelConfig, width: int = 0) -> None:
        """`width`: the intermediate size, if not the config's."""
        super().__init__()
        width = width or cfg.intermediate_size
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"
        self.fused: Dense | None = None

    def fuse(self, weights: bool = True) -> None:
        """Gate and up as one matmul (see `fuse_linears`)."""
        self.fused = fuse_linears(*(getattr(self, name) for name in self.FUSED),
                                  weights=weights)

    def forward(self, x: Tensor) -> Tensor:
        if self.fused is None:
            return self.down_proj(activation(self.gate_proj(x), self.gelu) * self.up_proj(x))
        gu = self.fused(x)
        if not self.gelu and rows.usable(gu):
            return self.down_proj(rows.silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(activation(gate, self.gelu) * up)


def activation(x: Tensor, gelu: bool) -> Tensor:
    """The gate's nonlinearity: silu, or gelu in its tanh form (Gemma; its tanh rounds
    differently in a vectorised loop's scalar tail: see `same_path`)."""
    return same_path(_gelu_tanh, x) if gelu else F.silu(x)


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [R/2] of the R rotary dims, with the config's scaling (linear,
    llama3 or yarn)."""
    dim, base = cfg.rotary_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_freq(inv_freq, scaling, cfg)
    elif kind == "proportional":
        inv_freq = _proportional_freq(cfg, float(scaling.get("factor") or 1.0))
    return inv_freq.float()


def _proportional_freq(cfg: ModelConfig, factor: float) -> Tensor:
    """Gemma 4's full layers: the first partial_rotary_factor of each half of the head
    rotates, at the frequencies of a head_dim-wide rope; the rest at frequency 0 (cos 1,
    sin 0: passed through)."""
    angles = int(cfg.partial_rotary_factor * cfg.head_dim // 2)
    exps = torch.arange(0, 2 * angles, 2, dtype=torch.int64).float() / cfg.head_dim
    rotated = 1.0 / (cfg.rope_theta ** exps)
    return torch.cat([rotated, torch.zeros(cfg.head_dim // 2 - angles)]) / factor


def rope_attention_factor(cfg: ModelConfig) -> float:
    """YaRN scales cos/sin (and so the logits) by a temperature; other kinds by 1."""
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
    return _yarn_mscale(factor)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _llama3_freq(inv_freq: Tensor, s: dict) -> Tensor:
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended smoothly.
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, out)


def _yarn_freq(inv_freq: Tensor, s: dict, cfg: ModelConfig) -> Tensor:
    dim, base, factor = cfg.rotary_dim, cfg.rope_theta, float(s["factor"])
    orig_len = s.get("original_max_position_embeddings") or cfg.max_position_embeddings
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1 where the frequency is kept as trained
    return inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate


def rope_tables(cfg: ModelConfig, max_seq_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [T, 1, R] (R the rotary dims; the 1 broadcasts over heads) in the half-split
    layout HF uses, with sin's first half negated: `apply_rope`'s rotate-half is then a roll.
    Gemma 4's are its sliding layers' tables then its full layers' along R (`rope_part`)."""
    if cfg.family == "gemma4":
        parts = [_rope_table(cfg.for_kind(kind), max_seq_len, device, dtype)
                 for kind in (SLIDING, FULL)]
        return torch.cat([c for c, _ in parts], -1), torch.cat([s for _, s in parts], -1)
    return _rope_table(cfg, max_seq_len, device, dtype)


def _rope_table(cfg: ModelConfig, max_seq_len: int, device: torch.device,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))  # [T, R/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, R]
    scale = rope_attention_factor(cfg)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    sin[:, :sin.shape[1] // 2] *= -1
    return cos[:, None].to(device, dtype), sin[:, None].to(device, dtype)


def rope_part(cfg: ModelConfig, kind: str, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """A Gemma 4 layer kind's own tables out of `rope_tables`' packed ones."""
    start = 0 if kind == SLIDING else cfg.for_kind(SLIDING).rotary_dim
    width = cfg.for_kind(kind).rotary_dim
    return rope[0][..., start:start + width], rope[1][..., start:start + width]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, S, H, D] rotated by `rope_tables`' rows for its positions, cos/sin [S, 1, R] (or
    [B, S, 1, R] per row); the first R dims rotate, the rest pass (partial rotary).

    HF's x * cos + cat(-x2, x1) * sin, bit for bit (negation is exact), in four kernels: the
    sign sits in the table and the half swap is a roll."""
    if rows.usable(x) and (y := rows.rope(x, cos, sin)) is not None:
        return y
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    return x * cos + x.roll(rot // 2, -1) * sin
