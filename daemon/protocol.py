"""The wire protocol between `ahead serve` and its clients (editors' `ahead lsp`, the CLI, hooks).

Each frame is a 4-byte big-endian length, then a msgpack body: one of the tagged `msgspec`
structs below (`op` names the type). The first frame a client sends is `Hello`; the daemon
answers `Welcome`, or an `Error` with code `version` when the protocol versions differ.
A request carries a client-chosen `id`; its answer streams as `Chunk`s and ends with exactly
one `Done` or `Error` of that id. Frames over MAX_FRAME_BYTES are refused. This module imports
no torch: clients load it in well under a second.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 4  # 2: RequestStats.hop_ms; 3: Done's scores, Complete.judge;
#                      4: the "prefetch" priority, RequestStats.prefetched
MAX_FRAME_BYTES = 16 * 1024 * 1024
HEADER_BYTES = 4
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0

# "prefetch": the completion that would follow a shown suggestion once accepted, computed
# while nothing else waits (daemon/requests.py); lowest of all.
Priority = Literal["editor", "cli", "batch", "prefetch"]
FeedbackEvent = Literal["shown", "accepted", "partial", "dismissed"]


class FrameError(Exception):
    """A frame that cannot be read; the connection is not usable after it."""


def check_sampling(temperature: float, top_p: float = 1.0) -> None:
    """The engine's rule (`engine.decode.sampling.Sampling`), checked at the wire so a bad
    value is answered as a bad request at once: greedy (0), or a temperature the softmax
    can take. NaN fails every comparison, so it is refused along with inf, subnormals and
    negative values."""
    if not (temperature == 0 or MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE):
        raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
                         f"{MAX_TEMPERATURE}], got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


class _Msg(msgspec.Struct, tag_field="op", forbid_unknown_fields=True, omit_defaults=True):
    pass


# Client to daemon.

class Hello(_Msg, tag="hello"):
    version: int
    client: str = "unknown"


class ContextChunk(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    text: str


class Complete(_Msg, tag="complete"):
    """Fill in the middle at the cursor of a document (text, not tokens: the daemon builds
    the model's own prompt)."""

    id: int
    session: str
    document: str
    prefix: str
    suffix: str = ""
    extra: list[ContextChunk] = []
    language: str = ""
    path: str = ""
    max_tokens: int = 64
    multiline: bool = True
    budget_ms: int | None = None
    temperature: float = 0.0
    stop: list[str] = []  # where the answer ends, besides the model's end tokens
    priority: Priority = "editor"
    # The daemon's quality rules decide whether there is an answer: one below its
    # `min_confidence`, an echo of the text around the cursor or a loop comes back empty,
    # with the reason as the finish reason (engine/decode/quality.py). False: the answer as
    # it is, with its scores, for a client that judges it itself.
    judge: bool = True
    stop_loops: bool = True  # the local engine ends the answer where it loops (quality.py)
    # The answer ends before the first line after its first that is indented less than this
    # many characters (0: never): the end of the block being written (engine/decode/indent.py).
    indent_floor: int = 0

    def __post_init__(self) -> None:  # msgspec answers a ValueError here as invalid
        check_sampling(self.temperature)
        if self.indent_floor < 0:
            raise ValueError(f"indent_floor must be >= 0, got {self.indent_floor}")


class Generate(_Msg, tag="generate"):
    id: int
    prompt: str
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] = []
    k: int | None = None
    speculative: bool = True
    seed: int | None = None
    budget_ms: int | None = None
    priority: Priority = "cli"
    stop_loops: bool = True  # the local engine ends the answer where it loops (quality.py)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_p)


class Cancel(_Msg, tag="cancel"):
    id: int


class Status(_Msg, tag="status"):
    id: int


class Reload(_Msg, tag="reload"):
    id: int
    model: str | None = None


class Shutdown(_Msg, tag="shutdown"):
    id: int


class Feedback(_Msg, tag="feedback"):
    """What became of a shown suggestion, for the daemon's stats."""

    id: int
    request: int
    event: FeedbackEvent
    chars: int = 0
    language: str = ""  # the document's language id


