"""The `ahead` command as a user runs it: a real process on a real checkpoint directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from daemon.client import SyncClient


def ahead(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture
def private_daemon(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Commands in this test talk to a daemon of their own, shut down afterwards."""
    rt = tmp_path / "rt"
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(rt))
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "st"))
    yield rt
    if (rt / "daemon.sock").exists():
        with SyncClient(socket_path=rt / "daemon.sock", autostart=False) as client:
            client.shutdown()


def test_generate_streams_a_completion_through_the_daemon(trained_dir: Path,
                                                         private_daemon: Path) -> None:
    proc = ahead("generate", "--model", str(trained_dir), "def add(a, b):", "--max-tokens", "12",
                 "--stats", "--raw")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def add(a, b):")
    assert len(proc.stdout) > len("def add(a, b):\n")
    assert "tokens_per_s=" in proc.stderr and "accepted_per_step=" in proc.stderr
    assert (private_daemon / "daemon.sock").exists()  # it stays for the next command
    here = ahead("generate", "--model", str(trained_dir), "def add(a, b):", "--max-tokens", "12",
                 "--no-daemon", "--raw")
    assert here.stdout == proc.stdout
    status = ahead("status", "--json")
    assert status.returncode == 0
    load = json.loads(status.stdout)["load_s"]  # where the daemon's start went, imports first
    assert list(load)[:2] == ["imports", "weights"] and load["imports"] > 0
    stopped = ahead("stop")
    assert stopped.returncode == 0 and not stopped.stderr, stopped.stderr
    assert ahead("status").returncode == 3  # gone by the time `stop` returned
    again = ahead("stop")
    assert again.returncode == 0 and "no daemon running" in again.stderr


def test_generate_shows_a_completion_only_above_the_threshold(trained_dir: Path) -> None:
    base = ("generate", "--model", str(trained_dir), "def add(a, b):", "--max-tokens", "12",
            "--no-daemon")
    raw = ahead(*base, "--raw", "--json")
    assert raw.returncode == 0, raw.stderr
    info = json.loads(raw.stdout)
    conf = info["confidence"]
    assert 0 < conf <= 1 and info["min_logprob"] <= math.log(conf)
    below = ahead(*base, "--min-confidence", f"{min(conf + 0.01, 0.999):.3f}", "--stats")
    assert below.returncode == 0 and below.stdout == "", below.stdout
    assert "confidence=" in below.stderr and "finish_reason=" in below.stderr
    assert "ahead: no completion:" in below.stderr.splitlines()[-1]
    above = ahead(*base, "--min-confidence", f"{max(conf - 0.01, 0):.3f}")
    if info["finish_reason"] == "repetition":
        assert above.stdout == "" and "went round in a loop" in above.stderr
    else:
        assert above.stdout == "def add(a, b):" + info["completion"] + "\n", above.stderr


def test_generate_json_from_stdin_is_identical_without_speculation(trained_dir: Path) -> None:
    outs = []
    for extra in ([], ["--no-spec"], ["--k", "3"]):
        proc = ahead("generate", "--model", str(trained_dir), "-", "--max-tokens", "16", "--json",
                     "--no-daemon", *extra, stdin="import os\n")
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    assert outs[0]["prompt"] == "import os\n"
    assert outs[0]["completion"] == outs[1]["completion"] == outs[2]["completion"]
    assert outs[1]["stats"]["k_histogram"] == {"0": outs[1]["stats"]["tokens"] - 1}


@pytest.mark.parametrize(("args", "message"), [
    (["generate", "--model", "/nonexistent/model", "x"], "does not exist"),
    (["generate", "--model", "{tmp}", "x", "--no-daemon"], "config.json"),
    (["complete", "/nonexistent.py:1:1", "--no-daemon"], "cannot read"),
    (["complete", "{tmp}:1", "--no-daemon"], "FILE:LINE:COL"),
    (["bench", "engine", "--model", "{model}", "--files", "/nonexistent.py"], "does not exist"),
])
def test_errors_are_one_clear_line(args: list[str], message: str, tmp_path: Path,
                                   random_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AHEAD_MODEL", raising=False)
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(tmp_path / "rt"))  # not the user's daemon
    args = [a.format(tmp=tmp_path, model=random_dir) for a in args]
    proc = ahead(*args)
    assert proc.returncode == 1
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("ahead: error:")


