"""`ahead bench quality`: its sampling, its measures and its choice of thresholds."""

from __future__ import annotations

from pathlib import Path

from clients.bench import quality as bq
from engine import Engine

SOURCE = '''\
"""A module."""

import os


def join(a, b):
    """Join two paths with the system's separator."""
    return os.path.join(a, b)


def total(values, start=0):
    """Add the values to start."""
    result = start
    for value in values:
        result = result + value
    return result


class Box:
    def area(self, width, height):
        """The area of a width by a height."""
        size = width * height
        return size
'''


def test_cursors_are_reproducible_and_the_kinds_take_turns(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    a = bq.sample_cursors([path], 12, seed=3)
    assert a == bq.sample_cursors([path], 12, seed=3)
    assert {c.kind for c in a} == set(bq.KINDS)
    for c in a:
        assert SOURCE.startswith(c.prefix) or c.prefix in SOURCE
        line = SOURCE[:len(c.prefix)].split("\n")[-1] + c.expected
        assert line in SOURCE.split("\n") and c.expected.strip()
        assert c.suffix.startswith("\n")
    docs = bq.sample_docstrings([path], 10, seed=0)
    assert {d.expected for d in docs} == {"Join two paths with the system's separator.",
                                          "Add the values to start.",
                                          "The area of a width by a height."}
    for d in docs:
        assert d.prefix.endswith('    """') and '"""' + d.expected not in d.suffix


def test_degenerate_docstrings() -> None:
    assert bq.degenerate("Return a list of a list of a list")
    assert bq.degenerate("Return a broken of the croken of the croken")
    assert bq.degenerate("...")
    assert not bq.degenerate("Return the sum of the values, or start when there are none.")


def test_a_small_run_and_the_thresholds_it_chooses(trained_engine: Engine,
                                                    tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(SOURCE)
    result = bq.bench_quality(trained_engine, [path], num=6, docs=2, max_tokens=12)
    sweep = result["sweep"]
    assert [r["threshold"] for r in sweep] == list(bq.THRESHOLDS)
    shown = [r["inline"]["shown_rate"] for r in sweep]
    assert shown == sorted(shown, reverse=True)  # a higher threshold never shows more
    assert result["before"]["inline"]["positions"] == 6
    chosen = bq.choose(result, min_shown=0.0, min_written=0.0)
    assert chosen["min_confidence"] in bq.THRESHOLDS
    assert "threshold" in bq.format_report(result).split("\n")[3]
