"""Building our kernels: their sources and flags, what the CPU must have, and the compile
into the cache on first use (engine/native/__init__.py loads what it makes)."""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from engine.paths import cache_dir, write_replacing

SOURCES = tuple(Path(__file__).with_name(f"{name}.c") for name in (
    "wq", "encode", "attention", "deltanet", "gdn", "rows", "layer", "mtp"))
HEADERS = tuple(Path(__file__).with_name(name) for name in ("tiles.h", "vecmath.h", "layer.h"))
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma",
         "-fopenmp", "-shared", "-fPIC", "-lm")
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c", "fma")


class NativeUnavailable(RuntimeError):
    """The kernels cannot run here (the reason is the message)."""


@functools.cache
def cpu_field(name: str) -> str | None:
    """A field of the CPU's entry in /proc/cpuinfo ("flags", "vendor_id"); None if unreadable."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    line = next((ln for ln in info.splitlines() if ln.split(":", 1)[0].strip() == name), "")
    return line.split(":", 1)[-1].strip()


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags, or None where they cannot be read."""
    return None if (flags := cpu_field("flags")) is None else frozenset(flags.split())


def missing_cpu_flags() -> list[str]:
    have = cpu_flags()
    return ["/proc/cpuinfo"] if have is None else [f for f in CPU_FLAGS if f not in have]


def compile_library() -> Path:
    """The kernels' shared library, compiled into the cache unless it is there (named by a
    hash of the sources, the flags and the compiler); raises NativeUnavailable."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise NativeUnavailable(f"no C compiler ({cc}) on PATH")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 check=True, timeout=60).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise NativeUnavailable(f"the C compiler ({cc}) does not run: {e}") from e
    key = hashlib.sha256("\n".join([*(f.read_text() for f in (*SOURCES, *HEADERS)),
                                     " ".join(FLAGS), cc, version]).encode()).hexdigest()[:16]
    path = cache_dir("native") / f"wq-{key}.so"
    if path.is_file():
        return path

    def compile_to(tmp: Path) -> None:
        done = subprocess.run([cc, *FLAGS, "-o", str(tmp), *map(str, SOURCES)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailable(f"the C compiler ({cc}) failed: {first}")

    write_replacing(path, compile_to)
    return path
