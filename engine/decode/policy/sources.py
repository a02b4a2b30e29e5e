"""Which source drafts a row's next step, and how far: the MTP modules' chain (made inside
the step, with a probability per draft) or the context's continuation (made on the host,
with the length of the match it came from).

Both are valued by the rule K is chosen by: tokens a step is expected to yield over what the
step costs. A step verifying K drafts without making any costs v(K) (the verify curve);
the modules' drafts are valued by their calibrated probabilities, the context's by the
acceptance seen per bucket of match length, kind of text and draft position. The context's
tables learn only from the drafts verified, so a bucket whose drafts stop paying would never
be tried again: now and then (`Probes`) it drafts one more than its best.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.decode.context import BUCKETS
from engine.decode.policy.acceptance import Acceptance
from engine.decode.policy.choice import Probes, best_k
from engine.decode.policy.kinds import TextKind

Cost = Callable[[int], float]


def expected(rates: Sequence[float]) -> float:
    """E(K) = sum_{i<=K} prod_{j<=i} a_j: the drafts expected to be kept."""
    total, run = 0.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


class ContextPolicy:
    def __init__(self, k_max: int, *, prior: float = 0.5, probe_every: int = 16,
                 decay: float = 0.1) -> None:
        self.k_max, self.decay = k_max, decay
        self.tables = [Acceptance(k_max, prior=prior) for _ in BUCKETS]
        self.probes = [Probes(probe_every) for _ in BUCKETS]
        # Drafts kept per step in which the modules drafted beside the context (0 where
        # the context's drafts were taken instead), over recent steps: what running them
        # has been worth lately where the context drafts too (None: not measured yet).
        self.modules_yield: float | None = None

    def length(self, kind: TextKind, bucket: int, available: int, cost: Cost) -> int:
        """How many of `available` context drafts to verify: the best K by expected tokens
        per second of verifying, now and then one more (a probe)."""
        rates = self.tables[bucket].rates(kind)[:available]
        best, _ = best_k(rates, cost)
        return min(self.probes[bucket].choose(best, available), available)

    def modules_kept(self, accepted: int) -> None:
        """The modules drafted beside the context, and `accepted` of their drafts were kept
        (0: the context's were taken)."""
        y = self.modules_yield
        self.modules_yield = accepted if y is None else y + self.decay * (accepted - y)

    def value(self, kind: TextKind, bucket: int, k: int) -> float:
        """Drafts expected to be kept of k from this bucket."""
        return expected(self.tables[bucket].rates(kind)[:k])

    def observe(self, kind: TextKind, bucket: int, k: int, accepted: int) -> None:
        self.tables[bucket].observe(kind, k, accepted)
        self.probes[bucket].observe(k, accepted)

    def report(self) -> dict[str, list[float]]:
        """Acceptance per draft position for each bucket of match length (code)."""
        return {f">={b}": [round(a, 3) for a in t.rates(TextKind.CODE)]
                for b, t in zip(BUCKETS, self.tables, strict=True)}
