"""Drafting: the MTP modules' chain of drafts after each row's pending token, and bringing a
module's cache up to the trunk where it fell behind. Gemma 4's assistant drafts in the
modules' place as module 0 (decode/assist.py): its every draft queries from the pending
token's position, and it has no cache to bring up.

Module 0's output at the last cached position N-1 (made from h_{N-1} and the pending token
x_N) gives draft 1; draft k >= 2 chains module min(k, M) on the previous draft's hidden
state, one position further on. The chain's stopping rule runs on the device: a row goes on
while the chance that all its drafts so far are accepted stays above the break-even point
of its position (policy/chain.py), or while it has fewer than its floor; it never makes more
than its limit. Rows that stop still run (the shapes are fixed); what they draft is not
kept. On the CPU the chain may end early once no row goes on (`early_exit`): one host read
per draft, which costs nothing there and saves the drafts nobody keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.decode.assist import assist, assist_at
from engine.decode.policy.calibration import CONFIDENCE_BINS
from engine.decode.random import DRAFT
from engine.decode.sampling import RowSampling
from engine.decode.state import ADAPTIVE, FLOOR, K_LIMIT, DecodeState
from engine.model.transformer import Transformer
from engine.native.mtp import ChainArgs, Drafted


@dataclass(slots=True)
class Chain:
    """The draft chain's state for a batch of rows, between drafts."""

    k_limit: Tensor  # [B] the most drafts a row keeps
    floor: Tensor  # [B] the drafts the rule cannot cut
    adaptive: Tensor  # [B] bool: whether the rule applies
    count: Tensor  # [B] drafts kept so far
    alive: Tensor  # [B] bool: whether the row's next draft is kept
    survival: Tensor  # [B] float: the chance that all its drafts so far are accepted
    # The rows still drafting, where our kernels ran the last draft's rule (else None: read
    # `alive`)
    live: int | None = None

    @classmethod
    def start(cls, state: DecodeState, slots: Tensor) -> Chain:
        plan = state.plan[slots]
        k_limit = plan[:, K_LIMIT].contiguous()  # (mtp.c reads them as [B])
        return cls(k_limit, plan[:, FLOOR].contiguous(), plan[:, ADAPTIVE] > 0,
                   torch.zeros_like(k_limit), k_limit > 0,
                   torch.ones(k_limit.shape, device=k_limit.device))


def draft_chain(model: Transformer, caches: Caches, state: DecodeState, slots: Tensor,
                out: Tensor, base: Tensor, k: int, kv_len: int, sampling: RowSampling, *,
                confident: bool, early_exit: bool = False, draft: DraftFn | None = None,
                span: tuple[int, int] | None = None) -> None:
    """Draft up to k tokens for each row into its slot's buffers: out [B, 1, H], module 0's
    output at position base - 1; base [B], the pending token's position. `draft`: the
    function making one draft (`draft_one`, or a compiled copy of it)."""
    draft = draft or draft_one
    chain = Chain.start(state, slots)
    if not confident:  # no row adapts: its drafts' probabilities are not computed, and read 1
        state.confidence.index_fill_(0, slots, 1.0)
    tok = base  # unused by the first draft
    m, j, chained = 0, 1, False
    while j <= k:
        step = state.draft_index[j:j + 1]  # [1], a tensor made once: no copy from the host
        m_in, m = m, max(min(j, model.num_mtp), 1) - 1  # the assistant: as module 0
        out, tok = draft(model, caches, state, slots, step, m_in, m, out, tok, base, kv_len,
                         sampling, chain, confident=confident, first=j == 1, span=span)
        if early_exit and j < k and not (bool(chain.alive.any()) if chain.live is None
                                         else chain.live):
            break
        if early_exit and not chained and model.num_mtp <= j < k and chain.live is not None \
                and draft is draft_one and model.chain_runner is not None:
            # the drafts after, the last module chained on itself, in one call of our kernels
            chained = True
            got = model.chain_runner(
                model, m, out, tok, j0=j + 1, j1=k, draft_index=state.draft_index, base=base,
                offset=-(2 if m == 0 else 1 + m), tables=(caches.cos, caches.sin),
                slots=slots, kv_len=kv_len, span=span, caches=caches.modules[m],
                early_exit=early_exit,
                chain=_chain_args(state, chain, state.draft_index[j + 1:j + 2], confident))
            if got is not None:  # drafts up to j made
                j, chain.live, out, tok = got
                if j == k or chain.live == 0:
                    break
        j += 1
    state.num_drafts[slots] = chain.count


DraftFn = Callable[..., tuple[Tensor, Tensor]]


