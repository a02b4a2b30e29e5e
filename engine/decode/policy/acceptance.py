"""Acceptance estimates: per kind of text and draft position, the chance a draft is accepted
given that the drafts before it were (a_i). A step of K drafts then yields
E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j tokens.
"""

from __future__ import annotations

from engine.decode.policy.kinds import TextKind

Pairs = list[tuple[float, float]]  # per position or bin: (accepted, observed) sums


class Acceptance:
    def __init__(self, k_max: int, *, decay: float = 0.05, prior: float = 0.6,
                 prior_weight: float = 2.0) -> None:
        self.k_max, self.decay = k_max, decay
        self.prior, self.prior_weight = prior, prior_weight
        # Per position, exponentially forgotten (accepted, observed) sums. The estimate is
        # (accepted + prior * w) / (observed + w): a few observations move it a long way, and
        # old ones fade. An unobserved position reads as the one before it, so good drafts at
        # position i lift the estimate for i+1, i+2, ... too.
        self.tables: dict[TextKind, Pairs] = {kind: [(0.0, 0.0)] * k_max for kind in TextKind}

    def rates(self, kind: TextKind | None = None) -> list[float]:
        """Conditional acceptance estimate per draft position, for one kind of text or (None)
        for all of them pooled. A kind's estimate leans on the pooled one while it has few
        observations of its own (empirical Bayes), so a rare kind is neither stuck at the
        prior nor thrown about by a handful of steps."""
        if kind is None:
            table = [(sum(self.tables[k][i][0] for k in TextKind),
                      sum(self.tables[k][i][1] for k in TextKind)) for i in range(self.k_max)]
            base = [self.prior] * self.k_max
        else:
            table, base = self.tables[kind], self.rates(None)
        out, last, w = [], self.prior, self.prior_weight
        for (hits, seen), prior in zip(table, base, strict=True):
            if seen > 0:
                last = (hits + prior * w) / (seen + w)
            out.append(last)
        return out

    def expected_tokens(self, kind: TextKind, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates(kind)[:k]:
            run *= a
            total += run
        return total

    def observe(self, kind: TextKind, k: int, accepted: int) -> None:
        """A step verified k drafts and accepted the first `accepted`. Position i is observed
        only when the drafts before it were all accepted."""
        table, keep = self.tables[kind], 1.0 - self.decay
        for i in range(min(accepted + 1, k)):
            hits, seen = table[i]
            table[i] = (hits * keep + (i < accepted), seen * keep + 1.0)
