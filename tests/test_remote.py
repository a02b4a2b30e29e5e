"""The `openai` backend against a real serving engine: llama.cpp's llama-server, serving a
tiny checkpoint written here (see tests/peers/). The pipeline above the backend (supersede,
typing through, deadlines, the HTTP endpoint, the LSP's status) must work as it does with
the local engine."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from lsprotocol import types

from daemon import protocol as p
from daemon.backends.openai import OpenAIBackend
from daemon.backends.prompts import InfillPrompts, TokenizerPrompts
from daemon.client import Client, RequestFailed
from daemon.http import HttpEndpoint
from daemon.server import Server
from tests.peers.llama import INSTALL, LlamaServer, installed, to_gguf
from tests.test_daemon import TIMEOUT, serving
from tests.test_lsp import as_dict, end_of, inline, open_doc, start, stop, wait_for_state

if not installed() and os.environ.get("AHEAD_REQUIRE_PEERS"):  # CI: never skip them
    raise RuntimeError(f"llama-server is not installed: run {INSTALL}")
pytestmark = pytest.mark.skipif(not installed(), reason=f"llama-server is not installed: "
                                f"run {INSTALL} (CI does)")
CONTEXT = 1024  # the tiny presets' positions
PY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    "


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random checkpoint (our tokenizer, two MTP modules) and its GGUF."""
    from training.synthetic import write_checkpoint

    path = tmp_path_factory.mktemp("tiny")
    write_checkpoint(path / "model", "tiny-qwen3", seed=3)
    return path / "model", to_gguf(path / "model", path / "tiny.gguf")


@pytest.fixture
async def peer(tiny: tuple[Path, Path]) -> AsyncIterator[LlamaServer]:
    async with LlamaServer(tiny[1], context=CONTEXT) as server:
        yield server


@pytest.fixture
async def daemon(tiny: tuple[Path, Path], peer: LlamaServer,
                 tmp_path: Path) -> AsyncIterator[Server]:
    backend = OpenAIBackend(peer.url, TokenizerPrompts(tiny[0], CONTEXT), timeout=10)
    async with serving(backend, tmp_path / "rt", http=HttpEndpoint("127.0.0.1", 0, "t")) as s:
        yield s


async def metric(peer: LlamaServer, name: str) -> float:
    async with aiohttp.ClientSession() as session, \
            session.get(peer.url.removesuffix("/v1") + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(f"llamacpp:{name} "):
                return float(line.split()[1])
    raise KeyError(name)


def fill(prefix: str, max_tokens: int = 24, *, multiline: bool = False,
         budget_ms: int | None = None) -> p.Complete:
    """A request; the long ones (still writing when the test acts) run on through loops."""
    return p.Complete(id=0, session="s", document="d.py", prefix=prefix,
                      suffix="\n\ndef mul(a, b):\n    return a * b\n", max_tokens=max_tokens,
                      multiline=multiline, budget_ms=budget_ms, stop_loops=max_tokens < 100)


async def test_lsp_inline_completion_goes_through_the_peer_and_reports_it_down(
        tiny: tuple[Path, Path], peer: LlamaServer, tmp_path: Path) -> None:
    """editor -> ahead lsp -> daemon -> llama-server and back; then the server dies (the
    editor hears "down") and comes back (the editor hears "ready")."""
    env = {"AHEAD_BACKEND": "openai", "AHEAD_URL": peer.url, "AHEAD_TOKENIZER": str(tiny[0]),
           "AHEAD_MAX_SEQ_LEN": str(CONTEXT),
           "AHEAD_MIN_CONFIDENCE": "0"}  # a random model: its answers are all unsure
    client = await start(tiny[0], tmp_path, env=env)
    try:
        await wait_for_state(client, "ready")
        uri = open_doc(client, PY)
        predicted = await metric(peer, "tokens_predicted_total")
        result = await inline(client, uri, end_of(PY))
        assert result is not None and result.items and result.items[0].insert_text
        assert await metric(peer, "tokens_predicted_total") > predicted  # the peer wrote it
        status = as_dict(await client.protocol.send_request_async("ahead/status", None))
        assert status["daemon"]["backend"] == "openai" and status["daemon"]["server"] == "up"

        await peer.kill()
        shown = result.items[0].insert_text
        text = PY + ("#" if not str(shown).startswith("#") else "@")  # not typing through it
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)]))
        assert await inline(client, uri, end_of(text)) is None
        await wait_for_state(client, "down")
        assert "cannot connect" in client.statuses[-1]["message"]  # type: ignore[attr-defined]
        await peer.start()
        await inline(client, uri, end_of(text))  # a suggestion or none: the model's choice
        await wait_for_state(client, "ready")
    finally:
        await stop(client, tmp_path)


