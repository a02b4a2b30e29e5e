"""The Neovim plugin (clients/nvim) in a headless Neovim: a real buffer, `ahead lsp`, the daemon.

Debian's Neovim (0.7, installed by .ci/run) is always tried; more builds can be named in
AHEAD_TEST_NVIMS (colon-separated paths), e.g. 0.10 and 0.12 to cover inline virtual text and
Neovim's own inline completion.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemon.client import SyncClient

ROOT = Path(__file__).parent.parent


def neovims() -> list[tuple[str, tuple[int, int]]]:
    found = [shutil.which("nvim") or ""]
    found += [p for p in os.environ.get("AHEAD_TEST_NVIMS", "").split(":") if p]
    builds = []
    for path in dict.fromkeys(p for p in found if p):
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
        m = re.search(r"NVIM v(\d+)\.(\d+)", out.stdout)
        if m:
            builds.append((path, (int(m[1]), int(m[2]))))
    return builds


CASES = [pytest.param(path, builtin, id=f"nvim-{v[0]}.{v[1]}{'-builtin' if builtin else ''}")
         for path, v in neovims() for builtin in ([False, True] if v >= (0, 12) else [False])]


@pytest.mark.skipif(not CASES, reason="Neovim is not installed (.ci/run installs it)")
@pytest.mark.parametrize(("nvim", "builtin"), CASES)
def test_plugin_shows_trims_and_accepts_a_suggestion(nvim: str, builtin: bool, model_dir: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp_path / "rt"),
           "AHEAD_STATE_DIR": str(tmp_path / "st"), "AHEAD_NVIM_OUT": str(out),
           "AHEAD_NVIM_FILE": str(tmp_path / "a.py"), "AHEAD_PYTHON": sys.executable,
           "AHEAD_MODEL_DIR": str(model_dir), "AHEAD_PLUGIN_DIR": str(ROOT / "clients" / "nvim"),
           "AHEAD_NVIM_BUILTIN": "1" if builtin else "0",
           "XDG_STATE_HOME": str(tmp_path / "xdg"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    script = Path(__file__).parent / "nvim" / "plugin.lua"
    try:
        proc = subprocess.run([nvim, "--headless", "-u", "NONE", "-i", "NONE",
                               "-c", f"luafile {script}"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=240, check=False)
    finally:
        sock = tmp_path / "rt" / "daemon.sock"
        if sock.exists():
            with SyncClient(socket_path=sock, autostart=False) as daemon:
                daemon.shutdown()
    result = out.read_text() if out.exists() else f"no output; stderr: {proc.stderr[-2000:]}"
    assert result.startswith("ok\n"), result


@pytest.mark.skipif(not CASES, reason="Neovim is not installed (.ci/run installs it)")
def test_help_file_has_its_tags(tmp_path: Path) -> None:
    doc = tmp_path / "doc"
    shutil.copytree(ROOT / "clients" / "nvim" / "doc", doc)
    proc = subprocess.run([CASES[0].values[0], "--headless", "-u", "NONE", "-i", "NONE",
                           "-c", f"helptags {doc}", "-c", "qall"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr  # e.g. a duplicate tag
    tags = {line.split("\t")[0] for line in (doc / "tags").read_text().splitlines()}
    assert {":AheadStatus", "ahead-keys", "ahead-options", "ahead-versions"} <= tags


@pytest.mark.skipif(not CASES, reason="Neovim is not installed (.ci/run installs it)")
@pytest.mark.parametrize("good", [True, False])
def test_checkhealth_reports_the_server_command(good: bool, tmp_path: Path) -> None:
    out = tmp_path / "health.txt"
    cmd = str(Path(sys.executable).parent / "ahead") if good else str(tmp_path / "no-ahead")
    env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp_path / "rt"), "AHEAD_CMD": cmd,
           "AHEAD_NVIM_OUT": str(out), "AHEAD_PLUGIN_DIR": str(ROOT / "clients" / "nvim")}
    subprocess.run([CASES[0].values[0], "--headless", "-u", "NONE", "-i", "NONE", "-c",
                    f"luafile {Path(__file__).parent / 'nvim' / 'health.lua'}"], env=env,
                   capture_output=True, timeout=60, check=False)
    report = out.read_text()
    if good:
        assert f"server command: {cmd} lsp" in report and "ERROR" not in report, report
        assert "no daemon running" in report, report  # a private, empty runtime directory
    else:
        assert "ERROR" in report and "is not executable" in report, report
