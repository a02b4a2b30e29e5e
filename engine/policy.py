"""Choosing K, the number of drafts per step, from measured acceptance and measured cost.

With a_i the probability that draft i is accepted given drafts < i were, one step with K drafts
yields E(K) = 1 + sum_{i<=K} prod_{j<=i} a_j tokens and costs c(K) seconds; we pick the K with
the highest E(K) / c(K). Acceptance differs by kind of text (code drafts well, prose and
comments less), so the a_i are kept per kind.

That choice is made before the drafts exist. Once a draft is made, the module's own
probability for it says much more about this draft than the average does (on the bundled
model: about 40% of drafts below 0.1 are accepted, all above 0.7), so the chain of drafts
stops where going on no longer pays (`DraftChain`): each draft's acceptance is read from a
calibration table of draft probability against outcome, kept from verified steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

CONFIDENCE_BINS = 10


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
                 cost_decay: float = 0.05, shape_decay: float = 0.02) -> None:
        self.cost_decay, self.shape_decay = cost_decay, shape_decay
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
        # Calibration: per draft position and bin of the module's probability for its draft,
        # (accepted, observed) sums over every kind, forgotten more slowly than the rates;
        # and the same summed over positions. The same probability means more further down
        # the chain (on the bundled model a first draft of a given probability is accepted
        # less often than a fourth), so each position keeps its own, leaning on the pooled
        # one where it has seen little.
        self.calibration: list[tuple[float, float]] = [(0.0, 0.0)] * CONFIDENCE_BINS
        self.calibration_at: list[list[tuple[float, float]]] = [
            [(0.0, 0.0)] * CONFIDENCE_BINS for _ in range(k_max)]
        self.calibration_decay = 0.01
        # How many observations a position's mean rate takes to move far from the pooled
        # one: it values drafts not yet made, so it only learns while chains reach it, and a
        # few failures must not stop every chain short of it for good.
        self.position_weight = 20.0
        self.plan_every = 8  # observed steps between refreshes of the draft chain's tables
        self._plan: tuple[list[list[float]], list[float]] | None = None
        self._plan_at = self._observed = 0
        self.steps = 0
        self.probing = False  # whether the last K chosen was a probe
        self.rate = 1.0 / self.cost(0)  # tokens per second expected at the last best K
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

    def accept_given(self, confidence: float, position: int | None = None) -> float:
        """The chance that a draft is accepted (drafts before it were), given the module's
        probability for it and its position in the chain (0: the first draft; None: any).
        The position's calibration bin leans on the bin pooled over positions, and that on
        the probability at the bin's middle, while each has few observations (for a module
        that agreed with the trunk exactly, the two would be equal)."""
        b, w = _bin(confidence), self.prior_weight
        hits, seen = self.calibration[b]
        pooled = (hits + (b + 0.5) / CONFIDENCE_BINS * w) / (seen + w)
        if position is None:
            return pooled
        hits, seen = self.calibration_at[position][b]
        return (hits + pooled * w) / (seen + w)

    def mean_acceptance(self, position: int | None = None) -> float:
        """The chance that a draft not made yet at `position` is accepted, given that those
        before it were: that position's rate over every bin, leaning on the rate pooled
        over positions while it has few observations (so a position the chain seldom
        reaches cannot pin it low)."""
        w = self.prior_weight
        pooled = ((sum(h for h, _ in self.calibration) + self.prior * w)
                  / (sum(n for _, n in self.calibration) + w))
        if position is None:
            return pooled
        table, w = self.calibration_at[position], self.position_weight
        return (sum(h for h, _ in table) + pooled * w) / (sum(n for _, n in table) + w)

    def chain_plan(self) -> tuple[list[list[float]], list[float]]:
        """What a `DraftChain` reads, refreshed every `plan_every` observed steps (the tables
        move slowly, and a chain is made every step): each position's chance of acceptance per
        bin of draft probability; and per number of drafts k, the break-even survival (in
        units of the run's rate times the unscaled cost table) below which no longer chain
        adds more tokens than the time it adds would yield at that rate."""
        if self._plan is None or self._observed - self._plan_at >= self.plan_every:
            self._plan_at = self._observed
            accept = [[self.accept_given((b + 0.5) / CONFIDENCE_BINS, i)
                       for b in range(CONFIDENCE_BINS)] for i in range(self.k_max)]
            ahead = [self.mean_acceptance(i) for i in range(self.k_max)]
            # Going on from k drafts to j adds survival * G_j tokens and costs
            # rate * (c_j - c_k): it pays iff survival > rate * (c_j - c_k) / G_j.
            unit = []
            for k in range(self.k_max + 1):
                best, gain, run = float("inf"), 0.0, 1.0
                for j in range(k + 1, self.k_max + 1):
                    run *= ahead[j - 1]
                    gain += run
                    best = min(best, (self.costs[j] - self.costs[k]) / gain)
                unit.append(best)
            self._plan = (accept, unit)
        return self._plan

    def learned(self) -> dict[str, Any]:
        """What the policy has learned about the model (acceptance per kind and position, and
        the calibration of draft probabilities), for a later start with the same model to
        begin from; the step costs are the machine's, measured at every load."""
        def pairs(table: list[tuple[float, float]]) -> list[list[float]]:
            return [[h, n] for h, n in table]

        return {"version": 1, "k_max": self.k_max,
                "accept": {kind.value: pairs(table) for kind, table in self.accept.items()},
                "calibration": pairs(self.calibration),
                "calibration_at": [pairs(table) for table in self.calibration_at]}

    def start_from(self, learned: Mapping[str, Any]) -> None:
        """Take over what `learned()` gave in an earlier run. A policy with another k_max takes
        the positions both have. ValueError, and nothing changed, for anything malformed."""
        if not isinstance(learned, Mapping) or learned.get("version") != 1:
            raise ValueError("not a K-policy state of version 1")
        n = min(self.k_max, _int(learned.get("k_max")))
        accept = {kind: _pairs(learned.get("accept", {}).get(kind.value), n) for kind in TextKind}
        calibration = _pairs(learned.get("calibration"), CONFIDENCE_BINS, exact=True)
        at = learned.get("calibration_at")
        if not isinstance(at, list) or len(at) < n:
            raise ValueError("calibration_at: need a table per draft position")
        calibration_at = [_pairs(table, CONFIDENCE_BINS, exact=True) for table in at[:n]]
        for kind in TextKind:
            self.accept[kind][:n] = accept[kind]
        self.calibration = calibration
        self.calibration_at[:n] = calibration_at
        self._plan = None

    def expected_tokens(self, kind: TextKind, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.rates(kind)[:k]:
            run *= a
            total += run
        return total

    def set_costs(self, costs: list[float]) -> None:
        """Measured seconds per step for each K: the cost curve to start from. Live steps
        scale it as a whole and correct its shape (see `cost`)."""
        if len(costs) != self.k_max + 1 or min(costs) <= 0:
            raise ValueError(f"need {self.k_max + 1} positive step costs, got {costs}")
        self.costs = list(costs)
        self.scale = 1.0
        self._plan = None

    def cost(self, k: int) -> float:
        """Seconds per step of K drafts now: the curve times a factor that live steps keep
        current. What moves step costs in use (a longer context, a busier machine) moves
        every K alike, so each step informs all of them through the factor; where per-K
        averages alone would keep the Ks not run at their start-up values, stale ones then
        winning or losing unfairly. Each step also moves its own K's point of the curve,
        more slowly: the curve measured at start-up is noisy, and taken at a context of
        other length than the prompts in use, and the draft chain's choice turns on the
        differences between its points."""
        return self.scale * self.costs[k]

    def best(self, kind: TextKind) -> int:
        """argmax_K E(K) / c(K), in one pass (it runs every step)."""
        total, run, best_k, best_rate = 1.0, 1.0, 0, 1.0 / self.cost(0)
        for k, a in enumerate(self.rates(kind), start=1):
            run *= a
            total += run
            if total / self.cost(k) > best_rate:
                best_k, best_rate = k, total / self.cost(k)
        self.rate = best_rate
        return best_k

    def choose(self, kind: TextKind) -> int:
        """The best K, but now and then one more (`probing` says so), so positions past the
        current best keep being measured and a drop to K = 0 is not forever. A probe that
        fails doubles the gap to the next one (up to 16x), so a model that cannot draft pays
        little for them."""
        self.steps += 1
        k = self.best(kind)
        self.probing = bool(self.probe_every and self.steps >= self._next_probe
                            and k < self.k_max)
        if self.probing:
            self._probe = k + 1
            self._next_probe = self.steps + self._probe_gap
            return k + 1
        return k

    def observe(self, kind: TextKind, k: int, accepted: int, seconds: float | None = None,
                confidences: Sequence[float] = ()) -> None:
        """Record a step that verified k drafts and accepted `accepted` of them; `confidences`:
        the module's probability for each draft, when known."""
        self._observed += 1
        acc, keep = self.accept[kind], 1.0 - self.decay
        cal, cal_keep = self.calibration, 1.0 - self.calibration_decay
        # Position i is observed only when drafts < i were all accepted.
        for i in range(min(accepted + 1, k)):
            hits, seen = acc[i]
            acc[i] = (hits * keep + (i < accepted), seen * keep + 1.0)
            if i < len(confidences):
                b, hit = _bin(confidences[i]), float(i < accepted)
                for table in (cal, self.calibration_at[i]):
                    hits, seen = table[b]
                    table[b] = (hits * cal_keep + hit, seen * cal_keep + 1.0)
        if seconds is not None and seconds > 0:  # one slow step (a hiccup) moves it a little
            ratio = min(max(seconds / self.costs[k], self.scale / 3), self.scale * 3)
            self.scale += self.cost_decay * (ratio - self.scale)
            own = min(max(seconds / self.scale, self.costs[k] / 3), self.costs[k] * 3)
            self.costs[k] += self.shape_decay * (own - self.costs[k])
        if self._probe is not None and self._probe == k:
            failed = accepted < k  # the probed position was not accepted
            self._probe_gap = min(self._probe_gap * 2, 16 * self.probe_every) if failed \
                else self.probe_every
            self._probe = None


def _int(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"k_max: need a count, got {value!r}")
    return value


def _pairs(table: object, n: int, *, exact: bool = False) -> list[tuple[float, float]]:
    """The first n (accepted, observed) pairs of a saved table, checked."""
    if not isinstance(table, list) or len(table) < n or (exact and len(table) != n):
        raise ValueError(f"need a table of {n} (accepted, observed) pairs")
    out = []
    for pair in table[:n]:
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, int | float) and not isinstance(x, bool) for x in pair)):
            raise ValueError(f"not an (accepted, observed) pair: {pair!r}")
        hits, seen = float(pair[0]), float(pair[1])
        if not 0 <= hits <= seen + 1e-6 or seen > 1e9:
            raise ValueError(f"not an (accepted, observed) pair: {pair!r}")
        out.append((hits, seen))
    return out


