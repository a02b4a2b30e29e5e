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


def _bench_steps_against(model: Path, gguf: Path, out: Path, server: Path = SERVER
                         ) -> tuple[dict, str]:
    """The bench's peer figures in step mode, and what it printed."""
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "engine", "--model", str(model),
         "--context", "48", "--max-new-tokens", "24", "--k-max", "2", "--ks", "1,2",
         "--synthetic-acceptance", "0.9,0.8", "--peer", str(server), "--peer-model",
         str(gguf), "--json", str(out)],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"peer {gguf.name}: plain" in run.stdout
    return json.loads(out.read_text())["peer"], run.stdout


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen3.5 checkpoint with its MTP module, and its f16 GGUF."""
    from tests.peers.preset_gguf import convert
    from training.synthetic import write_checkpoint

    root = tmp_path_factory.mktemp("qwen35")
    # head_dim 256 as the real ones: llama.cpp's M-RoPE sections (11, 11, 10 pairs) need
    # the 64 rotary dims a quarter of it gives
    write_checkpoint(root / "checkpoint", "tiny-qwen3.5", train_steps=0, seed=0,
                     mtp_naming="mtp", head_dim=256)
    return root / "checkpoint", convert(root / "checkpoint", root / "f16.gguf")


@needs_peer
def test_in_step_mode_the_peer_drafts_with_its_mtp_module_at_the_same_rates(
        qwen35: tuple[Path, Path], tmp_path: Path) -> None:
    """llama.cpp's own figures beside ours on the same shapes: its best plain decode
    (llama-bench), plain in llama-server (`--no-repack`) and draft-mtp as it runs best,
    drafts kept at the same synthetic rates as ours."""
    peer, printed = _bench_steps_against(*qwen35, tmp_path / "bench.json")
    assert peer["plain_tokens_per_s"] > 0 and peer["plain_no_repack_tokens_per_s"] > 0
    # its plain decode timed after as much context as ours (--context 48), not from none
    assert peer["plain_depth"] == 48 and "after 48 tokens" in printed
    assert peer["mtp_tokens_per_s"] > 0
    # rates 0.9, 0.8 on two drafts: 1 + 0.9 + 0.72 = 2.6 tokens a step expected
    assert 1.8 < peer["mtp_tokens_per_step"] <= 3
    if "amx_int8" not in Path("/proc/cpuinfo").read_text():
        # nothing crashes without AMX: it drafts with its weights repacked, as a user's does
        assert peer["mtp_repack"] is True and "mtp_repack_error" not in peer


@needs_peer
def test_the_peer_drafts_without_repacking_where_its_repacked_weights_crash(
        qwen35: tuple[Path, Path], tmp_path: Path) -> None:
    """As on AMX CPUs, where llama.cpp's repacked weights crash on any batch of more than one
    token: the real server behind a wrapper that dies by SIGSEGV unless `--no-repack` is
    given. The bench drafts again with `--no-repack`, and says so."""
    wrapper = tmp_path / "llama-server"
    wrapper.write_text(f'#!/bin/sh\ncase " $* " in *" --no-repack "*) exec "{SERVER}" "$@";; '
                       'esac\necho "repacked weights: crashed"\nkill -SEGV $$\n')
    wrapper.chmod(0o755)
    peer, printed = _bench_steps_against(*qwen35, tmp_path / "bench.json", server=wrapper)
    assert peer["mtp_repack"] is False and peer["mtp_repack_error"]
    assert peer["mtp_tokens_per_s"] > 0 and 1.8 < peer["mtp_tokens_per_step"] <= 3
    assert "with --no-repack, its repacked weights failed" in printed


@needs_peer
def test_a_peer_model_without_an_mtp_module_says_it_cannot_draft(random_dir: Path,
                                                                 tmp_path: Path) -> None:
    peer, _ = _bench_steps_against(random_dir, to_gguf(random_dir, tmp_path / "trunk.gguf"),
                                   tmp_path / "bench.json")
    assert peer["plain_no_repack_tokens_per_s"] > 0
    assert "mtp_tokens_per_s" not in peer and "MTP" in peer["mtp_error"]  # its own words


@needs_peer
def test_the_peer_drafts_from_the_context_beside_ours(trained_dir: Path, tmp_path: Path) -> None:
    """The trunk alone, ours drafting from the context and llama-server with its n-gram
    drafts (`--peer-args`), on prompts whose continuation repeats them: both draft, and
    ours is plain decoding's output."""
    gguf = to_gguf(trained_dir, tmp_path / "trained.gguf")
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [sys.executable, "-m", "clients.cli", "bench", "engine", "--model", str(trained_dir),
         "--without-mtp", "--workload", "edit", "--num-prompts", "3", "--max-new-tokens", "24",
         "--drafts", "context", "--files", str(Path(__file__).parent / "test_bench_peer.py"),
         "--peer", str(SERVER), "--peer-model", str(gguf), "--peer-args",
         "--spec-type ngram-simple --spec-ngram-simple-size-n 2 --spec-ngram-simple-size-m 8",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())
    assert "(without its MTP modules)" in result["model"] and result["workload"] == "edit"
    assert "fixed" not in result and "adaptive" not in result and "context" in result
    assert result["identical_to_ar"] is True
    peer = result["peer"]
    assert peer["args"].startswith("--spec-type ngram-simple") and peer["tokens_per_step"] >= 1
    assert "context drafts" in run.stdout and "ngram-simple" in run.stdout
