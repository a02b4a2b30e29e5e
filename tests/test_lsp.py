"""`ahead lsp` end to end: a real LSP client over stdio, a real daemon, a real model."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from lsprotocol import types
from pygls.exceptions import JsonRpcRequestCancelled
from pytest_lsp import ClientServerConfig, LanguageClient

from daemon.client import Client

PY = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    "


async def start(model: Path, tmp: Path, encoding: str = "utf-16",
                options: dict | None = None, env: dict | None = None) -> LanguageClient:
    """`ahead lsp` under a real client; the daemon it starts gets `env` too."""
    env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp / "rt"), "AHEAD_STATE_DIR": str(tmp / "st"),
           **(env or {})}
    config = ClientServerConfig(server_command=[sys.executable, "-m", "clients.cli", "lsp"],
                                server_env=env)
    client = await config.start()
    statuses: list[dict] = []  # ahead/didChangeStatus, in order
    client.statuses, client.status_seen = statuses, asyncio.Event()  # type: ignore[attr-defined]

    @client.feature("ahead/didChangeStatus")
    def on_status(_client: object, params: object) -> None:
        statuses.append(as_dict(params))
        client.status_seen.set()  # type: ignore[attr-defined]

    caps = types.ClientCapabilities(
        general=types.GeneralClientCapabilities(position_encodings=[encoding]),
        window=types.WindowClientCapabilities(work_done_progress=True))
    result = await client.initialize_session(types.InitializeParams(
        capabilities=caps, initialization_options={"model": str(model), "budgetMs": 20000,
                                                   "maxTokens": 24, **(options or {})}))
    assert result.capabilities.inline_completion_provider is not None
    assert result.capabilities.position_encoding == encoding
    return client


async def stop(client: LanguageClient, tmp: Path) -> None:
    await client.shutdown_session()
    await client.stop()
    daemon = Client(tmp / "rt" / "daemon.sock", autostart=False)
    await daemon.shutdown()  # the daemon the server started outlives it by design
    await daemon.close()


@pytest_asyncio.fixture
async def lsp(model_dir: Path, tmp_path: Path,
              request: pytest.FixtureRequest) -> AsyncIterator[LanguageClient]:
    client = await start(model_dir, tmp_path, env=getattr(request, "param", None))
    yield client
    await stop(client, tmp_path)


def as_dict(params: object) -> dict:
    """Custom messages' params, which pygls hands over as attribute objects."""
    if hasattr(params, "_asdict"):
        return {k: as_dict(v) for k, v in params._asdict().items()}
    return params if not isinstance(params, dict) else {k: as_dict(v) for k, v in params.items()}


async def wait_for_state(client: LanguageClient, state: str) -> None:
    statuses, seen = client.statuses, client.status_seen  # type: ignore[attr-defined]
    async with asyncio.timeout(60):
        while not statuses or statuses[-1]["state"] != state:
            seen.clear()
            await seen.wait()


def open_doc(client: LanguageClient, text: str, name: str = "a.py",
             language: str = "python") -> str:
    uri = f"file:///tmp/{uuid.uuid4().hex}/{name}"
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id=language, version=1,
                                             text=text)))
    return uri


def end_of(text: str, encoding: str = "utf-16") -> types.Position:
    lines = text.split("\n")
    last = lines[-1]
    units = {"utf-8": len(last.encode()), "utf-16": len(last.encode("utf-16-le")) // 2,
             "utf-32": len(last)}[encoding]
    return types.Position(line=len(lines) - 1, character=units)


def inline(client: LanguageClient, uri: str,
           pos: types.Position) -> asyncio.Future[types.InlineCompletionList | None]:
    return client.text_document_inline_completion_async(types.InlineCompletionParams(
        text_document=types.TextDocumentIdentifier(uri=uri), position=pos,
        context=types.InlineCompletionContext(
            trigger_kind=types.InlineCompletionTriggerKind.Automatic)))


