"""The daemon's HTTP endpoint (`ahead serve --http 127.0.0.1:8741`, off by default): other
tools use ahead through the APIs they already speak (shapes in `daemon.http_api`).

- POST /v1/completions: OpenAI's completions (a `suffix` makes it fill-in-the-middle);
- GET /v1/models: the one model;
- POST /infill: llama-server's shape, for llama.vim and llama.vscode;
- GET /health: {"status": "ok"}, or 503 while a remote backend's server is down.

Requests join the editors' scheduler (fill-in at editor priority, plain text at CLI
priority). A plain prompt in a known FIM layout (tools that render their model's template
themselves) is read back into prefix, suffix and other files: the model then gets its own.
A client that disconnects has its jobs cancelled, which stops them within one step.

Loopback by default; every route but /health needs the bearer token kept in the state dir
(file mode 0600), unless `--no-auth`, which only a loopback address allows (and then the
Host header must name the loopback: a web page cannot reach it by DNS rebinding). Bodies over
MAX_BODY_BYTES get 413; malformed or invalid JSON gets a 400 that says what is wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from daemon import http_api as api
from daemon import protocol as p
from daemon.fim import Extra, read_any
from daemon.requests import Listener, Requests
from daemon.scheduler import Backend, Job, Scheduler, Work

log = logging.getLogger("ahead.daemon")
MAX_BODY_BYTES = 2 * 1024 * 1024
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ERROR_STATUS = {"bad_request": 400, "unavailable": 503, "cancelled": 503, "shutdown": 503}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Daemon(Protocol):
    """What the endpoint needs of the server (`daemon.server.Server`)."""

    model_name: str
    requests: Requests
    scheduler: Scheduler
    backend: Backend

    def touch(self) -> None: ...
    def request_ended(self, listener: Listener) -> None: ...


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    return False


def token(path: Path) -> str:
    """The endpoint's bearer token, made on first use (mode 0600, like the state dir)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
        value = path.read_text().strip()
        if value:
            return value
        path.unlink()
        return token(path)
    value = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(value + "\n")
    return value


