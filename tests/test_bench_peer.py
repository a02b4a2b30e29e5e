"""`ahead bench engine --peer`: llama.cpp's llama-server decodes the same prompts in the same
run, through the real CLI and a real server built by tests/peers/install_llama_server.sh."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.peers.llama import INSTALL, SERVER, installed, to_gguf

if not installed() and os.environ.get("AHEAD_REQUIRE_PEERS"):  # CI: never skip it
    raise RuntimeError(f"llama-server is not installed: run {INSTALL}")
needs_peer = pytest.mark.skipif(not installed(), reason=f"llama-server is not installed: "
                                f"run {INSTALL} (CI does)")


@needs_peer
def test_the_peer_decodes_the_same_prompts(trained_dir: Path, tmp_path: Path) -> None:
    gguf = to_gguf(trained_dir, tmp_path / "trained.gguf")
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "engine", "--model", str(trained_dir),
         "--num-prompts", "4", "--ks", "2", "--max-new-tokens", "16", "--peer", str(SERVER),
         "--peer-model", str(gguf), "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "peer (llama-server" in run.stdout
    peer = json.loads(out.read_text())["peer"]
    assert peer["tokens_per_s"] > 0 and peer["ar_vs_peer"] > 0 and peer["adaptive_vs_peer"] > 0
    # The prompt ids reach the peer as ours: greedy f32 decoding agrees with ours (the
    # trained model's choices are far from ties).
    assert peer["same_tokens"] == peer["compared"]


def test_a_missing_peer_binary_is_a_clear_error(trained_dir: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "engine", "--model", str(trained_dir),
         "--num-prompts", "1", "--peer", str(tmp_path / "nope"), "--peer-model",
         str(tmp_path / "x.gguf")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1
    assert "llama-server binary" in run.stderr and "does not exist" in run.stderr
