"""`ahead lsp` against a hostile or clumsy client: every request gets exactly one response,
no message breaks another, and the editor gets no popup storm.

Most cases are raw JSON-RPC over the server's stdio, as no well-behaved client (pytest-lsp
included) would send them.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from lsprotocol import types
from pytest_lsp import LanguageClient

from daemon.client import Client
from tests.test_lsp import PY, end_of, inline, open_doc, start, stop

TIMEOUT = 60
POPUP = "window/showMessage"


def frame(body: bytes) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % len(body) + body


def message(msg: Any) -> bytes:
    return frame(json.dumps(msg).encode())


class RawLsp:
    """`ahead lsp` on pipes: writes any bytes, and collects every message it sends."""

    def __init__(self, proc: asyncio.subprocess.Process, rt: Path) -> None:
        self.proc, self.rt = proc, rt
        self.messages: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, tmp: Path, **init_options: Any) -> RawLsp:
        # The daemon's confidence threshold is off: these tests assert that every request is
        # answered and a good document still gets its suggestion after hostile input, not
        # how sure the bundled model is (other documents reach its prompt as context).
        env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp / "rt"),
               "AHEAD_STATE_DIR": str(tmp / "st"), "AHEAD_MIN_CONFIDENCE": "0"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "clients.cli", "lsp", env=env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
        lsp = cls(proc, tmp / "rt")
        lsp.send({"jsonrpc": "2.0", "id": "init", "method": "initialize",
                  "params": {"capabilities": {}, "initializationOptions": init_options}})
        assert "result" in await lsp.response("init")
        lsp.send({"jsonrpc": "2.0", "method": "initialized", "params": {}})
        return lsp

    async def _read(self) -> None:
        out = self.proc.stdout
        assert out is not None
        while True:
            length = None
            while (line := await out.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line or length is None:
                return
            self.messages.append(json.loads(await out.readexactly(length)))
            self.arrived.set()

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)

    def send(self, msg: Any) -> None:
        self.write(message(msg))

    def request(self, msg_id: int | str, method: str, params: Any) -> None:
        self.send({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params})

    def responses(self, msg_id: Any) -> list[dict[str, Any]]:
        return [m for m in self.messages if "method" not in m and m.get("id") == msg_id]

    async def response(self, msg_id: Any) -> dict[str, Any]:
        """The response to `msg_id`, once it has come."""
        async with asyncio.timeout(TIMEOUT):
            while not (found := self.responses(msg_id)):
                self.arrived.clear()
                await self.arrived.wait()
        return found[0]

    def open_and_complete(self, key: str, uri: str, text: str) -> None:
        """Open `text` as a Python document and ask (request `key`) for a completion at its
        end."""
        self.send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {
            "textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}})
        pos = end_of(text)
        self.request(key, "textDocument/inlineCompletion", {
            "textDocument": {"uri": uri},
            "position": {"line": pos.line, "character": pos.character}, "context": CTX})

    async def settle(self) -> None:
        """Until everything sent so far has been handled: messages are handled in order, so
        a request's answer comes after everything sent before it has been."""
        marker = f"settle-{len(self.messages)}-{id(self.messages)}"
        self.request(marker, "ahead/stats", None)
        await self.response(marker)

    def popups(self) -> list[str]:
        return [m["params"]["message"] for m in self.messages if m.get("method") == POPUP]

    async def close(self) -> None:
        self.request("bye", "shutdown", None)
        await self.response("bye")
        self.send({"jsonrpc": "2.0", "method": "exit"})
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        async with asyncio.timeout(TIMEOUT):
            assert await self.proc.wait() == 0
        await self.reader


@pytest.fixture
async def raw(tmp_path: Path) -> AsyncIterator[RawLsp]:
    """No model: nothing here needs the daemon (which fails to start, said once)."""
    lsp = await RawLsp.start(tmp_path, model=str(tmp_path / "no-model"))
    yield lsp
    await lsp.close()


URI = "file:///tmp/x.py"
DOC = {"uri": URI}
CTX = {"triggerKind": 1}


def at(line: Any, character: Any) -> dict[str, Any]:
    return {"textDocument": DOC, "position": {"line": line, "character": character},
            "context": CTX}


