"""Grouped-query attention with optional QKV bias, q/k norm and (Qwen3.5) an output gate,
over the slots' KV caches.

A cached forward writes each row's keys and values into its slot, then attends over a fixed
number of keys (kv_len) with a mask built from the positions. The attention is written out
(two matmuls and a float32 softmax) rather than a fused kernel: each query row's result is
then computed the same way whatever else shares the call, so a position verified among
drafts gives the bits it gives decoded alone (`engine/exec/invariance.py` checks this on the
device at load); on AVX-512 CPUs our kernel does the same in fp32 (`attend`). An engine
that does not promise bit-identical output (fp32 on the CPU, by default) uses the fused
kernel instead (`exact` False). Training and references run whole sequences with the causal
kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine import native
from engine.cache.kv import KEY_BLOCK, CacheBatch, KVCache
from engine.model.config import ModelConfig
from engine.model.layers import Dense, apply_rope, fuse_linears, norm
from engine.native import rows


class Attention(nn.Module):
    FUSED = ("q_proj", "k_proj", "v_proj")  # run as one matmul once fused

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = hd = cfg.head_dim
        # With the gate, q_proj makes per head its query, then its gate's logits.
        self.gated = cfg.attn_output_gate
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd * (1 + self.gated),
                                bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = norm(cfg, hd)
            self.k_norm = norm(cfg, hd)
        self.qk_norm = cfg.qk_norm
        self.fused: Dense | None = None
        # Cached forwards attend with `masked_attention` (rows invariant to the call's shape,
        # see above) unless the engine does not keep speculative output bit-identical.
        self.exact = True

    def fuse(self, weights: bool = True) -> None:
        """Q, K and V as one matmul (see `fuse_linears`)."""
        self.fused = fuse_linears(*(getattr(self, name) for name in self.FUSED),
                                  weights=weights)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: CacheBatch | None = None,
                cache: KVCache | None = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        hq, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.fused is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self.fused(x).split([hq * hd * (1 + self.gated), hkv * hd, hkv * hd],
                                          dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(bsz, seqlen, hq, 2 * hd).chunk(2, dim=-1)  # [B, S, H, D] each
        q = q.reshape(bsz, seqlen, hq, hd)  # [B, S, H, D]
        k = k.view(bsz, seqlen, hkv, hd)  # [B, S, Hkv, D]
        v = v.view(bsz, seqlen, hkv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        if cache is None:  # whole sequences at once (training, references): plain causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            assert batch is not None
            k_all, v_all = cache.update(batch, k, v)  # [B, Hkv, kv_len, D]
            if self.exact:
                y = attend(q, k_all, v_all, batch)
            else:  # the fused kernel: about twice as fast on the CPU, rows shape-dependent
                y = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=batch.mask,
                                                   enable_gqa=True)
        y = y.transpose(1, 2).reshape(bsz, seqlen, hq * hd)  # [B, S, H*D]
        if gate is not None:
            gated = rows.sigmoid_mul(y, gate) if rows.usable(y) else None
            y = gated if gated is not None else y * torch.sigmoid(gate.reshape(bsz, seqlen,
                                                                            hq * hd))
        return self.o_proj(y)


def attend(q: Tensor, k: Tensor, v: Tensor, batch: CacheBatch, scale: float | None = None,
           window: int = 0, mask: Tensor | None = None, ring: int = 0) -> Tensor:
    """`masked_attention` of a cached forward; on CPUs where our kernels run, theirs
    (engine/native/attention.c: the same softmax in fp32, each row over its own keys only,
    without torch's copies of the cache). Every cached forward takes the same path, prefill
    chunks too: a position's bits must not depend on whether a prompt's prefix was reused
    (then its last token runs alone) or prefilled with it. A sliding-window layer (Gemma 4)
    gives its `window` and the `mask` that says the same, and the size of its `ring` where
    k and v are one (cache/ring.py)."""
    if q.device.type == "cpu" and native.available():
        y = native.attention(q, k, v, batch.pos, scale, window, ring)
        if y is not None:
            return y
    return masked_attention(q, k, v, batch.mask if mask is None else mask, scale)


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor,
                     scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale, where mask) v, for q [B, H, S, D] against k, v [B, Hkv, T, D]
    (each group of H / Hkv query heads shares a key head) and mask [B, 1, S, T]; the scale
    1 / sqrt(D) unless given."""
    bsz, hq, seqlen, hd = q.shape
    hkv, group = k.shape[1], hq // k.shape[1]
    qg = q.reshape(bsz, hkv, group * seqlen, hd)  # [B, Hkv, G*S, D]
    scores = (qg @ k.transpose(-1, -2)).view(bsz, hkv, group, seqlen, -1)
    if scale != 1.0:
        scores = scores * (hd ** -0.5 if scale is None else scale)
    if scores.dtype != torch.float32:  # (a conversion that changes nothing still costs a call)
        scores = scores.float()
    scores = torch.where(mask[:, :, None], scores, float("-inf"))  # [B, Hkv, G, S, T]
    probs = torch.softmax(scores, dim=-1)
    if probs.dtype != q.dtype:
        probs = probs.to(q.dtype)
    probs = probs.view(bsz, hkv, group * seqlen, -1)
    return weighted_values(probs, v, blocks=q.is_cuda).view(bsz, hq, seqlen, hd)


def weighted_values(probs: Tensor, v: Tensor, *, blocks: bool) -> Tensor:
    """probs [B, Hkv, R, T] @ v [B, Hkv, T, D]. With `blocks`, summed over blocks of
    KEY_BLOCK keys: one product per block, the blocks' sums added in float32, in order. A GPU
    runs a product of few rows over thousands of keys on a handful of its cores (one tile per
    batch, the keys in a loop: 40 us a layer for the bundled model on an H100); by blocks it
    runs one tile per block. A row's bits still depend on its own keys only."""
    bsz, hkv, rows, keys = probs.shape
    n = keys // KEY_BLOCK
    if not blocks or n < 2 or keys % KEY_BLOCK:
        return probs @ v
    p = probs.view(bsz, hkv, rows, n, KEY_BLOCK).transpose(2, 3)  # [B, Hkv, n, R, block]
    parts = p @ v.reshape(bsz, hkv, n, KEY_BLOCK, v.shape[-1])  # [B, Hkv, n, R, D]
    return parts.float().sum(2).to(v.dtype)
