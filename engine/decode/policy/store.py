"""What the K policy learned about a model, as plain data: saved by the daemon, read back by
a later start with the same model: the modules' acceptance and calibration, and the
context's acceptance per bucket of match length (absent from files saved before there were
context drafts: those start from priors). The step costs are the machine's, measured at each
load, and are not kept."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.decode.policy.acceptance import Acceptance, Pairs
from engine.decode.policy.calibration import CONFIDENCE_BINS, Calibration
from engine.decode.policy.kinds import TextKind
from engine.decode.policy.sources import ContextPolicy

VERSION = 1


def learned(acceptance: Acceptance, calibration: Calibration,
            context: ContextPolicy) -> dict[str, Any]:
    """Acceptance per kind and position, the calibration of draft probabilities, and the
    context's acceptance per bucket, kind and position."""
    def pairs(table: Pairs) -> list[list[float]]:
        return [[h, n] for h, n in table]

    def by_kind(a: Acceptance) -> dict[str, list[list[float]]]:
        return {kind.value: pairs(table) for kind, table in a.tables.items()}

    return {"version": VERSION, "k_max": acceptance.k_max, "accept": by_kind(acceptance),
            "calibration": pairs(calibration.pooled),
            "calibration_at": [pairs(table) for table in calibration.at],
            "context": [by_kind(table) for table in context.tables]}


def start_from(acceptance: Acceptance, calibration: Calibration, context: ContextPolicy,
               state: Mapping[str, Any]) -> None:
    """Take over what `learned()` gave in an earlier run. A policy with another k_max takes
    the positions both have. ValueError, and nothing changed, for anything malformed."""
    if not isinstance(state, Mapping) or state.get("version") != VERSION:
        raise ValueError(f"not a K-policy state of version {VERSION}")
    n = min(acceptance.k_max, _count(state.get("k_max")))
    accept = {kind: _pairs(state.get("accept", {}).get(kind.value), n) for kind in TextKind}
    pooled = _pairs(state.get("calibration"), CONFIDENCE_BINS, exact=True)
    at = state.get("calibration_at")
    if not isinstance(at, list) or len(at) < n:
        raise ValueError("calibration_at: need a table per draft position")
    calibration_at = [_pairs(table, CONFIDENCE_BINS, exact=True) for table in at[:n]]
    buckets = state.get("context", [{}] * len(context.tables))
    if not isinstance(buckets, list) or len(buckets) != len(context.tables):
        raise ValueError(f"context: need a table per bucket of match length, "
                         f"{len(context.tables)}")
    seen = [{kind: _pairs(b.get(kind.value), n) if isinstance(b, dict) and b else None
             for kind in TextKind} for b in buckets]
    for kind in TextKind:
        acceptance.tables[kind][:n] = accept[kind]
    calibration.pooled = pooled
    calibration.at[:n] = calibration_at
    for table, kinds in zip(context.tables, seen, strict=True):
        for kind, pairs in kinds.items():
            if pairs is not None:
                table.tables[kind][:n] = pairs


def _count(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"k_max: need a count, got {value!r}")
    return value


def _pairs(table: object, n: int, *, exact: bool = False) -> Pairs:
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
