"""The `openai` backend: a remote server with the OpenAI completions API (vLLM, SGLang,
llama-server), or llama-server's `/infill`.

The daemon builds each prompt (`daemon.backends.prompts`), sends it with `stream: true`, and
hands each streamed chunk to the scheduler as one step of the job. Cancelling a job
(superseded, its client gone) closes its stream: vLLM and llama-server abort a request whose
connection closes. Every stream's connection is closed when it ends (llama-server closes it
after a stream anyway, though it says keep-alive, and a pooled dead connection would fail the
next request). At most `max_streams` requests are in flight (the server batches them);
queued jobs start most urgent first. A connection that cannot be made is tried again with
backoff (before any answer only: a request has no side effects), then the job fails with
code "unavailable" and the backend reports the server down, in `ahead status` and to the
editors, until a request gets through again.

The quality rules (engine/decode/quality.py) hold for a server's answers as for the local
engine's: each request asks for its tokens' log-probabilities (OpenAI's `logprobs`,
llama-server's `n_probs`), so a suggestion carries its confidence and the threshold applies;
a stream that falls into a loop is closed there (the server stops writing) and ends with
finish reason "repetition".
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from daemon.backends.prompts import PromptBuilder, RemotePrompt, prompt_builder
from daemon.config import Settings
from daemon.scheduler import PREFETCH, Job, Scheduler, StepReport, Usage
from engine.decode.indent import IndentFloor
from engine.decode.quality import REPETITION, LoopWatch

log = logging.getLogger("ahead.daemon")
RETRY_DELAYS = (0.1, 0.3, 1.0)  # seconds before each new try of a connection that failed
CONNECT_TIMEOUT = 5.0
UNAVAILABLE_STATUS = (502, 503, 504)  # a proxy without its server, a server still loading


class ServerUnavailable(Exception):
    """The server cannot be reached, or says it cannot serve now."""


class ServerError(Exception):
    """The server answered a request with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Health:
    """Whether the server answers: "unknown" until the first request, then "up" or "down"."""

    def __init__(self) -> None:
        self.state = "unknown"
        self.error: str | None = None
        self.since = time.monotonic()

    def up(self) -> None:
        if self.state != "up":
            log.info("the serving engine answers")
            self.state, self.error, self.since = "up", None, time.monotonic()

    def down(self, error: str) -> None:
        if self.state != "down":
            log.warning("the serving engine is down: %s", error)
            self.since = time.monotonic()
        self.state, self.error = "down", error


