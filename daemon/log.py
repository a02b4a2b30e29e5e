"""The daemon's log: `daemon.log` in the state dir, private (0600) and bounded in size.

The file is rotated when it reaches `max_bytes` (`daemon.log.1`, `.2`, older ones dropped), so
a daemon that runs for weeks, or a client that misbehaves in a loop, cannot fill the disk.
"""

from __future__ import annotations

import io
import logging
import os
from logging.handlers import RotatingFileHandler
from pathlib import Path

from daemon.paths import open_private

BACKUPS = 2
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PrivateRotatingHandler(RotatingFileHandler):
    """Rotates by size; every file it creates is 0600. Descriptors handed to `follow` (a
    detached daemon's stdout and stderr) are pointed at the current file after each
    rotation, so what is printed there (a stray warning, a fatal error) stays bounded too."""

    def __init__(self, path: Path, max_bytes: int) -> None:
        self._follow: tuple[int, ...] = ()
        super().__init__(path, maxBytes=max_bytes, backupCount=BACKUPS, encoding="utf-8")

    def _open(self) -> io.TextIOWrapper:
        fd = open_private(Path(self.baseFilename), os.O_WRONLY | os.O_APPEND)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)

    def follow(self, *fds: int) -> None:
        self._follow = fds
        self._point()

    def doRollover(self) -> None:
        super().doRollover()
        self._point()

    def _point(self) -> None:
        if self.stream is not None:
            for fd in self._follow:
                os.dup2(self.stream.fileno(), fd)


def setup(path: Path, max_bytes: int, *, to_stderr: bool) -> PrivateRotatingHandler:
    """Log the daemon's `ahead.*` and library messages to `path` (and to stderr when it is
    a terminal's, not a client's that started the daemon)."""
    handler = PrivateRotatingHandler(path, max_bytes)
    handlers: list[logging.Handler] = [handler]
    if to_stderr:
        handlers.append(logging.StreamHandler())
    logging.basicConfig(level=logging.INFO, handlers=handlers, format=FORMAT)
    return handler
