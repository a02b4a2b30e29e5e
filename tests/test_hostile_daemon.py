"""Hostile and clumsy clients of the daemon's socket, and of its files: every request gets
its answer, no client disturbs another, no path is hijacked."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from daemon import protocol as p
from daemon.backends.local import LocalBackend
from daemon.client import Client, DaemonUnavailable
from daemon.server import Server
from engine import Engine
from tests.test_daemon import PROMPT, TIMEOUT, serving, wait_exit

BAD = b"\xed\xa0\x80\xff\xfe"  # a UTF-16 surrogate as UTF-8, then two bytes UTF-8 never has
MARK = "\x01MARK"  # as long as BAD: swapped for it inside an encoded frame


@pytest.fixture
async def daemon(trained_engine: Engine, tmp_path: Path) -> AsyncIterator[Server]:
    async with serving(LocalBackend(trained_engine), tmp_path / "rt") as server:
        yield server


def frame(msg: dict[str, Any]) -> bytes:
    """`msg` as a frame, with every MARK in its strings turned into invalid UTF-8."""
    body = msgspec.msgpack.encode(msg).replace(MARK.encode(), BAD)
    return len(body).to_bytes(4, "big") + body


class Raw:
    """A client that writes any bytes and reads whatever comes back, frame by frame."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = p.reply_decoder()

    @classmethod
    async def open(cls, server: Server, greet: bool = True) -> Raw:
        raw = cls(*await asyncio.open_unix_connection(str(server.socket_path)))
        if greet:
            raw.writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION)))
            assert isinstance(await raw.next(), p.Welcome)
        return raw

    async def next(self) -> p.Reply:
        body = await asyncio.wait_for(p.read_frame(self.reader), TIMEOUT)
        assert body is not None, "the daemon hung up"
        return self.decoder.decode(body)

    async def until(self, done: set[int]) -> list[p.Reply]:
        """Replies until each id in `done` has had its last one."""
        got: list[p.Reply] = []
        while done:
            reply = await self.next()
            got.append(reply)
            if isinstance(reply, p.Done | p.Error | p.StatusReply):
                done.discard(reply.id)  # type: ignore[arg-type]
        return got

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


INVALID_UTF8 = {  # 19 cases: each string field of each request, and map keys
    "op": {"op": MARK, "id": 2},
    "generate.prompt": {"op": "generate", "id": 2, "prompt": MARK},
    "generate.stop": {"op": "generate", "id": 2, "prompt": "x", "stop": [MARK]},
    "generate.priority": {"op": "generate", "id": 2, "prompt": "x", "priority": MARK},
    "complete.session": {"op": "complete", "id": 2, "session": MARK, "document": "d",
                         "prefix": "x"},
    "complete.document": {"op": "complete", "id": 2, "session": "s", "document": MARK,
                          "prefix": "x"},
    "complete.prefix": {"op": "complete", "id": 2, "session": "s", "document": "d",
                        "prefix": MARK},
    "complete.suffix": {"op": "complete", "id": 2, "session": "s", "document": "d",
                        "prefix": "x", "suffix": MARK},
    "complete.language": {"op": "complete", "id": 2, "session": "s", "document": "d",
                          "prefix": "x", "language": MARK},
    "complete.path": {"op": "complete", "id": 2, "session": "s", "document": "d",
                      "prefix": "x", "path": MARK},
    "complete.extra.path": {"op": "complete", "id": 2, "session": "s", "document": "d",
                            "prefix": "x", "extra": [{"path": MARK, "text": "t"}]},
    "complete.extra.text": {"op": "complete", "id": 2, "session": "s", "document": "d",
                            "prefix": "x", "extra": [{"path": "p", "text": MARK}]},
    "complete.stop": {"op": "complete", "id": 2, "session": "s", "document": "d",
                      "prefix": "x", "stop": ["ok", MARK]},
    "complete.key": {"op": "complete", "id": 2, "session": "s", "document": "d",
                     "prefix": "x", MARK: 1},
    "reload.model": {"op": "reload", "id": 2, "model": MARK},
    "feedback.event": {"op": "feedback", "id": 2, "request": 1, "event": MARK},
    "cancel.key": {"op": "cancel", "id": 2, MARK: "x"},
    "status.key": {"op": "status", "id": 2, MARK: 0},
    "shutdown.key": {"op": "shutdown", "id": 2, MARK: 0},
}