class OpenAIBackend:
    name = "openai"
    reloader = None  # the model lives on the server

    def __init__(self, url: str, prompts: PromptBuilder, *, served_model: str | None = None,
                 api_key: str | None = None, max_streams: int = 4,
                 timeout: float = 30.0) -> None:
        """`url`: the server's API base, with or without its `/v1`."""
        base = url.rstrip("/")
        root = base.removesuffix("/v1")
        self.url = root + "/v1"
        self.urls = {"completions": self.url + "/completions", "infill": root + "/infill"}
        self.prompts, self.served_model = prompts, served_model
        self.max_streams, self.timeout = max_streams, timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.health = Health()
        self.retries = 0
        self._tasks: dict[Job, asyncio.Task[None]] = {}
        self._scheduler: Scheduler | None = None
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> OpenAIBackend:
        """The backend the settings describe (a ValueError says what is missing)."""
        if not settings.url:
            raise ValueError("the openai backend needs url: the server's API (e.g. "
                             "http://127.0.0.1:8080/v1)")
        api_key = None
        if settings.api_key_env:
            api_key = os.environ.get(settings.api_key_env)
            if not api_key:
                raise ValueError(f"api_key_env names ${settings.api_key_env}, which is not set")
        prompts = prompt_builder(tokenizer=settings.tokenizer,
                                 served_model=settings.served_model,
                                 fim_template=settings.fim_template, context=settings.max_seq_len)
        return cls(settings.url, prompts, served_model=settings.served_model, api_key=api_key,
                   max_streams=settings.slots, timeout=settings.timeout)

    def start(self, scheduler: Scheduler) -> None:
        self._scheduler, self._loop = scheduler, asyncio.get_running_loop()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT,
                                        sock_read=self.timeout)
        self._session = aiohttp.ClientSession(timeout=timeout, headers=self.headers)

    def wake(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch)

    def cancelled(self, job: Job) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop, job)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    def save_state(self) -> None:
        pass

    def status(self) -> dict[str, Any]:
        return {"backend": self.name, "url": self.url, "served_model": self.served_model,
                "prompts": self.prompts.description, "server": self.health.state,
                "server_error": self.health.error,
                "server_state_for_s": round(time.monotonic() - self.health.since, 1),
                "streams": len(self._tasks), "connection_retries": self.retries}

    def _dispatch(self) -> None:
        """Start the most urgent queued jobs while streams are free; a prefetch only while
        no other job is live (it would take a server slot from one)."""
        assert self._scheduler is not None and self._loop is not None
        live = self._scheduler.live()
        for job in live:
            if len(self._tasks) >= self.max_streams:
                return
            if job.priority == PREFETCH and live[0].priority < PREFETCH:
                return
            if job not in self._tasks:
                task = self._loop.create_task(self._run(job))
                self._tasks[job] = task
                task.add_done_callback(functools.partial(self._ended, job))

    def _ended(self, job: Job, task: asyncio.Task[None]) -> None:
        self._tasks.pop(job, None)
        self._dispatch()

    def _stop(self, job: Job) -> None:
        task = self._tasks.get(job)
        if task is not None:
            task.cancel()  # `_stream` closes the connection on its way out

    async def _run(self, job: Job) -> None:
        assert self._scheduler is not None
        scheduler = self._scheduler
        job.started = time.monotonic()
        deadline = asyncio.timeout_at(job.deadline)  # loop.time() is time.monotonic()
        try:
            async with deadline:  # the prompt is tokenized off the event loop
                await self._stream(job, await asyncio.to_thread(self.prompts.build, job.work))
        except TimeoutError:
            if not deadline.expired():
                raise
            scheduler.stepped([StepReport(job)], 0.0)  # past its deadline: the text so far
        except ServerUnavailable as e:
            self.health.down(str(e))
            scheduler.fail([job], "unavailable", str(e))
        except ServerError as e:
            scheduler.fail([job], e.code, str(e))
        except ValueError as e:  # a prompt that cannot be built, a chunk that is not JSON
            scheduler.fail([job], "bad_request", str(e))
        except Exception as e:  # a bug here must end the job, not leave it waiting
            log.exception("the openai backend failed a job")
            scheduler.fail([job], "internal", str(e))

    async def _stream(self, job: Job, prompt: RemotePrompt) -> None:
        assert self._scheduler is not None
        url = self.urls[prompt.endpoint]
        sent = time.monotonic()  # the hop counts from here: connecting is part of it
        resp = await self._post(url, self._body(job, prompt))
        self.health.up()
        stream = _Stream(prompt.endpoint, prompt.forced, sent, loops=job.work.stop_loops,
                         indent_floor=job.work.indent_floor)
        last = job.started or sent  # the backend's time: the prompt's building, the stream
        try:
            async for event in _events(resp):
                text = stream.read(event)
                now = time.monotonic()
                self._scheduler.stepped([StepReport(job, text, None, stream.usage(now))],
                                        now - last)
                last = now
                if not job.live:  # it ended here (a deadline): the server stops too
                    return
                if stream.ended:  # a loop, or the block's end: closing the stream
                    break  # (`finally`) stops the server
            now = time.monotonic()
            self._scheduler.stepped([StepReport(job, stream.flush(), stream.finish,
                                                stream.usage(now))], now - last)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, TimeoutError) as e:
            raise ServerUnavailable(f"the stream from {url} broke off: {_describe(e)}") from None
        finally:
            resp.close()  # a stream left early (cancelled) closes its connection: an abort

    def _body(self, job: Job, prompt: RemotePrompt) -> dict[str, Any]:
        w = job.work
        body: dict[str, Any] = {**prompt.body, "temperature": w.temperature, "top_p": w.top_p,
                                "stream": True}
        if w.stop:
            body["stop"] = list(w.stop)
        if w.seed is not None:
            body["seed"] = w.seed
        if prompt.endpoint == "infill":
            body["n_predict"] = w.max_tokens
            body["n_probs"] = 1  # each token's log-probability (and the top one's)
        else:
            body["max_tokens"] = w.max_tokens
            body["logprobs"] = 1
            body["stream_options"] = {"include_usage": True}
            if self.served_model:
                body["model"] = self.served_model
        return body

    async def _post(self, url: str, body: dict[str, Any]) -> aiohttp.ClientResponse:
        """The response to a POST whose status is 200; a connection that fails is tried
        again after each of RETRY_DELAYS (none while the server is known to be down)."""
        assert self._session is not None
        delays = () if self.health.state == "down" else RETRY_DELAYS
        for attempt in range(len(delays) + 1):
            try:
                resp = await self._session.post(url, json=body)
            except (aiohttp.ClientConnectionError, TimeoutError) as e:
                error = f"cannot connect to {url}: {_describe(e)}"
            else:
                if resp.status == 200:
                    return resp
                detail = (await resp.text())[:500].strip()
                resp.release()
                error = f"{url} answered {resp.status}: {detail}"
                if resp.status not in UNAVAILABLE_STATUS:
                    raise ServerError("bad_request" if resp.status < 500 else "internal",
                                      error)
            if attempt == len(delays):
                raise ServerUnavailable(error)
            self.retries += 1
            await asyncio.sleep(delays[attempt])
        raise AssertionError("unreachable")


