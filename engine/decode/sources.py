"""A row's drafts for its next step, from the source expected to yield the most: the MTP
modules' (made inside the step just run, for every row that plans them) or the context's
(looked up on the host from the row's own tokens, between steps).

The step reads its drafts from the slot's buffers whatever made them: a row whose next
drafts come from the context has them written there before the step, with the rest of the
step's inputs (no host read is added; a captured step replays unchanged). Output stays
identical to plain decoding: a draft only decides how many of the target's own tokens one
step commits, and for a sampled row a context draft is a draw from a point mass, which
speculative sampling accepts with probability p(d).

Before a step, a row whose drafts came from the context may leave the modules out of it:
when the match is likely to go on and the modules' drafts would not add enough tokens to pay
for the time they take (`modules_pay`).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.decode.context import ContextIndex
from engine.decode.policy import KPolicy, TextKind
from engine.decode.policy.sources import expected

DRAFTS = ("mtp", "context", "both")  # which sources a generation drafts from


@dataclass(frozen=True, slots=True)
class Match:
    """Where context drafts came from: the bucket of the match's length, and the position
    in the sequence of the token the first draft repeats."""

    bucket: int
    start: int


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: list[int]
    confidence: list[float]  # the module's probability per draft; empty for context drafts
    match: Match | None = None  # None: the modules' drafts


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
    if not k:
        return mtp
    context = Proposal(found.tokens[:k], [], Match(found.bucket, found.start))
    if not mtp.tokens:
        return context
    own = (1 + policy.context.value(kind, found.bucket, k)) / policy.verify_cost(k, rows)
    theirs = (1 + mtp_expected(policy, mtp.confidence)) / policy.verify_cost(len(mtp.tokens),
                                                                               rows)
    return context if own > theirs else mtp


def modules_pay(policy: KPolicy, kind: TextKind, seq: list[int], pending: Proposal,
                k_max: int, rows: int) -> bool:
    """Before a step verifying `pending`: whether the modules should draft in it. They
    should unless `pending` came from the context and the drafts the modules would add to
    what the match promises for the step after (if all of `pending` is kept and it goes on)
    are worth less than the time they take, at the run's rate."""
    match = pending.match
    if match is None:
        return True
    nd = len(pending.tokens)
    table = policy.context.tables[match.bucket].rates(kind)
    kept_all = 1.0
    for a in table[:nd]:
        kept_all *= a
    after = match.start + nd + 1  # the match's next token, once the target's own is kept
    ahead = max(0, min(k_max, len(seq) - after))
    from_context = kept_all * policy.context.value(kind, match.bucket, ahead)
    k = policy.best(kind, rows)
    if not k:
        return False
    gain = policy.expected_tokens(kind, k) - 1 - from_context
    return gain > policy.rate * (policy.cost(k, rows) - policy.verify_cost(k, rows))
