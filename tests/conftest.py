"""Shared fixtures: small real checkpoints written to disk once per session."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine import Engine, ExactnessUnavailable
from training.synthetic import write_checkpoint

# Token ids the synthetic chain is trained on (see engine/synthetic.py).
CHAIN_VOCAB = range(300, 396)


@pytest.fixture(autouse=True, scope="session")
def private_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Quantized codes and calibrations (~/.cache/ahead) in a directory of the run's own:
    nothing measured by an earlier run, or by another checkout, is read back."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))


def load_exact(path: Path, **kw: object) -> Engine:
    """`Engine.load(path, exact=True, ...)` for a test of the decoding contract; on a device
    where no step shape keeps it (engine/exec/invariance.py), the refusal must name why, and
    the test is skipped with it: there is no contract to check there."""
    try:
        return Engine.load(path, exact=True, **kw)  # type: ignore[arg-type]
    except ExactnessUnavailable as e:
        assert "unavailable on this device (" in str(e)
        pytest.skip(str(e))


def require_exact(engine: Engine) -> Engine:
    """An engine whose auto setting promised exactness, or the skip that says this device
    gave it up (and that it said so)."""
    if not engine.exact:
        assert engine.exactness.startswith("unavailable on this device (")
        pytest.skip(f"exact: {engine.exactness}")
    return engine


@pytest.fixture(scope="session")
def trained_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two MTP modules trained on a low-entropy chain: long accepted runs."""
    path = tmp_path_factory.mktemp("trained")
    write_checkpoint(path, "tiny-qwen3", train_steps=150, seed=0)
    return path


WRITER_DOC = "Say what it does."


@pytest.fixture(scope="session")
def writer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Taught to write WRITER_DOC as every docstring: a real model whose text the docstring
    gate passes (engine/decode/docgate.py), for the hook's tests of files and processes."""
    path = tmp_path_factory.mktemp("writer")
    write_checkpoint(path, "tiny-qwen3", train_steps=300, seed=0, docstring=WRITER_DOC)
    return path


@pytest.fixture(scope="session")
def writer_engine(writer_dir: Path) -> Engine:
    return Engine.load(writer_dir, max_seq_len=512, k_max=8)


@pytest.fixture(scope="session")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights, one MTP module, MiMo naming: drafts are mostly rejected."""
    path = tmp_path_factory.mktemp("random")
    write_checkpoint(path, "tiny-qwen2", seed=1, mtp_naming="mimo")
    return path


@pytest.fixture(scope="session")
def trained_engine(trained_dir: Path) -> Engine:
    return Engine.load(trained_dir, max_seq_len=512, k_max=8)


@pytest.fixture(scope="session")
def random_engine(random_dir: Path) -> Engine:
    return Engine.load(random_dir, max_seq_len=512, k_max=8)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """The bundled model: what users run, and the fixture of end-to-end tests."""
    from engine.bundled import bundled_model_dir

    path = bundled_model_dir()
    assert path is not None, "the bundled model (engine/model_data) is missing"
    return path


@pytest.fixture
def count_trunk(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[int]]:
    """Call it to count, from then on while the test runs, the blocks each call of layer.c's
    `trunk_forward` runs (engine/native/trunk.py): the list it returns fills in order."""
    from engine.native import trunk

    def start() -> list[int]:
        calls: list[int] = []
        c_trunk = trunk._trunk

        def counted(*args: Any) -> int:
            calls.append(args[1])
            return c_trunk(*args)

        monkeypatch.setattr(trunk, "_trunk", counted)
        return calls

    return start
