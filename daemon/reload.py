"""Hot model swaps: a changed checkpoint is loaded beside the old one and swapped in between
requests; one that fails to load is reported and the old model keeps serving."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import watchfiles

from daemon.config import ConfigFileError, load_settings
from engine import Engine

log = logging.getLogger("ahead.daemon")

Loader = Callable[[Path], Engine]


class Reloader:
    def __init__(self, swap: Callable[[Engine], None], loader: Loader, model_dir: Path) -> None:
        """`swap` puts a loaded engine into service (between requests)."""
        self.swap, self.loader, self.model_dir = swap, loader, model_dir
        self.reloads = 0
        self.last_error: str | None = None
        self.results: asyncio.Queue[str] = asyncio.Queue()  # "ok" or the error, per attempt
        self._lock = asyncio.Lock()

    async def reload(self, model_dir: Path | None = None) -> str:
        """Load (the same or another) model beside the serving one; swap it in if it loads."""
        async with self._lock:
            target = model_dir or self.model_dir
            try:
                engine = await asyncio.to_thread(self.loader, target)
            except Exception as e:  # any loading failure: the old model keeps serving
                self.last_error = f"{target}: {e}"
                log.error("reload failed, keeping the old model: %s", self.last_error)
                result = f"error: {self.last_error}"
            else:
                self.swap(engine)
                self.model_dir, self.last_error = target, None
                self.reloads += 1
                log.info("loaded %s; swapping it in between requests", target)
                result = "ok"
            self.results.put_nowait(result)
            return result

    async def watch(self, stop: asyncio.Event, debounce_ms: int = 1500,
                    config: Path | None = None) -> None:
        """Reload when files in the model directory change (a copy settling counts once), or
        when the config file names another model."""
        watched = [self.model_dir]
        if config is not None and config.parent.is_dir():
            watched.append(config.parent)
        async for changes in watchfiles.awatch(*watched, stop_event=stop, debounce=debounce_ms,
                                               recursive=False):
            changed = {Path(path) for _, path in changes}
            if config is not None and config in changed:
                await self._config_changed(config)
            if any(path.parent == self.model_dir for path in changed):
                await self.reload()

    async def _config_changed(self, config: Path) -> None:
        try:
            model = load_settings(config).model
        except ConfigFileError as e:
            self.last_error = str(e)
            log.error("config not applied: %s", e)
            self.results.put_nowait(f"error: {e}")
            return
        if model and Path(model).expanduser().resolve() != self.model_dir.resolve():
            log.info("the config file names another model: %s", model)
            await self.reload(Path(model).expanduser())
