"""Talking to `ahead serve`: an asyncio client that starts the daemon when nobody answers.

Imports no torch. One connection carries many requests; replies are routed by request id.
If the daemon dies, requests in flight fail with `DaemonUnavailable` and the next request
reconnects, starting a new daemon if need be. A daemon that is stopped or hung (it accepts the
connection but says nothing) is found out too: the greeting must come within `timeout`
seconds, and while a request waits, a daemon silent for `timeout` is asked for its status,
which its event loop answers at once however busy the model is; no answer within `timeout`
more fails the requests in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from daemon import paths
from daemon import protocol as p


class DaemonUnavailable(ConnectionError):
    """The daemon could not be reached or started, or went away mid-request."""

    def __init__(self, message: str, *, before_any_reply: bool = False) -> None:
        super().__init__(message)
        self.before_any_reply = before_any_reply


DEFAULT_TIMEOUT = 15.0


def default_timeout() -> float:
    """$AHEAD_CLIENT_TIMEOUT seconds, else 15."""
    value = os.environ.get("AHEAD_CLIENT_TIMEOUT", "")
    try:
        timeout = float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"AHEAD_CLIENT_TIMEOUT must be a number of seconds, not {value!r}")\
            from None
    if not timeout > 0:
        raise ValueError(f"AHEAD_CLIENT_TIMEOUT must be positive, not {value!r}")
    return timeout


class RequestFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def start_daemon(args: list[str], timeout: float) -> bool:
    """Start `ahead serve` detached, and wait until it says it listens (or why it cannot).
    False when another daemon holds the lock: it runs, or is still loading its model."""
    cmd = [sys.executable, "-m", "clients.cli", "serve", "--ready-fd", "1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    # The daemon outlives this call; a waiting thread reaps it whenever it exits.
    threading.Thread(target=proc.wait, name="ahead-daemon-reaper", daemon=True).start()
    assert proc.stdout is not None and proc.stderr is not None
    with proc.stdout, proc.stderr:  # both closed on every way out
        line = _readline(proc, timeout)
        if line.strip() == b"ready":
            return True
        err = proc.stderr.read().decode(errors="replace").strip()
    if "another ahead daemon is running" in err:
        return False  # someone else started it first: fine
    raise DaemonUnavailable(f"the daemon did not start: {err or 'no answer'}")


def _readline(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    import selectors

    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise DaemonUnavailable(f"the daemon did not get ready within {timeout:.0f} s")
    return proc.stdout.readline()


class Client:
    def __init__(self, socket_path: Path | None = None, *, autostart: bool = True,
                 serve_args: list[str] | None = None, start_timeout: float = 120.0,
                 client_name: str = "ahead", timeout: float | None = None) -> None:
        """`timeout`: seconds for the greeting, and for the liveness check of a daemon that
        has been silent that long (default: `default_timeout()`)."""
        self.socket_path = socket_path or paths.socket_path()
        self.autostart, self.serve_args = autostart, serve_args or []
        self.start_timeout, self.client_name = start_timeout, client_name
        self.timeout = default_timeout() if timeout is None else timeout
        self.welcome: p.Welcome | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._queues: dict[int, asyncio.Queue[p.Reply | None]] = {}
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._lost = ""  # why the connection was given up, when it was
        self._ping: asyncio.Future[bool] | None = None

    async def connect(self) -> p.Welcome:
        """Connect and greet; start the daemon if nobody answers (a stale socket of a killed
        daemon included)."""
        async with self._lock:
            if self._writer is not None and self.welcome is not None:
                return self.welcome
            try:
                return await self._handshake()
            except DaemonUnavailable:  # it is there but does not answer: starting another
                raise  # one would not help
            except (OSError, p.FrameError) as e:
                if not self.autostart:
                    raise DaemonUnavailable(f"no daemon answers on {self.socket_path}: "
                                            f"{e}") from None
            deadline = time.monotonic() + self.start_timeout
            ours = await asyncio.to_thread(start_daemon, self.serve_args, self.start_timeout)
            delay = 0.05
            while True:
                try:
                    return await self._handshake()
                except DaemonUnavailable:
                    raise
                except (OSError, p.FrameError) as e:
                    if ours or time.monotonic() + delay > deadline:
                        what = "started" if ours else "that is starting"
                        raise DaemonUnavailable(f"the daemon {what} does not answer: "
                                                f"{e}") from None
                # Another daemon holds the lock but does not listen yet: it is loading its
                # model (its socket appears when it is ready), so wait for it.
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.5)

    async def _handshake(self) -> p.Welcome:
        reader, writer = await asyncio.open_unix_connection(str(self.socket_path))
        writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION, client=self.client_name)))
        try:
            reply = await asyncio.wait_for(_read_reply(reader), self.timeout)
        except TimeoutError:
            writer.transport.abort()
            raise DaemonUnavailable(
                f"the daemon on {self.socket_path} accepts connections but does not answer "
                f"within {self.timeout:g} s (is it stopped or hung?)") from None
        if not isinstance(reply, p.Welcome):
            writer.close()
            if isinstance(reply, p.Error):
                raise RequestFailed(reply.code, reply.message)
            raise ConnectionResetError(f"unexpected greeting {reply!r}")
        self._writer, self.welcome, self._lost = writer, reply, ""
        self._reader_task = asyncio.create_task(self._route(reader))
        return reply

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self._reader_task is not None:
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._writer = self.welcome = None

    async def _route(self, reader: asyncio.StreamReader) -> None:
        try:
            while (reply := await _read_reply(reader)) is not None:
                req_id = getattr(reply, "id", None)
                if req_id in self._queues:
                    self._queues[req_id].put_nowait(reply)
        except (p.FrameError, ConnectionError):
            pass
        finally:
            if self._writer is not None:
                self._writer.close()
            self._writer = self.welcome = None
            for q in self._queues.values():
                q.put_nowait(None)  # the daemon went away

    async def stream(self, msg: p.Complete | p.Generate | p.Status | p.Shutdown,
                     ) -> AsyncGenerator[p.Reply, None]:
        """Send a request (its id is assigned here) and yield its replies to the last one."""
        await self.connect()
        msg.id = next(self._ids)
        queue: asyncio.Queue[p.Reply | None] = asyncio.Queue()
        self._queues[msg.id] = queue
        answered = replied = False
        try:
            assert self._writer is not None
            self._writer.write(p.encode(msg))
            while not answered:
                reply = await self._next(queue)
                if reply is None:
                    raise DaemonUnavailable(  # a hung daemon is not worth asking again
                        self._lost or "the daemon closed the connection",
                        before_any_reply=not replied and not self._lost)
                replied = True
                answered = isinstance(reply, p.Done | p.Error | p.StatusReply)
                yield reply
        finally:
            del self._queues[msg.id]
            if not answered and self._writer is not None:  # the caller gave up: stop the work
                with contextlib.suppress(ConnectionError):
                    self._writer.write(p.encode(p.Cancel(id=msg.id)))

    async def _next(self, queue: asyncio.Queue[p.Reply | None]) -> p.Reply | None:
        """The next reply in `queue`; None once the connection is gone (a daemon that does
        not prove alive when asked is hung up on)."""
        while True:
            try:
                return await asyncio.wait_for(queue.get(), self.timeout)
            except TimeoutError:
                if self._ping is None or self._ping.done():  # one check for all waiting
                    self._ping = asyncio.ensure_future(self._answers())
                if not await asyncio.shield(self._ping) and self._writer is not None:
                    self._lost = (f"the daemon has not answered for {2 * self.timeout:g} s "
                                  "(is it stopped or hung?)")
                    self._writer.transport.abort()  # the reader ends: every queue hears it

    async def _answers(self) -> bool:
        """Whether the daemon answers a status request within `timeout`; a connection
        already gone counts as answered (its waiters hear of it from the reader)."""
        if self._writer is None:
            return True
        req_id = next(self._ids)
        queue: asyncio.Queue[p.Reply | None] = asyncio.Queue()
        self._queues[req_id] = queue
        try:
            self._writer.write(p.encode(p.Status(id=req_id)))
            await asyncio.wait_for(queue.get(), self.timeout)
            return True
        except TimeoutError:
            return False
        finally:
            del self._queues[req_id]

    async def notify(self, msg: p.Feedback) -> None:
        """Send a message that has no answer."""
        await self.connect()
        if self._writer is None:
            raise DaemonUnavailable("the daemon closed the connection")
        self._writer.write(p.encode(msg))

    async def run(self, msg: p.Complete | p.Generate) -> p.Done:
        """The whole answer of a completion or generation. A request the daemon died before
        answering at all is sent once more (to a restarted daemon): it has no side effects."""
        for attempt in (1, 2):
            try:
                async for reply in self.stream(msg):
                    if isinstance(reply, p.Error):
                        raise RequestFailed(reply.code, reply.message)
                    if isinstance(reply, p.Done):
                        return reply
            except DaemonUnavailable as e:
                if attempt == 2 or not e.before_any_reply:
                    raise
        raise DaemonUnavailable("no answer")

    async def status(self) -> dict:
        async for reply in self.stream(p.Status(id=0)):
            if isinstance(reply, p.StatusReply):
                return reply.info
        raise DaemonUnavailable("no status")

    async def shutdown(self) -> None:
        with contextlib.suppress(DaemonUnavailable):
            async for _ in self.stream(p.Shutdown(id=0)):
                pass

    async def wait_closed(self, timeout: float) -> None:
        """Until the daemon closes the connection (after a shutdown: it is exiting)."""
        if self._reader_task is not None:
            await asyncio.wait_for(asyncio.shield(self._reader_task), timeout)


async def _read_reply(reader: asyncio.StreamReader) -> p.Reply | None:
    body = await p.read_frame(reader)
    if body is None:
        return None
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise p.FrameError(f"the daemon sent a frame that is not a reply: {e}") from None


_decoder = p.reply_decoder()



class SyncClient:
    """A blocking face for short-lived programs (the CLI, hooks): one event loop of its own."""

    def __init__(self, **kw: Any) -> None:
        self._runner = asyncio.Runner()
        self._client = Client(**kw)
        self.done: p.Done | None = None  # the last request's final answer

    def __enter__(self) -> SyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, msg: p.Complete | p.Generate) -> Iterator[str]:
        """The answer's text as it streams; the final text of a deadline cut may be shorter,
        so use `run` when only the whole answer matters."""
        agen = self._client.stream(msg)

        async def next_reply() -> p.Reply:
            return await anext(agen)

        try:
            while True:
                reply = self._runner.run(next_reply())
                if isinstance(reply, p.Chunk):
                    yield reply.text
                elif isinstance(reply, p.Error):
                    raise RequestFailed(reply.code, reply.message)
                elif isinstance(reply, p.Done):
                    self.done = reply
                    return
        except StopAsyncIteration:
            return
        finally:  # a caller who stops early (Ctrl-C) cancels the request
            self._runner.run(agen.aclose())

    def run(self, msg: p.Complete | p.Generate) -> p.Done:
        return self._runner.run(self._client.run(msg))

    def status(self) -> dict:
        return self._runner.run(self._client.status())

    def shutdown(self) -> None:
        self._runner.run(self._client.shutdown())

    def close(self) -> None:
        self._runner.run(self._client.close())
        self._runner.close()