async def test_inline_completion_in_a_python_file(lsp: LanguageClient) -> None:
    uri = open_doc(lsp, PY)
    result = await inline(lsp, uri, end_of(PY))
    assert result is not None and result.items
    item = result.items[0]
    assert isinstance(item.insert_text, str) and item.insert_text.strip()
    assert item.range == types.Range(start=end_of(PY), end=end_of(PY))
    assert lsp.progress_reports  # the daemon's start was shown as progress


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16", "utf-32"])
async def test_ranges_in_each_position_encoding(model_dir: Path, tmp_path: Path,
                                                encoding: str) -> None:
    client = await start(model_dir, tmp_path, encoding)
    try:
        text = "label = 'é中文🎉'  # ünïcode\ndef greet(name):\n    return 'héllo 🎉' + "
        uri = open_doc(client, text)
        pos = end_of(text, encoding)
        result = await inline(client, uri, pos)
        if result is not None:  # the model may have nothing to add; the range must be right
            assert result.items[0].range == types.Range(start=pos, end=pos)
        # A position past the end of the line is clamped to it, in the client's units.
        past = types.Position(line=0, character=200)
        result = await inline(client, uri, past)
        if result is not None:
            first = "label = 'é中文🎉'  # ünïcode"
            assert result.items[0].range.start == end_of(first, encoding)
    finally:
        await stop(client, tmp_path)


async def test_cancel_request_gets_the_cancelled_error_and_stops_the_daemon(
        lsp: LanguageClient, tmp_path: Path) -> None:
    uri = open_doc(lsp, PY)
    await inline(lsp, uri, end_of(PY))  # the daemon is up and warm
    msg_id = str(uuid.uuid4())
    future = lsp.protocol.send_request(
        types.TEXT_DOCUMENT_INLINE_COMPLETION,
        types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=types.Position(line=0, character=0),
            context=types.InlineCompletionContext(
                trigger_kind=types.InlineCompletionTriggerKind.Invoked)),
        msg_id=msg_id)
    lsp.protocol.notify(types.CANCEL_REQUEST, types.CancelParams(id=msg_id))
    with pytest.raises(JsonRpcRequestCancelled):
        await asyncio.wait_for(asyncio.wrap_future(future), 30)
    daemon = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
    info = await daemon.status()
    await daemon.close()
    assert info["counts"]["cancelled"] + info["counts"]["requests_completed"] >= 2


async def test_a_burst_answers_only_the_last(lsp: LanguageClient) -> None:
    uri = open_doc(lsp, PY)
    await inline(lsp, uri, end_of(PY))
    text = PY
    futures = []
    for ch in "return":  # typing, a request per keystroke, none awaited
        text += ch
        lsp.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=len(text)),
            content_changes=[types.TextDocumentContentChangeWholeDocument(text=text)]))
        futures.append(inline(lsp, uri, end_of(text)))
    results = await asyncio.gather(*futures)
    assert all(r is None for r in results[:-1])
    assert results[-1] is not None and results[-1].items


@pytest.mark.parametrize("lsp", [{"AHEAD_MIN_CONFIDENCE": "0"}], indirect=True)
async def test_bad_input_gets_an_empty_answer_and_the_server_keeps_serving(
        lsp: LanguageClient) -> None:
    # The threshold is off: what this asserts is that the server still answers after bad
    # input, not how sure the model is (the huge file's lines reach the last prompt as context,
    # and the bundled model's confidence there sits near the threshold, 0.36 against 0.3).
    unknown = "file:///nowhere/never-opened.py"
    assert await inline(lsp, unknown, types.Position(line=0, character=0)) is None
    uri = open_doc(lsp, "x = 1\n")
    assert await inline(lsp, uri, types.Position(line=40, character=3)) is None  # past the end
    binary = open_doc(lsp, "PK\x03\x04\x00\x00binary\x00data", "blob.py")
    assert await inline(lsp, binary, types.Position(line=0, character=4)) is None
    huge = "# filler line of a very large file\n" * 600_000 + "def f(x):\n    "  # ~21 MB
    big = open_doc(lsp, huge, "big.py")
    await inline(lsp, big, end_of(huge))  # answered (or empty) without choking
    uri = open_doc(lsp, PY)
    result = await inline(lsp, uri, end_of(PY))
    assert result is not None and result.items


async def test_disabled_language_gets_nothing(model_dir: Path, tmp_path: Path) -> None:
    client = await start(model_dir, tmp_path, options={"enable": {"markdown": False}})
    try:
        uri = open_doc(client, "# Title\n\nSome text ", "a.md", "markdown")
        assert await inline(client, uri, types.Position(line=2, character=10)) is None
    finally:
        await stop(client, tmp_path)


def test_the_language_server_imports_no_torch() -> None:
    code = "import sys, lsp.server; print('torch' in sys.modules, 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == ["False", "False"]


