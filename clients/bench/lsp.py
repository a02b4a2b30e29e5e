"""`ahead bench lsp`: the language server's own time per completion.

Starts `ahead lsp` over stdio (with its own daemon on a private socket), types a real file a
character at a time asking for an inline completion after each keystroke (awaiting each),
then asks the server for its overhead: request in to response out, minus the wait for the
daemon.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from daemon.client import Client
from daemon.stats import percentiles


async def bench_lsp(model: Path, file: Path, *, keystrokes: int = 100) -> dict[str, Any]:
    text = file.read_text(encoding="utf-8")
    cut = len(text) // 2
    cut = text.index("\n", cut) + 1 if "\n" in text[cut:] else cut
    with tempfile.TemporaryDirectory() as rt:
        env = {**os.environ, "AHEAD_RUNTIME_DIR": rt}
        client = LanguageClient("ahead-bench", "1")
        await client.start_io(sys.executable, "-m", "clients.cli", "lsp", env=env)
        try:
            await client.initialize_async(types.InitializeParams(
                capabilities=types.ClientCapabilities(),
                initialization_options={"model": str(model), "budgetMs": 30000}))
            client.initialized(types.InitializedParams())
            round_trips = await _type(client, text, cut, keystrokes, file.name)
            stats = await client.protocol.send_request_async("ahead/stats", {})
            await client.shutdown_async(None)
            client.exit(None)
        finally:
            await client.stop()
            daemon = Client(Path(rt) / "daemon.sock", autostart=False)
            await daemon.shutdown()
            await daemon.close()
    daemon_ms = list(getattr(stats, "daemon_ms", None) or stats["daemon_ms"])
    if len(daemon_ms) != len(round_trips):
        raise RuntimeError(f"{len(round_trips)} requests but {len(daemon_ms)} answered")
    # Request in to response out, stdio both ways included, minus the wait for the daemon.
    overhead = [rt - d for rt, d in zip(round_trips, daemon_ms, strict=True)]
    return {"keystrokes": keystrokes, "overhead_ms": percentiles(overhead),
            "round_trip_ms": percentiles(round_trips)}


async def _type(client: LanguageClient, text: str, cut: int, keystrokes: int,
                name: str) -> list[float]:
    uri = f"file:///bench/{name}"
    doc = text[:cut]
    client.text_document_did_open(types.DidOpenTextDocumentParams(
        text_document=types.TextDocumentItem(uri=uri, language_id="python", version=0,
                                             text=doc + text[cut:])))
    times = []
    for k in range(keystrokes):
        ch = text[cut + k]
        doc += ch
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=k + 1),
            content_changes=[types.TextDocumentContentChangePartial(
                range=types.Range(start=_pos(doc[:-1]), end=_pos(doc[:-1])), text=ch)]))
        t0 = time.perf_counter()
        await client.text_document_inline_completion_async(types.InlineCompletionParams(
            text_document=types.TextDocumentIdentifier(uri=uri),
            position=_pos(doc),
            context=types.InlineCompletionContext(
                trigger_kind=types.InlineCompletionTriggerKind.Automatic)))
        times.append((time.perf_counter() - t0) * 1000)
    return times


def _pos(text: str) -> types.Position:
    """The end of `text` in UTF-16 units (the default encoding)."""
    last = text[text.rfind("\n") + 1:]
    return types.Position(line=text.count("\n"), character=len(last.encode("utf-16-le")) // 2)


def format_report(r: dict[str, Any]) -> str:
    o = r["overhead_ms"]
    return (f"{r['keystrokes']} keystrokes: the language server's own time per completion "
            f"(round trip minus the daemon's) p50 {o.get('p50')} ms, p99 {o.get('p99')} ms; "
            f"round trip p50 {r['round_trip_ms']['p50']} ms")
