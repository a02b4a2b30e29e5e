"""The decode step: verify every row's pending token and drafts, accept on the device, bring
the MTP modules along, draft the next step; one host read at the end.

A row is a slot. Each verifies `width` tokens (its pending token, then its drafts, padded
with whatever the buffer holds past its real drafts), so every row of every step runs the
same shapes: its tokens are the ones plain decoding of the row alone gives. The trunk's
output over the window also feeds the modules: module entry t is made from h_t and x_{t+1},
which for the verified positions are the drafts kept and then the target's own token. The
whole step is a function of fixed-shape tensors (`DecodeState`, the caches, the slot index
tensor); `width`, `drafts` and `kv_len` are the shape of one variant. No Python loop runs
over rows or slots; the draft chain loops over draft positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.decode.accept import accept, accept_synthetic, accept_target
from engine.decode.assist import assist
from engine.decode.draft import DraftFn, draft_chain, draft_one
from engine.decode.quality import token_logprobs
from engine.decode.sampling import RowSampling
from engine.decode.state import DecodeState
from engine.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class Shape:
    """One variant of the step: what is fixed while it is compiled or captured."""

    width: int  # tokens verified per row: the pending one and up to width - 1 drafts
    drafts: int  # drafts made for the next step (0: the modules do not run)
    kv_len: int  # keys each row attends over
    sampled: bool = False  # some row samples (else every row is greedy)
    nucleus: bool = False  # some row cuts the tail (top-p)
    confident: bool = False  # some row adapts: the chain rule runs on each draft's probability
    early_exit: bool = False  # eager only: end the chain once no row goes on
    span: tuple[int, int] | None = None  # eager only: the slots are these, in order

    def window(self) -> Shape:
        """What the verify depends on (whether the modules run, not how many drafts), so
        that a compiled verify serves every K."""
        return Shape(self.width, min(self.drafts, 1), self.kv_len, self.sampled, self.nucleus,
                     span=self.span)


@dataclass(frozen=True, slots=True)
class StepFns:
    """The functions a step runs: these, or compiled copies of them (exec/compile.py)."""

    verify: VerifyFn
    draft: DraftFn


def decode_step(model: Transformer, caches: Caches, state: DecodeState, slots: Tensor,
                shape: Shape, fns: StepFns | None = None) -> Tensor:
    """One step of the rows in `slots` [B]. Returns, per row, the verified window's tokens
    (the first n + 1 are committed), n, the drafts made for the next step, their
    probabilities, and the window tokens' log-probabilities under the target (see
    `quality.py`): [B, 2 * width + 2 + 2 * drafts] float64, read by the host in one
    transfer."""
    fns = fns or EAGER
    out, n, last, logp = fns.verify(model, caches, state, slots, shape.window())
    k = shape.drafts
    if k:
        draft_chain(model, caches, state, slots, last, state.lengths[slots], k, shape.kv_len,
                    row_sampling(state, slots, shape), confident=shape.confident,
                    early_exit=shape.early_exit, draft=fns.draft, span=shape.span)
    else:  # a scalar by value: `[slots] = 0` would copy a host tensor, which no graph captures
        state.num_drafts.index_fill_(0, slots, 0)
    state.given.index_fill_(0, slots, False)  # the drafts now waiting are the modules'
    made = state.tokens[slots, 1:k + 1]
    return torch.cat([out.double(), n[:, None].double(), state.num_drafts[slots, None].double(),
                      made.double(), state.confidence[slots, :k].double(), logp.double()], dim=1)


def verify_window(model: Transformer, caches: Caches, state: DecodeState, slots: Tensor,
                  shape: Shape) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Verify each row's window, accept, commit on the device, and (when the step drafts)
    bring the modules along. Returns the window's tokens [B, W], the drafts kept n [B],
    module 0's output at the new last cached position [B, 1, H] (the assistant's for the
    new pending token; h itself when not drafting), and each window token's
    log-probability under the target [B, W]."""
    width = shape.width
    tokens = state.tokens[slots, :width]  # [B, W]
    length = state.lengths[slots]  # [B]
    pos = length[:, None] + torch.arange(width, device=tokens.device)  # [B, W]
    batch = CacheBatch(slots, pos, shape.kv_len, shape.span, per_position=True)
    rope = caches.rope(pos)
    h = model.trunk(tokens, rope, batch, caches.trunk)  # [B, W, H]
    caches.hidden[slots[:, None], pos] = h
    q = _draft_probs(state, slots, tokens, width) if shape.sampled else None
    # [B, W, V]: once for the argmax, log-probs and p; argmax and log-sum-exp in one pass
    logits, best = (model.head(h), None) if shape.sampled else model.head_top(h)
    lse = None
    if best is not None:
        target, _, lse = best
        out, n = accept_target(tokens[:, 1:], target, state.num_drafts[slots])
    else:
        logits = logits.float()
        out, n = accept(tokens[:, 1:], logits, state.num_drafts[slots], q,
                        row_sampling(state, slots, shape), pos + 1)
    if state.synthetic is not None:  # a benchmark's chosen acceptance
        out, n = accept_synthetic(tokens[:, 1:], out, state.num_drafts[slots], state.synthetic,
                                  state.seed[slots], pos + 1)
    logp = token_logprobs(logits, out, lse)
    pending = out.gather(1, n[:, None])  # [B, 1]: the target's own token
    caches.commit(slots, n)  # recurrent layers: the state after the last kept position
    state.lengths[slots] = length + n + 1  # the pending token's position
    state.tokens[slots, 0] = pending[:, 0]
    if not shape.drafts:
        return out, n, h[:, :1], logp
    if model.assistant is not None:  # no cache to bring along: its query for the pending
        last = h.gather(1, n[:, None, None].expand(-1, 1, h.shape[-1]))  # h at length + n
        first = assist(model, caches, slots, last, pending, length + n + 1, shape.kv_len,
                       shape.span)
        return out, n, first, logp
    # Module entries for the window: x_{t+1} is the next draft, then the pending token.
    nxt = torch.cat([tokens[:, 1:], pending], dim=1).scatter(1, n[:, None], pending)
    outs = [model.mtp_forward(m, h, nxt, rope, batch, kv)
            for m, kv in enumerate(caches.modules)]  # every module's cache catches up
    return out, n, outs[0].gather(1, n[:, None, None].expand(-1, 1, h.shape[-1])), logp


