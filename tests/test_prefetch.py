"""Prefetch: the completion that follows a shown suggestion, made before it is asked for
(daemon/requests.py), against a real daemon on a private socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from lsprotocol import types

from daemon import protocol as p
from daemon.backends.local import LocalBackend
from daemon.client import Client
from daemon.requests import _Last, _typed
from daemon.scheduler import Job, Work
from daemon.server import Server
from engine import Engine
from tests.test_daemon import PROMPT, client_for, serving
from tests.test_lsp import end_of, inline, open_doc, start, stop

SUFFIX = "\n"
LSP_DOC = 'import os\n\n\ndef list_files(top):\n    """List the files under top."""\n' \
    "    result = []\n    for "


@pytest.fixture
async def served(trained_engine: Engine, tmp_path: Path) -> AsyncIterator[Server]:
    async with serving(LocalBackend(trained_engine), tmp_path / "rt") as server:
        yield server


def ask(prefix: str, doc: str = "a.py", **kw: object) -> p.Complete:
    base: dict[str, object] = {"max_tokens": 12, "multiline": True, "stop_loops": False}
    return p.Complete(id=0, session="s", document=doc, prefix=prefix, suffix=SUFFIX,
                      **{**base, **kw})  # type: ignore[arg-type]


async def test_the_request_after_an_accept_is_answered_from_the_prefetch(
        served: Server) -> None:
    client = client_for(served)
    shown = await client.run(ask(PROMPT))
    assert shown.text.strip()
    ahead = await client.run(ask(PROMPT + shown.text, priority="prefetch"))
    assert ahead.text.strip()  # the model has more to say there
    steps = served.scheduler.counters.steps
    accepted = await client.run(ask(PROMPT + shown.text))
    assert accepted.stats.prefetched and accepted.text == ahead.text
    assert served.scheduler.counters.steps == steps  # no model work after the accept
    fresh = await client.run(ask(PROMPT + shown.text, doc="other.py"))
    assert not fresh.stats.prefetched and fresh.text == accepted.text  # what it would be
    counts = (await client.status())["counts"]
    assert (counts["prefetches"], counts["prefetch_hits"]) == (1, 1)
    assert counts["prefetch_steps"] >= 1 and counts["completions"] == 3  # prefetches apart
    await client.close()


async def test_typing_along_the_shown_suggestion_keeps_the_prefetch(served: Server) -> None:
    client = client_for(served)
    shown = await client.run(ask(PROMPT))
    assert len(shown.text) > 2
    ahead = await client.run(ask(PROMPT + shown.text, priority="prefetch"))
    typed = await client.run(ask(PROMPT + shown.text[:2]))  # typing through the shown one
    assert typed.stats.typed_through and typed.text == shown.text[2:]
    # The editor shows the rest and asks for the same prefetch again: the first one stands.
    again = await client.run(ask(PROMPT + shown.text, priority="prefetch"))
    assert again.text == "" and (await client.status())["counts"]["prefetches"] == 1
    accepted = await client.run(ask(PROMPT + shown.text))
    assert accepted.stats.prefetched and accepted.text == ahead.text
    await client.close()


async def test_a_running_prefetch_serves_the_accept_at_its_priority(served: Server) -> None:
    client = client_for(served)
    shown = await client.run(ask(PROMPT))
    prefetch = client.stream(ask(PROMPT + shown.text, priority="prefetch", max_tokens=300))
    assert isinstance(await anext(prefetch), p.Chunk)  # it is running
    accepted = await client.run(ask(PROMPT + shown.text, max_tokens=300))
    assert accepted.stats.prefetched and accepted.stats.typed_through
    rest = [r async for r in prefetch]  # the prefetch's own request was superseded
    assert isinstance(rest[-1], p.Error) and "superseded" in rest[-1].message
    fresh = await client.run(ask(PROMPT + shown.text, doc="other.py", max_tokens=300))
    assert accepted.text == fresh.text
    await client.close()


async def test_a_keystroke_that_leaves_the_suggestion_cancels_the_prefetch(
        served: Server) -> None:
    client = client_for(served)
    shown = await client.run(ask(PROMPT))
    prefetch = client.stream(ask(PROMPT + shown.text, priority="prefetch", max_tokens=300))
    assert isinstance(await anext(prefetch), p.Chunk)
    stale = served.scheduler.counters.stale_steps
    other = await client.run(ask(PROMPT + "#"))  # not the suggestion: new work
    assert not other.stats.prefetched and not other.stats.typed_through
    rest = [r async for r in prefetch]
    assert isinstance(rest[-1], p.Error) and "superseded" in rest[-1].message
    assert served.scheduler.counters.stale_steps - stale <= 1  # stopped within one step
    counts = (await client.status())["counts"]
    assert (counts["prefetches"], counts.get("prefetch_hits", 0)) == (1, 0)  # 0s left out
    await client.close()


async def test_a_prefetch_where_the_shown_completion_has_more_to_say_does_nothing(
        served: Server) -> None:
    """Accepting a part of a suggestion is answered by the rest of it: no prefetch runs."""
    client = client_for(served)
    shown = await client.run(ask(PROMPT))
    assert len(shown.text.strip()) > 2
    steps = served.scheduler.counters.steps
    part = await client.run(ask(PROMPT + shown.text[:2], priority="prefetch"))
    assert part.text == "" and served.scheduler.counters.steps == steps
    assert "prefetches" not in (await client.status())["counts"]  # none: 0 is left out
    await client.close()


def test_a_finished_completion_typed_to_its_end_has_nothing_left_to_say() -> None:
    """Typing a finished suggestion to its end (or to white space) needs a new completion:
    its empty rest would show nothing until the next keystroke. One the loop rule stopped
    answers at its own cursor only; one cut by its deadline, nowhere."""
    job = Job(work=Work("x = ", "\n"), listeners=[], text="f(1)\n", finish_reason="stop")
    last = _Last("x = ", "\n", job)
    assert _typed(last, ask("x = f(")) == (job, "f(")
    assert _typed(last, ask("x = f(1)")) is None
    assert _typed(last, ask("x = f(1)\n")) is None
    assert _typed(last, ask("x = ")) == (job, "")  # its own cursor: its own answer
    empty = _Last("y = ", "\n", Job(work=Work("y = ", "\n"), listeners=[], text="",
                                    finish_reason="stop"))
    assert _typed(empty, ask("y = ")) == (empty.job, "")  # a prefetch that found nothing
    job.finish_reason = None  # still running: its rest is still to come
    assert _typed(last, ask("x = f(1)")) == (job, "f(1)")
    # Stopped by the loop rule (a prefetch may be, before the request after an accept comes):
    # at its own cursor a new completion would loop the same way; typed into, no promise.
    job.finish_reason = "repetition"
    assert _typed(last, ask("x = ")) == (job, "")
    assert _typed(last, ask("x = f(")) is None
    job.finish_reason = "deadline"
    assert _typed(last, ask("x = ")) is None


async def _show_accept_and_ask_again(model: Path, tmp_path: Path,
                                     options: dict) -> tuple[str, str | None, dict]:
    """Through `ahead lsp` under a real client: a suggestion shown, accepted whole (the
    editor inserts it and runs the accept command), then the suggestion at the new cursor."""
    client = await start(model, tmp_path, options=options,
                         env={"AHEAD_MIN_CONFIDENCE": "0"})  # whatever it writes
    try:
        uri = open_doc(client, LSP_DOC)
        shown = await inline(client, uri, end_of(LSP_DOC))
        assert shown is not None
        taken = shown.items[0].insert_text
        assert isinstance(taken, str)
        client.text_document_did_change(types.DidChangeTextDocumentParams(
            text_document=types.VersionedTextDocumentIdentifier(uri=uri, version=2),
            content_changes=[types.TextDocumentContentChangePartial(
                range=types.Range(start=end_of(LSP_DOC), end=end_of(LSP_DOC)), text=taken)]))
        await client.workspace_execute_command_async(types.ExecuteCommandParams(
            command="ahead.accepted", arguments=[len(taken)]))
        after = await inline(client, uri, end_of(LSP_DOC + taken))
        text = after.items[0].insert_text if after else None
        daemon = Client(tmp_path / "rt" / "daemon.sock", autostart=False)
        counts = (await daemon.status())["counts"]
        await daemon.close()
    finally:
        await stop(client, tmp_path)
    return taken, text if isinstance(text, str) or text is None else text.value, counts


async def test_the_language_server_prefetches_what_follows_a_shown_suggestion(
        model_dir: Path, tmp_path: Path) -> None:
    taken, after, counts = await _show_accept_and_ask_again(model_dir, tmp_path / "on", {})
    # The request after the accept was answered from the prefetch (the bundled model's
    # answer there ends in a loop: what comes before it is shown, here nothing).
    assert counts["prefetches"] == 1 and counts["prefetch_hits"] == 1, sorted(counts.items())
    # Off, the same suggestions come from the model after the accept.
    off = await _show_accept_and_ask_again(model_dir, tmp_path / "off", {"prefetch": False})
    assert off[:2] == (taken, after) and "prefetches" not in off[2]
