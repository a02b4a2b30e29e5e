"""Gemma 4's dense text model: sliding-window and full-attention layers, keys that double as
values, KV sharing across the last layers, per-layer input embeddings.

Its block (parameter names as transformers' `Gemma4TextDecoderLayer`, so checkpoints load by
name) norms each sublayer's input and output: h = x + norm(attn(norm(x))), then
out = h + norm(mlp(norm(h))), then per-layer inputs (E2B/E4B) add
norm(proj(gelu(gate(out)) * e_i)), and the whole is scaled by the layer's scalar. Attention
is unscaled (the q and k norms stand in for 1/sqrt(D)); values are normed without a weight.

Sliding layers see only the last `sliding_window` keys, through their mask and the kernel's
window; their caches are rings of about twice the window where that is shorter than the
context (cache/ring.py: rollback and prefix reuse as there), else as long as the full
layers'. A KV-shared layer writes no cache: it attends over the keys and values the last
earlier unshared layer of its kind made in the same forward (`Stash`).

The cached forward's attention is `attend` (our CPU kernel, given the window, or
`masked_attention`: rows that do not depend on the call's shape) or, where the engine does
not keep output bit-identical, the fused kernel. Blocks run eager in eager-shaped steps: the
compiled block runner (exec/compile.py) takes the Llama-style block's call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.cache.ring import RingCache, ring_mask
from engine.model.attention import attend
from engine.model.config import FULL, SLIDING, ModelConfig
from engine.model.layers import MLP, Dense, activation, apply_rope, fuse_linears, norm, rope_part

# Layer kind -> the last unshared layer's k, v and the size of the ring they sit in (0: none).
Stash = dict[str, tuple[Tensor, Tensor, int]]
Rope = tuple[Tensor, Tensor]


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str, shared: bool) -> None:
        super().__init__()
        own = cfg.for_kind(kind)
        self.kind, self.shared, self.eps = kind, shared, cfg.rms_norm_eps
        self.num_heads, self.num_kv_heads = cfg.num_heads, own.num_kv_heads
        self.head_dim = hd = own.head_dim
        self.k_eq_v = cfg.attention_k_eq_v and kind == FULL
        self.window = cfg.sliding_window if kind == SLIDING else 0
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=cfg.qkv_bias)
        self.q_norm = norm(cfg, hd)
        if not shared:
            self.k_proj = nn.Linear(cfg.hidden_size, own.num_kv_heads * hd, bias=cfg.qkv_bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(cfg.hidden_size, own.num_kv_heads * hd,
                                        bias=cfg.qkv_bias)
            self.k_norm = norm(cfg, hd)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=cfg.qkv_bias)
        names = ("q_proj",) if shared else ("q_proj", "k_proj") if self.k_eq_v else \
            ("q_proj", "k_proj", "v_proj")
        self.FUSED = names if len(names) > 1 else ()  # run as one matmul once fused
        self.fused: Dense | None = None
        self.exact = True  # as Attention.exact

    def fuse(self, weights: bool = True) -> None:
        if self.FUSED:
            self.fused = fuse_linears(*(getattr(self, name) for name in self.FUSED),
                                      weights=weights)

    def projections(self, x: Tensor) -> list[Tensor]:
        """q, then (unless shared) k, then (unless keys are values) v."""
        if self.fused is None:
            return [getattr(self, name)(x) for name in self.FUSED or ("q_proj",)]
        return list(self.fused(x).split([lin.out_features for lin in
                                         (getattr(self, n) for n in self.FUSED)], dim=-1))

    def forward(self, x: Tensor, rope: Rope, mask: Tensor, stash: Stash,
                batch: CacheBatch | None = None, cache: KVCache | None = None) -> Tensor:
        bsz, seqlen, _ = x.shape
        hq, hkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope
        q, *kv = self.projections(x)
        q = apply_rope(self.q_norm(q.view(bsz, seqlen, hq, hd)), cos, sin).transpose(1, 2)
        if self.shared:
            k, v, ring = stash[self.kind]  # [B, Hkv, T, D]
        else:
            k = kv[0].view(bsz, seqlen, hkv, hd)  # [B, S, Hkv, D]
            v = k if self.k_eq_v else kv[1].view(bsz, seqlen, hkv, hd)
            k = apply_rope(self.k_norm(k), cos, sin).transpose(1, 2)  # [B, Hkv, S, D]
            v = F.rms_norm(v.float(), (hd,), eps=self.eps).to(v.dtype).transpose(1, 2)
            ring = ring_size(cache)
            if cache is not None:
                assert batch is not None
                k, v = cache.update(batch, k, v)  # [B, Hkv, kv_len or ring + 1, D]
            stash[self.kind] = k, v, ring
        if batch is not None and self.exact:
            y = attend(q, k, v, batch, 1.0, self.window, mask, ring)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                               enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, hq * hd))  # [B, S, H*D]


class Gemma4Block(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, shared: bool | None = None) -> None:
        """`shared`: whether the layer reads another's keys and values (default: as
        cfg.kv_sources says; the assistant's layers all read the target's)."""
        super().__init__()
        kind = cfg.layer_types[index]
        shared = cfg.kv_sources[index] != index if shared is None else shared
        self.kind = kind
        self.input_layernorm = norm(cfg)
        self.self_attn = Gemma4Attention(cfg, kind, shared)
        self.post_attention_layernorm = norm(cfg)
        self.pre_feedforward_layernorm = norm(cfg)
        wide = cfg.double_wide_mlp and shared
        self.mlp = MLP(cfg, cfg.intermediate_size * (2 if wide else 1))
        self.post_feedforward_layernorm = norm(cfg)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.per_layer = cfg.hidden_size_per_layer_input > 0
        self.gelu = self.mlp.gelu
        if self.per_layer:
            width = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = nn.Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection = nn.Linear(width, cfg.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm(cfg)

    def fuse(self, weights: bool = True) -> None:
        self.self_attn.fuse(weights)
        self.mlp.fuse(weights)

    def forward(self, x: Tensor, rope: Rope, mask: Tensor, stash: Stash,
                per_layer: Tensor | None, batch: CacheBatch | None = None,
                cache: KVCache | None = None) -> Tensor:
        mixed = self.self_attn(self.input_layernorm(x), rope, mask, stash, batch, cache)
        h = x + self.post_attention_layernorm(mixed)
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if per_layer is not None:
            gated = activation(self.per_layer_input_gate(h), self.gelu) * per_layer
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4Model(nn.Module):
    """The trunk: embeddings scaled by sqrt(hidden), the blocks, the final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma4Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = norm(cfg)
        width = cfg.hidden_size_per_layer_input
        if width:
            total = cfg.num_layers * width
            self.embed_tokens_per_layer = nn.Embedding(cfg.vocab_size_per_layer_input, total)
            self.per_layer_model_projection = nn.Linear(cfg.hidden_size, total, bias=False)
            self.per_layer_projection_norm = norm(cfg, width)

    def forward(self, tokens: Tensor, rope: Rope, batch: CacheBatch | None = None,
                caches: list | None = None) -> Tensor:
        """Final-normed hidden states [B, S, H] (cache-free over whole sequences without a
        batch, else over the slots' caches)."""
        cfg = self.cfg
        x = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, x)
        ring = next((ring_size(c) for c in caches or [] if ring_size(c)), 0)
        masks = attention_masks(batch, tokens.shape[1], cfg.sliding_window, tokens.device, ring)
        ropes = {kind: rope_part(cfg, kind, rope) for kind in masks}
        stash: Stash = {}
        for i, (layer, kind) in enumerate(zip(self.layers, cfg.layer_types, strict=True)):
            x = layer(x, ropes[kind], masks[kind], stash,
                      None if per_layer is None else per_layer[:, :, i],
                      batch, None if caches is None else caches[i])
        return self.norm(x)

    def embed(self, tokens: Tensor) -> Tensor:
        """The input embedding, scaled by sqrt(hidden)."""
        return scaled(self.embed_tokens(tokens), self.cfg.hidden_size)

    def per_layer_inputs(self, tokens: Tensor, x: Tensor) -> Tensor | None:
        """Each layer's input embedding [B, S, L, P]: (norm(proj(x) / sqrt(H)) +
        emb_i(token) * sqrt(P)) / sqrt(2); None without them."""
        cfg, width = self.cfg, self.cfg.hidden_size_per_layer_input
        if not width:
            return None
        shape = (*tokens.shape, cfg.num_layers, width)  # [B, S, L, P]
        own = scaled(self.embed_tokens_per_layer(tokens), width).view(shape)
        proj = self.per_layer_model_projection(x) * cfg.hidden_size ** -0.5
        return (self.per_layer_projection_norm(proj.view(shape)) + own) * 2 ** -0.5


