"""`ahead bench typist`: a scripted person writes code through the real language server.

The person writes a stretch of each file (from a cut point, with the file above it in the
buffer and nothing below: writing the file top to bottom) at a typing speed, through
`ahead lsp` and a daemon of its own. After each keystroke it asks for the inline suggestion
and reads it if it comes before its next keystroke is due; after an accept it waits for
the next suggestion (up to `read_ms`), as one reads what comes next. Taking a suggestion
takes `think_ms` of reading it first, and is a keystroke (Tab) like any other. It takes the
suggestion's next line if that is what the author wrote next (VS Code's and Neovim's accept
line), else its next word if that is, else it types the next character. Each file is
written twice, with the server's prefetch on and off (each by its own server process, the
order alternating by file), against one daemon.

What is measured: the share of the characters that accepted suggestions wrote, keystroke ->
suggestion and accept -> next suggestion (p50/p90 of the answers that came in time: those
that did not are counted apart), the latter also after the accepts that took all of a
suggestion (after a part, the suggestion's rest answers at once, prefetch or not), and from
the daemon's counters the model steps and prefill tokens per accepted character and the
stale steps per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lsprotocol import types
from pygls.lsp.client import LanguageClient

from clients.bench.lsp import _pos
from daemon.client import Client
from daemon.stats import percentiles

MODES = ("with_prefetch", "without_prefetch")
_COUNTERS = ("steps", "prefill_tokens", "stale_steps", "completions", "typed_through",
             "superseded", "prefetches", "prefetch_hits", "prefetch_steps")
_LINE = re.compile(r"\s*[^\n]*\n?")  # leading blank lines, then a line and its end
_WORD = re.compile(r"\s*(?:\w+|[^\w\s]+)")


@dataclass(slots=True)
class Writing:
    """One file written once: what the person did and waited for."""

    chars: int = 0  # characters to write
    from_suggestions: int = 0
    keystrokes: int = 0
    accepts: Counter[str] = field(default_factory=Counter)  # "line", "word"
    after_key_ms: list[float] = field(default_factory=list)  # answers in time
    after_accept_ms: list[float] = field(default_factory=list)
    after_whole_ms: list[float] = field(default_factory=list)  # the suggestion all taken
    late: Counter[str] = field(default_factory=Counter)  # answers not in time, by kind
    seconds: float = 0.0
    counts: Counter[str] = field(default_factory=Counter)  # the daemon's, for this writing


def take(suggestion: str, rest: str) -> tuple[str, str] | None:
    """What the person accepts of `suggestion` with `rest` still to write: ("line", text)
    or ("word", text), or None to type on."""
    for kind, pattern in (("line", _LINE), ("word", _WORD)):
        m = pattern.match(suggestion)
        if m and m.group().strip() and rest.startswith(m.group()):
            return kind, m.group()
    return None


def stretch(text: str, start: float, chars: int) -> tuple[str, str]:
    """(the buffer above, what to write): from the first line at `start` (a fraction of the
    file) for `chars` characters, to the end of that line."""
    text = text.replace("\r\n", "\n")
    at = int(len(text) * start)
    if at:
        newline = text.find("\n", at - 1)  # the line that starts at or after `at`
        at = len(text) if newline < 0 else newline + 1
    end = text.find("\n", at + chars)
    end = len(text) if end < 0 else end + 1
    return text[:at], text[at:end]


class Person:
    """Writes one stretch through one language server."""

    def __init__(self, client: LanguageClient, cps: float, read_ms: float,
                 think_ms: float) -> None:
        self.client, self.interval = client, 1 / cps
        self.read_s, self.think_s = read_ms / 1000, think_ms / 1000
        self.version = 0
        self.commands: list[asyncio.Future[Any]] = []

    async def write(self, name: str, above: str, target: str) -> Writing:
        w = Writing(chars=len(target))
        uri = f"file:///bench/{name}"
        self.client.text_document_did_open(types.DidOpenTextDocumentParams(
            text_document=types.TextDocumentItem(uri=uri, language_id=_language(name),
                                                 version=0, text=above)))
        doc, done, after_accept, whole = above, 0, False, False
        t0 = last = time.perf_counter()  # `last`: when the person last pressed a key
        while done < len(target):
            # After a keystroke the next one is due at the typing speed; after an accept
            # the person waits to read what comes next.
            wait = self.read_s if after_accept else self.interval
            shown, waited = await self._suggestion(uri, doc, time.perf_counter() + wait)
            kind = "accept" if after_accept else "key"
            if waited is None:
                w.late[kind] += 1
            else:
                (w.after_accept_ms if after_accept else w.after_key_ms).append(waited)
                if whole:  # what comes next needs new work (or a prefetch)
                    w.after_whole_ms.append(waited)
            taken = take(shown, target[done:]) if shown else None
            if taken is None:
                piece, after_accept, whole = target[done], False, False
                due = last + self.interval
                w.keystrokes += 1
            else:  # reading it takes a moment; the accept is a keystroke too
                (accept, piece), after_accept = taken, True
                whole = not shown[len(piece):].strip()
                due = max(last + self.interval, time.perf_counter() + self.think_s)
                w.accepts[accept] += 1
                w.from_suggestions += len(piece)
            if (pause := due - time.perf_counter()) > 0:
                await asyncio.sleep(pause)  # the person's pace, not a synchronisation
            last = time.perf_counter()
            self._insert(uri, doc, piece)
            doc, done = doc + piece, done + len(piece)
            if taken is not None:
                self.commands.append(asyncio.ensure_future(
                    self.client.workspace_execute_command_async(types.ExecuteCommandParams(
                        command="ahead.accepted", arguments=[len(piece)]))))
        w.seconds = time.perf_counter() - t0
        self.client.text_document_did_close(types.DidCloseTextDocumentParams(
            text_document=types.TextDocumentIdentifier(uri=uri)))
        await asyncio.gather(*self.commands)
        self.commands.clear()
        return w

    async def _suggestion(self, uri: str, doc: str, due: float) -> tuple[str, float | None]:
        """The suggestion at the end of `doc` ("" for none) and the ms it took, or ("",
        None) when it did not come before `due` (the request is left to be superseded)."""
        t0 = time.perf_counter()
        request = self.client.text_document_inline_completion_async(
            types.InlineCompletionParams(
                text_document=types.TextDocumentIdentifier(uri=uri), position=_pos(doc),
                context=types.InlineCompletionContext(
                    trigger_kind=types.InlineCompletionTriggerKind.Automatic)))
        try:
            result = await asyncio.wait_for(asyncio.shield(request), max(due - t0, 0.001))
        except TimeoutError:
            return "", None
        ms = (time.perf_counter() - t0) * 1000
        items = result.items if isinstance(result, types.InlineCompletionList) else result
        if not items:
            return "", ms
        text = items[0].insert_text
        return (text if isinstance(text, str) else text.value), ms

    def _insert(self, uri: str, doc: str, piece: str) -> None:
        self.version += 1
        self.client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=self.version),
            content_changes=[types.TextDocumentContentChangePartial(
                range=types.Range(start=_pos(doc), end=_pos(doc)), text=piece)]))


def _language(name: str) -> str:
    return {".py": "python", ".js": "javascript", ".ts": "typescript", ".rs": "rust",
            ".go": "go", ".c": "c", ".h": "c", ".java": "java"}.get(Path(name).suffix,
                                                                    "plaintext")


async def bench_typist(model: Path, files: list[Path], *, cps: float = 8.0, chars: int = 400,
                       start: float = 0.5, read_ms: float = 2000.0, think_ms: float = 300.0,
                       budget_ms: int = 2000,
                       serve_args: list[str] | None = None,
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Each file written with prefetch and without, side by side, against one daemon."""
    if cps <= 0 or chars < 1 or not 0 <= start < 1 or read_ms <= 0 or think_ms < 0:
        raise ValueError("--cps and --read-ms must be > 0, --think-ms >= 0, --chars >= 1, "
                         "--start in [0, 1)")
    args = ["--model", str(model), "--idle-timeout", "600", "--no-watch", *(serve_args or [])]
    written: dict[str, list[Writing]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as rt:
        os.environ["AHEAD_RUNTIME_DIR"] = rt  # a private daemon, not the user's (the
        #                                       servers started below inherit it)
        control = Client(serve_args=args, client_name="bench")
        servers: dict[str, LanguageClient] = {}
        try:
            await control.connect()
            backend = (await control.status())["backend"]
            for mode in MODES:
                servers[mode] = await _server(model, mode == MODES[0], budget_ms)
            for i, file in enumerate(files):
                above, target = stretch(file.read_text(encoding="utf-8"), start, chars)
                for mode in MODES if i % 2 == 0 else MODES[::-1]:
                    if progress:
                        progress(f"{file.name} ({i + 1}/{len(files)}), {mode}")
                    before = (await control.status())["counts"]
                    person = Person(servers[mode], cps, read_ms, think_ms)
                    w = await person.write(f"{mode}/{file.name}", above, target)
                    after = (await control.status())["counts"]
                    w.counts.update({k: after.get(k, 0) - before.get(k, 0) for k in _COUNTERS})
                    written[mode].append(w)
        finally:  # the servers first: a server whose daemon went away would start another
            for server in servers.values():
                await _stop(server)
            await control.shutdown()
            await control.close()
            os.environ.pop("AHEAD_RUNTIME_DIR", None)
    result: dict[str, Any] = {"backend": backend, "files": [str(f) for f in files],
                              "cps": cps, "chars_per_file": chars, "start": start,
                              "read_ms": read_ms, "think_ms": think_ms,
                              "budget_ms": budget_ms}
    result.update({mode: summary(ws) for mode, ws in written.items()})
    for name in ("accept_to_next", "whole_accept_to_next"):
        on, off = (result[m][f"{name}_ms"].get("p50") for m in MODES)
        result[f"{name}_p50_ratio"] = off / on if on and off else None
    return result


async def _server(model: Path, prefetch: bool, budget_ms: int) -> LanguageClient:
    client = LanguageClient("ahead-typist", "1")

    @client.feature("ahead/didChangeStatus")
    def on_status(_client: object, params: object) -> None:
        pass  # the server's state: ready from the first answer on (the daemon is up)

    await client.start_io(sys.executable, "-m", "clients.cli", "lsp")
    await client.initialize_async(types.InitializeParams(
        capabilities=types.ClientCapabilities(),
        initialization_options={"model": str(model), "budgetMs": budget_ms,
                                "prefetch": prefetch}))
    client.initialized(types.InitializedParams())
    return client


async def _stop(client: LanguageClient, timeout: float = 10.0) -> None:
    """Shut the server down: shutdown, exit, the end of its input; killed if it has not
    exited within `timeout` (a teardown never loses a run's figures)."""
    with contextlib.suppress(Exception):  # a server that does not answer is killed below
        await asyncio.wait_for(client.shutdown_async(None), timeout)
        client.exit(None)
    process = client._server  # pygls keeps the process it started there, and no other way
    if process is not None and process.returncode is None:
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), timeout)
        except TimeoutError:
            process.kill()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(client.stop(), timeout)
    if process is not None:  # else its pipes are closed after the loop, with a traceback
        process._transport.close()  # type: ignore[attr-defined]


