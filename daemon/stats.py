"""The daemon's statistics: what `ahead status` shows, saved atomically to the state dir.

Counts (the scheduler's, the request router's, and the clients' feedback) accumulate over the
daemon's life and, through the saved file, across restarts; latencies are kept for the most
recent requests only.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, deque
from pathlib import Path
from typing import Any

from daemon.paths import write_atomic
from daemon.suggestions import Suggestions


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {"p50": round(statistics.median(ordered), 2), "p90": at(0.9), "p99": at(0.99),
            "max": round(ordered[-1], 2), "n": len(ordered)}


class Stats:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.counts: Counter[str] = Counter()  # tokens and client feedback
        saved = _load(path)
        self.lifetime: Counter[str] = Counter(saved.get("lifetime", {}))
        self.suggestions = Suggestions(saved.get("suggestions_by_day"))
        self.k_chosen: Counter[int] = Counter()
        self.latency_ms: deque[float] = deque(maxlen=2000)
        self.engine_ms: deque[float] = deque(maxlen=2000)
        self.hop_ms: deque[float] = deque(maxlen=2000)  # a remote backend's HTTP hop

    def request_done(self, total_ms: float, engine_ms: float, tokens: int, prefill: int,
                     reused: int, k_histogram: dict[int, int], hop_ms: float = 0.0) -> None:
        self.latency_ms.append(total_ms)
        if engine_ms:
            self.engine_ms.append(engine_ms)
        if hop_ms:
            self.hop_ms.append(hop_ms)
        self.counts.update(generated_tokens=tokens, prefill_tokens=prefill, reused_tokens=reused)
        self.k_chosen.update(k_histogram)

    def snapshot(self, counts: dict[str, int]) -> dict[str, Any]:
        """`counts`: the other components' counters, merged in."""
        now = self.counts + Counter(counts)
        return {"counts": dict(now), "lifetime": dict(self.lifetime + now),
                "k_chosen": {str(k): v for k, v in sorted(self.k_chosen.items())},
                "latency_ms": percentiles(list(self.latency_ms)),
                "engine_ms": percentiles(list(self.engine_ms)),
                **self.suggestions.snapshot(),
                **({"http_hop_ms": percentiles(list(self.hop_ms))} if self.hop_ms else {})}

    def save(self, counts: dict[str, int]) -> None:
        """Write the snapshot atomically (a reader never sees half a file)."""
        if self.path is not None:
            write_atomic(self.path, json.dumps(self.snapshot(counts), indent=2) + "\n")


def _load(path: Path | None) -> dict[str, Any]:
    if path is None or not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged stats file is not worth refusing to start over
    return data if isinstance(data, dict) else {}
