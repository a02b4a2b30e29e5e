"""`ahead doctor` through the real command line: a clean environment the test makes, then
each thing broken in turn, the check that fails saying what to do."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BIN = str(Path(sys.executable).parent)  # where the environment's `ahead` is


def doctor(env: dict[str, str], *args: str) -> tuple[int, dict[str, tuple[str, str]]]:
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "doctor", *args],
                          capture_output=True, text=True, timeout=300, check=False, env=env)
    assert not proc.stderr.strip() or "Traceback" not in proc.stderr, proc.stderr
    lines = {}
    for line in proc.stdout.splitlines():
        level, rest = line.split(maxsplit=1)
        for name in ("editors' command", "C compiler", "CPU kernels", "runtime dir",
                     "state dir", "HTTP endpoint", "python", "torch", "daemon", "config",
                     "model"):
            if rest.startswith(name + " "):
                lines[name] = (level, rest[len(name):].strip())
                break
    return proc.returncode, lines


@pytest.fixture
def clean(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "rt").mkdir(mode=0o700)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("AHEAD_")},
            "AHEAD_RUNTIME_DIR": str(tmp_path / "rt"), "AHEAD_STATE_DIR": str(tmp_path / "st"),
            "AHEAD_CONFIG": str(tmp_path / "config.toml"),
            "PATH": BIN + os.pathsep + os.environ.get("PATH", "")}


def test_a_clean_environment_passes(clean: dict[str, str], tmp_path: Path) -> None:
    rc, lines = doctor(clean)
    assert rc == 0, lines
    assert len(lines) == 11 and all(level in ("ok", "note") for level, _ in lines.values())
    assert lines["daemon"][0] == "note" and "not running" in lines["daemon"][1]
    assert lines["config"] == ("ok", f"no file at {tmp_path / 'config.toml'} (defaults)")
    assert lines["editors' command"][1].startswith(os.path.join(BIN, "ahead"))
    assert lines["model"][0] == "ok" and lines["HTTP endpoint"][1].startswith("off")
    assert (tmp_path / "st").is_dir() and oct((tmp_path / "st").stat().st_mode)[-3:] == "700"


def test_each_broken_thing_fails_with_what_to_do(clean: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("bogus = 1\n")
    rc, lines = doctor(clean)
    assert rc == 1 and lines["config"][0] == "FAIL" and "unknown key 'bogus'" in lines["config"][1]
    config.write_text('http = "127.0.0.1:9"\nk_max = 4\n')
    rc, lines = doctor({**clean, "AHEAD_SLOTS": "2"})
    assert rc == 0 and lines["config"][1].endswith("http, k_max; from the environment: "
                                                   "AHEAD_SLOTS")
    assert lines["HTTP endpoint"][0] == "note" and "nothing answers" in lines["HTTP endpoint"][1]
    config.unlink()

    (tmp_path / "rt" / "daemon.sock").write_text("")  # left behind by a daemon that died
    rc, lines = doctor(clean)
    assert rc == 1 and lines["daemon"][0] == "FAIL" and "nobody answers" in lines["daemon"][1]
    (tmp_path / "rt" / "daemon.sock").unlink()

    shutil.rmtree(tmp_path / "st")  # made by the runs above
    (tmp_path / "st").symlink_to(tmp_path / "rt")
    rc, lines = doctor(clean)
    assert rc == 1 and lines["state dir"][0] == "FAIL" and "symbolic link" in lines["state dir"][1]
    (tmp_path / "st").unlink()

    path = os.pathsep.join(p for p in clean["PATH"].split(os.pathsep)[1:] if p != BIN)
    rc, lines = doctor({**clean, "PATH": path, "CC": "no-such-cc"})
    assert rc == 1 and lines["editors' command"][0] == "FAIL" and lines["C compiler"][0] == "FAIL"
    assert "not on PATH" in lines["editors' command"][1] and "no no-such-cc" in \
        lines["C compiler"][1]
    assert lines["CPU kernels"][0] == "note"

    rc, lines = doctor(clean, "--model", str(tmp_path))
    assert rc == 1 and lines["model"][0] == "FAIL" and "no config.json" in lines["model"][1]
    rc, lines = doctor({**clean, "AHEAD_MODEL": str(tmp_path / "gone")})
    assert rc == 1 and "does not exist" in lines["model"][1]
