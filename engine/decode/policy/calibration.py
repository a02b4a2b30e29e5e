"""Calibration of draft probabilities: how often a draft the module gave probability c is
accepted, per draft position.

Once a draft is made, the module's own probability for it says much more about this draft
than the average does (on the bundled model: about 40% of drafts below 0.1 are accepted,
all above 0.7). The same probability means more further down the chain (a first draft of a
given probability is accepted less often than a fourth), so each position keeps its own
table, leaning on the one pooled over positions where it has seen little.
"""

from __future__ import annotations

from engine.decode.policy.acceptance import Pairs

CONFIDENCE_BINS = 10


def bin_of(confidence: float) -> int:
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)


class Calibration:
    def __init__(self, k_max: int, *, prior: float = 0.6, prior_weight: float = 2.0,
                 decay: float = 0.01, position_weight: float = 20.0) -> None:
        self.k_max, self.prior, self.prior_weight = k_max, prior, prior_weight
        # Per bin of the module's probability for its draft, (accepted, observed) sums over
        # every kind of text, forgotten more slowly than the acceptance rates: pooled over
        # positions, and per position.
        self.pooled: Pairs = [(0.0, 0.0)] * CONFIDENCE_BINS
        self.at: list[Pairs] = [[(0.0, 0.0)] * CONFIDENCE_BINS for _ in range(k_max)]
        self.decay = decay
        # How many observations a position's mean rate takes to move far from the pooled
        # one: it values drafts not yet made, so it only learns while chains reach it, and a
        # few failures must not stop every chain short of it for good.
        self.position_weight = position_weight

    def accept_given(self, confidence: float, position: int | None = None) -> float:
        """The chance that a draft is accepted (drafts before it were), given the module's
        probability for it and its position in the chain (0: the first draft; None: any).
        The position's bin leans on the bin pooled over positions, and that on the
        probability at the bin's middle, while each has few observations (for a module that
        agreed with the trunk exactly, the two would be equal)."""
        b, w = bin_of(confidence), self.prior_weight
        hits, seen = self.pooled[b]
        pooled = (hits + (b + 0.5) / CONFIDENCE_BINS * w) / (seen + w)
        if position is None:
            return pooled
        hits, seen = self.at[position][b]
        return (hits + pooled * w) / (seen + w)

    def mean_acceptance(self, position: int | None = None) -> float:
        """The chance that a draft not made yet at `position` is accepted, given that those
        before it were: that position's rate over every bin, leaning on the rate pooled
        over positions while it has few observations (so a position the chain seldom
        reaches cannot pin it low)."""
        w = self.prior_weight
        pooled = ((sum(h for h, _ in self.pooled) + self.prior * w)
                  / (sum(n for _, n in self.pooled) + w))
        if position is None:
            return pooled
        table, w = self.at[position], self.position_weight
        return (sum(h for h, _ in table) + pooled * w) / (sum(n for _, n in table) + w)

    def observe(self, k: int, accepted: int, confidences: list[float] | tuple[float, ...],
                ) -> None:
        """A step verified k drafts, of the given probabilities, and accepted `accepted`."""
        keep = 1.0 - self.decay
        for i in range(min(accepted + 1, k, len(confidences))):
            b, hit = bin_of(confidences[i]), float(i < accepted)
            for table in (self.pooled, self.at[i]):
                hits, seen = table[b]
                table[b] = (hits * keep + hit, seen * keep + 1.0)
