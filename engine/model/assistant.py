"""Gemma 4's `-assistant` drafter (transformers' `gemma4_assistant`): a few Gemma 4 layers
that keep no cache of their own. Each attends over the target's keys and values: a sliding
layer over those of the target's last unshared sliding layer, a full layer over its last
unshared full layer's.

One draft: x = pre_projection([emb(x_{t+1}); h_t]), with emb the target's scaled input
embedding of the token the target has not cached yet and h_t the target's final-normed
hidden state before it; the layers (queries only, rotated at position t+1, seeing the
target's keys of positions <= t, the sliding ones the last `sliding_window` + 1 of them:
transformers' window for them is |q - k| <= sliding_window, counted back from t); the final
norm: out. Logits are head(out) (no soft cap); the next draft starts from
[emb(draft); post_projection(out)] at the same position t+1 over the same keys.

The head of E2B/E4B's assistants is clustered (`CentroidHead`): the top_k of num_centroids
centroids score the hidden state; only the tokens of those clusters are scored, every other
token gets the lowest of those scores less one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.model.config import FULL, SLIDING, ConfigError, ModelConfig
from engine.model.gemma4 import Gemma4Block, attention_masks, ring_size
from engine.model.layers import norm, rope_part

Rope = tuple[Tensor, Tensor]


@dataclass(slots=True)
class AssistantConfig:
    text: ModelConfig  # the assistant's own layers (no per-layer inputs, no MLP widening)
    backbone_hidden_size: int  # the target's width it was trained with
    tie_word_embeddings: bool = True
    ordered: bool = False  # the clustered head (use_ordered_embeddings)
    num_centroids: int = 2048
    top_k: int = 32  # clusters scored (centroid_intermediate_top_k)

    def __post_init__(self) -> None:
        text = self.text
        if text.hidden_size_per_layer_input or text.double_wide_mlp:
            raise ConfigError("an assistant's layers have no per-layer inputs and no "
                              "double-wide MLPs (hidden_size_per_layer_input 0)")
        if self.backbone_hidden_size <= 0:
            raise ConfigError(f"backbone_hidden_size must be positive, got "
                              f"{self.backbone_hidden_size}")
        if self.ordered and not (0 < self.top_k <= self.num_centroids and
                                 text.vocab_size % self.num_centroids == 0):
            raise ConfigError(f"the clustered head needs 0 < centroid_intermediate_top_k "
                              f"({self.top_k}) <= num_centroids ({self.num_centroids}) and "
                              f"num_centroids dividing vocab_size ({text.vocab_size})")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> AssistantConfig:
        if raw.get("model_type") != "gemma4_assistant":
            raise ConfigError(f"model_type {raw.get('model_type')!r} is not a Gemma 4 "
                              "assistant (gemma4_assistant)")
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError("an assistant's config needs its text_config")
        layers, shared = text.get("num_hidden_layers"), text.get("num_kv_shared_layers")
        if shared not in (None, 0, layers):
            raise ConfigError(f"every layer of an assistant reads the target's cache: "
                              f"num_kv_shared_layers must be {layers}, got {shared}")
        try:  # read as a model of its own (all layers shared: the target's caches)
            own = ModelConfig.from_hf({**text, "model_type": "gemma4_text",
                                       "num_kv_shared_layers": 0})
            return cls(own, int(raw.get("backbone_hidden_size", 1536)),
                       bool(raw.get("tie_word_embeddings", True)),
                       bool(raw.get("use_ordered_embeddings", False)),
                       int(raw.get("num_centroids", 2048)),
                       int(raw.get("centroid_intermediate_top_k", 32)))
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"bad value: {e}") from None

    @classmethod
    def from_file(cls, path: Path) -> AssistantConfig:
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read the assistant's config: {e}") from None
        try:
            return cls.from_hf(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that both ahead and transformers read back (all of its layers
        reading the target's caches, as transformers has it)."""
        text = self.text.to_hf()
        text.update(num_kv_shared_layers=self.text.num_layers, hidden_size_per_layer_input=0,
                    vocab_size_per_layer_input=0, architectures=None)
        return {"architectures": ["Gemma4AssistantForCausalLM"],
                "model_type": "gemma4_assistant", "text_config": text,
                "backbone_hidden_size": self.backbone_hidden_size,
                "tie_word_embeddings": self.tie_word_embeddings,
                "use_ordered_embeddings": self.ordered, "num_centroids": self.num_centroids,
                "centroid_intermediate_top_k": self.top_k, "torch_dtype": "float32"}

    def check_target(self, target: ModelConfig) -> None:
        """Raise ConfigError unless the assistant's queries fit the target's keys."""
        text = self.text
        if target.family != "gemma4" or target.num_mtp_modules:
            raise ConfigError("a Gemma 4 assistant drafts for a Gemma 4 model without MTP "
                              f"modules, not a {target.family} one with "
                              f"{target.num_mtp_modules}")
        pairs: list[tuple[str, object, object]] = [
            ("hidden size", self.backbone_hidden_size, target.hidden_size),
            ("vocabulary", text.vocab_size, target.vocab_size)]
        for kind in sorted(set(text.layer_types)):
            ours, theirs = text.for_kind(kind), target.for_kind(kind)
            if kind not in target.layer_types:
                raise ConfigError(f"the assistant has {kind} layers, the target none")
            pairs += [(f"{kind} head size", ours.head_dim, theirs.head_dim),
                      (f"{kind} rope", _rope(ours), _rope(theirs))]
            if ours.num_heads % theirs.num_kv_heads:
                raise ConfigError(f"the assistant's {ours.num_heads} query heads do not "
                                  f"group over the target's {theirs.num_kv_heads} {kind} "
                                  "kv heads")
        for what, ours_value, theirs_value in pairs:
            if ours_value != theirs_value:
                raise ConfigError(f"the assistant does not fit the target: its {what} is "
                                  f"{ours_value}, the target's {theirs_value}")


