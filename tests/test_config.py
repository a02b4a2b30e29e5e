"""The config file and the environment."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from daemon import protocol as p
from daemon.backends.local import LocalBackend
from daemon.client import Client
from daemon.config import (
    DOCSTRING_MIN_CONFIDENCE,
    ConfigFileError,
    docstring_threshold,
    load_settings,
    save_model_quality,
)
from daemon.instance import InstanceLock
from daemon.server import Server
from engine import Engine


def test_file_then_environment(tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('model = "/models/a"\nidle_timeout = 60\nk_max = 4\n')
    s = load_settings(cfg, env={"AHEAD_K_MAX": "2"})
    assert (s.model, s.idle_timeout, s.k_max, s.slots) == ("/models/a", 60.0, 2, 4)
    assert load_settings(tmp_path / "missing.toml", env={}).model is None
    remote = load_settings(cfg, env={"AHEAD_BACKEND": "openai", "AHEAD_URL": "http://h:8000/v1",
                                     "AHEAD_FIM_TEMPLATE": "qwen", "AHEAD_TIMEOUT": "5"})
    assert (remote.backend, remote.url, remote.fim_template, remote.timeout) == (
        "openai", "http://h:8000/v1", "qwen", 5.0)


@pytest.mark.parametrize(("text", "env", "message"), [
    ("modle = 'x'\n", {}, "unknown key 'modle'"),
    ("k_max = 'many'\n", {}, "k_max must be"),
    ("k_max = 2.5\n", {}, "k_max must be"),
    ("dtype = 'fp8'\n", {}, "dtype must be"),
    ("slots = 0\n", {}, "slots must be positive"),
    ("drafts = 'ngram'\n", {}, "drafts must be mtp, context or both"),
    ("threads = -2\n", {}, "threads must not be negative"),
    ("k_max = [\n", {}, "config.toml"),
    ("", {"AHEAD_MAX_SEQ_LEN": "lots"}, "AHEAD_MAX_SEQ_LEN: max_seq_len must be"),
    ("backend = 'vllm'\n", {}, "backend must be one of local, openai"),
    ("fim_template = 'gpt'\n", {}, "fim_template must be one of"),
    ("", {"AHEAD_URL": "gpu-box:8000"}, "url must start with http"),
    ("timeout = 0\n", {}, "timeout must be positive"),
])
def test_bad_settings_name_the_file_and_key(tmp_path: Path, text: str, env: dict,
                                            message: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    with pytest.raises(ConfigFileError, match=message):
        load_settings(cfg, env=env)


async def test_the_daemon_follows_the_config_file_to_another_model(
        trained_engine: Engine, trained_dir: Path, random_dir: Path, tmp_path: Path) -> None:
    conf_dir = tmp_path / "conf"
    conf_dir.mkdir()
    config = conf_dir / "config.toml"
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    backend = LocalBackend(trained_engine, model_dir=trained_dir,
                           loader=lambda path: Engine.load(path, max_seq_len=256, k_max=2))
    server = Server(backend, rt / "daemon.sock", InstanceLock(rt / "daemon.lock"),
                    model_name=str(trained_dir), watch_debounce_ms=100, config_file=config)
    ready = asyncio.Event()
    task = asyncio.create_task(server.serve(on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), 30)
    assert server.reloader is not None
    config.write_text("modle = 1\n")  # a broken config is reported and changes nothing
    assert "unknown key" in await asyncio.wait_for(server.reloader.results.get(), 30)
    config.write_text(f"model = {str(random_dir)!r}\n")
    assert await asyncio.wait_for(server.reloader.results.get(), 30) == "ok"
    client = Client(server.socket_path, autostart=False)
    info = await client.status()
    assert info["serving"] == str(random_dir) and info["reloads"] == 1
    await client.run(p.Generate(id=0, prompt="x", max_tokens=2))
    assert backend.engine is not trained_engine
    await client.close()
    server.stop()
    await asyncio.wait_for(task, 30)


def test_the_docstring_threshold_is_the_configs_else_the_models_else_the_default(
        tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    none = load_settings(tmp_path / "none.toml", env={})
    assert docstring_threshold(none, model) == (DOCSTRING_MIN_CONFIDENCE, "the default")
    saved = save_model_quality(model, {"docstring_min_confidence": None}, ["pygls 2.1.1"])
    assert docstring_threshold(none, model) == (None, str(saved))  # the model writes none
    save_model_quality(model, {"docstring_min_confidence": 0.4}, ["pygls 2.1.1"])
    assert docstring_threshold(none, model)[0] == 0.4
    configured = load_settings(tmp_path / "none.toml",
                               env={"AHEAD_DOCSTRING_MIN_CONFIDENCE": "0.1"})
    assert docstring_threshold(configured, model) == (0.1, "the config")
    (model / "quality.json").write_text("{not json")
    with pytest.raises(ConfigFileError, match=r"quality\.json"):
        docstring_threshold(none, model)
