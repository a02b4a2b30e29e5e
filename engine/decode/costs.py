"""Step costs measured on the device at load: seconds per step for each K.

A step of K means what the K policy prices: verify K drafts (K + 1 tokens) and draft K for
the next step; a verify step of K, what the context's drafts cost: verify K drafts the step
did not make (decode/sources.py), and make none. Each K is timed on steps that follow one of
the same K, at a context as long as a short editor's prompt, 512 tokens (attention over it
is a good part of a small model's step; a 2B model's load spent 7.5 of its 12 s of measuring
in prefilling 1024; the policy corrects the curves from the steps that run). The Ks take
turns, round after round, so that a disturbance of the machine (another process, a frequency
change) spreads over all of them instead of bending one; each K's cost is the median of its
rounds, made monotone (more drafts never cost less).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Hashable, Sequence
from typing import Protocol

from engine.decode.policy import monotone
from engine.generation import Generation, GenParams, Step

SLOT = ("ahead", "calibration")  # slot keys of their own (and a row number), cleared after
# Seconds of measuring after which rounds stop (at least one timed round of each number of
# rows runs): the bundled model's rounds all fit; a 2B model's first rounds already take
# longer (its load measured for 208 s before this).
BUDGET_S = 10.0


class Stepper(Protocol):
    """What measuring needs of an `Engine`."""

    k_max: int
    mtp: bool
    max_seq_len: int

    def start(self, prompt: list[int], params: GenParams | None = None, *,
              slot: Hashable = None) -> Generation: ...
    def step(self, gens: Sequence[Generation]) -> list[Step | None]: ...
    def clear_cache(self, slot: Hashable = None) -> None: ...
    def give_drafts(self, gen: Generation, drafts: list[int]) -> None: ...


Curves = dict[int, list[float]]  # per number of rows, seconds per step for each K


def row_buckets(max_slots: int) -> list[int]:
    """Numbers of rows whose step costs are measured: 1, 2, 4, ... and all slots."""
    return sorted({*(1 << i for i in range(max_slots.bit_length()) if 1 << i <= max_slots),
                   max_slots})


def measure_costs(engine: Stepper, vocab_size: int, rows: Sequence[int] = (1,),
                  reps: int = 7, context: int = 512, *, warmup: bool = True,
                  budget_s: float = BUDGET_S) -> tuple[Curves, Curves]:
    """The cost curves of steps, and of verify steps, of each number of rows: every K of a
    step for one row (a model with MTP modules); for verify steps and more rows, K = 0, 1,
    2, 4 and k_max (more rows: with fewer rounds), the rest interpolated (a batch's curve
    has the same shape, and load time matters). `warmup`: a first round untimed (compiled or
    captured steps: it compiles them). Rounds stop early once measuring has taken
    `budget_s` (a large model: seconds a step), after at least one timed round; past it,
    more rows take one row's curve (each prefills a long prompt of its own). The K policy
    corrects the curves from the steps that run."""
    if engine.k_max == 0:
        return {r: [1.0] for r in rows}, {r: [1.0] for r in rows}
    n = max(1, min(context, engine.max_seq_len // 2))
    warm = [(i * 7919 + 13) % vocab_size for i in range(n)]
    curves: Curves = {}
    verify: Curves = {}
    deadline = time.perf_counter() + budget_s
    few = sorted({k for k in (0, 1, 2, 4, engine.k_max) if k <= engine.k_max})
    for r in rows:
        if r > 1 and 1 in curves and time.perf_counter() > deadline:
            # out of time (a large model): a batch's curve has one row's shape, and the
            # policy scales it to the steps that run
            curves[r], verify[r] = list(curves[1]), list(verify[1])
            continue
        ks = list(range(engine.k_max + 1)) if r == 1 else few
        variants = [(k, False) for k in ks if engine.mtp] + [(k, True) for k in few]
        times = _rounds(engine, warm, r, variants, reps if r == 1 else max(2, reps // 2),
                        warmup, deadline)
        for given, out in ((True, verify), (False, curves)):
            points = {k: statistics.median(t) for (k, g), t in times.items() if g == given}
            if points:
                out[r] = monotone([_interpolate(points, k) for k in range(engine.k_max + 1)])
        curves.setdefault(r, verify[r])  # no modules: every step is a verify step
    for r in rows:
        for i in range(r):
            engine.clear_cache((*SLOT, i))
    return curves, verify


def _rounds(engine: Stepper, warm: list[int], rows: int, variants: list[tuple[int, bool]],
            reps: int, warmup: bool, deadline: float) -> dict[tuple[int, bool], list[float]]:
    """Each variant's step times, (K, whether a verify step): one generation a row runs them
    all in turns (K set before each pair of steps: the first verifies the last K's drafts
    and drafts K, the second is timed; a verify step's K drafts are given to it, and it
    makes none), started again only when it runs out of room, so the prompt is prefilled
    once or twice rather than once a K and a round (a recurrent model cannot reuse all of
    it)."""
    times: dict[tuple[int, bool], list[float]] = {v: [] for v in variants}
    gens: list[Generation] = []
    room = 2 * (engine.k_max + 1) + 1  # tokens two steps of k_max may commit
    for rep in range(reps + 1):  # the first round warms up every K's shapes
        if rep > int(warmup) and time.perf_counter() > deadline:
            break
        for k, given in variants:
            if not gens or any(g.finish_reason is not None or g.tokens_left() < room
                               for g in gens):
                gens = _start(engine, warm, rows)
            for g in gens:
                g.params.k = 0 if given else k
            engine.step(gens)  # verifies the last drafts, drafts k (or none)
            for g in gens if given else ():
                engine.give_drafts(g, [g.sequence[-1]] * k)  # any tokens cost the same
            t0 = time.perf_counter()
            engine.step(gens)  # verifies k, drafts k (or none)
            if rep or not warmup:
                times[k, given].append(time.perf_counter() - t0)
    return times


def _start(engine: Stepper, warm: list[int], rows: int) -> list[Generation]:
    """Generations of `rows` rows after `warm`, prefilled; as long as the context allows."""
    new = max(1, engine.max_seq_len - len(warm) - 2 * engine.k_max - 16)
    params = GenParams(max_new_tokens=new, k=0, stop_loops=False, drafts="mtp",
                       ignore_eos=True)
    gens = [engine.start(warm, params, slot=(*SLOT, i)) for i in range(rows)]
    engine.step(gens)  # the prefills
    return gens


def _interpolate(points: dict[int, float], k: int) -> float:
    if k in points:
        return points[k]
    lo = max(p for p in points if p < k)
    hi = min(p for p in points if p > k)
    return points[lo] + (points[hi] - points[lo]) * (k - lo) / (hi - lo)