class HttpEndpoint:
    def __init__(self, host: str, port: int, bearer: str | None) -> None:
        """`bearer` None: no token needed (loopback only)."""
        if bearer is None and not is_loopback(host):
            raise ValueError(f"--no-auth is only allowed on a loopback address, not {host}")
        self.host, self.port, self.bearer = host, port, bearer
        self._runner: web.AppRunner | None = None
        self._daemon: Daemon | None = None

    @classmethod
    def parse(cls, spec: str, bearer: str | None) -> HttpEndpoint:
        """From HOST:PORT (or PORT, on 127.0.0.1); an IPv6 host goes in brackets."""
        host, _, port = spec.rpartition(":")
        try:
            number = int(port)
        except ValueError:
            raise ValueError(f"expected HOST:PORT for the HTTP endpoint, got {spec!r}") from None
        if not 0 <= number < 65536:
            raise ValueError(f"port {number} is out of range")
        return cls(host.strip("[]") or "127.0.0.1", number, bearer)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, daemon: Daemon) -> None:
        self._daemon = daemon
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self._guard])
        app.add_routes([web.post("/v1/completions", self._completions),
                        web.get("/v1/models", self._models),
                        web.post("/infill", self._infill),
                        web.get("/health", self._health)])
        # handler_cancellation: a client that hangs up cancels its handler, and so its jobs
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the one the system chose for port 0
        log.info("HTTP endpoint on %s (%s)", self.address,
                 "no token" if self.bearer is None else "bearer token required")

    async def stop(self, timeout: float) -> None:
        if self._runner is not None:
            await asyncio.wait_for(self._runner.cleanup(), timeout)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Authentication, then any error as a JSON body in OpenAI's shape."""
        try:
            if request.path != "/health":
                self._authorise(request)
            return await handler(request)
        except web.HTTPException as e:
            kind = "authentication_error" if e.status in (401, 403) else "invalid_request_error"
            return web.json_response(api.error_body(e.text or e.reason, kind),
                                     status=e.status, headers=_challenge(e.status))

    def _authorise(self, request: web.Request) -> None:
        if self.bearer is None:  # loopback without a token: the Host must be ours too
            if not is_loopback(request.url.host or ""):
                raise web.HTTPForbidden(text="the Host header must name the loopback address")
            return
        given = request.headers.get("Authorization", "")
        if not given.startswith("Bearer ") or not given[7:].strip():
            raise web.HTTPUnauthorized(text="a bearer token is required (Authorization: "
                                            "Bearer TOKEN; ahead serve logs where it is kept)")
        if not hmac.compare_digest(given[7:].strip().encode(), self.bearer.encode()):
            raise web.HTTPUnauthorized(text="the bearer token is not valid")

    async def _models(self, request: web.Request) -> web.Response:
        assert self._daemon is not None
        return web.json_response({"object": "list", "data": [
            {"id": self._daemon.model_name, "object": "model", "owned_by": "ahead"}]})

    async def _health(self, request: web.Request) -> web.Response:
        assert self._daemon is not None
        info = self._daemon.backend.status()
        if info.get("server") == "down":
            return web.json_response({"status": "unavailable", "error": info.get(
                "server_error")}, status=503)
        return web.json_response({"status": "ok"})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        req = await _read(request, api.CompletionRequest)
        n = req.n or 1
        works = [Work(*_parts(prompt, req.suffix), max_tokens=req.max_tokens or 16,
                      temperature=1.0 if req.temperature is None else req.temperature,
                      top_p=req.top_p or 1.0, stop=req.stops(),
                      seed=None if req.seed is None else req.seed + j, slot=("http", i * n + j))
                 for i, prompt in enumerate(req.prompts()) for j in range(n)]
        answer = api.Completion(self._model)
        async with self._run(works, "editor" if works[0].fill_in else "cli") as run:
            if not req.stream:
                return web.json_response(answer.whole(await run.dones()))
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            resp = await _sse(request)
            dones: list[p.Done] = []
            async for reply in run.replies():
                if isinstance(reply, p.Error):
                    await _event(resp, api.error_body(reply.message, reply.code))
                    return resp
                if isinstance(reply, p.Chunk):
                    await _event(resp, answer.chunk(reply.id, reply.text))
                else:
                    dones.append(reply)
                    await _event(resp, answer.chunk(reply.id, "", api.finish_reason(reply)))
            if include_usage:
                await _event(resp, answer.usage_chunk(dones))
            await resp.write(b"data: [DONE]\n\n")
            return resp

    async def _infill(self, request: web.Request) -> web.StreamResponse:
        req = await _read(request, api.InfillRequest)
        if req.n_predict == 0:  # llama.vim's warm-up of the server's cache: nothing to write
            empty = p.Done(id=0, text="", finish_reason="length")
            return web.json_response(api.infill_answer(empty, self._model, req.response_fields))
        work = Work(req.input_prefix + req.prompt, req.input_suffix,
                    tuple((c.filename, c.text) for c in req.input_extra),
                    max_tokens=req.max_tokens(),
                    temperature=req.temperature, top_p=req.top_p, stop=tuple(req.stop),
                    seed=None if req.seed < 0 else req.seed, slot=("http", 0),
                    indent_floor=req.n_indent)
        async with self._run([work], "editor", budget_ms=req.t_max_predict_ms) as run:
            if not req.stream:
                done = (await run.dones())[0]
                return web.json_response(api.infill_answer(done, self._model,
                                                           req.response_fields))
            resp = await _sse(request)
            async for reply in run.replies():
                if isinstance(reply, p.Error):
                    await _event(resp, api.error_body(reply.message, reply.code))
                elif isinstance(reply, p.Chunk):
                    await _event(resp, {"content": reply.text, "stop": False})
                else:
                    await _event(resp, {**api.infill_answer(reply, self._model, None),
                                        "content": ""})
            return resp

    @property
    def _model(self) -> str:
        assert self._daemon is not None
        return self._daemon.model_name

    def _run(self, works: list[Work], priority: p.Priority,
             budget_ms: int | None = None) -> Run:
        assert self._daemon is not None
        return Run(self._daemon, works, priority, budget_ms)


