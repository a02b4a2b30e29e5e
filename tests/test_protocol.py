"""The wire protocol: round trips, framing limits, and hostile bytes."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon import protocol as p

REQUESTS = [
    p.Hello(version=p.PROTOCOL_VERSION, client="test"),
    p.Complete(id=1, session="s", document="file:///a.py", prefix="def f(", suffix=")\n",
               extra=[p.ContextChunk(path="b.py", text="x = 1\n")], language="python",
               budget_ms=200),
    p.Generate(id=2, prompt="def fib(n):", stop=["\n\n"], k=3),
    p.Cancel(id=1), p.Status(id=3), p.Reload(id=4, model="/m"), p.Shutdown(id=5),
    p.Feedback(id=6, request=1, event="accepted", chars=12),
]
REPLIES = [
    p.Welcome(version=1, model="m", pid=1), p.Chunk(id=1, text="é🎉"),
    p.Done(id=1, text="x", finish_reason="stop",
           stats=p.RequestStats(tokens=3, k_histogram={0: 1, 3: 2})),
    p.Error(id=None, code="bad_frame", message="no"), p.Progress(message="loading", fraction=0.5),
    p.StatusReply(id=3, info={"model": "m", "latency_ms": {"p50": 1.0}}),
]


def feed(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


@pytest.mark.parametrize("msg", REQUESTS)
async def test_requests_round_trip(msg: p.Request) -> None:
    body = await p.read_frame(feed(p.encode(msg)))
    assert body is not None
    assert p.request_decoder().decode(body) == msg


@pytest.mark.parametrize("msg", REPLIES)
def test_replies_round_trip_through_a_socket(msg: p.Reply) -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(p.encode(msg) * 2)
        a.shutdown(socket.SHUT_WR)
        dec = p.reply_decoder()
        assert [dec.decode(p.read_frame_sync(b)) for _ in range(2)] == [msg, msg]
        assert p.read_frame_sync(b) is None


async def test_clean_end_of_stream_is_none() -> None:
    assert await p.read_frame(feed(b"")) is None


async def test_oversized_length_is_refused_before_reading() -> None:
    header = (p.MAX_FRAME_BYTES + 1).to_bytes(4, "big")
    with pytest.raises(p.FrameError, match="exceeds"):
        await p.read_frame(feed(header, eof=False))


@pytest.mark.parametrize("cut", [1, 3, 5, 20])
async def test_a_frame_cut_off_midway_is_a_frame_error(cut: int) -> None:
    data = p.encode(REQUESTS[1])
    with pytest.raises(p.FrameError, match="closed"):
        await p.read_frame(feed(data[:cut]))


def test_unknown_op_and_wrong_types_are_validation_errors() -> None:
    dec = p.request_decoder()
    for raw in ({"op": "explode", "id": 1}, {"op": "cancel", "id": "one"},
                {"op": "complete", "id": 1}, {"op": "cancel", "id": 1, "extra": True}):
        with pytest.raises(msgspec.ValidationError):
            dec.decode(msgspec.msgpack.encode(raw))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_garbage_never_raises_anything_but_decode_errors(data: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError):  # ValidationError is a DecodeError
        p.request_decoder().decode(data)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_garbage_frames_read_or_fail_with_frame_error(data: bytes) -> None:
    async def read() -> None:
        reader = feed(data)
        while True:
            try:
                if await p.read_frame(reader, max_bytes=1024) is None:
                    return
            except p.FrameError:
                return

    asyncio.run(read())
