"""What became of the suggestions editors showed, per model and language, day by day: shown,
accepted in full, accepted in part, and rejected, which is what a suggestion becomes when it
is not accepted within REJECT_AFTER_S seconds of being shown (Continue's rule). The editors
report the first three (`Feedback` frames from `ahead lsp`); the daemon decides the last.
"""

from __future__ import annotations

import datetime
import time
from collections import deque
from collections.abc import Callable
from typing import Any

REJECT_AFTER_S = 10.0
DAYS_KEPT = 30
EVENTS = ("shown", "accepted", "partial", "rejected")

Table = dict[str, dict[str, dict[str, dict[str, int]]]]  # day -> model -> language -> event


class Suggestions:
    def __init__(self, saved: object = None, clock: Callable[[], float] = time.time) -> None:
        """`saved`: the table a snapshot wrote (anything malformed starts it afresh)."""
        self.clock = clock
        self.days: Table = _checked(saved)
        self._open: deque[tuple[float, str, str]] = deque()  # shown, not yet settled

    def shown(self, model: str, language: str) -> None:
        now = self.clock()
        self._settle(now)
        self._open.append((now, model, language))
        self._count(now, model, language, "shown")

    def taken(self, model: str, language: str, *, full: bool) -> None:
        """The last suggestion shown in `language` was accepted, all of it or a part."""
        now = self.clock()
        self._settle(now)
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][1:] == (model, language):
                del self._open[i]  # taken (a later part of it counts again, as a part)
                break
        self._count(now, model, language, "accepted" if full else "partial")

    def snapshot(self) -> dict[str, Any]:
        """Totals per model and language over the days kept, and the days themselves."""
        self._settle(self.clock())
        total: dict[str, dict[str, dict[str, int]]] = {}
        for models in self.days.values():
            for model, languages in models.items():
                for language, counts in languages.items():
                    into = total.setdefault(model, {}).setdefault(language, dict.fromkeys(
                        EVENTS, 0))
                    for event, n in counts.items():
                        into[event] += n
        out = {model: {language: {**c, "acceptance": round(
                   (c["accepted"] + c["partial"]) / c["shown"], 3) if c["shown"] else 0.0}
                   for language, c in languages.items()}
               for model, languages in total.items()}
        return {"suggestions": out, "suggestions_by_day": self.days}

    def _settle(self, now: float) -> None:
        while self._open and now - self._open[0][0] >= REJECT_AFTER_S:
            t, model, language = self._open.popleft()
            self._count(t, model, language, "rejected")

    def _count(self, t: float, model: str, language: str, event: str) -> None:
        day = datetime.date.fromtimestamp(t).isoformat()
        counts = self.days.setdefault(day, {}).setdefault(model, {}).setdefault(
            language, dict.fromkeys(EVENTS, 0))
        counts[event] += 1
        for old in sorted(self.days)[:-DAYS_KEPT]:
            del self.days[old]


def _checked(saved: object) -> Table:
    """A saved table as it was written, or an empty one."""
    if not isinstance(saved, dict):
        return {}
    try:
        return {str(day): {str(m): {str(lang): {e: int(c.get(e, 0)) for e in EVENTS}
                                   for lang, c in langs.items()}
                           for m, langs in models.items()}
                for day, models in saved.items()}
    except (AttributeError, TypeError, ValueError):
        return {}
