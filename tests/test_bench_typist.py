"""`ahead bench typist`: a scripted person writing code through the real language server and
daemon, with a model trained here to know the text it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clients.bench.typist import stretch, take

TEXT = "def add(a, b):\n    return a + b\n\n\ndef scale(xs, k):\n    return [x * k for x in xs]\n"


@pytest.fixture(scope="module")
def knower(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Completes TEXT from any point of it (training/synthetic.py: train_text)."""
    from training.synthetic import write_checkpoint

    path = tmp_path_factory.mktemp("knower")
    write_checkpoint(path, "tiny-qwen3", train_steps=300, seed=0, text=TEXT)
    return path


def test_the_person_takes_a_line_else_a_word_of_what_comes_next() -> None:
    rest = "    return a + b\n\n\ndef scale"
    assert take("    return a + b\n\n\ndef", rest) == ("line", "    return a + b\n")
    assert take("    return a + c", rest) == ("word", "    return")
    assert take("    return", rest) == ("line", "    return")  # the suggestion's only line
    assert take("\n\n\ndef scale(", "\n\n\ndef scale(xs):") == ("line", "\n\n\ndef scale(")
    assert take("    yield a", rest) is None
    assert take("   ", rest) is None  # nothing but white space is nothing to take


def test_the_stretch_starts_and_ends_at_lines() -> None:
    text = "a = 1\nb = 2\r\nc = 3\nd = 4\n"
    assert stretch(text, 0, 3) == ("", "a = 1\n")
    above, target = stretch(text, 0.3, 1)
    assert above == "a = 1\nb = 2\n" and target == "c = 3\n"  # \r\n read as \n
    assert stretch(text, 0.99, 50) == (text.replace("\r\n", "\n"), "")


def test_a_person_writing_what_the_model_knows_takes_most_of_it_from_suggestions(
        knower: Path, tmp_path: Path) -> None:
    file, out = tmp_path / "known.py", tmp_path / "typist.json"
    file.write_text(TEXT)
    env = {**os.environ, "AHEAD_STATE_DIR": str(tmp_path / "state"),
           "AHEAD_MIN_CONFIDENCE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "typist", "--model", str(knower),
         "--files", str(file), "--start", "0", "--chars", str(len(TEXT)), "--cps", "50",
         "--think-ms", "0", "--json", str(out)],
        capture_output=True, text=True, timeout=600, check=False, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "characters written by accepted suggestions" in proc.stdout
    r = json.loads(out.read_text())
    on, off = r["with_prefetch"], r["without_prefetch"]
    for mode in (on, off):
        assert mode["chars"] == len(TEXT)
        # What the person did not type came from suggestions, most of it.
        assert mode["chars_from_suggestions"] + mode["keystrokes"] == len(TEXT)
        assert mode["chars_from_suggestions_share"] >= 0.7, mode
        assert mode["accepts"].get("line", 0) >= 2
        assert mode["accept_to_next_ms"]["n"] >= 1 and mode["requests"] > 0
    assert on["prefetches"] >= 1 and on["prefetch_hits"] >= 1
    assert off["prefetches"] == off["prefetch_hits"] == 0
    assert set(on["keystroke_to_suggestion_ms"]) <= {"p50", "p90", "n"}
