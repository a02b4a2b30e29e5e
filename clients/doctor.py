"""`ahead doctor`: what a user checks when something is off, a line each.

Each check says `ok` with what it found, `note` (works, but worth knowing: no GPU, no
daemon running yet) or `FAIL` with what to do. The exit status is 1 when a check failed.
Nothing is changed, except the daemon's private directories, which are created (0700)
where they do not exist yet, as the daemon would.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

OK, NOTE, FAIL = "ok", "note", "FAIL"


@dataclass(slots=True)
class Check:
    name: str
    level: str
    detail: str


def _torch() -> Check:
    import torch

    version = torch.__version__
    if torch.cuda.is_available():
        return Check("torch", OK, f"{version}, CUDA {torch.version.cuda}: "
                     f"{torch.cuda.get_device_name()} (ahead runs there in bf16)")
    if torch.version.cuda is None:
        return Check("torch", NOTE, f"{version}, a CPU build: ahead runs on the CPU (for an "
                     "NVIDIA GPU, install torch's CUDA build, see the README)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else \
        "no GPU or no driver visible (nvidia-smi should list one)"
    return Check("torch", NOTE, f"{version}, built for CUDA {torch.version.cuda} but it sees no "
                 f"GPU: {why}; ahead runs on the CPU")


def _compiler() -> Check:
    cc = os.environ.get("CC") or "cc"
    found = shutil.which(cc)
    if found is None:
        return Check("C compiler", FAIL, f"no {cc} on PATH: install gcc or clang (our CPU "
                     "kernels and torch.compile build C code), or set CC")
    return Check("C compiler", OK, found)


def _kernels() -> Check:
    from engine import native

    status = native.status()
    if status == "vnni":
        return Check("CPU kernels", OK, "AVX-512 VNNI kernels built and loaded")
    return Check("CPU kernels", NOTE, f"not used: {status} (torch's kernels run instead)")


def _dirs() -> list[Check]:
    from daemon import paths

    out = []
    for name, where in (("runtime dir", paths.runtime_dir), ("state dir", paths.state_dir)):
        try:
            out.append(Check(name, OK, f"{where()} (private: 0700, yours)"))
        except OSError as e:
            out.append(Check(name, FAIL, f"{e}: fix or remove it, or set AHEAD_RUNTIME_DIR / "
                             "AHEAD_STATE_DIR to a directory of your own"))
    return out


def _daemon() -> Check:
    from daemon import paths
    from daemon.client import DaemonUnavailable, SyncClient

    try:
        sock = paths.socket_path()
    except OSError as e:
        return Check("daemon", FAIL, f"no socket path: {e}")
    if not sock.exists():
        return Check("daemon", NOTE, f"not running (editors and commands start it; {sock})")

    try:
        with SyncClient(socket_path=sock, autostart=False) as client:
            info = client.status()
    except DaemonUnavailable as e:
        return Check("daemon", FAIL, f"{sock} is there but nobody answers ({e}): a daemon that "
                     "died; `ahead stop`, or remove the file")
    return Check("daemon", OK, f"answering at {sock}: model {info.get('model', '?')}, "
                 f"device {info.get('device', '?')}")


def _config() -> Check:
    import tomllib

    from daemon.config import ConfigFileError, config_path, load_settings

    path = config_path()
    try:
        load_settings()
    except ConfigFileError as e:
        return Check("config", FAIL, f"{e}: fix it (docs/configuration.md lists the keys)")
    env = sorted(k for k, v in os.environ.items() if k.startswith("AHEAD_") and v
                 and k.removeprefix("AHEAD_").lower() in _setting_names())
    keys = sorted(tomllib.loads(path.read_text(encoding="utf-8"))) if path.is_file() else []
    where = f"{path}: {', '.join(keys) or 'no keys'}" if path.is_file() else \
        f"no file at {path} (defaults)"
    return Check("config", OK, where + (f"; from the environment: {', '.join(env)}"
                                        if env else ""))


def _setting_names() -> set[str]:
    from dataclasses import fields

    from daemon.config import Settings

    return {f.name for f in fields(Settings)}


def _editors() -> Check:
    found = shutil.which("ahead")
    if found is None:
        return Check("editors' command", FAIL, "`ahead` is not on PATH, so an editor cannot "
                     f"start `ahead lsp`: activate the environment ahead is installed in "
                     f"({sys.prefix}) where the editor starts, or give the editor the full "
                     "path of its `ahead`")
    return Check("editors' command", OK, f"{found} (editors start `{found} lsp`)")


def _model(args: argparse.Namespace) -> Check:
    from clients.common import CliError, model_dir
    from daemon.config import ConfigFileError

    try:
        path = model_dir(args)
    except CliError as e:
        return Check("model", FAIL, str(e))
    except ConfigFileError:
        return Check("model", NOTE, "unknown: the config does not load (above)")
    missing = [f for f in ("config.json", "tokenizer.json") if not (path / f).is_file()]
    if missing:
        return Check("model", FAIL, f"{path} has no {' or '.join(missing)}: not a model "
                     "directory (`ahead models` lists those that are)")
    return Check("model", OK, f"{path} (`ahead models` says how it would run)")


def _http() -> Check:
    from daemon.config import ConfigFileError, load_settings

    try:
        where = load_settings().http
    except ConfigFileError:
        return Check("HTTP endpoint", NOTE, "unknown: the config does not load (above)")
    if not where:
        return Check("HTTP endpoint", OK, "off (set http = \"127.0.0.1:8741\" to serve it)")
    host, _, port = where.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=2):
            return Check("HTTP endpoint", OK, f"answering at {where}")
    except (OSError, ValueError) as e:
        return Check("HTTP endpoint", NOTE, f"nothing answers at {where} ({e}): the daemon "
                     "serves it while it runs")


def checks(args: argparse.Namespace) -> list[Check]:
    out = [Check("python", OK, f"{sys.version.split()[0]} at {sys.executable}")]
    steps: list[Callable[[], Check | list[Check]]] = [
        _torch, _compiler, _kernels, _dirs, _daemon, _config, _editors,
        lambda: _model(args), _http]
    for step in steps:
        try:
            got = step()
        except Exception as e:  # a doctor reports what breaks, it does not break with it
            got = Check(getattr(step, "__name__", "check").strip("_<>"), FAIL,
                        f"{type(e).__name__}: {e}")
        out += got if isinstance(got, list) else [got]
    return out


def command(args: argparse.Namespace) -> int:
    found = checks(args)
    width = max(len(c.name) for c in found)
    for c in found:
        print(f"{c.level:<5} {c.name:<{width}}  {c.detail}")
    return 1 if any(c.level == FAIL for c in found) else 0