INVALID_PARAMS: dict[str, tuple[str, Any]] = {  # id -> (method, params)
    "line -1": ("textDocument/inlineCompletion", at(-1, 0)),
    "character -1": ("textDocument/inlineCompletion", at(0, -1)),
    "line 2^31": ("textDocument/inlineCompletion", at(2**31, 0)),
    "character 2^31": ("textDocument/inlineCompletion", at(0, 2**31)),
    "line 2^64": ("textDocument/inlineCompletion", at(2**64, 0)),
    "position as a string": ("textDocument/inlineCompletion",
                             {"textDocument": DOC, "position": "0:0", "context": CTX}),
    "no textDocument": ("textDocument/inlineCompletion",
                        {"position": {"line": 0, "character": 0}, "context": CTX}),
    "no context": ("textDocument/inlineCompletion",
                   {"textDocument": DOC, "position": {"line": 0, "character": 0}}),
    "params a list": ("textDocument/inlineCompletion", [DOC, {"line": 0, "character": 0}]),
    "params null": ("textDocument/inlineCompletion", None),
    "params a string": ("textDocument/inlineCompletion", "x"),
    "completion line -1": ("textDocument/completion",
                           {"textDocument": DOC, "position": {"line": -1, "character": 0}}),
    "completion params a list": ("textDocument/completion", []),
}


async def test_invalid_params_are_answered_with_invalid_params(raw: RawLsp) -> None:
    for msg_id, (method, params) in INVALID_PARAMS.items():
        raw.request(msg_id, method, params)
    raw.send({"jsonrpc": "2.0", "id": "omitted", "method": "textDocument/inlineCompletion"})
    for msg_id in [*INVALID_PARAMS, "omitted"]:
        answer = await raw.response(msg_id)
        assert answer.get("error", {}).get("code") == -32602, (msg_id, answer)
    await raw.settle()
    for msg_id in [*INVALID_PARAMS, "omitted"]:
        assert len(raw.responses(msg_id)) == 1, msg_id
    assert not any("Error in server" in m for m in raw.popups()), raw.popups()


async def test_malformed_messages_are_answered_and_the_server_serves_on(raw: RawLsp) -> None:
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "ahead/stats"}]
    raw.write(message(batch))  # LSP has no batches
    raw.send({"id": "no-jsonrpc", "method": "ahead/stats", "params": None})
    raw.send({"jsonrpc": "1.0", "id": "old-jsonrpc", "method": "ahead/stats"})
    raw.send({"jsonrpc": "2.0", "id": "method-a-number", "method": 7})
    raw.write(frame(b'{"jsonrpc": "2.0", "id": "bad-utf8", "method": "ahead/\xff\xfe"}'))
    raw.write(frame(b'{"jsonrpc": "2.0", "id": "bad-json", "method": '))
    raw.write(frame(b"[" * 100_000 + b"]" * 100_000))  # deeper than json can go
    raw.send({"jsonrpc": "2.0", "id": {"an": "object"}, "method": "ahead/stats"})
    raw.send("a string")
    await raw.settle()
    by_id = {m.get("id"): m for m in raw.messages if "error" in m}
    assert by_id["no-jsonrpc"]["error"]["code"] == -32600
    assert by_id["old-jsonrpc"]["error"]["code"] == -32600
    assert by_id["method-a-number"]["error"]["code"] == -32600
    assert by_id["bad-utf8"]["error"]["code"] == -32700
    nameless = [m["error"]["code"] for m in raw.messages if "error" in m and m["id"] is None]
    assert sorted(nameless) == [-32700, -32700, -32600, -32600, -32600], nameless
    assert not raw.responses(1)  # the batch's request was not run
    assert not any("Error in server" in m for m in raw.popups()), raw.popups()


