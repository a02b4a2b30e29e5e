"""A row's drafts for its next step, from the source expected to yield the most: the MTP
modules' (made inside the step just run, for every row that plans them) or the context's
(looked up on the host from the row's own tokens, between steps).

The step reads its drafts from the slot's buffers whatever made them: a row whose next
drafts come from the context has them written there before the step, with the rest of the
step's inputs (no host read is added; a captured step replays unchanged). Output stays
identical to plain decoding: a draft only decides how many of the target's own tokens one
step commits, and for a sampled row a context draft is a draw from a point mass, which
speculative sampling accepts with probability p(d).

Before a step, a row may leave the modules out of it (`modules_pay`): where the drafts of
theirs that such steps have kept lately (measured, not modelled: the modules run where the
context has nothing, which is where their drafts are hardest), beyond what the context
promises for the step after, would not pay for the time they take.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.decode.context import ContextIndex
from engine.decode.policy import KPolicy, TextKind
from engine.decode.policy.sources import expected

DRAFTS = ("mtp", "context", "both")  # which sources a generation drafts from


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]
    confidence: list[float]  # the module's probability per draft; empty for context drafts
    bucket: int | None = None  # context drafts': of their match's length
    source: str = "mtp"  # what made them: "mtp", "context" or "given" (a caller)


def mtp_expected(policy: KPolicy, confidence: list[float]) -> float:
    """Drafts expected to be kept of the modules' chain with these probabilities."""
    return expected([policy.accept_given(c, i) for i, c in enumerate(confidence)])


def propose(policy: KPolicy, kind: TextKind, seq: list[int], index: ContextIndex | None,
            mtp: Proposal, limit: int, fixed: int | None, rows: int) -> Proposal:
    """The drafts to verify next: the modules' `mtp` or the context's (None for `index`: the
    row does not draft from the context), whichever yields more tokens per second of
    verifying; `limit`: the most drafts; `fixed`: that many, where there are (a fixed K:
    the modules' where they made any, else the context's, whatever the policy has learned)."""
    if index is None or (fixed is not None and mtp.tokens):
        return mtp
    found = index.draft(seq, limit)
    if found is None:
        return mtp
    available = len(found.tokens)
    if fixed is not None:
        k = min(fixed, available)
    else:
        k = policy.context.length(kind, found.bucket, available,
                                  lambda n: policy.verify_cost(n, rows))
    value = policy.context.value(kind, found.bucket, k)
    if not k:
        return mtp
    context = Proposal(found.tokens[:k], [], found.bucket, "context")
    if not mtp.tokens:
        return context
    own = (1 + value) / policy.verify_cost(k, rows)
    theirs = (1 + mtp_expected(policy, mtp.confidence)) / policy.verify_cost(len(mtp.tokens),
                                                                               rows)
    return context if own > theirs else mtp


def modules_pay(policy: KPolicy, kind: TextKind, seq: list[int], index: ContextIndex,
                pending: Proposal, k: int, k_max: int, rows: int) -> bool:
    """Before a step verifying `pending`, for which the policy chose to draft up to `k`:
    whether the modules should draft in it beside the context. They should unless the
    drafts of theirs kept lately in such steps, beyond what the context offers for the step
    after, are worth less than the time they take at the run's rate. The context offers
    its continuation past `pending` (and past the target's own token after it), should all
    of `pending` be kept."""
    if pending.bucket is not None:
        rates = policy.context.tables[pending.bucket].rates(kind)
    else:
        rates = [policy.accept_given(c, i) for i, c in enumerate(pending.confidence)]
    kept_all = 1.0
    for a in rates[:len(pending.tokens)]:
        kept_all *= a
    found = index.draft(seq, k_max + 1, pending.tokens)
    past = 0.0
    if found is not None and len(found.tokens) > 1:
        # the first token found must be the target's own (as a draft's acceptance); the
        # rest are the drafts: a0 * (a1 + a1 a2 + ...)
        first = policy.context.tables[found.bucket].rates(kind)[0]
        past = policy.context.value(kind, found.bucket, len(found.tokens)) - first
    measured = policy.context.modules_yield
    kept = policy.expected_tokens(kind, k) - 1 if measured is None else measured
    gain = kept - kept_all * past
    return gain > policy.rate * (policy.cost(k, rows) - policy.verify_cost(k, rows))
