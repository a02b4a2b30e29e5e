"""One daemon per user, and only the user's own processes as its clients."""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from pathlib import Path


class AlreadyRunning(RuntimeError):
    """Another daemon holds the lock."""


class InstanceLock:
    """One daemon per user: an flock on a file that also records the holder's pid."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise AlreadyRunning(f"another ahead daemon is running (pid {holder})") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def peer_uid(sock: socket.socket) -> int | None:
    """The connecting process's uid (SO_PEERCRED on Linux)."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    return struct.unpack("3i", creds)[1]
