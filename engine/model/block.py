"""One pre-norm decoder block: attention then the MLP, each added to the residual stream."""

from __future__ import annotations

from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.model.attention import Attention
from engine.model.config import ModelConfig
from engine.model.layers import MLP, RMSNorm


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def fuse(self) -> None:
        self.self_attn.fuse()
        self.mlp.fuse()

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: CacheBatch | None = None,
                cache: KVCache | None = None) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), rope, batch, cache)
        return h + self.mlp(self.post_attention_layernorm(h))
