"""What arrives on `ahead lsp`'s stdin, read so that every request gets exactly one response.

A thin layer over pygls: its reader loop (`pygls.io_.run_async`) is replaced by `serve`, and
its protocol gets `receive`, which turns one message body into a pygls message or a JSON-RPC
error. pygls handles everything that reads well; what it would drop (a request it cannot
structure gets no response, only an "Error in server" message) is answered here:

- -32700 (parse error): a body that is not UTF-8 or not JSON;
- -32600 (invalid request): not a JSON object (LSP has no batches), no `"jsonrpc": "2.0"`, an
  id or method of the wrong type, a request after `shutdown`, a body over the size limit;
- -32602 (invalid params): params that do not fit the method's type (a negative or too
  large position, a string for a position, a missing field, a list, null or nothing).

The error carries the request's id when the message says one, else null. Lone UTF-16
surrogates (`"\\ud800"` in a document) become U+FFFD, one unit for one in every position
encoding, so that a broken document cannot break what is sent to the daemon for the others.
A body over MAX_MESSAGE_BYTES is not read: the stream is skipped to the next header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
from concurrent.futures import Executor
from typing import Any, BinaryIO

from lsprotocol import types
from pygls.protocol import LanguageServerProtocol
from pygls.protocol.json_rpc import JsonRPCNotification, JsonRPCRequestMessage

log = logging.getLogger("ahead.lsp")

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
MAX_LINE_BYTES = 64 * 1024  # header lines are read in pieces of at most this
PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS = -32700, -32600, -32602

# The Content-Length header at the end of a line. Valid JSON cannot hold this (a raw CR LF
# never comes inside a string, and the digits outside one would be no JSON), so after a
# body that was not read it marks where the next message starts.
_LENGTH = re.compile(rb"Content-Length:[ \t]*(\d{1,20})\r?\n\Z", re.IGNORECASE)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class Protocol(LanguageServerProtocol):
    def receive(self, body: bytes) -> None:
        """Handle one message body: hand it to pygls, or answer it with an error."""
        try:
            text = body.decode("utf-8")
            data = json.loads(text)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self.refuse(_id_in(body), PARSE_ERROR, f"parse error: {_first_line(e)}")
            return
        if _SURROGATE_ESCAPE.search(text):  # rare: only then is every string looked at
            data = _without_lone_surrogates(data)
        if not isinstance(data, dict):
            self.refuse(None, INVALID_REQUEST, "a message must be a JSON object "
                        "(LSP has no batches)")
            return
        msg_id, method = data.get("id"), data.get("method")
        has_id = "id" in data
        good_id = isinstance(msg_id, int | str) and not isinstance(msg_id, bool)
        if data.get("jsonrpc") != "2.0" or (has_id and not good_id) or (
                "method" in data and not isinstance(method, str)):
            self.refuse(msg_id if good_id else None, INVALID_REQUEST,
                        'invalid request: needs "jsonrpc": "2.0", a string method and an '
                        "integer or string id")
            return
        if method is None:  # a response to one of our requests
            self._handle(data)
            return
        if has_id and self._shutdown and method != types.EXIT:
            self.refuse(msg_id, INVALID_REQUEST, "the server is shutting down")
            return
        try:
            message = self._structure_call(data)
        except Exception as e:
            if has_id:
                self.refuse(msg_id, INVALID_PARAMS, f"invalid params for {method}: "
                            f"{_first_line(e)}")
            else:
                log.warning("ignored %s: invalid params: %s", method, _first_line(e))
            return
        if has_id and getattr(message, "id", None) is None:  # typed as a notification
            self.refuse(msg_id, INVALID_REQUEST, f"{method} is a notification: no id")
            return
        self.handle_message(message)

    def structure_message(self, data: dict[str, Any]) -> Any:
        """`params` may be left out of a request or notification (JSON-RPC 2.0); pygls's
        generic message types require it, and would answer nothing at all."""
        if "method" in data and "params" not in data:
            data = {**data, "params": None}
        return super().structure_message(data)

    def _structure_call(self, data: dict[str, Any]) -> Any:
        """A request or notification as pygls types it (what `structure_message` does for
        them, without logging a traceback for each bad one)."""
        if "params" not in data:
            data = {**data, "params": None}
        generic = JsonRPCRequestMessage if "id" in data else JsonRPCNotification
        kind = self.get_message_type(data["method"]) or generic
        return self._converter.structure(data, kind)

    def _handle(self, data: dict[str, Any]) -> None:
        try:
            self.handle_message(self.structure_message(data))
        except Exception as e:  # a bad response from the client: nobody waits for an answer
            log.warning("ignored a response: %s", _first_line(e))

    def refuse(self, msg_id: int | str | None, code: int, message: str) -> None:
        """Answer with an error (a null id: the message did not say which it was)."""
        log.warning("answered %s with %d: %s", msg_id, code, message)
        self._send_data({"jsonrpc": "2.0", "id": msg_id,  # a null id is said, not left out
                         "error": {"code": code, "message": message}})


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    if e.__cause__ is not None and str(e.__cause__).strip():  # cattrs says it there
        text = str(e.__cause__).strip()
    if hasattr(e, "exceptions"):  # a cattrs ClassValidationError: say the first reason
        text = f"{text}: {_first_line(e.exceptions[0])}"
    return text.splitlines()[0][:300]


def _id_in(body: bytes) -> int | str | None:
    """The id of a message that is not valid UTF-8, when it is JSON all the same."""
    try:
        data = json.loads(body.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return None
    msg_id = data.get("id") if isinstance(data, dict) else None
    return msg_id if isinstance(msg_id, int | str) and not isinstance(msg_id, bool) else None


def _without_lone_surrogates(value: Any) -> Any:
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_without_lone_surrogates(v) for v in value]
    if isinstance(value, dict):
        return {_without_lone_surrogates(k): _without_lone_surrogates(v)
                for k, v in value.items()}
    return value


class _Stdin:
    """Blocking reads of stdin, each on a worker thread."""

    def __init__(self, stream: BinaryIO, executor: Executor | None) -> None:
        self.stream, self.executor = stream, executor
        self.loop = asyncio.get_running_loop()

    async def readline(self) -> bytes:
        return await self.loop.run_in_executor(self.executor, self.stream.readline,
                                               MAX_LINE_BYTES)

    async def read(self, n: int) -> bytes:
        return await self.loop.run_in_executor(self.executor, self.stream.read, n)


async def _next_length(stdin: _Stdin) -> int | None:
    """Read up to the blank line that ends a message's headers: its Content-Length. Lines
    before a Content-Length header (what is left of a message that was not read) are
    skipped. None at the end of the input."""
    length: int | None = None
    tail = b""  # the end of a long line, read in pieces: a header may span two of them
    while line := await stdin.readline():
        if length is not None:
            if not line.strip():
                return length
            continue  # Content-Type and the like
        match = _LENGTH.search(tail + line)
        if match:
            length = int(match.group(1))
        tail = b"" if line.endswith(b"\n") else (tail + line)[-64:]
    return None


async def serve(stream: BinaryIO, protocol: Protocol, stop: threading.Event,
                executor: Executor | None = None) -> None:
    """Read messages from `stream` until it ends or `stop` is set, as pygls' loop does."""
    stdin = _Stdin(stream, executor)
    while not stop.is_set():
        length = await _next_length(stdin)
        if length is None:
            return
        if length > MAX_MESSAGE_BYTES:
            protocol.refuse(None, INVALID_REQUEST, f"a message of {length} bytes exceeds the "
                            f"limit of {MAX_MESSAGE_BYTES}; skipped")
            continue
        body = await stdin.read(length)
        if len(body) < length:
            return  # the input ended inside a message
        try:
            protocol.receive(body)
        except Exception:  # a bug of ours, not the client's: keep serving the others
            log.exception("could not handle a message")