class Run:
    """The jobs of one HTTP request, their replies in one queue; leaving the `async with`
    (answered, failed, or the client gone) cancels what is still running."""

    def __init__(self, daemon: Daemon, works: list[Work], priority: p.Priority,
                 budget_ms: int | None) -> None:
        self.daemon, self.works = daemon, works
        self.priority, self.budget_ms = priority, budget_ms
        self.queue: asyncio.Queue[p.Reply] = asyncio.Queue()
        self.jobs: list[tuple[Job, Listener]] = []

    async def __aenter__(self) -> Run:
        loop, daemon = asyncio.get_running_loop(), self.daemon
        daemon.touch()

        def send(msg: p.Reply) -> None:
            loop.call_soon_threadsafe(self.queue.put_nowait, msg)

        def ended(listener: Listener) -> None:
            loop.call_soon_threadsafe(daemon.request_ended, listener)

        for i, work in enumerate(self.works):
            listener = Listener(i, send, on_end=ended)
            try:
                job = daemon.requests.run(work, listener, priority=self.priority,
                                          budget_ms=self.budget_ms, multiline=True)
            except RuntimeError:  # the scheduler closed: the daemon is shutting down
                await self.__aexit__()
                raise web.HTTPServiceUnavailable(text="the daemon is shutting down") from None
            self.jobs.append((job, listener))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for job, listener in self.jobs:
            if not listener.ended:
                self.daemon.scheduler.detach(job, listener)
        self.daemon.touch()

    async def replies(self) -> AsyncIterator[p.Chunk | p.Done | p.Error]:
        """Every job's chunks, then its Done or Error, until all have ended."""
        left = len(self.jobs)
        while left:
            reply = await self.queue.get()
            if isinstance(reply, p.Chunk | p.Done | p.Error):
                left -= not isinstance(reply, p.Chunk)
                yield reply

    async def dones(self) -> list[p.Done]:
        """Every job's final answer, in order; an error of any is raised as an HTTP one."""
        dones: dict[int, p.Done] = {}
        async for reply in self.replies():
            if isinstance(reply, p.Error):
                raise _http_error(ERROR_STATUS.get(reply.code, 500), reply.message)
            if isinstance(reply, p.Done):
                dones[reply.id] = reply
        return [dones[i] for i in range(len(self.jobs))]


def _parts(prompt: str, suffix: str | None) -> tuple[str, str | None, Extra]:
    """A completion's prefix, suffix and other files. A prompt a client wrote in a known
    FIM layout itself (Continue renders its model's template) is read back into its parts,
    so that the model gets its own prompt, in its own order and tokens."""
    if suffix is None and (parts := read_any(prompt)) is not None:
        return parts
    return prompt, suffix, ()


def _http_error(status: int, message: str) -> web.HTTPException:
    kinds: dict[int, type[web.HTTPException]] = {400: web.HTTPBadRequest,
                                                  503: web.HTTPServiceUnavailable}
    return kinds.get(status, web.HTTPInternalServerError)(text=message)


def _challenge(status: int) -> dict[str, str]:
    return {"WWW-Authenticate": "Bearer"} if status == 401 else {}


async def _read(request: web.Request, kind: type[Any]) -> Any:
    try:
        return api.decode(await request.read(), kind)
    except ValueError as e:
        raise web.HTTPBadRequest(text=str(e)) from None


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _event(resp: web.StreamResponse, data: dict[str, Any]) -> None:
    await resp.write(b"data: " + json.dumps(data).encode() + b"\n\n")
