"""Where the daemon keeps its socket, lock, log and stats (per user, private)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
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
    """Create `path` as 0700, or check that an existing one is a real directory (a symlink
    planted there, as another user can in /tmp, is refused), ours and private. The checks and
    the chmod go through a descriptor of the directory itself, never through a link."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700, parents=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.is_symlink():
            raise PermissionError(f"{path} is a symbolic link; ahead keeps its files only in "
                                  "a real directory of its own (remove the link)") from None
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise PermissionError(f"{path} belongs to another user")
        if stat.S_IMODE(st.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def open_private(path: Path, flags: int) -> int:
    """A descriptor of the file at `path` (`flags`: os.O_WRONLY | os.O_APPEND and the like),
    created 0600 if need be; an existing file is made 0600, and a symlink is refused."""
    fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
    except BaseException:
        os.close(fd)
        raise
    return fd


def socket_path() -> Path:
    return runtime_dir() / "daemon.sock"


def lock_path() -> Path:
    return runtime_dir() / "daemon.lock"


def http_token_path() -> Path:
    """The HTTP endpoint's bearer token (`daemon.http.token` makes it, mode 0600)."""
    return state_dir() / "http-token"


def write_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (a reader never sees half a file); 0600."""
    tmp = path.with_suffix(".tmp")
    with os.fdopen(open_private(tmp, os.O_WRONLY | os.O_TRUNC), "w") as f:
        f.write(text)
    os.replace(tmp, path)