async def test_an_oversized_or_endless_header_is_skipped_and_the_server_serves_on(
        raw: RawLsp) -> None:
    raw.write(b"Content-Length: 99999999999\r\n\r\n" + b'{"jsonrpc": "2.0", "id": "huge"}')
    raw.request("after-huge", "ahead/stats", None)
    raw.write(b"X-Junk: " + b"x" * 3_000_000)  # a header line that never ends...
    raw.write(b"\r\n\r\n")  # ...until here
    raw.request("after-junk", "ahead/stats", None)
    assert "result" in await raw.response("after-huge")
    assert "result" in await raw.response("after-junk")
    refused = [m for m in raw.messages if "error" in m and m["id"] is None]
    assert len(refused) == 1 and "exceeds the limit" in refused[0]["error"]["message"]


async def test_bad_notifications_get_no_answer_and_no_popup(raw: RawLsp) -> None:
    raw.send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": None})
    raw.send({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": [1, 2]})
    for version in range(30):  # changes to a document never opened: a popup each, today
        raw.send({"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
            "textDocument": {"uri": "file:///never/opened.py", "version": version},
            "contentChanges": [{"range": {"start": {"line": 5, "character": 0},
                                          "end": {"line": 5, "character": 1}}, "text": "x"}]}})
    raw.send({"jsonrpc": "2.0", "method": "$/cancelRequest", "params": {"id": "nothing"}})
    raw.send({"jsonrpc": "2.0", "method": "no/such/notification", "params": {}})
    await raw.settle()
    assert not [m for m in raw.messages if "error" in m]
    assert not any("Error in server" in m for m in raw.popups()), raw.popups()


async def test_requests_after_shutdown_are_refused_not_dropped(tmp_path: Path) -> None:
    lsp = await RawLsp.start(tmp_path, model=str(tmp_path / "no-model"))
    lsp.request(1, "shutdown", None)
    assert "result" in await lsp.response(1)
    lsp.request(2, "ahead/stats", None)
    assert (await lsp.response(2))["error"]["code"] == -32600
    lsp.send({"jsonrpc": "2.0", "method": "exit"})
    assert lsp.proc.stdin is not None
    lsp.proc.stdin.close()
    async with asyncio.timeout(TIMEOUT):
        assert await lsp.proc.wait() == 0


# With a daemon and the bundled model: a broken document must not break the others.

@pytest.fixture
async def lsp(model_dir: Path, tmp_path: Path) -> AsyncIterator[LanguageClient]:
    client = await start(model_dir, tmp_path, env={"AHEAD_MIN_CONFIDENCE": "0"})  # see RawLsp
    yield client
    await stop(client, tmp_path)


async def test_a_lone_surrogate_in_one_document_does_not_break_the_others(
        lsp: LanguageClient) -> None:
    broken = "label = 'a\ud800b'  # a lone surrogate, sent as the JSON escape \\ud800\n"
    broken_uri = open_doc(lsp, broken, "broken.py")
    uri = open_doc(lsp, PY)
    result = await inline(lsp, uri, end_of(PY))  # today: -32603 UnicodeEncodeError
    assert result is not None and result.items
    await inline(lsp, broken_uri, types.Position(line=1, character=0))  # answered itself
    lsp.text_document_did_change(types.DidChangeTextDocumentParams(
        text_document=types.VersionedTextDocumentIdentifier(uri=broken_uri, version=2),
        content_changes=[types.TextDocumentContentChangeWholeDocument(text=broken + "\udfff")]))
    result = await inline(lsp, uri, end_of(PY))
    assert result is not None and result.items


async def test_a_document_with_invalid_utf8_does_not_break_the_others(
        model_dir: Path, tmp_path: Path) -> None:
    raw = await RawLsp.start(tmp_path, model=str(model_dir), budgetMs=20000, maxTokens=24)
    try:
        body = json.dumps({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {
            "textDocument": {"uri": "file:///tmp/raw.py", "languageId": "python",
                             "version": 1, "text": "x = 'MARK'\n"}}}).encode()
        raw.write(frame(body.replace(b"MARK", b"\xed\xa0\x80")))  # a surrogate as raw bytes
        raw.open_and_complete("good", "file:///tmp/good.py", PY)
        answer = await raw.response("good")
        assert answer.get("result") and answer["result"]["items"], answer
        assert [m["error"]["code"] for m in raw.messages if "error" in m] == [-32700]
    finally:
        await raw.close()
        daemon = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
        await daemon.shutdown()
        await daemon.close()
