"""What became of shown suggestions (daemon/suggestions.py): per model, language and day."""

from __future__ import annotations

import json

from daemon.suggestions import REJECT_AFTER_S, Suggestions


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def test_shown_taken_in_full_or_in_part_and_rejected_after_ten_seconds() -> None:
    clock = Clock()
    s = Suggestions(clock=clock)
    s.shown("m", "python")
    clock.now += 2
    s.taken("m", "python", full=True)  # accepted in time
    s.shown("m", "python")
    s.shown("m", "lua")
    clock.now += 1
    s.taken("m", "lua", full=False)  # a word of it
    clock.now += REJECT_AFTER_S  # the python one was never taken
    counts = s.snapshot()["suggestions"]
    assert counts["m"]["python"] == {"shown": 2, "accepted": 1, "partial": 0, "rejected": 1,
                                     "acceptance": 0.5}
    assert counts["m"]["lua"] == {"shown": 1, "accepted": 0, "partial": 1, "rejected": 0,
                                  "acceptance": 1.0}
    s.shown("m", "python")
    clock.now += REJECT_AFTER_S - 1
    assert s.snapshot()["suggestions"]["m"]["python"]["rejected"] == 1  # not yet


def test_days_are_kept_and_read_back_and_damage_starts_afresh() -> None:
    clock = Clock()
    s = Suggestions(clock=clock)
    s.shown("m", "python")
    clock.now += 86400
    s.shown("m", "python")
    saved = json.loads(json.dumps(s.snapshot()["suggestions_by_day"]))
    assert len(saved) == 2
    again = Suggestions(saved, clock=clock)
    assert again.snapshot()["suggestions"]["m"]["python"]["shown"] == 2
    assert Suggestions({"2026-01-01": "junk"}).days == {}
    assert Suggestions(["not", "a", "table"]).days == {}
