"""Grouped-query attention with optional QKV bias and q/k norm, over a slot's KV cache.

Eager today: a batch's projections run together, but attention runs per row (each slot has
its own batch-1 cache and its own key length), and the mask's width follows the row's length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.cache.kv import LayerKV, RowsKV
from engine.model.config import ModelConfig
from engine.model.layers import RMSNorm, apply_rope


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