def _draft_probs(state: DecodeState, slots: Tensor, tokens: Tensor, width: int) -> Tensor:
    """q of each row's drafts [B, W-1, V]: the modules' distributions, or point masses at
    the drafts the host gave."""
    q = state.draft_probs[slots, :width - 1]
    point = torch.zeros_like(q).scatter_(-1, tokens[:, 1:, None], 1.0)
    return torch.where(state.given[slots][:, None, None], point, q)


def row_sampling(state: DecodeState, slots: Tensor, shape: Shape) -> RowSampling:
    return RowSampling(state.temperature[slots], state.top_p[slots], state.seed[slots],
                       shape.sampled, shape.nucleus)


VerifyFn = Callable[[Transformer, Caches, DecodeState, Tensor, Shape],
                    tuple[Tensor, Tensor, Tensor, Tensor]]
EAGER = StepFns(verify_window, draft_one)


def unpack(row: list[float], shape: Shape) -> tuple[list[int], int, list[int], list[float]]:
    """One row of `decode_step`'s result: the committed tokens, the drafts made, and their
    probabilities."""
    w, k = shape.width, shape.drafts
    n, count = int(row[w]), int(row[w + 1])
    tokens = [int(t) for t in row[:n + 1]]
    drafts = [int(t) for t in row[w + 2:w + 2 + count]]
    return tokens, n, drafts, row[w + 2 + k:w + 2 + k + count]


def unpack_logprobs(row: list[float], shape: Shape) -> list[float]:
    """One row's log-probabilities of its committed tokens (as `unpack` gives them)."""
    start = shape.width + 2 + 2 * shape.drafts
    return row[start:start + int(row[shape.width]) + 1]
