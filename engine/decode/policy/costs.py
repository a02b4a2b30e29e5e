"""Step costs: seconds per step for each K, measured at load and kept current by live steps.

What moves step costs in use (a longer context, a busier machine) moves every K alike, so
each step informs all of them through one factor; per-K averages alone would keep the Ks
not run at their start-up values, stale ones then winning or losing unfairly. Each step
also moves its own K's point of the curve, more slowly: the curve measured at start-up is
noisy, and taken at a context of other length than the prompts in use, and the draft
chain's choice turns on the differences between its points.
"""

from __future__ import annotations

from collections.abc import Mapping


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
    """A cost curve per number of rows a step runs (a step of several slots costs more on a
    device that computes rather than waits for memory), scaled by one factor that live steps
    keep current."""

    def __init__(self, k_max: int, costs: list[float], *, decay: float = 0.05,
                 shape_decay: float = 0.02) -> None:
        self.k_max, self.decay, self.shape_decay = k_max, decay, shape_decay
        self.set(costs)

    def set(self, costs: list[float] | Mapping[int, list[float]]) -> None:
        """Measured seconds per step for each K (one curve, or one per number of rows):
        the curves to start from."""
        curves = dict(costs) if isinstance(costs, Mapping) else {1: costs}
        for rows, curve in curves.items():
            if rows < 1 or len(curve) != self.k_max + 1 or min(curve) <= 0:
                raise ValueError(f"need {self.k_max + 1} positive step costs, got {curve}")
        if 1 not in curves:
            raise ValueError("need the costs of steps of one row")
        # Unscaled: the chain's break-even table reads their shape.
        self.curves = {rows: list(curve) for rows, curve in sorted(curves.items())}
        self.scale = 1.0

    def curve(self, rows: int = 1) -> list[float]:
        """The curve measured for the most rows not above `rows`."""
        return self.curves[max(r for r in self.curves if r <= max(rows, 1))]

    def cost(self, k: int, rows: int = 1) -> float:
        """Seconds per step of K drafts now: the curve times the factor live steps keep."""
        return self.scale * self.curve(rows)[k]

    def observe(self, k: int, seconds: float, rows: int = 1) -> None:
        """A step of K drafts took `seconds`; one slow step (a hiccup) moves it a little."""
        if seconds <= 0:
            return
        curve = self.curve(rows)
        ratio = min(max(seconds / curve[k], self.scale / 3), self.scale * 3)
        self.scale += self.decay * (ratio - self.scale)
        own = min(max(seconds / self.scale, curve[k] / 3), curve[k] * 3)
        curve[k] += self.shape_decay * (own - curve[k])
