"""Arbitrary bytes, msgpack and JSON-RPC at a live daemon and a live `ahead lsp`, for a
bounded number of examples; then a normal request still succeeds, and every request got
exactly one response. The counts of what was sent and answered are printed (`-s`)."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon import protocol as p
from daemon.client import Client
from tests.test_hostile_lsp import RawLsp, frame
from tests.test_lsp import PY

pytestmark = pytest.mark.slow
FUZZ = settings(max_examples=60, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
TIMEOUT = 60
ids = itertools.count(1000)
CLOSING = -(2**62) - 7  # the id of the status that closes each exchange

scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats()
           | st.text(max_size=20) | st.binary(max_size=20))
anything = st.recursive(scalars, lambda kids: st.lists(kids, max_size=4)
                        | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=12)
FIELDS = ["prompt", "prefix", "suffix", "session", "document", "max_tokens", "temperature",
          "top_p", "stop", "k", "extra", "budget_ms", "priority", "model", "event", "request",
          "seed", "speculative", "multiline", "language", "path"]
REQUESTS = {"complete", "generate", "status", "reload"}  # answered: exactly once each
request_like = st.fixed_dictionaries(
    {"op": st.sampled_from([*REQUESTS, "cancel", "feedback", "explode"])},
    optional={f: anything for f in FIELDS})


def daemon_frame(value: Any) -> bytes:
    """A frame of `value`; a request-like dict gets an id of its own."""
    if isinstance(value, dict) and "op" in value:
        value = {**value, "id": next(ids)}
    body = msgspec.msgpack.encode(value)
    return len(body).to_bytes(4, "big") + body


def finals(replies: list[p.Reply]) -> Counter[int | None]:
    return Counter(r.id for r in replies if isinstance(r, p.Done | p.Error | p.StatusReply))


async def exchange(sock: Path, frames: list[bytes], want: Counter[int | None] | None = None,
                   ) -> tuple[list[p.Reply], bool]:
    """Send `frames` after a hello, then a status; the replies up to its answer and
    the final replies `want` says (or up to the daemon hanging up), and whether it did."""
    reader, writer = await asyncio.open_unix_connection(str(sock))
    decoder = p.reply_decoder()
    writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION)))
    writer.write(b"".join(frames) + p.encode(p.Status(id=CLOSING)))
    want = (want or Counter()) + Counter({CLOSING: 1})
    got: list[p.Reply] = []
    hung_up = False
    async with asyncio.timeout(TIMEOUT):  # what never comes fails the test here
        while want - finals(got):
            body = await p.read_frame(reader)
            if body is None:
                hung_up = True
                break
            got.append(decoder.decode(body))
    writer.close()
    await writer.wait_closed()
    return got, hung_up


def expected_finals(frames: list[bytes]) -> Counter[int | None]:
    """How many final replies each id must get: one per request, and one error per frame
    that is no valid message (under the id it says, if any)."""
    want: Counter[int | None] = Counter()
    decoder = p.request_decoder()
    for f in frames:
        body = f[4:]
        try:
            msg = decoder.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            want[p.request_id(body)] += 1
            continue
        if isinstance(msg, p.Hello):
            want[None] += msg.version != p.PROTOCOL_VERSION  # the right one gets a Welcome
        elif not isinstance(msg, p.Cancel | p.Feedback):
            want[getattr(msg, "id", None)] += 1
    return want


def test_fuzz_the_daemon(trained_dir: Path, tmp_path: Path,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "st"))
    sock = tmp_path / "rt" / "daemon.sock"
    tally: Counter[str] = Counter()
    with asyncio.Runner() as runner:
        client = Client(serve_args=["--model", str(trained_dir), "--k-max", "2",
                                    "--max-seq-len", "512", "--no-watch"])
        welcome = runner.run(client.connect())

        @FUZZ
        @given(st.binary(max_size=200))
        def raw_bytes(data: bytes) -> None:
            got, hung_up = runner.run(exchange(sock, [data]))
            tally["bytes cases"] += 1
            tally["bytes hung up (a frame out of step)"] += hung_up
            assert all(isinstance(r, p.Error | p.StatusReply | p.Welcome) for r in got), got

        @FUZZ
        @given(st.lists(request_like | anything, min_size=1, max_size=6))
        def messages(values: list[Any]) -> None:
            values = [v for v in values if not (isinstance(v, dict) and v.get("op") in (
                "shutdown", "hello"))]
            frames = [daemon_frame(v) for v in values]
            want = expected_finals(frames)
            got, hung_up = runner.run(exchange(sock, frames, want))
            assert not hung_up, got
            answered = finals(got) - Counter({CLOSING: 1})
            tally["msgpack cases"] += 1
            tally["msgpack frames"] += len(frames)
            tally["msgpack answers due"] += sum(want.values())
            tally["unanswered"] += sum((want - answered).values())
            assert answered == want, (values, got)

        try:
            raw_bytes()
            messages()
            done = runner.run(client.run(p.Generate(id=0, prompt="def f(x):", max_tokens=4)))
            assert done.text
            assert runner.run(client.status())["pid"] == welcome.pid  # never restarted
        finally:
            runner.run(client.shutdown())
            runner.run(client.close())
    print(dict(tally))


METHODS = ["textDocument/inlineCompletion", "textDocument/completion", "ahead/status",
           "ahead/stats", "workspace/executeCommand", "textDocument/hover", "no/such/method",
           "initialize", "$/cancelRequest"]
NOTIFICATIONS = ["textDocument/didOpen", "textDocument/didChange", "textDocument/didClose",
                 "workspace/didChangeConfiguration", "$/cancelRequest", "no/such/thing"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4), max_leaves=12)
positions = st.fixed_dictionaries({"line": json_values | st.integers(-3, 3),
                                   "character": json_values | st.integers(-3, 3)})
documents = st.fixed_dictionaries({"uri": st.sampled_from(["file:///tmp/f.py", "x"])
                                   | json_values})
params = json_values | st.fixed_dictionaries({}, optional={
    "textDocument": documents, "position": positions, "context": json_values
    | st.just({"triggerKind": 1}), "contentChanges": json_values, "text": json_values})
lsp_requests = st.builds(lambda m, prm: {"jsonrpc": "2.0", "method": m, "params": prm},
                         st.sampled_from(METHODS), params)
lsp_notifications = st.builds(lambda m, prm: {"jsonrpc": "2.0", "method": m, "params": prm},
                              st.sampled_from(NOTIFICATIONS), params)
lsp_messages = lsp_requests | lsp_notifications | json_values | st.binary(max_size=60)


def lsp_frame(value: Any) -> tuple[bytes, str | None]:
    """The framed message, and the id of a request that must be answered."""
    if isinstance(value, bytes):
        return frame(value), None
    msg_id = None
    if isinstance(value, dict) and value.get("method") in METHODS and "id" not in value:
        msg_id = f"fuzz-{next(ids)}"
        value = {**value, "id": msg_id}
    return frame(json.dumps(value).encode()), msg_id


def test_fuzz_the_language_server(model_dir: Path, tmp_path: Path) -> None:
    tally: Counter[str] = Counter()
    with asyncio.Runner() as runner:
        lsp = runner.run(RawLsp.start(tmp_path, model=str(model_dir), budgetMs=20000,
                                      maxTokens=8))

        @FUZZ
        @given(st.lists(lsp_messages, min_size=1, max_size=6))
        def messages(values: list[Any]) -> None:
            sent = [lsp_frame(v) for v in values]
            lsp.write(b"".join(f for f, _ in sent))
            asked = [i for _, i in sent if i is not None]
            runner.run(lsp.settle())
            for msg_id in asked:  # the slowest (a completion) may come after the settle
                runner.run(lsp.response(msg_id))
            tally["cases"] += 1
            tally["messages"] += len(sent)
            tally["requests"] += len(asked)
            tally["unanswered"] += sum(not lsp.responses(i) for i in asked)
            assert all(len(lsp.responses(i)) == 1 for i in asked)

        try:
            messages()
            assert lsp.proc.returncode is None  # alive
            lsp.open_and_complete("after", "file:///tmp/after.py", PY)
            answer = runner.run(lsp.response("after"))
            assert answer.get("result") and answer["result"]["items"], answer
            tally["popups"] = sum("Error in server" in m for m in lsp.popups())
            assert not tally["popups"]
        finally:
            runner.run(lsp.close())
            daemon = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
            runner.run(daemon.shutdown())
            runner.run(daemon.close())
    print(dict(tally))
