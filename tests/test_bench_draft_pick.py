"""`ahead bench draft-pick`: the greedy drafts' coarse pass against the int4 draft head, in
acceptance and agreement, through the real CLI on the bundled model (a reduced head of 1,024
of its 4,096 rows, so that it has one)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native
from engine.decode import draft_vocab
from engine.model import transformer


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", "bench", "draft-pick", *args],
                          capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("code")
    for module in (draft_vocab, transformer):
        (repo / f"{module.__name__.rsplit('.', 1)[-1]}.py").write_text(
            inspect.getsource(module), encoding="utf-8")
    return repo


@pytest.mark.skipif(native.status() != "vnni",
                    reason=f"the coarse pass needs our kernels: {native.status()}")
def test_acceptance_and_agreement_by_candidate_tiles(code: Path, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = run("--files", str(code), "--draft-vocab", "1024", "--tiles", "0,2,32,40",
               "--prompts", "6", "--tokens", "24", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    r = json.loads(out.read_text())
    assert r["draft_rows"] == 1024 and r["prompts"] == 6
    t = r["tiles"]
    assert [t[n]["coarse_pass"] for n in ("0", "2", "32", "40")] == [False, True, True, False]
    assert t["0"]["agreement"] is None and t["40"]["agreement"] is None  # the int4 rows
    assert 0 < t["2"]["agreement"] <= t["32"]["agreement"] and t["32"]["agreement"] > 0.9
    assert all(row["drafted"] > 0 and 0 <= row["acceptance"] <= 1 for row in t.values())
    assert t["0"]["acceptance"] == t["40"]["acceptance"]  # the same drafts: the int4 rows'
    assert "same as int4" in proc.stdout and "pass off" in proc.stdout


def test_bad_input_says_what(code: Path, tmp_path: Path) -> None:
    proc = run("--files", str(code), "--tiles", "4x")
    assert proc.returncode != 0 and "--tiles: whole numbers" in proc.stderr
    proc = run("--files", str(code), "--tiles", "-1")
    assert proc.returncode != 0 and "0 or more" in proc.stderr
    proc = run("--files", str(tmp_path / "missing"))
    assert proc.returncode != 0 and "does not exist" in proc.stderr
    if native.status() == "vnni":
        proc = run("--files", str(code), "--draft-vocab", "4096")  # not under half of 4096
        assert proc.returncode != 0 and "no reduced draft head" in proc.stderr
    assert "Traceback" not in proc.stderr
