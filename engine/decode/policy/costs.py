"""Step costs: seconds per step for each K, measured at load and kept current by live steps.

What moves step costs in use (a longer context, a busier machine) moves every K alike, so
each step informs all of them through one factor; per-K averages alone would keep the Ks
not run at their start-up values, stale ones then winning or losing unfairly. Each step
also moves its own K's point of the curve, more slowly: the curve measured at start-up is
noisy, and taken at a context of other length than the prompts in use, and the draft
chain's choice turns on the differences between its points.
"""

from __future__ import annotations


def monotone(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, n2), (m1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2])
    return [m for m, n in blocks for _ in range(int(n))]


class StepCosts:
    def __init__(self, k_max: int, costs: list[float], *, decay: float = 0.05,
                 shape_decay: float = 0.02) -> None:
        self.k_max, self.decay, self.shape_decay = k_max, decay, shape_decay
        self.set(costs)

    def set(self, costs: list[float]) -> None:
        """Measured seconds per step for each K: the curve to start from."""
        if len(costs) != self.k_max + 1 or min(costs) <= 0:
            raise ValueError(f"need {self.k_max + 1} positive step costs, got {costs}")
        self.curve = list(costs)  # unscaled: the chain's break-even table reads its shape
        self.scale = 1.0

    def cost(self, k: int) -> float:
        """Seconds per step of K drafts now: the curve times the factor live steps keep."""
        return self.scale * self.curve[k]

    def observe(self, k: int, seconds: float) -> None:
        """A step of K drafts took `seconds`; one slow step (a hiccup) moves it a little."""
        if seconds <= 0:
            return
        ratio = min(max(seconds / self.curve[k], self.scale / 3), self.scale * 3)
        self.scale += self.decay * (ratio - self.scale)
        own = min(max(seconds / self.scale, self.curve[k] / 3), self.curve[k] * 3)
        self.curve[k] += self.shape_decay * (own - self.curve[k])
