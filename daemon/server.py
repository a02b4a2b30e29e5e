"""`ahead serve`: the resident model behind a private Unix socket (and, when asked for, an
HTTP endpoint: `daemon.http`).

Lifecycle as uvicorn does it: `serve()` is startup (single-instance lock, stale socket
cleanup, listen), the main loop (until SIGTERM, a shutdown request or the idle timeout), and
shutdown (stop listening, cancel the jobs, close connections within a timeout, remove the
socket). The backend runs the jobs (the local engine on its worker thread, or a remote
server's streams); the event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from daemon import protocol as p
from daemon.http import HttpEndpoint
from daemon.instance import InstanceLock, peer_uid
from daemon.requests import Listener, Requests
from daemon.scheduler import Backend, Job, Scheduler
from daemon.stats import Stats

log = logging.getLogger("ahead.daemon")
FRAME_TIMEOUT = 10.0  # seconds a frame's body may take to follow its header


class Connection:
    def __init__(self, server: Server, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.server, self.reader, self.writer = server, reader, writer
        self.loop = asyncio.get_running_loop()
        self.outbox: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.decoder = p.request_decoder()
        self.jobs: dict[int, tuple[Job, Listener]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.greeted = False

    def send(self, msg: p.Reply) -> None:
        """Thread-safe: the worker thread calls it through listeners."""
        self.loop.call_soon_threadsafe(self.outbox.put_nowait, p.encode(msg))

    async def run(self) -> None:
        writer_task = asyncio.create_task(self._write())
        try:
            await self._read()
        finally:
            for job, listener in list(self.jobs.values()):  # the client went away
                self.server.scheduler.detach(job, listener)
            self.close_soon()
            await writer_task
            with contextlib.suppress(ConnectionError):
                await self.writer.wait_closed()

    def close_soon(self) -> None:
        """Flush what is queued, then hang up (the read loop then sees the end). Through
        the loop's callback queue, so frames `send` scheduled earlier still go first."""
        self.loop.call_soon(self.outbox.put_nowait, None)

    async def _write(self) -> None:
        try:
            while (frame := await self.outbox.get()) is not None:
                self.writer.write(frame)
                await self.writer.drain()
        except ConnectionError:
            pass
        finally:
            self.writer.close()

    async def _read(self) -> None:
        while True:
            try:
                body = await p.read_frame(self.reader, body_timeout=self.server.frame_timeout)
            except p.FrameError as e:
                self.send(p.Error(id=None, code="bad_frame", message=str(e)))
                return  # the stream is out of step: close it
            except ConnectionError as e:  # a killed editor: its unread replies reset us
                log.info("a client went away: %s", e.strerror or e)
                return
            if body is None:
                return
            try:
                msg = self.decoder.decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError) as e:  # invalid UTF-8 included
                self.send(p.Error(id=p.request_id(body), code="bad_request",
                                  message=str(e)))
                continue
            self.server.touch()
            self.dispatch(msg)

    def dispatch(self, msg: p.Request) -> None:
        if not self.greeted and not isinstance(msg, p.Hello):
            self.send(p.Error(id=None, code="bad_request", message="the first frame must be hello"))
            return
        match msg:
            case p.Hello(version=version):
                if version != p.PROTOCOL_VERSION:
                    self.send(p.Error(id=None, code="version", message=(
                        f"protocol version {version} is not supported; the daemon speaks "
                        f"{p.PROTOCOL_VERSION} (restart the daemon or update the client)")))
                    return
                self.greeted = True
                self.send(p.Welcome(version=p.PROTOCOL_VERSION, model=self.server.model_name,
                                    pid=os.getpid()))
            case p.Complete() | p.Generate():
                self._start(msg)
            case p.Cancel(id=req_id):
                if req_id in self.jobs:
                    job, listener = self.jobs[req_id]
                    self.server.scheduler.detach(job, listener)
            case p.Status(id=req_id):
                self.send(p.StatusReply(id=req_id, info=self.server.status()))
            case p.Feedback(event=event, language=language):
                self.server.stats.counts[event] += 1
                suggestions, model = self.server.stats.suggestions, self.server.model_name
                if event == "shown":
                    suggestions.shown(model, language or "unknown")
                elif event in ("accepted", "partial"):
                    suggestions.taken(model, language or "unknown", full=event == "accepted")
            case p.Shutdown(id=req_id):
                self.send(p.Done(id=req_id, text="", finish_reason="shutdown"))
                self.server.stop()
            case p.Reload(id=req_id, model=model):
                task = asyncio.create_task(self._reload(req_id, model))
                self.tasks.add(task)  # held until done: the loop keeps only weak references
                task.add_done_callback(self.tasks.discard)
            case _:
                self.send(p.Error(id=None, code="bad_request", message=f"unexpected {msg!r}"))

    async def _reload(self, req_id: int, model: str | None) -> None:
        reloader = self.server.reloader
        if reloader is None:
            self.send(p.Error(id=req_id, code="unsupported", message="this daemon cannot reload"))
            return
        result = await reloader.reload(Path(model) if model else None)
        if result == "ok":
            self.send(p.Done(id=req_id, text=str(reloader.model_dir), finish_reason="reloaded"))
        else:
            self.send(p.Error(id=req_id, code="reload_failed", message=result))

    def _start(self, msg: p.Complete | p.Generate) -> None:
        if msg.id in self.jobs:
            self.send(p.Error(id=msg.id, code="bad_request", message=f"id {msg.id} is in use"))
            return
        listener = Listener(msg.id, self.send, on_end=self._ended)
        requests = self.server.requests
        try:
            job = requests.complete(msg, listener) if isinstance(msg, p.Complete) else \
                requests.generate(msg, listener)
        except RuntimeError:  # the scheduler closed: the daemon is shutting down
            self.send(p.Error(id=msg.id, code="shutdown", message="the daemon is shutting down"))
            return
        if job is not None and not listener.ended:
            self.jobs[msg.id] = (job, listener)

    def _ended(self, listener: Listener) -> None:
        """Thread-safe: a request got its last frame."""
        self.loop.call_soon_threadsafe(self._forget, listener)

    def _forget(self, listener: Listener) -> None:
        self.server.request_ended(listener)
        entry = self.jobs.get(listener.req_id)
        if entry is not None and entry[1] is listener:
            del self.jobs[listener.req_id]