def summary(ws: list[Writing]) -> dict[str, Any]:
    chars = sum(w.chars for w in ws)
    taken = sum(w.from_suggestions for w in ws)
    counts: Counter[str] = sum((w.counts for w in ws), Counter())
    accepts: Counter[str] = sum((w.accepts for w in ws), Counter())
    late: Counter[str] = sum((w.late for w in ws), Counter())
    after_key = [ms for w in ws for ms in w.after_key_ms]
    after_accept = [ms for w in ws for ms in w.after_accept_ms]
    per_char = max(taken, 1)
    return {
        "chars": chars, "chars_from_suggestions": taken,
        "chars_from_suggestions_share": taken / chars if chars else 0.0,
        "keystrokes": sum(w.keystrokes for w in ws), "accepts": dict(accepts),
        "keystroke_to_suggestion_ms": _p50_p90(after_key),
        "accept_to_next_ms": _p50_p90(after_accept),
        "whole_accept_to_next_ms": _p50_p90([ms for w in ws for ms in w.after_whole_ms]),
        "late": {"after_keystroke": late["key"], "after_accept": late["accept"]},
        "model_steps_per_accepted_char": counts["steps"] / per_char,
        "prefill_tokens_per_accepted_char": counts["prefill_tokens"] / per_char,
        "stale_steps_per_request": counts["stale_steps"] / max(counts["completions"], 1),
        "requests": counts["completions"], "typed_through": counts["typed_through"],
        "prefetches": counts["prefetches"], "prefetch_hits": counts["prefetch_hits"],
        "prefetch_steps": counts["prefetch_steps"],
        "seconds": round(sum(w.seconds for w in ws), 1),
    }


