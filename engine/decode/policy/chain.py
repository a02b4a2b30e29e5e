"""When to stop drafting, decided after each draft.

Decoding is a run of steps, and what counts is tokens per second over the run, not per
step: so a step should yield as much as it can beyond what its time would yield at the run's
rate R (the best K's expected rate now). Each further draft adds its chance of being
accepted together with all before it, and costs its share of the step; the chain goes on
while some longer chain adds more tokens than R times the time it adds, that is while the
chance that every draft so far is accepted stays above a break-even point. A draft's chance
comes from its position's calibration; drafts not made yet are valued at their position's
mean rate, which leans on the rate pooled over positions until a position has been reached
often. (Valuing them at the last draft's chance stopped a fifth of the chains after one
doubtful draft, though the drafts after a doubtful one are mostly confident again; one table
for every position undervalued long chains, because first drafts are the most often seen and
the least often right.)
"""

from __future__ import annotations

from typing import Protocol

from engine.decode.policy.calibration import CONFIDENCE_BINS, Calibration, bin_of

Plan = tuple[list[list[float]], list[float]]


def chain_plan(calibration: Calibration, curve: list[float]) -> Plan:
    """What a `DraftChain` reads: each position's chance of acceptance per bin of draft
    probability; and per number of drafts k, the break-even survival (in units of the run's
    rate times the unscaled cost curve) below which no longer chain adds more tokens than
    the time it adds would yield at that rate."""
    k_max = calibration.k_max
    accept = [[calibration.accept_given((b + 0.5) / CONFIDENCE_BINS, i)
               for b in range(CONFIDENCE_BINS)] for i in range(k_max)]
    ahead = [calibration.mean_acceptance(i) for i in range(k_max)]
    # Going on from k drafts to j adds survival * G_j tokens and costs rate * (c_j - c_k):
    # it pays iff survival > rate * (c_j - c_k) / G_j.
    unit = []
    for k in range(k_max + 1):
        best, gain, run = float("inf"), 0.0, 1.0
        for j in range(k + 1, k_max + 1):
            run *= ahead[j - 1]
            gain += run
            best = min(best, (curve[j] - curve[k]) / gain)
        unit.append(best)
    return accept, unit


class ChainSource(Protocol):
    """What a chain is made from (a `KPolicy`)."""

    @property
    def rate(self) -> float: ...  # tokens per second expected at the best K now
    @property
    def scale(self) -> float: ...  # live steps' cost over the cost curve's
    def chain_plan(self) -> Plan: ...


class DraftChain:
    """One step's chain of drafts: it makes at least `floor` drafts (a probe's), and at most
    as many as its caller allows."""

    __slots__ = ("accept", "drafted", "floor", "limit", "survival")

    def __init__(self, policy: ChainSource, floor: int = 1) -> None:
        self.accept, unit = policy.chain_plan()
        rate = policy.rate * policy.scale  # tokens per second of the unscaled cost curve
        self.limit = [rate * u for u in unit]
        self.floor, self.drafted, self.survival = floor, 0, 1.0

    def more(self, confidence: float) -> bool:
        """Take in the next draft's probability; whether to draft another."""
        k = self.drafted
        self.survival *= self.accept[k][bin_of(confidence)]
        self.drafted = k = k + 1
        return k < self.floor or self.survival > self.limit[k]