class Server:
    def __init__(self, backend: Backend, socket_path: Path, lock: InstanceLock, *,
                 model_name: str, idle_timeout: float = 0.0, stats_path: Path | None = None,
                 watch_debounce_ms: int | None = 1500, config_file: Path | None = None,
                 http: HttpEndpoint | None = None) -> None:
        """`backend` runs the jobs; if it can reload its model (`backend.reloader`), the
        model directory is watched unless `watch_debounce_ms` is None; `http` serves the
        same pipeline over HTTP."""
        self.model_name = model_name
        self.socket_path, self.lock = socket_path, lock
        self.idle_timeout = idle_timeout
        self.frame_timeout = FRAME_TIMEOUT
        self.backend = backend
        self.scheduler = Scheduler(backend)
        self.requests = Requests(self.scheduler)
        self.reloader = getattr(backend, "reloader", None)
        self.watch_debounce_ms, self.config_file = watch_debounce_ms, config_file
        self.http = http
        self.stats = Stats(stats_path)
        self.started = time.monotonic()
        self.last_activity = self.started
        self.connections: dict[asyncio.Task[None], Connection] = {}
        self._stop: asyncio.Event | None = None

    def save_state(self) -> None:
        """Save the statistics and what the backend keeps (the local engine's K policy); a
        failure is logged, the daemon serves on."""
        try:
            self.stats.save(self.counts())
            self.backend.save_state()
        except OSError as e:
            log.error("could not save the daemon's state: %s", e)

    def request_ended(self, listener: Listener) -> None:
        """A request got its last frame: count it (on the event loop)."""
        if listener.final is not None:
            s = listener.final
            self.stats.request_done(s.total_ms, s.engine_ms, s.tokens, s.prefill_tokens,
                                    s.reused_tokens, s.k_histogram, s.hop_ms)
        if listener.withheld is not None:  # why editors saw nothing: `ahead status` says
            self.stats.counts[f"withheld_{listener.withheld}"] += 1

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        self._stop = asyncio.Event()
        self.lock.acquire()
        try:
            self.scheduler.start()
            server = await self._listen()
            if self.http is not None:
                await self.http.start(self)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
            log.info("serving %s on %s", self.model_name, self.socket_path)
            watcher = None
            if self.reloader and self.watch_debounce_ms is not None:
                watcher = asyncio.create_task(self.reloader.watch(
                    self._stop, self.watch_debounce_ms, self.config_file))
            if on_ready:
                on_ready()
            await self._main_loop()
            if watcher:
                await asyncio.wait_for(watcher, timeout=10)
            await self._shutdown(server)
            self.save_state()
        finally:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self.lock.release()

    async def _listen(self) -> asyncio.base_events.Server:
        # We hold the lock, so a socket file left behind is a dead daemon's.
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        old = os.umask(0o177)  # the socket is born 0600
        try:
            server = await asyncio.start_unix_server(self._accept, path=str(self.socket_path))
        finally:
            os.umask(old)
        os.chmod(self.socket_path, 0o600)
        return server

    async def _main_loop(self) -> None:
        assert self._stop is not None
        saved = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=1.0)
            if time.monotonic() - saved > 60:
                self.save_state()
                saved = time.monotonic()
            idle = time.monotonic() - self.last_activity
            if self.idle_timeout and not self.connections and idle > self.idle_timeout:
                log.info("idle for %.0f s: exiting to give the GPU back", idle)
                self._stop.set()

    async def _shutdown(self, server: asyncio.base_events.Server, timeout: float = 5.0) -> None:
        server.close()
        await self.scheduler.close()  # in-flight jobs end with a "shutdown" cancellation
        if self.http is not None:
            await self.http.stop(timeout)
        for conn in self.connections.values():
            conn.close_soon()
        if self.connections:
            _, pending = await asyncio.wait(list(self.connections), timeout=timeout)
            for task in pending:
                task.cancel()
        await server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid != os.getuid():
            log.warning("refused a connection from uid %s", uid)
            writer.write(p.encode(p.Error(id=None, code="forbidden",
                                          message="connections from other users are refused")))
            writer.close()
            return
        self.touch()
        task = asyncio.current_task()
        assert task is not None
        conn = self.connections[task] = Connection(self, reader, writer)
        try:
            await conn.run()
        finally:
            del self.connections[task]
            self.touch()

    def counts(self) -> dict[str, int]:
        c = self.scheduler.counters
        return {"requests_completed": c.completed, "steps": c.steps, "cancelled": c.cancelled,
                "superseded": c.superseded, "stale_steps": c.stale_steps,
                "errors": c.errors, "batched_steps": c.batched_steps,
                "batched_jobs": c.batched_jobs, "prefilled_tokens": c.prefilled_tokens,
                "prefix_reused_tokens": c.prefix_reused_tokens,
                "completions": self.requests.completions,
                "typed_through": self.requests.typed_through,
                "prefetches": self.requests.prefetches,
                "prefetch_hits": self.requests.prefetch_hits,
                "prefetch_steps": c.prefetch_steps}

    def status(self) -> dict[str, Any]:
        reloader = self.reloader
        return {"model": self.model_name, "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self.started, 1),
                "connections": len(self.connections),
                "serving": str(reloader.model_dir) if reloader else self.model_name,
                **({"http": self.http.address} if self.http else {}),
                **self.stats.snapshot(self.counts()),
                **self.backend.status()}
