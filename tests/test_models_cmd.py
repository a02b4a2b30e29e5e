"""`ahead models`: a Hugging Face cache tree and a directory the test writes, some checkpoints
loadable and some not, through the real command line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine import native
from engine.model.weights import load_model
from training.heads import save_heads, with_new_heads
from training.synthetic import write_checkpoint

HEAD, OLD = "a" * 40, "b" * 40


def snapshot_of(cache: Path, name: str, commit: str = HEAD, *, main: bool = True) -> Path:
    repo = cache / ("models--" + name.replace("/", "--"))
    snap = repo / "snapshots" / commit
    snap.parent.mkdir(parents=True, exist_ok=True)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A hub cache with a model with MTP modules (two snapshots), one without, one of an
    unsupported family, one truncated and one without a tokenizer; and a directory of
    checkpoints beside it, one with heads trained apart (a heads file)."""
    root = tmp_path_factory.mktemp("models")
    cache, mine = root / "hub", root / "mine"
    good = snapshot_of(cache, "org/good")
    write_checkpoint(good, "tiny-qwen3", seed=0)
    shutil.copytree(good, snapshot_of(cache, "org/good", OLD, main=False))
    write_checkpoint(snapshot_of(cache, "org/plain"), "tiny-qwen2", seed=1, num_mtp_modules=0)
    gpt2 = snapshot_of(cache, "org/gpt2")
    shutil.copytree(good, gpt2)
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    cut = snapshot_of(cache, "org/cut")
    shutil.copytree(good, cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[:len(data) // 2])
    notok = snapshot_of(cache, "org/notok")
    shutil.copytree(good, notok)
    (notok / "tokenizer.json").unlink()
    mine.mkdir()
    shutil.copytree(good, mine / "local")
    shutil.copytree(cache / "models--org--plain" / "snapshots" / HEAD, mine / "headed")
    save_heads(with_new_heads(load_model(mine / "headed")), mine / "headed")
    (mine / "empty").mkdir()  # no config.json: not a model, not listed
    return root, cache, mine


def models(root: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "AHEAD_CONFIG": str(root / "none.toml")}
    return subprocess.run([sys.executable, "-m", "clients.cli", "models", *args],
                          capture_output=True, text=True, timeout=300, check=False, env=env)


def test_every_checkpoint_with_how_it_would_run_or_why_not(
        tree: tuple[Path, Path, Path]) -> None:
    root, cache, mine = tree
    proc = models(root, cache, str(mine), "--device", "cpu", "--dtype", "bf16",
                  "--max-seq-len", "1024", "--quant", "none", "--json")
    assert proc.returncode == 0, proc.stderr
    found = {f["name"]: f for f in json.loads(proc.stdout)}
    assert set(found) == {"bundled", "org/good", f"org/good@{OLD[:12]}", "org/plain",
                          "org/gpt2", "org/cut", "org/notok", str(mine / "local"),
                          str(mine / "headed")}
    good = found["org/good"]
    params = sum(p.numel() for p in load_model(cache / "models--org--good" / "snapshots" / HEAD)
                 .parameters())
    assert good["loadable"] and good["family"] == "qwen3" and good["parameters"] == params
    assert good["mtp"] == "2 modules" and (good["device"], good["dtype"]) == ("cpu", "bfloat16")
    assert good["weights_bytes"] == 2 * params and good["quant"] == "none"
    assert good["cache_bytes"] > 0
    assert found["org/plain"]["loadable"] and found["org/plain"]["mtp"] == "none"
    assert found[str(mine / "local")]["loadable"]
    headed = found[str(mine / "headed")]
    assert headed["loadable"] and headed["mtp"].endswith("(heads from ahead train --heads-only)")
    assert "model_type 'gpt2' is not supported" in found["org/gpt2"]["reason"]
    assert "truncated" in found["org/cut"]["reason"] and not found["org/cut"]["loadable"]
    assert found["org/notok"]["reason"] == "no tokenizer.json"


def test_a_line_each_and_int8_where_asked(tree: tuple[Path, Path, Path]) -> None:
    root, cache, _ = tree
    proc = models(root, cache, "--device", "cpu", "--quant", "int8")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 7  # the bundled model and the cache's six snapshots
    good = next(ln for ln in lines if ln.startswith("org/good "))
    # no dtype asked for: int8 runs its activations in bf16 where the CPU dots bf16
    dtype = "bfloat16" if native.available() and native.kernels().bf16_dot else "float32"
    assert "qwen3" in good and "MTP: 2 modules" in good and f"cpu {dtype} int8" in good
    assert next(ln for ln in lines if ln.startswith("org/gpt2 ")).startswith(
        "org/gpt2  cannot load: ")
