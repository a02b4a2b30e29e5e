"""One completion, from an editor position to the text to show: context, daemon, clean-up.

Plain code, testable without an LSP client; `lsp.server` wires it to the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

import msgspec
from lsprotocol import types
from pygls.workspace import Workspace

from daemon import protocol as p
from daemon.client import Client, DaemonUnavailable, RequestFailed
from lsp.context import ExtraContext, cursor_window
from lsp.postprocess import ask_for, cursor_lines, postprocess

log = logging.getLogger("ahead.lsp")

BINARY_SNIFF = 8192  # a NUL byte in the first this-many characters marks a binary file


@dataclass(slots=True)
class Settings:
    """What the client may set (initialization options, workspace/didChangeConfiguration)."""

    max_tokens: int = 64
    budget_ms: int | None = 2000
    enable: dict[str, bool] = field(default_factory=dict)  # language id -> on/off; "*" default
    prefix_chars: int = 8000
    suffix_chars: int = 2000
    model: str | None = None  # for a daemon this client starts
    prefetch: bool = True  # ask for the suggestion after a shown one while it is shown

    def update(self, options: Any) -> None:
        """Apply the known keys of a client's options, ignoring what is not ours."""
        if not isinstance(options, dict):
            return
        for key, kind in (("max_tokens", int), ("budget_ms", int), ("prefix_chars", int),
                          ("suffix_chars", int)):
            value = options.get(key, options.get(_camel(key)))
            if isinstance(value, kind) and not isinstance(value, bool) and value > 0:
                setattr(self, key, value)
        enable = options.get("enable")
        if isinstance(enable, dict):
            self.enable = {str(k): bool(v) for k, v in enable.items()}
        if isinstance(options.get("model"), str):
            self.model = options["model"]
        if isinstance(options.get("prefetch"), bool):
            self.prefetch = options["prefetch"]

    def enabled(self, language: str) -> bool:
        return self.enable.get(language, self.enable.get("*", True))


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def uri_path(uri: str) -> str:
    parsed = urlparse(uri)
    return unquote(parsed.path) if parsed.scheme == "file" else uri


class Completer:
    def __init__(self, client: Client, settings: Settings, *, session: str,
                 report: Callable[[str, str], None]) -> None:
        self.client, self.settings, self.session = client, settings, session
        self.report = report  # (state, message): "ready" or "down", on every answer
        self.extra = ExtraContext()
        self.overhead_ms: deque[float] = deque(maxlen=5000)  # per answered request
        self.daemon_ms: deque[float] = deque(maxlen=5000)  # its wait for the daemon
        self.last_shown = (0, "")  # the last suggestion's length and language
        self.prefetching: set[asyncio.Task[None]] = set()

    def note(self, uri: str, text: str, line: int | None) -> None:
        if "\x00" not in text[:BINARY_SNIFF]:
            self.extra.note(uri_path(uri), text, line)

    def forget(self, uri: str) -> None:
        self.extra.forget(uri_path(uri))

    async def complete(self, workspace: Workspace, uri: str,
                       position: types.Position) -> tuple[str, types.Position] | None:
        """The suggestion and where it goes (client units), or None for nothing to show."""
        t0 = time.perf_counter()
        doc = workspace.text_documents.get(uri)
        if doc is None or not self.settings.enabled(doc.language_id or ""):
            return None
        text, lines = doc.source, doc.lines
        if "\x00" in text[:BINARY_SNIFF] or position.line > len(lines):
            return None
        at = types.Position(line=position.line, character=position.character)
        server_at = doc.position_codec.position_from_client_units(lines, at)
        offset = doc.offset_at_server_position(server_at)
        at = doc.position_codec.position_to_client_units(lines, server_at)  # clamped
        req, before, after = self._request(doc.uri, doc.language_id or "", text, offset)
        t1 = time.perf_counter()
        try:
            done = await self.client.run(req)
        except RequestFailed as e:
            if e.code == "unavailable":  # the daemon's remote server is down
                self.report("down", e.message)
            elif e.code != "cancelled":  # superseded or cancelled: simply nothing to show
                log.warning("completion failed: %s", e)
            return None
        except DaemonUnavailable as e:
            self.report("down", f"the daemon is not available: {e}")
            return None
        t2 = time.perf_counter()
        self.report("ready", "")
        shown = postprocess(done.text, line_before_cursor=before, line_after_cursor=after,
                            suffix=req.suffix, multiline=req.multiline)
        # Our own time: everything but the wait for the daemon.
        self.overhead_ms.append((time.perf_counter() - t0 - (t2 - t1)) * 1000)
        self.daemon_ms.append((t2 - t1) * 1000)
        if not shown:
            return None
        await self.shown(shown, req.language)
        if self.settings.prefetch:
            self._prefetch(doc.uri, doc.language_id or "", text[:offset] + shown,
                           text[offset:])
        return shown, at

    def _prefetch(self, uri: str, language: str, before: str, after: str) -> None:
        """Ask the daemon, at the lowest priority, for what this server would ask for at
        the end of the suggestion once accepted (daemon/requests.py): the request after an
        accept is then answered from it. Its own answer is not needed: not waited for."""
        req, _, _ = self._request(uri, language, before + after, len(before))
        task = asyncio.create_task(self._ignore(msgspec.structs.replace(req,
                                                                        priority="prefetch")))
        self.prefetching.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(self.prefetching.discard)

    async def _ignore(self, req: p.Complete) -> None:
        with contextlib.suppress(RequestFailed, DaemonUnavailable):
            await self.client.run(req)

    def _request(self, uri: str, language: str, text: str,
                 offset: int) -> tuple[p.Complete, str, str]:
        """The daemon request, and the cursor line's text before and after the cursor."""
        s = self.settings
        window = cursor_window(text, offset, max_prefix_chars=s.prefix_chars,
                               max_suffix_chars=s.suffix_chars)
        c = cursor_lines(window.prefix, window.suffix)
        before, after = c.before, c.after
        multiline, floor = ask_for(c)
        path = uri_path(uri)
        extra = [p.ContextChunk(path=cp, text=ct) for cp, ct in self.extra.chunks(exclude=path)]
        req = p.Complete(id=0, session=self.session, document=uri, prefix=window.prefix,
                         suffix=window.suffix, extra=extra, language=language, path=path,
                         max_tokens=s.max_tokens, multiline=multiline, budget_ms=s.budget_ms,
                         indent_floor=floor)
        return req, before, after

    async def shown(self, text: str, language: str) -> None:
        """A suggestion went to the editor."""
        self.last_shown = (len(text), language)
        await self.feedback("shown", len(text), language)

    async def accepted(self, chars: int) -> None:
        """The editor took `chars` characters of the last suggestion shown: all of it, or a
        part (a word, a line)."""
        shown, language = self.last_shown
        await self.feedback("partial" if 0 < chars < shown else "accepted", chars, language)

    async def feedback(self, event: p.FeedbackEvent, chars: int, language: str = "") -> None:
        with contextlib.suppress(DaemonUnavailable):  # statistics are not worth a warning
            await self.client.notify(p.Feedback(id=0, request=0, event=event, chars=chars,
                                                language=language))