def draft_one(model: Transformer, caches: Caches, state: DecodeState, slots: Tensor,
              j: Tensor, m_in: int, m: int, out: Tensor, prev: Tensor, base: Tensor,
              kv_len: int, sampling: RowSampling, chain: Chain, *, confident: bool,
              first: bool, span: tuple[int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Draft j (a tensor [1], so that one compiled copy serves every j) for every row:
    module m chains on `out`, module m_in's output at the previous position, and `prev`,
    the previous draft [B] (the first draft reads module 0's output as it is). Writes the
    draft, its probability and (sampled rows) its distribution into the slots' buffers;
    advances `chain`. Returns the module's output [B, 1, H] and the draft [B]."""
    greedy: tuple[Tensor, Tensor | None] | None = None
    native = _native_draft(model, caches, state, slots, j, m_in, m, out, prev, base, kv_len,
                           span, chain, confident=confident, first=first) \
        if model.draft_runner is not None and not sampling.sampled \
        and model.assistant is None else None
    if native is not None and native.live is not None:  # the chain's rule ran there too
        chain.live = native.live
        return native.out, native.tok[:, 0]
    chain.live = None
    if native is not None:
        out, greedy = native.out, (native.tok, native.prob)
    elif not first and model.assistant is not None:  # every draft queries from `base`
        out = assist(model, caches, slots, model.chain_hidden(m_in, out), prev[:, None], base,
                     kv_len, span)
    elif not first:
        h = model.chain_hidden(m_in, out)
        pos = _module_pos(base, j, m)
        out = model.mtp_forward(m, h, prev[:, None], caches.rope(pos),
                                CacheBatch(slots, pos, kv_len, span), caches.modules[m])
    if native is None and not sampling.sampled:
        greedy = model.mtp_greedy(m, out, prob=confident)
    q: Tensor | None = None
    if greedy is not None:
        tok, top = greedy
        conf = None if top is None else top[:, 0]
    else:
        logits = model.mtp_logits(m, out)  # [B, 1, V]
        tok, q = sampling.pick(logits, (base + j)[:, None], DRAFT)  # for position base + j
        conf = _confidence(logits, tok, q) if confident else None
    rows = slots[:, None]  # [B, 1] against j [1]: tensor indices, not a read of j's value
    state.tokens[rows, j] = tok
    if q is not None:
        state.draft_probs[rows, j - 1] = q
    chain.count = chain.count + chain.alive.long()
    go_on = j < chain.k_limit
    if conf is not None:  # the rule (else no row adapts, and the rule lets each go on)
        state.confidence[rows, j - 1] = conf[:, None]
        chain.survival, more = chain_rule(state.chain_accept, state.chain_limit, j,
                                          chain.survival, conf, chain.floor, chain.adaptive)
        go_on = go_on & more
    chain.alive = chain.alive & go_on
    return out, tok[:, 0]


def _native_draft(model: Transformer, caches: Caches, state: DecodeState, slots: Tensor,
                  j: Tensor, m_in: int, m: int, out: Tensor, prev: Tensor, base: Tensor,
                  kv_len: int, span: tuple[int, int] | None, chain: Chain, *, confident: bool,
                  first: bool) -> Drafted | None:
    """`draft_one`'s draft in one call of our kernels (`Transformer.draft_runner`:
    native/mtp.py), the chain's rule after it included, or None where they do not take
    it."""
    runner = model.draft_runner
    assert runner is not None
    args = _chain_args(state, chain, j, confident)
    if first:
        return runner(model, m, out, prob=confident, slots=slots, chain=args)
    pos = _module_pos(base, j, m)
    return runner(model, m, out, prob=confident, m_in=m_in, prev=prev, rope=caches.rope(pos),
                  slots=slots, pos=pos, kv_len=kv_len, span=span, caches=caches.modules[m],
                  chain=args)


def _chain_args(state: DecodeState, chain: Chain, j: Tensor, confident: bool) -> ChainArgs:
    """The chain and the slots' buffers as our kernels run its rule after draft j."""
    return ChainArgs(j, state.tokens, state.confidence if confident else None,
                     state.chain_accept, state.chain_limit, chain.k_limit, chain.floor,
                     chain.adaptive, chain.count, chain.alive, chain.survival)


def _module_pos(base: Tensor, j: Tensor, m: int) -> Tensor:
    """[B, 1]: where module m's entry for draft j goes (base [B]: the pending token's)."""
    return (base + j - (2 if m == 0 else 1 + m))[:, None]


def chain_rule(accept: Tensor, limit: Tensor, j: int | Tensor, survival: Tensor, conf: Tensor,
               floor: Tensor, adaptive: Tensor) -> tuple[Tensor, Tensor]:
    """After draft j of probability conf [B]: the chance that drafts 1..j are all accepted,
    and whether to make draft j + 1 (`DraftChain.more`, for all rows at once; rows the rule
    does not apply to always go on)."""
    j = torch.as_tensor(j, device=conf.device).reshape(1)
    survival = survival * accept[(j - 1).expand_as(conf), _bin(conf)]
    return survival, (j < floor) | (survival > limit[j]) | ~adaptive


def _confidence(logits: Tensor, tok: Tensor, q: Tensor | None) -> Tensor:
    """Each row's probability of its draft [B]: under q when sampled, else the softmax's
    top (one op more than an argmax)."""
    top = torch.softmax(logits[:, 0].float(), -1).max(-1).values
    if q is None:
        return top
    return q[:, 0].gather(-1, tok).squeeze(-1)


def _bin(conf: Tensor) -> Tensor:
    return (conf * CONFIDENCE_BINS).long().clamp(0, CONFIDENCE_BINS - 1)


@torch.inference_mode()
def catch_up(model: Transformer, caches: Caches, slot: int, seq: list[int], start: int,
             end: int, chunk: int = 512) -> Tensor:
    """Run every module over positions start..end-1 of one slot (entry t from h_t and
    x_{t+1} = seq[t + 1]); module 0's output at end-1 [1, 1, H]. The assistant keeps no
    cache: its output for the pending token seq[end]."""
    if model.assistant is not None:
        return assist_at(model, caches, slot, seq, end)
    device = caches.device
    nxt = torch.tensor([seq[start + 1:end + 1]], device=device)
    index = torch.tensor([slot], device=device)
    outs: list[Tensor] = []
    for s in range(start, end, chunk):
        e = min(s + chunk, end)
        pos = torch.arange(s, e, device=device)[None]
        batch = CacheBatch(index, pos, _blocks(e, caches.length), (slot, slot + 1))
        h = caches.hidden[slot:slot + 1, s:e]
        outs = [model.mtp_forward(m, h, nxt[:, s - start:e - start], caches.rope(pos), batch,
                                  kv) for m, kv in enumerate(caches.modules)]
    return outs[0][:, -1:]


def _blocks(n: int, limit: int, block: int = 256) -> int:
    return min(limit, -(-n // block) * block)
