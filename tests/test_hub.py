"""Models by name in the Hugging Face cache: a cache tree laid out as huggingface_hub writes
it, resolved offline (refs, revisions, HF_HUB_CACHE / HF_HOME / the default), and clear errors
for what is not there."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from clients.common import CliError, model_dir
from daemon.backends.prompts import hf_cache_dir
from engine.model.hub import ModelNotFound, hf_hub_cache, resolve_model, snapshot

MAIN = "a" * 40
OLD = "b" * 40


def lay_out(cache: Path, name: str = "Qwen/Qwen3.5-2B") -> Path:
    """models--ORG--NAME with two snapshots, refs/main -> MAIN and a tag v1 -> OLD."""
    repo = cache / ("models--" + name.replace("/", "--"))
    for commit in (MAIN, OLD):
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text(f'{{"commit": "{commit}"}}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v1").write_text(OLD + "\n")
    return repo


def test_the_cache_location_follows_the_environment(tmp_path: Path) -> None:
    assert hf_hub_cache({"HF_HUB_CACHE": str(tmp_path / "x")}) == tmp_path / "x"
    assert hf_hub_cache({"HF_HOME": str(tmp_path / "h")}) == tmp_path / "h" / "hub"
    assert hf_hub_cache({"HF_HUB_CACHE": str(tmp_path / "x"), "HF_HOME": "/nope"}) == \
        tmp_path / "x"
    assert hf_hub_cache({}) == Path("~/.cache/huggingface/hub").expanduser()


def test_names_resolve_to_the_snapshot_refs_main_names(tmp_path: Path) -> None:
    repo = lay_out(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    assert snapshot("Qwen/Qwen3.5-2B", env=env) == repo / "snapshots" / MAIN
    assert snapshot("Qwen/Qwen3.5-2B", revision="v1", env=env) == repo / "snapshots" / OLD
    assert snapshot("Qwen/Qwen3.5-2B@v1", env=env) == repo / "snapshots" / OLD
    assert snapshot(f"Qwen/Qwen3.5-2B@{OLD}", env=env) == repo / "snapshots" / OLD
    assert resolve_model("Qwen/Qwen3.5-2B", env) == repo / "snapshots" / MAIN
    # HF_HOME/hub when HF_HUB_CACHE is not set
    assert snapshot("Qwen/Qwen3.5-2B", env={"HF_HOME": str(tmp_path)}) == \
        repo / "snapshots" / MAIN
    # a directory is taken as it is, even if it looks like a name
    here = tmp_path / "org" / "name"
    here.mkdir(parents=True)
    assert resolve_model(here, env) == here


def test_a_missing_model_or_revision_names_where_it_looked(tmp_path: Path) -> None:
    lay_out(tmp_path / "hub")
    env = {"HF_HUB_CACHE": str(tmp_path / "hub")}
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache") as e:
        snapshot("Qwen/Qwen3.5-9B", env=env)
    assert str(tmp_path / "hub") in str(e.value) and "never downloads" in str(e.value)
    with pytest.raises(ModelNotFound, match=r"revision 'v2'.*revisions there: main, v1"):
        snapshot("Qwen/Qwen3.5-2B@v2", env=env)
    with pytest.raises(ModelNotFound, match=r"revision 'c{40}'"):
        snapshot("Qwen/Qwen3.5-2B@" + "c" * 40, env=env)
    shutil.rmtree(tmp_path / "hub" / "models--Qwen--Qwen3.5-2B" / "snapshots" / MAIN)
    with pytest.raises(ModelNotFound, match=r"config\.json"):  # a ref without its snapshot
        snapshot("Qwen/Qwen3.5-2B", env=env)
    with pytest.raises(ModelNotFound, match="does not exist"):
        resolve_model(tmp_path / "no-such-dir", env)


def test_the_cli_and_the_tokenizer_lookup_use_the_resolver(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = lay_out(tmp_path / "hub")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert model_dir(argparse.Namespace(model="Qwen/Qwen3.5-2B@v1")) == repo / "snapshots" / OLD
    with pytest.raises(CliError, match=r"Qwen/Qwen3\.5-0\.8B"):
        model_dir(argparse.Namespace(model="Qwen/Qwen3.5-0.8B"))
    (repo / "snapshots" / OLD / "tokenizer.json").write_text("{}")
    (repo / "refs" / "main").write_text(OLD)
    assert hf_cache_dir("Qwen/Qwen3.5-2B", {"HF_HUB_CACHE": str(tmp_path / "hub")}) == \
        repo / "snapshots" / OLD


def test_ahead_generate_reports_a_missing_model_in_one_line(tmp_path: Path) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "empty"), "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "clients.cli", "generate", "--model",
                          "Qwen/Qwen3.5-2B", "--no-daemon", "def f():"],
                         capture_output=True, text=True, env=env, timeout=120,
                         cwd=Path(__file__).parent.parent)
    assert run.returncode != 0
    assert "not in the Hugging Face cache" in run.stderr and "Traceback" not in run.stderr
