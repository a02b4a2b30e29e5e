"""The dense decoder trunk with its MTP modules (`mtp.py`), sharing embedding and head.

Draft k > 1 feeds the previous draft's module output back in (pre-norm for DeepSeek, normed
for MiMo and Qwen3-Next: the conventions their servers use). `forward` is the cache-free
full-sequence pass of training and references; decoding calls `trunk`, `mtp_forward`,
`mtp_logits`, `chain_hidden` and `head` on a slot's caches.

A Gemma 4 model may draft with its assistant (`assistant.py`) in the MTP modules' place:
`mtp_logits` and `chain_hidden` are then the assistant's, and decode/assist.py runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.cache.kv import CacheBatch, KVCache
from engine.cache.state import StateCache
from engine.model.assistant import Assistant
from engine.model.attention import Attention
from engine.model.block import DecoderBlock, run_block
from engine.model.codes import Packed
from engine.model.config import ModelConfig
from engine.model.gemma4 import Gemma4Attention, Gemma4Block, Gemma4Model
from engine.model.layers import Dense, norm, rope_tables, same_path
from engine.model.mtp import MTPModule, Rope
from engine.native import rows

if TYPE_CHECKING:
    from engine.decode.draft_vocab import DraftHead


class TrunkModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(cfg, kind) for kind in cfg.layer_types)
        self.norm = norm(cfg)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Gemma4Model(cfg) if cfg.family == "gemma4" else TrunkModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.mtp = nn.ModuleList(MTPModule(cfg) for _ in range(cfg.num_mtp_modules))
        self.chain_normed = cfg.mtp_naming in ("mimo", "mtp")
        # How full-attention blocks and Gated DeltaNet blocks run: `run_block`, or a compiled
        # copy of it for all blocks of the kind (exec/compile.py).
        self.block_runner: Callable[..., Tensor] = run_block
        self.linear_runner: Callable[..., Tensor] = run_block
        # A greedy draft in one call where the blocks run so (native/mtp.py `draft`), else
        # None: decode/draft.py's Python path.
        self.draft_runner: Callable[..., Any] | None = None
        # A trunk's blocks in one call where our kernels take them all (native/layer.py
        # `run_blocks`: None where it does not), else None.
        self.trunk_runner: Callable[..., Tensor | None] | None = None
        # A chain's drafts after its first in one call, where our kernels take them (set
        # with draft_runner: engine/native/mtp.py `chain`).
        self.chain_runner: Callable[..., Any] | None = None
        # The head's quantized weight, once quantized (see engine/model/quant.py); the mode.
        self.head_weight: Callable[[Tensor], Tensor] | None = None
        # The head drafts score, when it is not this one (decode/draft_vocab.py).
        self.draft_head: DraftHead | None = None
        # A drafter of its own checkpoint in the MTP modules' place (Gemma 4's assistant,
        # model/assistant.py), attached after loading.
        self.assistant: Assistant | None = None
        self.quant = "none"  # what runs (model/quant.py), and what was asked for (auto)
        self.quant_asked = "none"
        self.draft_quant = "none"  # what the drafts' matmuls run in (quant.draft_mode)
        self.apply(_init_weights)

    @property
    def num_mtp(self) -> int:
        return len(self.mtp)

    @property
    def drafts(self) -> bool:
        """Whether the step drafts: with MTP modules, or the assistant in their place."""
        return self.num_mtp > 0 or self.assistant is not None

    def embed(self, tokens: Tensor) -> Tensor:
        """The trunk's input embedding of tokens (Gemma 4's scaled by sqrt(hidden))."""
        if isinstance(self.model, Gemma4Model):
            return self.model.embed(tokens)
        return self.model.embed_tokens(tokens)

    def head(self, h: Tensor) -> Tensor:
        if self.head_weight is not None:  # quantized (engine/model/quant.py)
            logits = self.head_weight(h)
        else:
            logits = F.linear(h, self.head_matrix())
        cap = self.cfg.final_logit_softcapping
        return same_path(torch.tanh, logits / cap) * cap if cap else logits

    def head_top(self, h: Tensor, weight: Dense | Packed | None = None
                 ) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor] | None]:
        """The head's logits of h (`weight`'s, where given: the draft head's rows) and, where
        our kernels take them, each row's argmax, maximum and log-sum-exp: summed as our
        product stores the logits (`Packed.top`), else by rows.c over them; None elsewhere."""
        linear = self.head_weight if weight is None else weight
        if isinstance(linear, Packed) and (weight is not None
                                           or not self.cfg.final_logit_softcapping):
            fused = linear.top(h)
            if fused is not None:
                return fused[0], fused[1:]
        logits = self.head(h) if weight is None else weight(h)
        return logits, rows.argmax_max_lse(logits) if rows.takes_logits(logits) else None

    def head_matrix(self) -> Tensor:
        """The head's full-precision weight [V, H]: the tied embedding, or lm_head's."""
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings \
            else self.lm_head.weight

    def fuse(self, weights: bool = True) -> None:
        """Each block's Q, K, V and its gate and up projections as one matmul each, for
        decoding (the parameters stay as they are, views into the fused weights). `weights`
        False: the fused weights left unmade, for quantization (see `fuse_linears`)."""
        for module in self.modules():
            if isinstance(module, DecoderBlock | Gemma4Block):
                module.fuse(weights)

    def set_exact(self, exact: bool) -> None:
        """Whether cached attention keeps each row's bits whatever the call's shape (see
        attention.py); the engine says, from what it promises."""
        for module in self.modules():
            if isinstance(module, Attention | Gemma4Attention):
                module.exact = exact

    def trunk(self, tokens: Tensor, rope: Rope, batch: CacheBatch | None = None,
              caches: Sequence[KVCache | StateCache] | None = None,
              depth: int | None = None) -> Tensor:
        """Final-normed hidden states [B, S, H]; logits are `head()` of them. `depth`: the
        first layers alone (the invariance probe's; Gemma 4 runs all of its layers, whose
        per-layer inputs and shared keys tie them together)."""
        if isinstance(self.model, Gemma4Model):
            return self.model(tokens, rope, batch, caches)
        x = self.model.embed_tokens(tokens)
        layers = self.model.layers if depth is None else self.model.layers[:depth]
        if self.trunk_runner is not None and (
                out := self.trunk_runner(layers, x, rope, batch, caches)) is not None:
            return self.model.norm(out)
        for i, layer in enumerate(layers):
            run = self.linear_runner if layer.linear else self.block_runner
            x = run(layer, x, rope, batch, None if caches is None else caches[i])
        return self.model.norm(x)

    def mtp_forward(self, i: int, h: Tensor, next_tokens: Tensor, rope: Rope,
                    batch: CacheBatch | None = None,
                    caches: Sequence[KVCache] | None = None) -> Tensor:
        """Module i's pre-norm output [B, S, H] from hidden h_t and token x_{t+1}."""
        return self.mtp[i](h, self.model.embed_tokens(next_tokens), rope, batch, caches,
                           run=self.block_runner)

    def mtp_logits(self, i: int, out: Tensor) -> Tensor:
        if self.assistant is not None:
            return self.assistant.logits(out)
        module: MTPModule = self.mtp[i]  # type: ignore[assignment]
        head = self.draft_head or self.head
        return head(module.norm(out))

    def mtp_greedy(self, i: int, out: Tensor, prob: bool = True
                   ) -> tuple[Tensor, Tensor | None] | None:
        """Module i's greedy draft and (`prob`, else None) the softmax's probability of it,
        [B, S] each, from one pass over its logits where our kernels take them (rows.c; the
        drafts' reduced vocabulary scored alone, none of the -inf logits outside it made):
        what `mtp_logits`, an argmax and a softmax give; where the draft head is int4 in our
        kernels' layout, its coarse pass and candidates (`DraftHead.greedy`). None
        elsewhere."""
        if self.assistant is not None or not rows.takes_logits(out):
            return None
        module: MTPModule = self.mtp[i]  # type: ignore[assignment]
        x = module.norm(out)
        if self.draft_head is not None:  # a coarse pass, then its candidates exactly
            picked = self.draft_head.greedy(x, prob)
            if picked is not None:
                index, top, lse = picked
                tok = self.draft_head.ids[index]
                return tok, None if lse is None else rows.probability(top, lse)
        _, best = self.head_top(x, None if self.draft_head is None else self.draft_head.rows)
        assert best is not None  # the logits take out's dtype and device, which rows.c takes
        index, top, lse = best
        tok = index if self.draft_head is None else self.draft_head.ids[index]
        return tok, rows.probability(top, lse) if prob else None

    def chain_hidden(self, i: int, out: Tensor) -> Tensor:
        """What the next draft step receives as its hidden state."""
        if self.assistant is not None:  # back to the target's width
            return self.assistant.post_projection(out)
        module: MTPModule = self.mtp[i]  # type: ignore[assignment]
        return module.norm(out) if self.chain_normed else out

    def forward(self, tokens: Tensor) -> tuple[Tensor, list[Tensor]]:
        """Full-sequence forward without a cache (training and references).

        Returns trunk logits [B, S, V] and, per MTP module i, logits [B, S-1, V] where row t
        predicts token t+2 from (h_t, x_{t+1}): DeepSeek-V3's depth-1 objective for each module.
        """
        seqlen = tokens.shape[1]
        rope = rope_tables(self.cfg, seqlen, tokens.device, self.model.embed_tokens.weight.dtype)
        h = self.trunk(tokens, rope)
        short = (rope[0][: seqlen - 1], rope[1][: seqlen - 1])
        mtp_logits = [self.mtp_logits(i, self.mtp_forward(i, h[:, :-1], tokens[:, 1:], short))
                      for i in range(self.num_mtp)]
        return self.head(h), mtp_logits


def _init_weights(module: nn.Module, std: float = 0.02) -> None:
    """HF's initialisation: N(0, 0.02) matrices, zero biases. PyTorch's N(0, 1) embedding
    would give a tied head logits with a standard deviation of sqrt(hidden_size)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, std=std)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