async def test_a_superseded_request_is_aborted_on_the_peer(daemon: Server,
                                                           peer: LlamaServer) -> None:
    client = Client(daemon.socket_path, autostart=False)
    stream = client.stream(fill("import os\n", max_tokens=900, multiline=True))
    assert isinstance(await anext(stream), p.Chunk)  # the peer is writing it
    seen = len(peer.lines)
    newer = await client.run(fill("import os\nimport re\n", max_tokens=4))
    rest = [r async for r in stream]
    assert isinstance(rest[-1], p.Error) and "superseded" in rest[-1].message
    assert "cancel task" in await peer.wait_for_log("cancel task", TIMEOUT, since=seen)
    assert newer.finish_reason in ("stop", "length")
    assert daemon.scheduler.counters.superseded == 1
    await client.close()


async def test_typing_through_a_remote_answer_asks_the_peer_nothing(daemon: Server,
                                                                    peer: LlamaServer) -> None:
    client = Client(daemon.socket_path, autostart=False)
    first = await client.run(fill(PY, max_tokens=12, multiline=True))
    assert len(first.text) > 2 and first.stats.tokens > 0 and first.stats.hop_ms > 0
    assert first.stats.engine_ms > 0  # the peer's own time, from its timings
    predicted = await metric(peer, "tokens_predicted_total")
    typed = await client.run(fill(PY + first.text[:2], max_tokens=12, multiline=True))
    assert typed.stats.typed_through and typed.text == first.text[2:]
    assert await metric(peer, "tokens_predicted_total") == predicted
    info = await client.status()
    assert info["backend"] == "openai" and info["server"] == "up"
    assert info["counts"]["typed_through"] == 1 and info["http_hop_ms"]["n"] == 1
    await client.close()


async def test_the_request_after_an_accept_is_answered_from_the_remote_prefetch(
        daemon: Server, peer: LlamaServer) -> None:
    client = Client(daemon.socket_path, autostart=False)
    shown = await client.run(fill(PY, max_tokens=8))
    ahead = await client.run(msgspec.structs.replace(fill(PY + shown.text, max_tokens=8),
                                                     priority="prefetch"))
    predicted = await metric(peer, "tokens_predicted_total")
    accepted = await client.run(fill(PY + shown.text, max_tokens=8))
    assert accepted.stats.prefetched and accepted.text == ahead.text
    assert await metric(peer, "tokens_predicted_total") == predicted  # nothing asked
    counts = (await client.status())["counts"]
    assert (counts["prefetches"], counts["prefetch_hits"]) == (1, 1)
    await client.close()


async def test_a_deadline_returns_the_text_so_far(daemon: Server) -> None:
    client = Client(daemon.socket_path, autostart=False)
    done = await client.run(fill("import os\n", max_tokens=900, multiline=True, budget_ms=30))
    assert done.finish_reason == "deadline" and done.stats.tokens < 900
    await client.close()


async def test_a_dead_server_is_a_clear_error_and_the_daemon_recovers(
        daemon: Server, peer: LlamaServer) -> None:
    client = Client(daemon.socket_path, autostart=False)
    assert (await client.run(fill(PY))).finish_reason in ("stop", "length")
    await peer.kill()
    with pytest.raises(RequestFailed) as failed:
        await client.run(fill(PY + "r"))
    assert failed.value.code == "unavailable" and peer.url in failed.value.message
    info = await client.status()
    assert info["server"] == "down" and "cannot connect" in info["server_error"]
    assert daemon.http is not None
    async with aiohttp.ClientSession() as session, \
            session.get(daemon.http.address + "/health") as resp:
        assert resp.status == 503
    await peer.start()
    assert (await client.run(fill(PY + "re"))).finish_reason in ("stop", "length")
    assert (await client.status())["server"] == "up"
    await client.close()


