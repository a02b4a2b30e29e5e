"""Choosing K, the number of drafts per step, from measured acceptance and measured cost.

With a_i the probability that draft i is accepted given drafts < i were, one step with K drafts
yields E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j tokens and costs c(K) seconds; we pick the K with
the highest E(K) / c(K). Acceptance differs by kind of text (code drafts well, prose and
comments less), so the a_i are kept per kind.
"""

from __future__ import annotations

from enum import StrEnum


class TextKind(StrEnum):
    CODE = "code"
    COMMENT = "comment"
    STRING = "string"


def classify(tail: str) -> TextKind:
    """The kind of text at the end of `tail` (a window of recent text), for Python/C-like code."""
    parts = tail.split('"""')
    if len(parts) % 2 == 0:  # an odd number of triple quotes: inside a docstring
        return TextKind.STRING
    line = parts[-1].rsplit("\n", 1)[-1]
    quote: str | None = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" or line.startswith("//", i):
            return TextKind.COMMENT
        i += 1
    return TextKind.STRING if quote else TextKind.CODE


class KPolicy:
    """Per-kind, per-position acceptance averages and a per-K cost table."""

    def __init__(self, k_max: int, costs: list[float], *, decay: float = 0.05,
                 prior: float = 0.6, prior_weight: float = 2.0, probe_every: int = 8,
                 cost_decay: float = 0.05) -> None:
        self.cost_decay = cost_decay
        self.k_max = k_max
        self.set_costs(costs)
        self.decay = decay
        self.prior, self.prior_weight = prior, prior_weight
        self.probe_every = probe_every
        # Per position, exponentially forgotten (accepted, observed) sums. The estimate is
        # (accepted + prior * w) / (observed + w): a few observations move it a long way, and
        # old ones fade. An unobserved position reads as the one before it, so good drafts at
        # position i lift the estimate for i+1, i+2, ... too.
        self.accept: dict[TextKind, list[tuple[float, float]]] = {
            kind: [(0.0, 0.0)] * k_max for kind in TextKind}
        self.steps = 0
        self._probe: int | None = None  # the K of the last probe, until a step of it is seen
        self._probe_gap = probe_every
        self._next_probe = probe_every

    def rates(self, kind: TextKind | None = None) -> list[float]:
        """Conditional acceptance estimate per draft position, for one kind of text or (None)
        for all of them pooled. A kind's estimate leans on the pooled one while it has few
        observations of its own (empirical Bayes), so a rare kind is neither stuck at the
        prior nor thrown about by a handful of steps."""
        if kind is None:
            table = [(sum(self.accept[k][i][0] for k in TextKind),
                      sum(self.accept[k][i][1] for k in TextKind)) for i in range(self.k_max)]
            base = [self.prior] * self.k_max
        else:
            table, base = self.accept[kind], self.rates(None)
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

    def set_costs(self, costs: list[float]) -> None:
        """Measured seconds per step for each K: the shape of the cost curve. Live steps
        scale it as a whole (see `cost`)."""
        if len(costs) != self.k_max + 1 or min(costs) <= 0:
            raise ValueError(f"need {self.k_max + 1} positive step costs, got {costs}")
        self.costs = list(costs)
        self.scale = 1.0

    def cost(self, k: int) -> float:
        """Seconds per step of K drafts now: the calibrated curve times a factor that live
        steps keep current. What moves step costs in use (a longer context, a busier
        machine) moves every K alike, and the policy mostly runs a few Ks, so each step must
        inform all of them; a factor learned from any K does, where per-K averages would keep
        the Ks not run at their start-up values (stale ones then win or lose unfairly)."""
        return self.scale * self.costs[k]

    def best(self, kind: TextKind) -> int:
        """argmax_K E(K) / c(K), in one pass (it runs every step)."""
        total, run, best_k, best_rate = 1.0, 1.0, 0, 1.0 / self.cost(0)
        for k, a in enumerate(self.rates(kind), start=1):
            run *= a
            total += run
            if total / self.cost(k) > best_rate:
                best_k, best_rate = k, total / self.cost(k)
        return best_k

    def choose(self, kind: TextKind) -> int:
        """The best K, but now and then one more, so positions past the current best keep
        being measured and a drop to K = 0 is not forever. A probe that fails doubles the
        gap to the next one (up to 16x), so a model that cannot draft pays little for them."""
        self.steps += 1
        k = self.best(kind)
        if self.probe_every and self.steps >= self._next_probe and k < self.k_max:
            self._probe = k + 1
            self._next_probe = self.steps + self._probe_gap
            return k + 1
        return k

    def observe(self, kind: TextKind, k: int, accepted: int, seconds: float | None = None) -> None:
        """Record a step that verified k drafts and accepted `accepted` of them."""
        acc, keep = self.accept[kind], 1.0 - self.decay
        # Position i is observed only when drafts < i were all accepted.
        for i in range(min(accepted + 1, k)):
            hits, seen = acc[i]
            acc[i] = (hits * keep + (i < accepted), seen * keep + 1.0)
        if seconds is not None and seconds > 0:  # one slow step (a hiccup) moves it a little
            ratio = min(max(seconds / self.costs[k], self.scale / 3), self.scale * 3)
            self.scale += self.cost_decay * (ratio - self.scale)
        if self._probe is not None and self._probe == k:
            failed = accepted < k  # the probed position was not accepted
            self._probe_gap = min(self._probe_gap * 2, 16 * self.probe_every) if failed \
                else self.probe_every
            self._probe = None
