"""`ahead bench quality`: its sampling, its measures and its choice of thresholds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from clients.bench import docquality as dq
from clients.bench import quality as bq
from engine import Engine
from engine.decode.docgate import DocContext

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
    docs = dq.sample_docstrings([path], 10, seed=0)
    assert {d.expected for d in docs} == {"Join two paths with the system's separator.",
                                          "Add the values to start.",
                                          "The area of a width by a height."}
    for d in docs:
        assert d.prefix.endswith('    """') and '"""' + d.expected not in d.suffix


def test_degenerate_docstrings() -> None:
    assert dq.degenerate("Return a list of a list of a list")
    assert dq.degenerate("Return a broken of the croken of the croken")
    assert dq.degenerate("...")
    assert not dq.degenerate("Return the sum of the values, or start when there are none.")


def _case(params: tuple[str, ...] = ("values", "start"),
          imports: frozenset[str] = frozenset({"os"})) -> dq.DocCase:
    return dq.DocCase("m.py:1", "", "", "", DocContext("total", params, frozenset(), imports),
                      params)


# The junk (#28) and more, each with the start of the reason the bench's check gives.
JUNK = {
    "Return a basic of the given basic.\n\nParameters\n----------\nx : int\n    The value.":
        "documents a parameter it does not have: x",
    "Add.\n\n>>> from sympy.polys.domains.lru_cache import g\n>>> total([1])\n1":
        "its example imports sympy",
    "Add them.\n\ndef __init__(): return x + self.dropout(y)": "a line of code",
    "Add the values.\n    return self.values": "a line of code",
    "if not isinstance(values, list):": "a line of code",
    "@property": "a line of code",
    "Add.\n\nresult = start + sum(values)": "a line of code",
    "Add.\n\n:param stop: where to stop": "documents a parameter it does not have: stop",
    "Add.\n\nArgs:\n    values (list): the values\n    step: by how much":
        "documents a parameter it does not have: step",
    "Return the frob of the frob of the frob": "no words, or words said over again",
    # seen at the old hook's threshold on outside code (pygls)
    "if self.document_formatted_formatted_formatted": "a line of code",
    "Make a :py:class:`~docs.aws.amazon.com/resources.html` for them.": "a reference to",
    "Make a :wrong-chunks.": "a role with no reference",
}
CLEAN = [
    "Return the sum of the values, or start when there are none.",
    "If start is given, add the values to it.",
    "Add the values.\n\nArgs:\n    values (list): the values.\n    start: where to begin."
    "\n\nReturns:\n    int: the total.",
    "Add.\n\nParameters\n----------\nvalues : list\n    The values.\n"
    "start : int, optional\n\nReturns\n-------\nint\n    The sum.",
    "Add.\n\n>>> import os\n>>> total([1, 2])\n3",
    "Add.\n\nFor example::\n\n    x = total([1, 2])\n",
    "Note: this walks the values once.",
    "Add the values with :func:`sum` (see :pep:`8`).",
    "Add.\n\n:param values: the values.\n:returns: the sum.",
]


@pytest.mark.parametrize("text", list(JUNK))
def test_the_benchs_own_junk_check_names_the_reason(text: str) -> None:
    why = dq.junk(text, _case())
    assert why is not None and why.startswith(JUNK[text]), why


@pytest.mark.parametrize("text", CLEAN)
def test_the_benchs_own_junk_check_passes_documentation(text: str) -> None:
    assert dq.junk(text, _case()) is None


def _sweep(rows: list[tuple[float, int, int, int]]) -> list[dict[str, Any]]:
    """(threshold, cases, written, junk) rows as the sweep has them."""
    return [{"threshold": t, "docstrings": {"cases": n, "written": w, "junk_written": j,
                                            "written_rate": w / n if n else 0.0}}
            for t, n, w, j in rows]


def test_the_docstring_threshold_needs_a_written_share_and_no_junk() -> None:
    # the lowest threshold that writes enough and no junk
    assert dq.choose_docstring_threshold(
        _sweep([(0.0, 10, 9, 3), (0.2, 10, 6, 1), (0.3, 10, 4, 0), (0.4, 10, 1, 0)]),
        0.2) == 0.3
    # no junk only where too little is written: none qualifies (the hook writes none)
    assert dq.choose_docstring_threshold(
        _sweep([(0.0, 10, 9, 3), (0.3, 10, 1, 0), (0.5, 10, 0, 0)]), 0.2) is None
    # an empty sample satisfies no rule, whatever the share asked for
    assert dq.choose_docstring_threshold(_sweep([(0.0, 0, 0, 0), (0.5, 0, 0, 0)]), 0.0) is None
    assert dq.choose_docstring_threshold(_sweep([(0.0, 10, 0, 0)]), 0.2) is None


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


def test_outside_code_is_installed_code_the_model_never_saw() -> None:
    import importlib.metadata
    import json

    from engine.bundled import bundled_model_dir

    files, record = dq.outside_code()
    assert [r["project"] for r in record] == list(dq.OUTSIDE)
    for r in record:
        assert r["version"] == importlib.metadata.version(r["project"]) and r["licence"] \
            not in ("", "unknown")
    assert len(files) == sum(int(r["files"]) for r in record) > 10
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    bundled = bundled_model_dir()
    assert bundled is not None
    trained = {json.loads(line)["path"].rpartition("site-packages/")[2].split("/")[0]
               for line in (bundled / "corpus-manifest.jsonl").read_text().splitlines()}
    assert not set(dq.OUTSIDE) & trained
