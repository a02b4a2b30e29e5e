"""The daemon's HTTP endpoint through clients nobody here wrote: the official `openai` client,
aiohttp's, and the `ahead complete` command for the same text."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon.backends.local import LocalBackend
from daemon.fim import LAYOUTS
from daemon.http import HttpEndpoint, token
from daemon.server import Server
from engine import Engine
from lsp.context import cursor_window
from lsp.postprocess import cursor_lines, postprocess, wants_multiline
from tests.test_daemon import TIMEOUT, serving

PREFIX, SUFFIX = "def add(a, b):\n    return", "\n\n\ndef sub(a, b):\n    return a - b\n"


@pytest.fixture
async def daemon(trained_engine: Engine, tmp_path: Path) -> AsyncIterator[Server]:
    http = HttpEndpoint("127.0.0.1", 0, token(tmp_path / "http-token"))
    async with serving(LocalBackend(trained_engine), tmp_path / "rt", http=http) as server:
        yield server


def openai_client(server: Server, api_key: str | None = None) -> openai.AsyncOpenAI:
    assert server.http is not None
    return openai.AsyncOpenAI(base_url=server.http.address + "/v1", max_retries=0,
                              api_key=server.http.bearer if api_key is None else api_key)


@pytest.fixture
async def client(daemon: Server) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client(daemon) as client:
        yield client


async def test_completion_with_a_suffix_streaming_stop_and_n(
        client: openai.AsyncOpenAI) -> None:
    whole = await client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX,
                                            max_tokens=12, temperature=0)
    assert whole.choices[0].text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage is not None and whole.usage.completion_tokens > 0
    # Streamed, the same text arrives in pieces.
    stream = await client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX,
                                             max_tokens=12, temperature=0, stream=True)
    pieces = [chunk.choices[0].text async for chunk in stream if chunk.choices]
    assert len(pieces) > 1 and "".join(pieces) == whole.choices[0].text
    # A FIM prompt the client wrote itself (as Continue does) is read back into its parts.
    raw = await client.completions.create(model="tiny", prompt=LAYOUTS["qwen"].write(
        PREFIX, SUFFIX), max_tokens=12, temperature=0)
    assert raw.choices[0].text == whole.choices[0].text
    # A stop string ends the answer before it; n asks for several answers.
    text = whole.choices[0].text
    stop = text[1:3]
    stopped = await client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX,
                                              max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    several = await client.completions.create(model="tiny", prompt="import os\n", n=3,
                                              max_tokens=5, temperature=0.8, seed=1)
    assert sorted(c.index for c in several.choices) == [0, 1, 2]
    models = await client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


async def test_a_bad_or_missing_token_is_refused(daemon: Server, tmp_path: Path) -> None:
    async with openai_client(daemon, api_key="not-the-token") as bad:
        with pytest.raises(openai.AuthenticationError, match="not valid"):
            await bad.completions.create(model="tiny", prompt="x", max_tokens=2)
        with pytest.raises(openai.AuthenticationError, match="bearer token is required"):
            await bad.completions.create(model="tiny", prompt="x", max_tokens=2,
                                         extra_headers={"Authorization": openai.Omit()})
    assert daemon.http is not None
    async with aiohttp.ClientSession() as session, \
            session.get(daemon.http.address + "/health") as resp:
        assert resp.status == 200  # says nothing worth a token
    assert stat.S_IMODE((tmp_path / "http-token").stat().st_mode) == 0o600
    assert token(tmp_path / "http-token") == daemon.http.bearer  # made once, then read


async def test_malformed_requests_get_a_400_that_says_what_is_wrong(daemon: Server) -> None:
    assert daemon.http is not None
    url, auth = daemon.http.address, {"Authorization": f"Bearer {daemon.http.bearer}"}
    cases = [(b'{"prompt": "x",', 400, "malformed JSON"),
             (b'{"prompt": "x", "max_tokens": "many"}', 400, "$.max_tokens"),
             (b'{"prompt": "x", "max_tokens": 100000}', 400, "<= 2048"),
             (b'{"prompt": [], "max_tokens": 1}', 400, "prompt must be"),
             (b'{"max_tokens": 1}', 400, "prompt"),
             (b'{"prompt": "x", "temperature": 5e-324}', 400, "temperature must be"),
             (b'{"prompt": "' + b"x" * (3 << 20) + b'"}', 413, "")]
    async with aiohttp.ClientSession(headers=auth) as session:
        for body, status, says in cases:
            async with session.post(url + "/v1/completions", data=io.BytesIO(body)) as resp:
                assert resp.status == status, body[:60]
                if says:
                    assert says in (await resp.json())["error"]["message"]
        # Fields the endpoint does not know are ignored, as OpenAI clients expect.
        async with session.post(url + "/v1/completions", json={
                "prompt": "x", "max_tokens": 2, "logprobs": None, "user": "u",
                "frequency_penalty": 0}) as resp:
            assert resp.status == 200
        async with session.post(url + "/infill", json={"prompt": "x", "temperature": 1e-300}
                                ) as resp:
            assert resp.status == 400
            assert "temperature must be" in (await resp.json())["error"]["message"]


async def test_infill_in_llama_servers_shape(daemon: Server) -> None:
    assert daemon.http is not None
    body = {"input_prefix": "def add(a, b):\n", "prompt": "    return", "input_suffix": SUFFIX,
            "input_extra": [{"filename": "m.py", "text": "X = 1\n"}], "n_predict": 8,
            "samplers": ["top_k", "infill"], "cache_prompt": True,
            "response_fields": ["content", "timings/predicted_n"]}
    auth = {"Authorization": f"Bearer {daemon.http.bearer}"}
    async with aiohttp.ClientSession(headers=auth) as session:
        async with session.post(daemon.http.address + "/infill", json=body) as resp:
            answer = await resp.json()
        assert resp.status == 200 and set(answer) == {"content", "timings/predicted_n"}
        async with session.post(daemon.http.address + "/infill",
                                json={**body, "stream": True}) as resp:
            events = [json.loads(line[6:]) async for line in resp.content
                      if line.startswith(b"data: ")]
    assert "".join(e["content"] for e in events) == answer["content"]
    assert events[-1]["stop"] is True and not any(e["stop"] for e in events[:-1])
    # llama.vim's request to warm the server's cache with other files asks for no tokens.
    jobs = daemon.scheduler.counters.completed
    async with aiohttp.ClientSession(headers=auth) as session, session.post(
            daemon.http.address + "/infill", json={
                "id_slot": 0, "input_prefix": "", "input_suffix": "", "prompt": "",
                "input_extra": [{"filename": "m.py", "text": "X = 1\n"}], "n_predict": 0,
                "samplers": [], "t_max_prompt_ms": 1, "t_max_predict_ms": 1,
                "response_fields": [""]}) as resp:
        assert resp.status == 200 and await resp.json() == {}
    assert daemon.scheduler.counters.completed == jobs


async def test_a_client_that_disconnects_stops_its_work(daemon: Server) -> None:
    assert daemon.http is not None
    auth = {"Authorization": f"Bearer {daemon.http.bearer}"}
    async with aiohttp.ClientSession(headers=auth) as session:
        resp = await session.post(daemon.http.address + "/v1/completions", json={
            "prompt": "x", "max_tokens": 480, "stream": True, "temperature": 0})
        assert (await resp.content.readline()).startswith(b"data: ")
        resp.close()  # hangs up mid-answer
    assert await asyncio.to_thread(daemon.scheduler.wait_idle, TIMEOUT)
    counters = daemon.scheduler.counters
    assert counters.cancelled == 1 and counters.completed == 0
    assert counters.stale_steps <= 1  # stopped within one step


def test_no_auth_is_for_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback"):
        HttpEndpoint.parse("0.0.0.0:8741", None)
    assert HttpEndpoint.parse("[::1]:8741", None).address == "http://[::1]:8741"
    assert HttpEndpoint.parse("8741", "t").host == "127.0.0.1"


async def test_without_a_token_the_host_must_be_the_loopback(trained_engine: Engine,
                                                             tmp_path: Path) -> None:
    http = HttpEndpoint("127.0.0.1", 0, None)
    async with serving(LocalBackend(trained_engine), tmp_path / "rt", http=http), \
            aiohttp.ClientSession() as session:
        async with session.get(http.address + "/v1/models") as resp:
            assert resp.status == 200
        async with session.get(http.address + "/v1/models",
                               headers={"Host": "attacker.example"}) as resp:
            assert resp.status == 403  # a web page's DNS rebinding gets nothing


async def test_the_endpoint_answers_what_ahead_complete_answers(model_dir: Path,
                                                               tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("import math\n\n\ndef area(r):\n    return \n\n\ndef main():\n    pass\n")
    line, col = 5, 12  # after "return "
    engine = Engine.load(model_dir, max_seq_len=1024, k_max=2)
    http = HttpEndpoint("127.0.0.1", 0, "t")
    async with serving(LocalBackend(engine), tmp_path / "rt", http=http):
        env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp_path / "rt")}
        cli = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "clients.cli", "complete",
                             f"{source}:{line}:{col}", "--json"],
            env=env, capture_output=True, text=True, timeout=TIMEOUT)
        assert cli.returncode == 0, cli.stderr
        shown = json.loads(cli.stdout)["completion"]
        text = source.read_text()
        offset = sum(len(x) + 1 for x in text.split("\n")[:line - 1]) + col - 1
        window = cursor_window(text, offset)
        c = cursor_lines(window.prefix, window.suffix)
        multiline = wants_multiline(c.before, c.after, c.next_line, prev_line=c.prev_line)
        async with openai.AsyncOpenAI(base_url=http.address + "/v1", api_key="t",
                                      max_retries=0) as client:
            answer = await client.completions.create(
                model="m", prompt=window.prefix, suffix=window.suffix, max_tokens=64,
                temperature=0, stop=None if multiline else ["\n"])
    raw = answer.choices[0].text
    assert raw  # the model said something; the editor's clean-up then shows the same
    assert postprocess(raw, line_before_cursor=c.before, line_after_cursor=c.after,
                       suffix=window.suffix, multiline=multiline) == shown


# Hostile input: whatever arrives, an answer (never a 500) and other clients unaffected.


def nested(inner: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(-3, 3)
                    | st.text(max_size=8), nested, max_leaves=8)
FIELDS = st.fixed_dictionaries({}, optional={
    "prompt": JSON | st.text(max_size=40), "suffix": JSON, "max_tokens": JSON,
    "temperature": JSON, "top_p": JSON, "n": JSON, "stream": JSON, "stop": JSON,
    "stream_options": JSON, "input_prefix": JSON, "input_extra": JSON, "n_predict": JSON,
    "t_max_predict_ms": JSON, "response_fields": JSON})
BODIES = st.binary(max_size=200) | FIELDS.map(lambda d: json.dumps(d).encode()) \
    | JSON.map(lambda v: json.dumps(v).encode())
PATHS = st.sampled_from(["/v1/completions", "/infill", "/v1/models", "/health", "/v1/x",
                         "/v1/completions?x=1"])


async def test_hostile_requests_get_answers_and_others_are_unaffected(
        daemon: Server, client: openai.AsyncOpenAI) -> None:
    assert daemon.http is not None
    url, auth = daemon.http.address, {"Authorization": f"Bearer {daemon.http.bearer}"}

    async def reference() -> str:
        answer = await client.completions.create(model="tiny", prompt=PREFIX, suffix=SUFFIX,
                                                 max_tokens=6, temperature=0)
        return answer.choices[0].text

    before = await reference()
    statuses: set[int] = set()
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:

        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(method=st.sampled_from(["POST", "GET", "PUT"]), path=PATHS, body=BODIES,
               authorised=st.booleans())
        def hostile(method: str, path: str, body: bytes, authorised: bool) -> None:
            async def send() -> None:
                async with session.request(method, url + path, data=body,
                                           headers=auth if authorised else {}) as resp:
                    await resp.read()
                    statuses.add(resp.status)
            asyncio.run_coroutine_threadsafe(send(), loop).result(TIMEOUT)

        await asyncio.gather(asyncio.to_thread(hostile), reference())
    assert statuses <= {200, 400, 401, 404, 405, 413} and 400 in statuses
    assert await reference() == before
