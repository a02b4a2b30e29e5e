"""One pre-norm decoder block: attention (full, or Gated DeltaNet in a hybrid model's linear
layers) then the MLP, each added to the residual stream."""

from __future__ import annotations

from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.cache.state import StateCache
from engine.model.attention import Attention
from engine.model.config import FULL, ModelConfig
from engine.model.deltanet import GatedDeltaNet
from engine.model.layers import MLP, norm


class DecoderBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str = FULL) -> None:
        super().__init__()
        self.input_layernorm = norm(cfg)
        self.linear = kind != FULL
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm(cfg)
        self.mlp = MLP(cfg)

    def fuse(self, weights: bool = True) -> None:
        (self.linear_attn if self.linear else self.self_attn).fuse(weights)
        self.mlp.fuse(weights)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], batch: CacheBatch | None = None,
                cache: KVCache | StateCache | None = None) -> Tensor:
        if self.linear:
            assert cache is None or isinstance(cache, StateCache)
            mixed = self.linear_attn(self.input_layernorm(x), batch, cache)
        else:
            assert cache is None or isinstance(cache, KVCache)
            mixed = self.self_attn(self.input_layernorm(x), rope, batch, cache)
        h, normed = self.post_attention_layernorm.residual(x, mixed)
        return h + self.mlp(normed)


def run_block(block: nn.Module, x: Tensor, rope: tuple[Tensor, Tensor],
              batch: CacheBatch | None = None,
              cache: KVCache | StateCache | None = None) -> Tensor:
    """One block's forward, as a function of the block: `Transformer.block_runner` is this, or
    a compiled copy of it (exec/compile.py) that serves every full-attention block alike."""
    return block(x, rope, batch, cache)