def _bin(confidence: float) -> int:
    return min(max(int(confidence * CONFIDENCE_BINS), 0), CONFIDENCE_BINS - 1)


class DraftChain:
    """When to stop drafting, decided after each draft.

    Decoding is a run of steps, and what counts is tokens per second over the run, not per
    step: so a step should yield as much as it can beyond what its time would yield at the
    run's rate R (the best K's expected rate now). Each further draft adds its chance of
    being accepted together with all before it, and costs its share of the step; the chain
    goes on while some longer chain adds more tokens than R times the time it adds, that is
    while the chance that every draft so far is accepted stays above a break-even point
    (`KPolicy.chain_plan`). A draft's chance comes from its position's calibration; drafts
    not made yet are valued at their position's mean rate, which leans on the rate pooled
    over positions until a position has been reached often. (Valuing them at the last
    draft's chance stopped a fifth of the chains after one doubtful draft, though the drafts
    after a doubtful one are mostly confident again; one table for every position
    undervalued long chains, because first drafts are the most often seen and the least
    often right.) It makes at least `floor` drafts (a probe's), and at most as many as its
    caller allows.
    """

    __slots__ = ("accept", "drafted", "floor", "limit", "survival")

    def __init__(self, policy: KPolicy, floor: int = 1) -> None:
        self.accept, unit = policy.chain_plan()
        rate = policy.rate * policy.scale  # tokens per second of the unscaled cost table
        self.limit = [rate * u for u in unit]
        self.floor, self.drafted, self.survival = floor, 0, 1.0

    def more(self, confidence: float) -> bool:
        """Take in the next draft's probability; whether to draft another."""
        k = self.drafted
        self.survival *= self.accept[k][_bin(confidence)]
        self.drafted = k = k + 1
        return k < self.floor or self.survival > self.limit[k]