async def test_the_http_endpoint_over_the_peer(daemon: Server) -> None:
    """An OpenAI client -> the daemon's endpoint -> the openai backend -> llama-server."""
    assert daemon.http is not None
    async with openai.AsyncOpenAI(base_url=daemon.http.address + "/v1", api_key="t",
                                  max_retries=0) as client:
        stream = await client.completions.create(model="m", prompt=PY, suffix="\n",
                                                 max_tokens=8, temperature=0, stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        whole = await client.completions.create(model="m", prompt=PY, suffix="\n",
                                                max_tokens=8, temperature=0)
        several = await client.completions.create(model="m", prompt=PY, suffix="\n", n=2,
                                                  max_tokens=8, temperature=0.8, seed=1)
    assert text and whole.choices[0].text == text
    assert sorted(c.index for c in several.choices) == [0, 1]  # two jobs, two streams


async def test_llama_servers_infill_builds_the_prompt(tiny: tuple[Path, Path],
                                                      peer: LlamaServer, tmp_path: Path) -> None:
    backend = OpenAIBackend(peer.url, InfillPrompts())
    async with serving(backend, tmp_path / "rt") as server:
        client = Client(server.socket_path, autostart=False)
        seen = len(peer.lines)
        done = await client.run(fill(PY, max_tokens=6))
        assert done.stats.tokens > 0 and done.finish_reason in ("stop", "length")
        assert done.mean_logprob is not None  # /infill's own shape of the scores
        await peer.wait_for_log("processing task", TIMEOUT, since=seen)
        await client.close()


async def test_the_peers_answers_carry_its_scores_and_the_threshold_holds(
        daemon: Server) -> None:
    """The backend asks the server for its tokens' log-probabilities: a completion carries
    the confidence the daemon's threshold is on, as the local engine's do."""
    client = Client(daemon.socket_path, autostart=False)
    shown = await client.run(fill(PY, max_tokens=8))
    assert shown.mean_logprob is not None and shown.min_logprob is not None
    assert shown.min_logprob <= shown.mean_logprob <= 0 and shown.text
    daemon.requests.min_confidence = 0.999  # no random model is that sure
    withheld = await client.run(fill(PY, max_tokens=8))
    assert withheld.text == "" and withheld.finish_reason == "low_confidence"
    assert withheld.mean_logprob == pytest.approx(shown.mean_logprob, abs=0.05)  # same answer
    await client.close()


@pytest.fixture(scope="module")
def bundled_gguf(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return to_gguf(model_dir, tmp_path_factory.mktemp("bundled") / "bundled.gguf")


async def test_a_looping_stream_is_cut_at_the_loop_and_the_peer_stops(
        model_dir: Path, bundled_gguf: Path, tmp_path: Path) -> None:
    """The bundled model, greedy on a docstring's first words, falls into a loop on
    llama-server as it does locally: the backend ends the answer there (finish reason
    "repetition") and closes the stream, so the server stops writing it."""
    prompt = 'def fibonacci(n):\n    """'
    async with LlamaServer(bundled_gguf, context=CONTEXT) as peer:
        backend = OpenAIBackend(peer.url, TokenizerPrompts(model_dir, CONTEXT), timeout=10)
        async with serving(backend, tmp_path / "rt") as server:
            client = Client(server.socket_path, autostart=False)
            free = await client.run(p.Generate(id=0, prompt=prompt, max_tokens=96,
                                               stop_loops=False))
            seen = len(peer.lines)
            cut = await client.run(p.Generate(id=0, prompt=prompt, max_tokens=900))
            await client.close()
            assert free.finish_reason == "length"  # it would go on to the end
            assert cut.finish_reason == "repetition" and cut.stats.tokens < 96
            assert free.text.startswith(cut.text)
            assert "cancel task" in await peer.wait_for_log("cancel task", TIMEOUT, since=seen)


async def test_a_stream_ends_at_the_end_of_the_block_and_the_peer_stops(
        model_dir: Path, bundled_gguf: Path, tmp_path: Path) -> None:
    """With an indentation floor the backend ends a served answer where the block ends, as
    the local engine does (engine/decode/indent.py), and closes the stream there."""
    from engine.decode.indent import IndentFloor

    request = p.Complete(id=0, session="s", document="d.py", suffix="\n", max_tokens=96,
                         prefix="class Stack:\n    def __init__(self):\n        ",
                         judge=False, stop_loops=False)
    async with LlamaServer(bundled_gguf, context=CONTEXT) as peer:
        backend = OpenAIBackend(peer.url, TokenizerPrompts(model_dir, CONTEXT), timeout=10)
        async with serving(backend, tmp_path / "rt") as server:
            client = Client(server.socket_path, autostart=False)
            free = await client.run(request)
            seen = len(peer.lines)
            cut = await client.run(msgspec.structs.replace(request, session="t",
                                                           indent_floor=8))
            await client.close()
            rule = IndentFloor(8)
            assert cut.text == rule.push(free.text, final=True) and rule.ended
            assert cut.finish_reason == "stop" and cut.stats.tokens < free.stats.tokens
            assert "cancel task" in await peer.wait_for_log("cancel task", TIMEOUT, since=seen)