def scaled(emb: Tensor, width: int) -> Tensor:
    """An embedding times sqrt(width), the factor rounded to the embedding's dtype first (as
    transformers does: in bf16, sqrt(3072) = 55.43 multiplies as 55.5)."""
    return emb * torch.full((), width ** 0.5, dtype=emb.dtype, device=emb.device)


def ring_size(cache: object) -> int:
    """The entries of the ring `cache` is (0: it is no ring)."""
    return cache.size if isinstance(cache, RingCache) else 0


def attention_masks(batch: CacheBatch | None, seqlen: int, window: int,
                    device: torch.device, ring: int = 0) -> dict[str, Tensor]:
    """Per layer kind, the keys each query sees: causal for full layers, and for sliding
    ones the last `window` of those (among a `ring`'s entries, where their caches are
    rings). A cached forward's rows sit at batch.pos among batch.kv_len keys; a padding row
    past them (at the scratch position) sees the last window of them, never none: an
    all-masked row's NaNs would reach real rows through the values it writes."""
    if batch is None:
        pos = torch.arange(seqlen, device=device)[None]  # [1, S]
        keys = torch.arange(seqlen, device=device)
        causal = (keys[None, None, :] <= pos[:, :, None])[:, None]  # [1, 1, S, S]
    else:
        pos, keys, causal = batch.pos, torch.arange(batch.kv_len, device=device), batch.mask
        pos = pos.clamp(max=batch.kv_len - 1)
    if not window:
        return {FULL: causal}
    if ring:
        return {FULL: causal, SLIDING: ring_mask(pos, window, ring)}
    recent = (keys[None, None, :] > pos[:, :, None] - window)[:, None]  # [B, 1, S, T]
    return {FULL: causal, SLIDING: causal & recent}
