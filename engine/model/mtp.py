"""MTP modules of the DeepSeek-V3 kind, sharing the trunk's embedding and head.

An MTP module turns the trunk's hidden state at position t and the embedding of token t+1
into a hidden state that predicts token t+2:
    h' = Block(Proj([enorm(emb(x_{t+1})); hnorm(h_t)]))      logits = head(norm(h'))
MiMo checkpoints concatenate in the other order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.model.block import DecoderBlock, run_block
from engine.model.config import ModelConfig
from engine.model.layers import norm

Rope = tuple[Tensor, Tensor]


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.enorm, self.hnorm = norm(cfg), norm(cfg)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.mtp_layers_per_module))
        self.norm = norm(cfg)
        self.hidden_first = cfg.mtp_naming == "mimo"

    def forward(self, h: Tensor, emb: Tensor, rope: Rope, batch: CacheBatch | None = None,
                caches: Sequence[KVCache] | None = None,
                run: Callable[..., Tensor] = run_block) -> Tensor:
        e, hn = self.enorm(emb), self.hnorm(h)
        x = self.eh_proj(torch.cat([hn, e] if self.hidden_first else [e, hn], dim=-1))  # [B, S, H]
        for i, block in enumerate(self.blocks):  # full attention, also in hybrid models
            x = run(block, x, rope, batch, None if caches is None else caches[i])
        return x
