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
def test_pre_commit_hook_keeps_a_declared_encoding(writer_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("pre_commit")
    # what is tested here is the encoding: no threshold
    repo, run = hook_repo(tmp_path, writer_dir, "--min-confidence", "0")
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


@pytest.mark.parametrize("source, docstring, why", [
    (b"# coding: ascii\ndef f(x):\n    return x\n", "Return x in \u00b0C.", "ascii cannot hold"),
    (b"# -*- coding: no-such-codec -*-\ndef f(x):\n    return x\n", "Say what it is.",
     "unknown encoding"),
], ids=["the declared encoding cannot hold the docstring", "an unknown declared encoding"])
def test_a_file_whose_encoding_cannot_take_the_docstring_is_left_alone(
        tmp_path: Path, source: bytes, docstring: str, why: str) -> None:
    path = tmp_path / "file.py"
    path.write_bytes(source)
    err = io.StringIO()
    status = docstrings.run([str(path)], lambda: lambda document, prefix, suffix: docstring,
                            out=io.StringIO(), err=err)
    assert status == 2 and why in err.getvalue(), err.getvalue()
    assert path.read_bytes() == source
