"""Where the daemon keeps its socket, lock, log and stats (per user, private)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/ahead, else a per-user directory in the temp dir; always 0700."""
    override = os.environ.get("AHEAD_RUNTIME_DIR")
    if override:
        path = Path(override)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "ahead"
    else:
        path = Path(tempfile.gettempdir()) / f"ahead-{os.getuid()}"
    return private_dir(path)


def state_dir() -> Path:
    """$AHEAD_STATE_DIR, else $XDG_STATE_HOME/ahead, else ~/.local/state/ahead."""
    if os.environ.get("AHEAD_STATE_DIR"):
        return private_dir(Path(os.environ["AHEAD_STATE_DIR"]))
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return private_dir(Path(base) / "ahead")


def private_dir(path: Path) -> Path:
    """Create `path` as 0700, or check that an existing one is ours and private."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to another user")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_path() -> Path:
    return runtime_dir() / "daemon.sock"


def lock_path() -> Path:
    return runtime_dir() / "daemon.lock"


def http_token_path() -> Path:
    """The HTTP endpoint's bearer token (`daemon.http.token` makes it, mode 0600)."""
    return state_dir() / "http-token"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
