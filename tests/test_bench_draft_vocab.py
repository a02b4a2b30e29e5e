"""`ahead bench draft-vocab`: the share of a code base's tokens the drafts' reduced
vocabulary holds, by language, through the real CLI on the bundled tokenizer."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

from engine.decode import draft_vocab


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", "bench", "draft-vocab", *args],
                          capture_output=True, text=True, timeout=300)


def test_coverage_by_language_and_size(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "node_modules").mkdir()
    (repo / "pkg" / "mod.py").write_text(inspect.getsource(draft_vocab), encoding="utf-8")
    (repo / "pkg" / "words.rb").write_text("puts '" + "漢字かな交じり文" * 200 + "'\n",
                                           encoding="utf-8")
    (repo / "README.txt").write_text("not code")
    (repo / "node_modules" / "dep.js").write_text("module.exports = 1;\n")
    out = tmp_path / "r.json"
    proc = run("--files", str(repo), "--sizes", "256,1024,4096", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert set(r["languages"]) == {"python", "ruby"}  # node_modules and .txt left out
    assert r["reduced"] == {"256": True, "1024": True, "4096": False}
    for row in (*r["languages"].values(), r["overall"]):
        cov = [row["coverage"][n] for n in ("256", "1024", "4096")]
        assert row["tokens"] > 0 and cov == sorted(cov) and cov[-1] == 1.0, row
    py, rb = r["languages"]["python"]["coverage"], r["languages"]["ruby"]["coverage"]
    assert py["256"] > 0.4 > rb["256"]  # the standard library's frequent tokens, not kanji
    assert "python" in proc.stdout and "100.0%" in proc.stdout


def test_bad_input_says_what(tmp_path: Path) -> None:
    proc = run("--files", str(tmp_path / "missing"))
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    (tmp_path / "notes.txt").write_text("x")
    proc = run("--files", str(tmp_path))
    assert proc.returncode != 0 and "no source files" in proc.stderr
    proc = run("--files", str(tmp_path), "--sizes", "0,12")
    assert proc.returncode != 0 and "sizes must be positive" in proc.stderr
    proc = run("--files", str(tmp_path), "--sizes", "16k")
    assert proc.returncode != 0 and "--sizes: whole numbers" in proc.stderr
    proc = run("--model", str(tmp_path), "--files", str(tmp_path))  # no tokenizer there
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
