"""A Qwen3.5-shaped checkpoint end to end, through the real CLI and a real LSP client: written
by `ahead new-model`, found by name in a Hugging Face cache tree, generating through the
daemon (whose status shows the recurrent states' memory) and in-process alike."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from lsprotocol import types

from tests.test_cli import ahead
from tests.test_lsp import end_of, inline, open_doc, start, stop

COMMIT = "c" * 40


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A hub cache holding org/tiny-qwen3.5 (random weights, its MTP module in `mtp.*`)."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / "models--org--tiny-qwen3.5"
    snap = repo / "snapshots" / COMMIT
    made = ahead("new-model", str(snap), "--preset", "tiny-qwen3.5", "--naming", "mtp")
    assert made.returncode == 0, made.stderr
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    raw = json.loads((snap / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and "linear_attention" in raw["layer_types"]
    return cache


@pytest.fixture
def env(hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.delenv("AHEAD_MODEL", raising=False)
    # Random weights are sure of nothing: what is tested here is that the model runs.
    monkeypatch.setenv("AHEAD_MIN_CONFIDENCE", "0")
    yield tmp_path
    ahead("stop")


def test_generate_by_name_through_the_daemon_and_in_process(env: Path) -> None:
    args = ["generate", "--model", "org/tiny-qwen3.5", "def add(a, b):", "--max-tokens", "16",
            "--raw"]  # the text as it comes, whatever the quality rules would make of it
    served = ahead(*args, "--stats")
    assert served.returncode == 0, served.stderr
    assert served.stdout.startswith("def add(a, b):") and "tokens_per_s=" in served.stderr
    status = ahead("status", "--json")
    info = json.loads(status.stdout)
    assert info["recurrent_state_mib"] > 0 and info["state_snapshots_per_slot"] == 8 + 2
    assert info["state_checkpoints_per_slot"] == 4
    assert info["cache_mib"] > info["recurrent_state_mib"]
    here = ahead(*args, "--no-daemon")
    assert here.returncode == 0, here.stderr
    assert here.stdout == served.stdout
    plain = ahead(*args, "--no-daemon", "--no-spec")
    assert plain.stdout == served.stdout


async def test_the_language_server_completes_with_a_qwen35_model(env: Path, hub: Path) -> None:
    model = hub / "models--org--tiny-qwen3.5" / "snapshots" / COMMIT
    client = await start(model, env, env={"HF_HUB_CACHE": os.environ["HF_HUB_CACHE"]})
    try:
        text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    "
        uri = open_doc(client, text)
        result = await inline(client, uri, end_of(text))
        assert isinstance(result, types.InlineCompletionList)
        assert result.items and isinstance(result.items[0].insert_text, str)
    finally:
        await stop(client, env)


def test_bench_engine_runs_a_hybrid_preset_built_in_memory(tmp_path: Path) -> None:
    """`--preset` (random weights in the preset's shapes): tiny-qwen3.5 here, qwen3.5-2b's
    real shapes take the same path."""
    out = tmp_path / "steps.json"
    proc = ahead("bench", "engine", "--preset", "tiny-qwen3.5", "--k-max", "2", "--context",
                 "40", "--max-new-tokens", "6", "--max-seq-len", "256", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["preset"] == "tiny-qwen3.5" and "tiny-qwen3.5" in proc.stdout
