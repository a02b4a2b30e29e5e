"""Building blocks of the dense decoder: RMSNorm, RoPE, GQA attention, SwiGLU, one block.

Parameter names follow Hugging Face's Llama/Qwen modules so that trunk checkpoints load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32, scale in the input dtype: the order HF uses, so bf16 matches too.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LayerKV:
    """One attention layer's cache, allocated once at full length and written in place."""

    __slots__ = ("k", "v")

    def __init__(self, bsz: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (bsz, num_kv_heads, max_seq_len, head_dim)  # [B, Hkv, T, D]
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class RowsKV:
    """One layer's caches for a batch of sequences, one `LayerKV` per row, each with its own
    positions [B, S] and attention mask [S, kv_len_b] (lengths differ between rows)."""

    __slots__ = ("masks", "rows")

    def __init__(self, rows: list[LayerKV], masks: list[Tensor]) -> None:
        self.rows, self.masks = rows, masks


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2], with the config's scaling (linear, llama3 or yarn)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_freq(inv_freq, scaling)
    elif kind == "yarn":
        inv_freq = _yarn_freq(inv_freq, scaling, cfg)
    return inv_freq.float()


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
    dim, base, factor = cfg.head_dim, cfg.rope_theta, float(s["factor"])
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
    """cos, sin [T, D] in the half-split layout HF uses (rotate_half)."""
    t = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(t, rope_inv_freq(cfg))  # [T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [T, D]
    scale = rope_attention_factor(cfg)
    return ((emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype))


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [B, S, H, D]; cos/sin [S, D] for the tokens' positions, or [B, S, D] per row
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], input_pos: Tensor,
                kv: LayerKV | RowsKV | None, mask: Tensor | None) -> Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.num_heads, self.head_dim)  # [B, S, H, D]
        k = self.k_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)  # [B, S, Hkv, D]
        v = self.v_proj(x).view(bsz, seqlen, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        if kv is None:  # whole sequence at once (training, references): plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        elif isinstance(kv, RowsKV):  # a batch: projections above shared, attention per row
            y = torch.cat([_cached_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], pos, row, m)
                           for b, (pos, row, m) in enumerate(zip(input_pos, kv.rows, kv.masks,
                                                                 strict=True))])
        else:
            assert mask is not None
            y = _cached_attention(q, k, v, input_pos, kv, mask)
        y = y.transpose(1, 2).reshape(bsz, seqlen, self.num_heads * self.head_dim)  # [B, S, H*D]
        return self.o_proj(y)


def _cached_attention(q: Tensor, k: Tensor, v: Tensor, input_pos: Tensor, kv: LayerKV,
                      mask: Tensor) -> Tensor:
    """Write k, v [1, Hkv, S, D] at `input_pos` [S], then attend over the first kv_len
    positions (the mask's width), where the mask [S, kv_len] allows."""
    kv_len = mask.shape[-1]
    k_all, v_all = kv.update(input_pos, k, v)
    return F.scaled_dot_product_attention(q, k_all[:, :, :kv_len], v_all[:, :, :kv_len],
                                          attn_mask=mask, enable_gqa=True)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], input_pos: Tensor,
                kv: LayerKV | RowsKV | None, mask: Tensor | None) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, input_pos, kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))