class _Stream:
    """One response's chunks: text (healing's forced start taken off), usage, finish, the
    tokens' log-probabilities, and whether the text has fallen into a loop."""

    def __init__(self, endpoint: str, forced: str, sent: float = 0.0, *,
                 loops: bool = True, indent_floor: int = 0) -> None:
        self.infill, self.forced, self.sent = endpoint == "infill", forced, sent
        self.finish: str | None = None
        self.chunks = 0
        self.tokens: int | None = None  # as the server counts them, once it says
        self.prompt_tokens = self.cached_tokens = 0
        self.server_s: float | None = None  # its own time for the request, once it says
        self._held = ""  # text kept back until it is known whether it starts with `forced`
        self.logprob_sum, self.logprob_min, self.scored = 0.0, 0.0, 0
        self.looped = False
        self._pieces: dict[str, int] = {}  # token text -> an id of our own, for the watch
        self._texts: list[str] = []
        self._watch = LoopWatch(self._texts.__getitem__) if loops else None
        self._block = IndentFloor(indent_floor)

    @property
    def ended(self) -> bool:
        """Whether the text has ended here: a loop, or the end of the block (indent.py)."""
        return self.looped or self._block.ended

    def usage(self, now: float) -> Usage:
        """So far; the HTTP hop (the round trip since `sent` beyond the server's own time)
        once the server has said what that was."""
        hop = 0.0 if self.server_s is None else max(0.0, now - self.sent - self.server_s)
        scored = self.scored > 0
        return Usage(tokens=self.chunks if self.tokens is None else self.tokens,
                     steps=self.chunks, prompt_tokens=self.prompt_tokens,
                     reused_tokens=self.cached_tokens, hop_s=hop,
                     mean_logprob=self.logprob_sum / self.scored if scored else None,
                     min_logprob=self.logprob_min if scored else None)

    def read(self, event: dict[str, Any]) -> str:
        if self.infill:  # llama-server's own format
            text = str(event.get("content") or "")
            if event.get("stop"):
                self.finish = "length" if event.get("stop_type") == "limit" else "stop"
        else:
            choice = (event.get("choices") or [{}])[0]
            text = str(choice.get("text") or "")
            if choice.get("finish_reason"):
                self.finish = "length" if choice["finish_reason"] == "length" else "stop"
            if isinstance(event.get("usage"), dict):
                self.prompt_tokens = int(event["usage"].get("prompt_tokens") or 0)
                self.tokens = int(event["usage"].get("completion_tokens") or 0)
        self.chunks += bool(text)
        self._score(event, text)
        if isinstance(event.get("timings"), dict):  # llama-server says what it did
            t = event["timings"]
            self.cached_tokens = int(t.get("cache_n") or 0)
            self.prompt_tokens = self.cached_tokens + int(t.get("prompt_n") or 0)
            self.tokens = int(t.get("predicted_n") or 0)
            ms = float(t.get("prompt_ms") or 0.0) + float(t.get("predicted_ms") or 0.0)
            self.server_s = ms / 1000
        text = self._block.push(self._unforced(text))
        if self._block.ended and not self.looped:
            self.finish = "stop"
        return text

    def _score(self, event: dict[str, Any], text: str) -> None:
        """Take the chunk's tokens: their log-probabilities into the scores, their text into
        the loop watch (the chunk's text as one piece when the server names no tokens)."""
        items: Any = None
        if self.infill:  # llama-server: [{"token", "logprob", ...}]
            items = event.get("completion_probabilities")
        else:
            lp = (event.get("choices") or [{}])[0].get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):  # llama-server
                items = lp["content"]
            elif isinstance(lp, dict) and isinstance(lp.get("token_logprobs"), list):  # OpenAI
                tokens = lp.get("tokens")
                tokens = tokens if isinstance(tokens, list) else []
                items = [{"logprob": v, "token": tokens[i] if i < len(tokens) else None}
                         for i, v in enumerate(lp["token_logprobs"])]
        items = [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []
        for value in (i.get("logprob") for i in items):
            if isinstance(value, int | float) and math.isfinite(value):
                self.logprob_min = min(self.logprob_min, value) if self.scored else value
                self.logprob_sum += value
                self.scored += 1
        pieces = [i.get("token") for i in items]
        if not all(isinstance(t, str) for t in pieces) or "".join(pieces) != text:
            pieces = [text] if text else []  # (a stop string cut the chunk, or no tokens)
        for piece in pieces:
            self._watch_piece(piece)

    def _watch_piece(self, piece: str) -> None:
        if self._watch is None or self.looped:
            return
        if piece not in self._pieces:
            self._pieces[piece] = len(self._texts)
            self._texts.append(piece)
        if self._watch.push(self._pieces[piece]):
            self.looped, self.finish = True, REPETITION

    def flush(self) -> str:
        held, self._held, self.forced = self._held, "", ""
        return self._block.push(held, final=True)

    def _unforced(self, text: str) -> str:
        if not self.forced:
            return text
        self._held += text
        if len(self._held) < len(self.forced) and self.forced.startswith(self._held):
            return ""
        held, self._held = self._held, ""
        if held.startswith(self.forced):
            held = held[len(self.forced):]
        self.forced = ""
        return held


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to `[DONE]` or its end."""
    data: list[str] = []
    async for raw in resp.content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:
            continue  # other fields (event:, id:, comments) say nothing we need
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            return
        event = json.loads(payload)
        if isinstance(event, dict):
            yield event


def _describe(e: BaseException) -> str:
    return str(e) or type(e).__name__