@pytest.mark.parametrize("case", list(INVALID_UTF8))
async def test_invalid_utf8_in_any_field_is_a_bad_request_and_the_connection_goes_on(
        daemon: Server, case: str) -> None:
    raw = await Raw.open(daemon)
    raw.writer.write(p.encode(p.Generate(id=1, prompt=PROMPT, max_tokens=24, k=0)))
    raw.writer.write(frame(INVALID_UTF8[case]))
    raw.writer.write(p.encode(p.Status(id=3)))
    got = await raw.until({1, 3})
    errors = [r for r in got if isinstance(r, p.Error)]
    assert [(e.id, e.code) for e in errors] == [(2, "bad_request")], got
    assert "utf-8" in errors[0].message.lower()
    done = [r for r in got if isinstance(r, p.Done)]  # the other request was not disturbed
    assert len(done) == 1 and done[0].finish_reason in ("stop", "length")
    await raw.close()


async def test_a_frame_that_never_comes_whole_is_an_error_not_a_hang(daemon: Server) -> None:
    """A client that says a length and sends less (here: one stray byte before a status
    frame, so that the status's own header becomes part of a 16 MiB length) gets a
    `bad_frame` error and is hung up on when the body does not follow in time; other
    clients go on."""
    daemon.frame_timeout = 0.5
    raw = await Raw.open(daemon)
    other = await Raw.open(daemon)
    raw.writer.write(b"\x01" + p.encode(p.Status(id=3)))
    error = await raw.next()
    assert isinstance(error, p.Error) and error.code == "bad_frame", error
    assert "did not come whole" in error.message
    assert await p.read_frame(raw.reader) is None  # hung up on
    other.writer.write(p.encode(p.Status(id=4)))
    assert isinstance(await other.next(), p.StatusReply)
    await raw.close()
    await other.close()


@pytest.mark.parametrize("field", ["client", "key"])
async def test_invalid_utf8_in_the_hello_is_answered_and_a_good_hello_still_works(
        daemon: Server, field: str) -> None:
    raw = await Raw.open(daemon, greet=False)
    bad = {"op": "hello", "version": p.PROTOCOL_VERSION}
    bad.update({"client": MARK} if field == "client" else {MARK: "x"})
    raw.writer.write(frame(bad))
    reply = await raw.next()
    assert isinstance(reply, p.Error) and reply.code == "bad_request"
    raw.writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION)))
    assert isinstance(await raw.next(), p.Welcome)
    raw.writer.write(p.encode(p.Status(id=4)))
    assert isinstance(await raw.next(), p.StatusReply)
    await raw.close()


