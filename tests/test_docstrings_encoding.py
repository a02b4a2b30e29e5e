"""The docstring hook and PEP 263: a file that declares its encoding is read and written in it."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest

from clients import docstrings
from tests.test_docstrings import assert_only_insertions, documented, hook_repo

LATIN = (b"# -*- coding: latin-1 -*-\n"
         b'"""Caf\xe9 tools."""\n\n\n'
         b"def area(width, height):\n"
         b"    # na\xefve: no units\n"
         b"    return width * height\n")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_pre_commit_hook_keeps_a_declared_encoding(model_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("pre_commit")
    # what is tested here is the encoding: no threshold
    repo, run = hook_repo(tmp_path, model_dir, "--min-confidence", "0")
    (repo / "tools.py").write_bytes(LATIN)
    assert run("git", "init", "-q").returncode == 0
    assert run("git", "add", ".pre-commit-config.yaml", "tools.py").returncode == 0
    first = run(sys.executable, "-m", "pre_commit", "run", "--files", "tools.py")
    assert first.returncode == 1, first.stdout + first.stderr  # today: skipped, not UTF-8
    assert "files were modified by this hook" in first.stdout, first.stdout
    data = (repo / "tools.py").read_bytes()
    new = data.decode("latin-1")
    assert documented(new)["area"]
    assert_only_insertions(LATIN.decode("latin-1"), new)  # é and ï still one byte each
    second = run(sys.executable, "-m", "pre_commit", "run", "--files", "tools.py")
    assert second.returncode == 0 and "Passed" in second.stdout, second.stdout


def test_what_the_declared_encoding_cannot_hold_leaves_the_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "ascii.py"
    source = b"# coding: ascii\ndef f(x):\n    return x\n"
    path.write_bytes(source)
    err = io.StringIO()
    status = docstrings.run([str(path)], lambda: lambda document, prefix, suffix: "Ca\u00e9.",
                            out=io.StringIO(), err=err)
    assert status == 2 and "ascii cannot hold" in err.getvalue(), err.getvalue()
    assert path.read_bytes() == source


def test_an_unknown_declared_encoding_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "odd.py"
    source = b"# -*- coding: no-such-codec -*-\ndef f(x):\n    return x\n"
    path.write_bytes(source)
    err = io.StringIO()
    status = docstrings.run([str(path)], lambda: lambda document, prefix, suffix: "Doc.",
                            out=io.StringIO(), err=err)
    assert status == 2 and "unknown encoding" in err.getvalue(), err.getvalue()
    assert path.read_bytes() == source