# Daemon to client.

class Welcome(_Msg, tag="welcome"):
    version: int
    model: str
    pid: int


class Chunk(_Msg, tag="chunk"):
    id: int
    text: str


class RequestStats(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    queue_ms: float = 0.0
    engine_ms: float = 0.0  # the model's time: engine steps, or a remote server's own time
    total_ms: float = 0.0
    hop_ms: float = 0.0  # a remote backend: its round trip beyond the server's own time
    typed_through: bool = False
    prefetched: bool = False  # answered from a prefetch (made before it was asked for)
    k_histogram: dict[int, int] = {}


class Done(_Msg, tag="done"):
    id: int
    text: str
    finish_reason: str  # "stop", "length", "deadline", "repetition"; for a judged
    #                     completion that came back empty: "low_confidence", "echo"
    stats: RequestStats = msgspec.field(default_factory=RequestStats)
    # Of the answer's tokens under the model (None: a backend that gives none): the mean
    # and the minimum log-probability; exp(mean) is the confidence `min_confidence` is on.
    mean_logprob: float | None = None
    min_logprob: float | None = None


class Error(_Msg, tag="error"):
    id: int | None
    code: str  # "version", "bad_frame", "bad_request", "cancelled", "unavailable" (a remote
    #            backend's server cannot be reached), "internal"...
    message: str


class Progress(_Msg, tag="progress"):
    message: str
    fraction: float | None = None


class StatusReply(_Msg, tag="status_reply"):
    id: int
    info: dict[str, Any]


Request = Hello | Complete | Generate | Cancel | Status | Reload | Shutdown | Feedback
Reply = Welcome | Chunk | Done | Error | Progress | StatusReply

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Request | Reply) -> bytes:
    """One frame: the length, then the body."""
    body = _encoder.encode(msg)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return len(body).to_bytes(HEADER_BYTES, "big") + body


def request_decoder() -> msgspec.msgpack.Decoder[Request]:
    """A decoder of client frames; the server makes one per connection."""
    return msgspec.msgpack.Decoder(Request)


def reply_decoder() -> msgspec.msgpack.Decoder[Reply]:
    return msgspec.msgpack.Decoder(Reply)


class _Addressed(msgspec.Struct):
    id: int | None = None


def request_id(body: bytes) -> int | None:
    """The id of a request that cannot be decoded, when its frame still says one, so the
    error reaches the request that waits for it (the other fields are not looked at)."""
    try:
        return msgspec.msgpack.decode(body, type=_Addressed).id
    except (msgspec.DecodeError, UnicodeDecodeError):
        return None


def _length(header: bytes, max_bytes: int) -> int:
    n = int.from_bytes(header, "big")
    if n > max_bytes:
        raise FrameError(f"frame of {n} bytes exceeds the limit of {max_bytes}")
    return n


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES,
                     body_timeout: float | None = None) -> bytes | None:
    """The next frame's body; None at a clean end of stream (between frames). Once its
    header has come, the body must follow within `body_timeout` seconds: a peer that says a
    length and sends less would otherwise hold the reader forever."""
    try:
        header = await reader.readexactly(HEADER_BYTES)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise FrameError("connection closed inside a frame header") from None
    n = _length(header, max_bytes)
    try:
        async with asyncio.timeout(body_timeout):
            return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise FrameError(f"connection closed after {len(e.partial)} of {n} bytes") from None
    except TimeoutError:
        raise FrameError(f"a frame of {n} bytes did not come whole within "
                         f"{body_timeout:g} s") from None


def read_frame_sync(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> bytes | None:
    """Blocking `read_frame` for short-lived clients."""
    header = _recv_exactly(sock, HEADER_BYTES, allow_eof=True)
    if header is None:
        return None
    body = _recv_exactly(sock, _length(header, max_bytes), allow_eof=False)
    assert body is not None
    return body


def _recv_exactly(sock: socket.socket, n: int, *, allow_eof: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            if allow_eof and not buf:
                return None
            raise FrameError(f"connection closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)