def close_with_unread_data(path: Path) -> None:
    """What a killed editor does: its unread replies make the daemon's next read fail."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(TIMEOUT)
        s.connect(str(path))
        s.sendall(p.encode(p.Hello(version=p.PROTOCOL_VERSION)) + p.encode(p.Status(id=1)))
        s.recv(1, socket.MSG_PEEK)  # a reply is there, and left unread


async def wait_for(condition: Any, what: str) -> None:
    """Until `condition()` holds; checked on each turn of the loop, for at most TIMEOUT."""
    async with asyncio.timeout(TIMEOUT):
        while not condition():
            await asyncio.sleep(0.01)


async def test_clients_that_leave_with_unread_data_log_one_line_each_no_traceback(
        daemon: Server, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    for _ in range(20):
        await asyncio.to_thread(close_with_unread_data, daemon.socket_path)
    await wait_for(lambda: not daemon.connections, "the connections to end")
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    assert len([r for r in caplog.records if "went away" in r.getMessage()]) <= 20
    client = Client(daemon.socket_path, autostart=False)
    assert (await client.run(p.Generate(id=0, prompt="x", max_tokens=2))).text
    await client.close()


TEMPERATURES = [float("nan"), float("inf"), float("-inf"), 5e-324, 1e-300, -0.5, -1.0, 101.0]


@pytest.mark.parametrize("temperature", TEMPERATURES, ids=repr)
@pytest.mark.parametrize("op", ["generate", "complete"])
async def test_unusable_temperatures_are_refused(daemon: Server, op: str,
                                                 temperature: float) -> None:
    raw = await Raw.open(daemon)
    msg: dict[str, Any] = {"op": op, "id": 5, "temperature": temperature}
    msg.update({"prompt": "x"} if op == "generate" else
               {"session": "s", "document": "d", "prefix": PROMPT})
    raw.writer.write(frame(msg))
    reply = await raw.next()
    assert isinstance(reply, p.Error), reply
    assert (reply.id, reply.code) == (5, "bad_request") and "temperature" in reply.message
    with pytest.raises(ValueError, match="temperature"):  # and clients cannot even send one
        p.Generate(id=1, prompt="x", temperature=temperature)
    await raw.close()


# A daemon in its own process, as users run it.

@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "st"))
    return dict(os.environ)


SERVE = ["--k-max", "2", "--max-seq-len", "512", "--no-watch"]


async def test_the_log_is_rotated_and_every_file_is_private(
        trained_dir: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AHEAD_LOG_MAX_BYTES", "1024")
    old = os.umask(0o022)  # what most users have: files are 0644 unless made private
    try:
        client = Client(serve_args=["--model", str(trained_dir), *SERVE])
        welcome = await client.connect()
    finally:
        os.umask(old)
    await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=8))
    sock = Path(env["AHEAD_RUNTIME_DIR"]) / "daemon.sock"
    for _ in range(60):  # each logs a line: several times what one file may hold
        await asyncio.to_thread(close_with_unread_data, sock)
    await client.shutdown()
    await client.close()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)
    st = Path(env["AHEAD_STATE_DIR"])
    logs = sorted(st.glob("daemon.log*"))
    assert [f.name for f in logs] == ["daemon.log", "daemon.log.1", "daemon.log.2"]
    assert all(f.stat().st_size <= 1024 + 200 for f in logs)
    assert not any("Traceback" in f.read_text() for f in logs)
    written = [*logs, st / "stats.json", *(st / "policy").glob("*.json")]
    assert len(written) == 5
    assert {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in written} == \
        {f.name: "0o600" for f in written}


async def test_a_stopped_daemon_is_a_clear_error_not_a_wait_forever(
        trained_dir: Path, env: dict[str, str]) -> None:
    client = Client(serve_args=["--model", str(trained_dir), *SERVE], timeout=1.0)
    welcome = await client.connect()
    stream = client.stream(p.Generate(id=0, prompt="x", max_tokens=400, k=0))
    assert isinstance(await anext(stream), p.Chunk)
    os.kill(welcome.pid, signal.SIGSTOP)
    try:
        with pytest.raises(DaemonUnavailable, match="stopped or hung"):
            async with asyncio.timeout(TIMEOUT):  # today: forever
                async for _ in stream:
                    pass
        other = Client(autostart=False, timeout=1.0)  # a new client: the greeting times out
        with pytest.raises(DaemonUnavailable, match="does not answer"):
            async with asyncio.timeout(TIMEOUT):
                await other.connect()
        await other.close()
    finally:
        os.kill(welcome.pid, signal.SIGCONT)
    # Woken up, it serves again.
    assert (await client.run(p.Generate(id=0, prompt="x", max_tokens=2))).text
    await client.shutdown()
    await client.close()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)


def ahead(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "clients.cli", *args], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def bare_env(tmp_path: Path) -> dict[str, str]:
    """No AHEAD_RUNTIME_DIR, AHEAD_STATE_DIR nor XDG_RUNTIME_DIR: the default paths, in a
    temp dir and a state home of this test's own."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("AHEAD_RUNTIME_DIR", "AHEAD_STATE_DIR", "XDG_RUNTIME_DIR")}
    (tmp_path / "tmp").mkdir()
    return {**env, "TMPDIR": str(tmp_path / "tmp"), "XDG_STATE_HOME": str(tmp_path / "state")}


def planted(link: Path, target: Path) -> None:
    """Another user's trap: a symlink where ahead's directory goes, to a directory the
    victim can use (ours here, which is the hard case: ownership alone does not tell)."""
    target.mkdir(mode=0o755)
    os.chmod(target, 0o755)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(target)


def test_a_symlink_at_the_default_runtime_path_is_refused(tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    link = tmp_path / "tmp" / f"ahead-{os.getuid()}"
    planted(link, tmp_path / "trap")
    proc = ahead("status", env=env)
    assert proc.returncode == 1 and "symbolic link" in proc.stderr, proc.stderr
    assert stat.S_IMODE((tmp_path / "trap").stat().st_mode) == 0o755  # not chmodded
    assert not list((tmp_path / "trap").iterdir())
    link.unlink()  # without the trap, the same default path works
    proc = ahead("status", env=env)
    assert proc.returncode == 3 and "no daemon running" in proc.stderr
    assert stat.S_IMODE(link.lstat().st_mode) == 0o700 and link.is_dir()


def test_a_symlink_at_the_default_state_path_is_refused(trained_dir: Path,
                                                        tmp_path: Path) -> None:
    env = bare_env(tmp_path)
    planted(tmp_path / "state" / "ahead", tmp_path / "trap")
    proc = ahead("serve", "--model", str(trained_dir), *SERVE, env=env)
    assert proc.returncode == 1 and "symbolic link" in proc.stderr, proc.stderr
    assert stat.S_IMODE((tmp_path / "trap").stat().st_mode) == 0o755
    assert not list((tmp_path / "trap").iterdir())