def _p50_p90(values: list[float]) -> dict[str, float]:
    p = percentiles(values)
    return {k: p[k] for k in ("p50", "p90", "n") if k in p}


def format_report(r: dict[str, Any]) -> str:
    on, off = (r[m] for m in MODES)

    def ms(d: dict[str, float]) -> str:
        return f"{d['p50']:.0f} / {d['p90']:.0f}" if d else "-"

    rows = [
        ("characters written by accepted suggestions",
         *(f"{m['chars_from_suggestions_share']:.1%} of {m['chars']}" for m in (on, off))),
        ("keystroke -> suggestion p50 / p90 ms",
         *(ms(m["keystroke_to_suggestion_ms"]) for m in (on, off))),
        ("accept -> next suggestion p50 / p90 ms",
         *(ms(m["accept_to_next_ms"]) for m in (on, off))),
        ("  after taking all of a suggestion",
         *(ms(m["whole_accept_to_next_ms"]) for m in (on, off))),
        ("answers not in time (after keystroke / accept)",
         *(f"{m['late']['after_keystroke']} / {m['late']['after_accept']}" for m in (on, off))),
        ("accepts (line / word)",
         *(f"{m['accepts'].get('line', 0)} / {m['accepts'].get('word', 0)}" for m in (on, off))),
        ("model steps per accepted character",
         *(f"{m['model_steps_per_accepted_char']:.2f}" for m in (on, off))),
        ("prefill tokens per accepted character",
         *(f"{m['prefill_tokens_per_accepted_char']:.2f}" for m in (on, off))),
        ("stale steps per request", *(f"{m['stale_steps_per_request']:.2f}" for m in (on, off))),
        ("prefetches (answered from)",
         *(f"{m['prefetches']} ({m['prefetch_hits']})" for m in (on, off))),
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"{len(r['files'])} files, {r['chars_per_file']} characters each from "
             f"{r['start']:.0%} of the file, {r['cps']:g} characters/s, backend "
             f"{r['backend']}", f"{'':{width}}  {'with prefetch':>18}  {'without':>18}"]
    lines += [f"{name:{width}}  {a:>18}  {b:>18}" for name, a, b in rows]
    ratios = [r[f"{name}_p50_ratio"] for name in ("accept_to_next", "whole_accept_to_next")]
    lines.append("accept -> next suggestion p50, without / with prefetch: " + ", ".join(
        "-" if x is None else f"{x:.1f}x" for x in ratios) + " (all accepts, taking all)")
    return "\n".join(lines)