async def test_accepting_a_suggestion_reaches_the_daemons_stats(lsp: LanguageClient,
                                                                tmp_path: Path) -> None:
    uri = open_doc(lsp, PY)
    shown = await inline(lsp, uri, end_of(PY))
    assert shown is not None
    text = shown.items[0].insert_text
    taken = text if isinstance(text, str) else text.value
    await lsp.workspace_execute_command_async(types.ExecuteCommandParams(
        command="ahead.accepted", arguments=[len(taken)]))
    await lsp.workspace_execute_command_async(types.ExecuteCommandParams(  # a word of the next
        command="ahead.accepted", arguments=[1]))
    daemon = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
    info = await daemon.status()
    await daemon.close()
    assert info["counts"].get("accepted") == 1 and info["counts"].get("partial") == 1, taken
    # what became of shown suggestions, per model and language (and day)
    (model, languages), = info["suggestions"].items()
    assert languages["python"]["shown"] == 1 and languages["python"]["accepted"] == 1
    assert languages["python"]["partial"] == 1
    assert sum(d[model]["python"]["shown"] for d in info["suggestions_by_day"].values()) == 1


def test_bench_lsp_reports_the_servers_own_time(model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "lsp.json"
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "bench", "lsp", "--model",
                           str(model_dir), "--keystrokes", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["overhead_ms"]["n"] == 8 and result["overhead_ms"]["p50"] >= 0
    assert result["overhead_ms"]["p50"] <= result["round_trip_ms"]["p50"]


async def test_settings_change_through_did_change_configuration(lsp: LanguageClient) -> None:
    uri = open_doc(lsp, PY)
    assert await inline(lsp, uri, end_of(PY)) is not None
    lsp.workspace_did_change_configuration(types.DidChangeConfigurationParams(
        settings={"ahead": {"enable": {"python": False}}}))
    assert await inline(lsp, uri, end_of(PY)) is None


async def test_a_missing_daemon_is_said_once_not_on_every_keystroke(tmp_path: Path) -> None:
    client = await start(tmp_path / "no-such-model", tmp_path)  # the daemon cannot start
    try:
        uri = open_doc(client, PY)
        for _ in range(3):
            assert await inline(client, uri, end_of(PY)) is None
        errors = [m for m in client.messages if m.type == types.MessageType.Error]
        assert len(errors) == 1 and "not available" in errors[0].message
        await wait_for_state(client, "down")
        info = await client.protocol.send_request_async("ahead/status", {})
        assert as_dict(info)["state"] == "down" and as_dict(info)["daemon"] is None
    finally:
        await client.shutdown_session()
        await client.stop()


async def test_status_goes_from_starting_to_ready_with_the_daemons_figures(
        lsp: LanguageClient) -> None:
    await wait_for_state(lsp, "ready")
    states = [s["state"] for s in lsp.statuses]  # type: ignore[attr-defined]
    assert states == ["starting", "ready"]
    assert lsp.statuses[-1]["model"]  # type: ignore[attr-defined]
    uri = open_doc(lsp, PY)
    await inline(lsp, uri, end_of(PY))
    info = as_dict(await lsp.protocol.send_request_async("ahead/status", {}))
    assert info["state"] == "ready" and info["model"] == info["daemon"]["model"]
    assert info["daemon"]["counts"]["completions"] >= 1


def test_requests_without_params_are_answered(tmp_path: Path) -> None:
    """JSON-RPC lets a request leave `params` out (VS Code's sendRequest(method) does)."""
    def frame(msg: dict) -> bytes:
        body = json.dumps(msg).encode()
        return b"Content-Length: %d\r\n\r\n" % len(body) + body

    env = {**os.environ, "AHEAD_RUNTIME_DIR": str(tmp_path / "rt"),
           "AHEAD_STATE_DIR": str(tmp_path / "st")}
    messages = [{"jsonrpc": "2.0", "id": 1, "method": "initialize",
                 "params": {"capabilities": {}}},
                {"jsonrpc": "2.0", "id": 2, "method": "ahead/status"},
                {"jsonrpc": "2.0", "id": 3, "method": "ahead/stats"},
                {"jsonrpc": "2.0", "id": 4, "method": "shutdown"},
                {"jsonrpc": "2.0", "method": "exit"}]
    proc = subprocess.run([sys.executable, "-m", "clients.cli", "lsp"], env=env,
                          input=b"".join(frame(m) for m in messages), capture_output=True,
                          timeout=60, check=False)
    bodies = [json.loads(part[part.index(b"{"):]) for part in
              proc.stdout.split(b"Content-Length")[1:]]
    answers = {b["id"]: b for b in bodies if "id" in b}
    assert answers[2]["result"]["state"] == "starting", bodies  # no `initialized` was sent
    assert "overhead_ms" in answers[3]["result"], bodies
