"""Chained self-distillation: train one MTP module the way decoding chains it.

At decode time draft 1 comes from module 0 at position t (inputs h_t and x_{t+1}); draft d > 1
feeds the previous draft's hidden state and token back in one position further on, and
attends to the module's committed entries (positions <= t) plus the chain's own entries. Plain
MTP training only ever shows the module trunk hidden states; here, depth d's queries see
exactly what decoding shows them, and learn the trunk's own distribution for token t+d+1 (so
a draft is what verification will accept). Depth 1 is the ordinary distillation loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model.block import DecoderBlock
from engine.model.layers import apply_rope, rope_tables
from engine.model.mtp import MTPModule
from engine.model.transformer import Transformer


def _block(block: DecoderBlock, x: Tensor, cos: Tensor, sin: Tensor, keys: list[Tensor],
           values: list[Tensor], mask: Tensor) -> Tensor:
    """One decoder block whose queries attend to earlier streams' keys plus their own."""
    attn = block.self_attn
    bsz, seqlen, _ = x.shape
    xn = block.input_layernorm(x)
    q = attn.q_proj(xn).view(bsz, seqlen, attn.num_heads, attn.head_dim)  # [B, S, H, D]
    k = attn.k_proj(xn).view(bsz, seqlen, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(xn).view(bsz, seqlen, attn.num_kv_heads, attn.head_dim)
    if attn.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
    keys.append(k)  # [B, Hkv, S, D]
    values.append(v.transpose(1, 2))
    y = F.scaled_dot_product_attention(q, torch.cat(keys, dim=2), torch.cat(values, dim=2),
                                       attn_mask=mask, enable_gqa=True)
    h = x + attn.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))
    return h + block.mlp(block.post_attention_layernorm(h))


def chain_logits(model: Transformer, tokens: Tensor, depth: int) -> tuple[list[Tensor], Tensor]:
    """Per depth d, the module's log-probs [B, S, V] at rows t (position t + d - 1, input
    token x_{t+d}, drafting x_{t+d+1}); and the trunk's log-probs [B, L, V] (no gradient)."""
    module = model.mtp[0]
    assert isinstance(module, MTPModule) and len(module.blocks) == 1
    block = module.blocks[0]
    assert isinstance(block, DecoderBlock)
    length = tokens.shape[1]
    seqlen = length - 1 - depth  # rows t whose chain reaches depth `depth` inside the batch
    if seqlen < 1:
        raise ValueError(f"sequences of {length} tokens are too short for depth {depth}")
    cos, sin = rope_tables(model.cfg, length, tokens.device, model.model.embed_tokens.weight.dtype)
    with torch.no_grad():
        h0 = model.trunk(tokens, (cos, sin))
        teacher = F.log_softmax(model.head(h0).float(), dim=-1)  # row p predicts x_{p+1}
    rows = torch.arange(seqlen, device=tokens.device)
    causal = rows[None, :] <= rows[:, None]  # stream 1: committed entries at positions <= t
    own = torch.eye(seqlen, dtype=torch.bool, device=tokens.device)  # chain entries of row t
    keys: list[Tensor] = []
    values: list[Tensor] = []
    hidden, students = h0[:, :seqlen], []
    for d in range(1, depth + 1):
        pos = rows + d - 1
        emb = model.model.embed_tokens(tokens[:, d:d + seqlen])  # x_{t+d}
        e, hn = module.enorm(emb), module.hnorm(hidden)
        x = module.eh_proj(torch.cat([hn, e] if module.hidden_first else [e, hn], dim=-1))
        mask = torch.cat([causal] + [own] * (d - 1), dim=1)  # [S, d*S]
        out = _block(block, x, cos[pos], sin[pos], keys, values, mask)
        students.append(F.log_softmax(model.mtp_logits(0, out).float(), dim=-1))
        hidden = model.chain_hidden(0, out)
    return students, teacher


def chained_distill_loss(model: Transformer, tokens: Tensor, depth: int = 3,
                         weights: tuple[float, ...] = (1.0, 0.8, 0.6, 0.5)) -> Tensor:
    """Weighted KL(trunk || module) over chain depths 1..depth, for a one-module model."""
    students, teacher = chain_logits(model, tokens, depth)
    bsz, seqlen = students[0].shape[:2]
    total = teacher.new_zeros(())
    for d, student in enumerate(students, start=1):
        kl = F.kl_div(student, teacher[:, d:d + seqlen], log_target=True, reduction="sum")
        total = total + weights[min(d, len(weights)) - 1] * kl / (bsz * seqlen)
    return total