def test_bench_engine_reports_every_mode(random_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = ahead("bench", "engine", "--model", str(random_dir), "--num-prompts", "2",
                 "--ks", "1,3", "--max-new-tokens", "8", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "MTP adaptive K" in proc.stdout
    result = json.loads(out.read_text())
    assert result["identical_to_ar"] is True
    assert result["ar"]["tokens_per_s"] > 0
    for k in ("1", "3"):
        assert result["fixed"][k]["tokens_per_s"] > 0
        assert result["fixed"][k]["tokens_per_step"] >= 1
    assert result["adaptive"]["tokens_per_step"] >= 1
    assert sum(result["adaptive"]["k_histogram"].values()) > 0
    assert set(result["adaptive"]["vs_fixed"]) == {"1", "3"}
    assert all(r > 0 for r in result["adaptive"]["vs_fixed"].values())
    assert "adaptive / fixed K" in proc.stdout
    assert isinstance(result["acceptance_by_position"], list)
    # where loading went, phase by phase
    assert set(result["load_s"]) == {"weights", "probe", "costs", "warm-up"}
    assert result["load_s"]["weights"] > 0 and result["load_s"]["costs"] > 0
    assert "load: weights" in proc.stdout and "step costs (compiling, capturing)" in proc.stdout


def test_bench_engine_on_a_tiny_gemma4_and_its_assistant(tmp_path: Path) -> None:
    """`ahead new-model --preset tiny-gemma4` writes a model and DIR-assistant beside it;
    `bench engine --draft-model` drafts with the assistant and keeps the output plain
    decoding's (bf16: exact where this CPU keeps rows bit-identical)."""
    model, out = tmp_path / "g4", tmp_path / "bench.json"
    proc = ahead("new-model", str(model), "--preset", "tiny-gemma4")
    assert proc.returncode == 0, proc.stderr
    assistant = tmp_path / "g4-assistant"
    assert proc.stdout.split() == [str(model), str(assistant)]
    proc = ahead("bench", "engine", "--model", str(model), "--draft-model", str(assistant),
                 "--num-prompts", "2", "--ks", "2", "--k-max", "2", "--max-new-tokens", "8",
                 "--drafts", "mtp", "--dtype", "bf16", "--max-seq-len", "512",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["drafter"] == "assistant" and "assistant K=2" in proc.stdout
    assert result["fixed"]["2"]["tokens_per_step"] >= 1  # the assistant's drafts, verified
    assert result["acceptance_by_position"][0] is not None
    if not str(result["exact"]).startswith("on"):  # no identity promised on this device
        pytest.skip(f"exact: {result['exact']}")
    assert result["identical_to_ar"] is True
    assert "identical to autoregressive: True" in proc.stdout


def test_new_model_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    proc = ahead("new-model", str(tmp_path))
    assert proc.returncode == 1 and "not empty" in proc.stderr
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_bench_pipeline_reports_its_figures(trained_dir: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "state"))
    out = tmp_path / "pipeline.json"
    proc = ahead("bench", "pipeline", "--model", str(trained_dir), "--clients", "2",
                 "--keystrokes", "5", "--interval-ms", "20", "--rounds", "2",
                 "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    for key in ("superseded_steps_per_request", "final_latency_ratio", "typed_through_share",
                "prefill_tokens_saved_share", "batched_share"):
        assert isinstance(result[key], float | int), key
    assert result["requests"] == 2 * 2 * 6 and result["superseded_steps_per_request"] <= 1
    assert len(result["final_latency_ratios"]) == 4  # every editor of every round
    worked = result["final_latency_ratio_model_work"]
    ratios = result["final_latency_ratios"]
    assert worked is None or min(ratios) - 1e-3 <= worked <= max(ratios) + 1e-3
    assert result["prefill_tokens_saved_share"] > 0  # later keystrokes reuse the prompt
    assert result["overhead_ms"]["p50"] >= 0 and "p99" in result["overhead_ms"]


def test_bench_pipeline_refuses_zero_rounds(trained_dir: Path) -> None:
    proc = ahead("bench", "pipeline", "--model", str(trained_dir), "--rounds", "0")
    assert proc.returncode == 1 and "at least 1" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_model_that_does_not_load_is_reported_through_the_daemon(
        tmp_path: Path, private_daemon: Path) -> None:
    proc = ahead("generate", "--model", str(tmp_path), "x")
    assert proc.returncode == 1
    assert "config.json" in proc.stderr and "Traceback" not in proc.stderr


def test_complete_at_a_file_position(trained_dir: Path, tmp_path: Path,
                                     private_daemon: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\n\ndef home():\n    return \n")
    outs = []
    for extra in (["--no-daemon"], []):
        proc = ahead("complete", f"{src}:4:12", "--model", str(trained_dir), "--json", *extra)
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout))
    assert outs[0] == outs[1] and outs[0]["line"] == 4 and outs[0]["multiline"] is False
    assert src.read_text() == "import os\n\ndef home():\n    return \n"  # untouched
    bad = ahead("complete", f"{src}:9:1", "--model", str(trained_dir), "--no-daemon")
    assert bad.returncode == 1 and "has no line 9" in bad.stderr
