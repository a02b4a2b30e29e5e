"""Choosing K before the drafts exist: the K with the most expected tokens per second, and
now and then a probe one past it."""

from __future__ import annotations

from collections.abc import Callable


def best_k(rates: list[float], cost: Callable[[int], float]) -> tuple[int, float]:
    """argmax_K E(K) / c(K), in one pass (it runs every step); and that rate."""
    total, run, best, best_rate = 1.0, 1.0, 0, 1.0 / cost(0)
    for k, a in enumerate(rates, start=1):
        run *= a
        total += run
        if total / cost(k) > best_rate:
            best, best_rate = k, total / cost(k)
    return best, best_rate


class Probes:
    """Every `every` steps one draft more than the best K, so positions past the best keep
    being measured and a drop to K = 0 is not forever. A probe that fails doubles the gap to
    the next one (up to 16x), so a model that cannot draft pays little for them."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.steps = 0
        self.probing = False  # whether the last K chosen was a probe
        self._probe: int | None = None  # the K of the last probe, until a step of it is seen
        self._gap = every
        self._next = every

    def choose(self, best: int, k_max: int) -> int:
        self.steps += 1
        self.probing = bool(self.every and self.steps >= self._next and best < k_max)
        if not self.probing:
            return best
        self._probe = best + 1
        self._next = self.steps + self._gap
        return best + 1

    def observe(self, k: int, accepted: int) -> None:
        if self._probe is not None and self._probe == k:
            failed = accepted < k  # the probed position was not accepted
            self._gap = min(self._gap * 2, 16 * self.every) if failed else self.every
            self._probe = None