def _rope(cfg: ModelConfig) -> tuple[object, ...]:
    return cfg.rotary_dim, cfg.rope_theta, cfg.partial_rotary_factor, cfg.rope_scaling


class CentroidHead(nn.Module):
    """Scores only the tokens of the top_k clusters whose centroids score h highest;
    `token_ordering` lists the token ids cluster by cluster."""

    token_ordering: Tensor

    def __init__(self, cfg: AssistantConfig) -> None:
        super().__init__()
        self.top_k, self.num_centroids = cfg.top_k, cfg.num_centroids
        self.centroids = nn.Linear(cfg.text.hidden_size, cfg.num_centroids, bias=False)
        self.token_ordering: Tensor
        self.register_buffer("token_ordering", torch.zeros(cfg.text.vocab_size,
                                                           dtype=torch.long))

    def forward(self, h: Tensor, weight: Tensor) -> Tensor:
        """Logits [B, S, V] of h [B, S, H] against the head's weight [V, H]."""
        vocab = weight.shape[0]
        top = self.centroids(h).topk(self.top_k, dim=-1).indices  # [B, S, K]
        clusters = self.token_ordering.view(self.num_centroids, -1)  # [C, V / C]
        ids = clusters[top].flatten(-2)  # [B, S, K * V / C]: token ids
        scores = (weight[ids] @ h[..., None]).squeeze(-1)  # [B, S, K * V / C]
        # Each row's floor, not the batch's (transformers takes the min over the whole call):
        # a row's drafts must not depend on what shares its step.
        floor = scores.amin(-1, keepdim=True) - 1
        return floor.expand(*scores.shape[:-1], vocab).scatter(-1, ids, scores)


class AssistantModel(nn.Module):
    """The layers (names as transformers' Gemma4TextModel): embed_tokens is the tied head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma4Block(cfg, i, shared=True)
                                    for i in range(cfg.num_layers))
        self.norm = norm(cfg)


class Assistant(nn.Module):
    def __init__(self, cfg: AssistantConfig, target: ModelConfig) -> None:
        super().__init__()
        cfg.check_target(target)
        self.cfg, self.target = cfg, target
        text = cfg.text
        self.window = text.sliding_window + 1  # keys a sliding layer sees (see above)
        self.model = AssistantModel(replace(text, sliding_window=self.window))
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(text.hidden_size, text.vocab_size, bias=False)
        self.pre_projection = nn.Linear(2 * cfg.backbone_hidden_size, text.hidden_size,
                                        bias=False)
        self.post_projection = nn.Linear(text.hidden_size, cfg.backbone_hidden_size, bias=False)
        self.masked_embedding = CentroidHead(cfg) if cfg.ordered else None
        # The target's layer whose cache each kind of the assistant's layers reads: the last
        # of that kind that keeps one (transformers' "store" layers).
        first = target.num_layers - target.num_kv_shared_layers
        kinds = target.layer_types[:first]
        self.sources = {kind: first - 1 - kinds[::-1].index(kind)
                        for kind in (SLIDING, FULL) if kind in text.layer_types}

    def forward(self, h: Tensor, emb: Tensor, rope: Rope, seen: CacheBatch,
                caches: Sequence[object]) -> Tensor:
        """The final-normed output [B, 1, Ha] from the target's hidden state h [B, 1, H] and
        embedding emb [B, 1, H]; `rope`: the target's tables at the query's position;
        `seen`: the rows' slots, with pos the last position their queries see (one before
        the query's own); `caches`: the target's."""
        x = self.pre_projection(torch.cat([emb, h], dim=-1))  # [B, 1, Ha]
        stash = {kind: (*_cache(caches[i]).read(seen), ring_size(caches[i]))
                 for kind, i in self.sources.items()}
        ring = stash[SLIDING][2] if SLIDING in stash else 0
        masks = attention_masks(seen, 1, self.window, x.device, ring)
        for layer, kind in zip(self.model.layers, self.cfg.text.layer_types, strict=True):
            x = layer(x, rope_part(self.target, kind, rope), masks[kind], stash, None, seen)
        return self.model.norm(x)

    @property
    def head_weight(self) -> Tensor:
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings \
            else self.lm_head.weight

    def logits(self, out: Tensor) -> Tensor:
        if self.masked_embedding is not None:
            return self.masked_embedding(out, self.head_weight)
        return F.linear(out, self.head_weight)

    def nbytes(self) -> int:
        """Its parameters' and buffers' memory."""
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *self.buffers()])


def _cache(cache: object) -> KVCache:
    assert isinstance(cache, KVCache)  # an attention layer's (check_target: Gemma 4 only)
    return cache
