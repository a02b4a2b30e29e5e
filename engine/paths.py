"""Where the engine keeps what it can compute again but would rather not: quantized codes and
calibrations, under $XDG_CACHE_HOME/ahead (~/.cache/ahead)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def cache_dir(kind: str) -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ahead" / kind


def write_replacing(path: Path, write: Callable[[Path], object]) -> None:
    """`write(tmp)` into a file of this process's own beside `path`, then put it in place in
    one step: a reader, or another daemon loading the same model, never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def checkpoint_identity(model_dir: Path) -> str:
    """A checkpoint's files: its path, and their names, sizes and modification times."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    return "\n".join([str(Path(model_dir).resolve())] + [
        f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files])
