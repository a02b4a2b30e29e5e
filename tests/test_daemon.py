"""A real daemon on a temporary socket: requests, hostile input, faults and lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
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
from daemon.client import Client
from daemon.instance import InstanceLock
from daemon.scheduler import Backend
from daemon.server import Server
from engine import Engine
from engine.decode import quality

TIMEOUT = 30


@contextlib.asynccontextmanager
async def serving(backend: Backend, rt: Path, **kw: Any) -> AsyncIterator[Server]:
    """A daemon in this process on a private socket in `rt` (`kw`: more for `Server`)."""
    rt.mkdir(mode=0o700)
    server = Server(backend, rt / "daemon.sock", InstanceLock(rt / "daemon.lock"),
                    model_name="tiny", **kw)
    ready = asyncio.Event()
    task = asyncio.create_task(server.serve(on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), TIMEOUT)
    yield server
    server.stop()
    await asyncio.wait_for(task, TIMEOUT)
    assert not server.socket_path.exists()


@pytest.fixture
async def daemon(trained_engine: Engine, tmp_path: Path) -> AsyncIterator[Server]:
    async with serving(LocalBackend(trained_engine), tmp_path / "rt") as server:
        yield server


def client_for(server: Server) -> Client:
    return Client(server.socket_path, autostart=False)


async def raw(server: Server) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(server.socket_path))


async def replies(reader: asyncio.StreamReader) -> list[p.Reply]:
    out, dec = [], p.reply_decoder()
    while (body := await asyncio.wait_for(p.read_frame(reader), TIMEOUT)) is not None:
        out.append(dec.decode(body))
    return out


async def hello(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> None:
    writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION)))
    body = await asyncio.wait_for(p.read_frame(reader), TIMEOUT)
    assert body is not None and isinstance(p.reply_decoder().decode(body), p.Welcome)


async def hang_up(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


PROMPT = "def add(a, b):\n    return"


async def test_generate_and_complete(daemon: Server) -> None:
    client = client_for(daemon)
    done = await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=12, stop_loops=False))
    assert done.finish_reason in ("length", "stop") and done.stats.tokens > 0
    chunks = [r async for r in client.stream(p.Complete(
        id=0, session="s", document="a.py", prefix=PROMPT, suffix="\n", max_tokens=12))]
    assert isinstance(chunks[-1], p.Done)
    streamed = "".join(c.text for c in chunks if isinstance(c, p.Chunk))
    assert streamed.startswith(chunks[-1].text) or chunks[-1].text.startswith(streamed)
    await client.close()


async def test_judged_completions_below_the_threshold_come_back_empty(daemon: Server) -> None:
    """The Done frame carries the answer's scores; a completion whose confidence is below
    the daemon's `min_confidence` comes back empty with the reason, one above it as it is."""
    client = client_for(daemon)
    judged_on_confidence = 0
    for n, prefix in enumerate([PROMPT, "import os\n\n", "class A:\n    def f(self):\n"]):
        req = {"session": "s", "prefix": prefix, "suffix": "\n", "max_tokens": 12}
        free = await client.run(p.Complete(id=0, document=f"free{n}.py", judge=False, **req))
        assert free.mean_logprob is not None and free.min_logprob is not None
        assert free.min_logprob <= free.mean_logprob <= 0
        conf = math.exp(free.mean_logprob)
        scores = quality.Confidence(free.mean_logprob, free.min_logprob, free.stats.tokens)
        if quality.verdict(free.text, free.finish_reason, scores, 0.0, prefix=prefix,
                           suffix="\n") is not None:
            continue  # a loop or an echo: withheld whatever the threshold
        judged_on_confidence += 1
        daemon.requests.min_confidence = min(conf + 0.01, 0.999)
        held = await client.run(p.Complete(id=0, document=f"held{n}.py", **req))
        assert (held.text, held.finish_reason) == ("", "low_confidence")
        assert held.mean_logprob == pytest.approx(free.mean_logprob)
        daemon.requests.min_confidence = max(conf - 0.01, 0.0)
        shown = await client.run(p.Complete(id=0, document=f"shown{n}.py", **req))
        assert (shown.text, shown.finish_reason) == (free.text, free.finish_reason)
    assert judged_on_confidence
    counts = (await client.status())["counts"]  # what editors were not shown, and why
    assert {k: v for k, v in counts.items() if k.startswith("withheld_")} == \
        {"withheld_low_confidence": judged_on_confidence}
    daemon.requests.min_confidence = 0.0
    await client.close()


async def test_typing_through_a_suggestion_costs_no_model_work(daemon: Server) -> None:
    client = client_for(daemon)
    first = await client.run(p.Complete(id=0, session="s", document="b.py", prefix=PROMPT,
                                        suffix="\n", max_tokens=16))
    steps = daemon.scheduler.counters.steps
    for typed in range(1, min(6, len(first.text))):
        again = await client.run(p.Complete(id=0, session="s", document="b.py",
                                            prefix=PROMPT + first.text[:typed], suffix="\n",
                                            max_tokens=16))
        assert again.text == first.text[typed:] and again.stats.typed_through
    assert daemon.scheduler.counters.steps == steps
    # The client's window may drop a line at its start as the cursor moves on.
    cut = PROMPT.index("\n") + 1
    shifted = await client.run(p.Complete(id=0, session="s", document="b.py",
                                          prefix=PROMPT[cut:] + first.text[:2], suffix="\n",
                                          max_tokens=16))
    assert shifted.stats.typed_through and shifted.text == first.text[2:]
    # Text that is not the suggestion is new work.
    other = await client.run(p.Complete(id=0, session="s", document="b.py",
                                        prefix=PROMPT + "#", suffix="\n", max_tokens=4))
    assert not other.stats.typed_through or first.text.startswith("#")
    await client.close()


async def test_with_the_bundled_model_typing_prefills_only_what_was_typed(
        model_dir: Path, tmp_path: Path) -> None:
    """The bundled model takes its FIM prompts suffix first (SPM): a keystroke appends to the
    prompt, so the KV cache keeps the suffix and the daemon runs only the new tokens, where
    prefix-suffix-middle would run the whole suffix again."""
    engine = Engine.load(model_dir, max_seq_len=1024, k_max=2, slots=1)
    assert engine.tokenizer.fim_order == "spm"
    source = Path(json.__file__).read_text(encoding="utf-8")
    cursor = source.index("def dumps(")
    prefix, suffix = source[cursor - 1500:cursor], source[cursor:cursor + 1500]
    async with serving(LocalBackend(engine), tmp_path / "rt") as server:
        client = client_for(server)
        first = await client.run(p.Complete(id=0, session="s", document="j.py", prefix=prefix,
                                            suffix=suffix, max_tokens=2))
        assert first.stats.prefill_tokens > 300  # the suffix is in the prompt
        typed = ""
        for ch in "def dum":
            typed += ch
            done = await client.run(p.Complete(id=0, session="s", document="j.py",
                                               prefix=prefix + typed, suffix=suffix,
                                               max_tokens=2))
            assert done.stats.typed_through or done.stats.prefill_tokens <= 4
            assert done.stats.typed_through or done.stats.reused_tokens > 300
        await client.close()


async def test_a_newer_request_supersedes_the_running_one(daemon: Server) -> None:
    client = client_for(daemon)
    old = client.stream(p.Complete(id=0, session="s", document="c.py", prefix="import os\n",
                                   max_tokens=200, multiline=True, stop_loops=False))
    assert isinstance(await anext(old), p.Chunk)  # the first request is running
    new = await client.run(p.Complete(id=0, session="s", document="c.py",
                                      prefix="import sys\n", max_tokens=8, stop_loops=False))
    assert new.finish_reason in ("length", "stop")
    rest = [r async for r in old]
    assert isinstance(rest[-1], p.Error) and "superseded" in rest[-1].message
    assert daemon.scheduler.counters.superseded == 1
    assert daemon.scheduler.counters.stale_steps <= 1  # stale work stops within one step
    await client.close()


async def test_status_reports_counters(daemon: Server) -> None:
    client = client_for(daemon)
    await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=12, k=2, stop_loops=False))
    await client.run(p.Complete(id=0, session="s", document="d.py", prefix=PROMPT, max_tokens=4))
    info = await client.status()
    assert info["model"] == "tiny" and info["counts"]["requests_completed"] >= 2
    assert info["counts"]["completions"] == 1 and info["latency_ms"]["n"] == 2
    assert info["step"] == "eager"  # how the step runs: the CPU default
    assert info["exact"] == "off (auto: fp32 on the CPU, where it costs)"
    assert info["load_s"]["weights"] > 0 and "costs" in info["load_s"]
    assert set(info["acceptance_by_position"]) == {"code", "comment", "string"}
    # which source drafted, and how often it was right
    assert info["drafts_by_source"] and set(info["drafts_by_source"]) <= {"mtp", "context"}
    assert all(0 <= c["accepted"] <= c["drafted"] and c["steps"] > 0
               for c in info["drafts_by_source"].values())
    await client.close()


async def test_editor_requests_overtake_batch_work(daemon: Server) -> None:
    client = client_for(daemon)
    batch = client.stream(p.Generate(id=0, prompt=PROMPT, max_tokens=300, k=0,
                                     priority="batch", stop_loops=False))
    assert isinstance(await anext(batch), p.Chunk)  # the batch job is running
    editor = await client.run(p.Complete(id=0, session="s", document="e.py", prefix=PROMPT,
                                         max_tokens=6, stop_loops=False))
    assert editor.finish_reason in ("length", "stop")
    rest = [r async for r in batch]  # the batch job resumes and finishes afterwards
    assert isinstance(rest[-1], p.Done) and rest[-1].stats.tokens == 300
    await client.close()


async def test_concurrent_editors_share_each_step(daemon: Server) -> None:
    """Three editors asking at once are stepped as one batch (not one after another), and
    each gets the completion it gets on an idle daemon."""
    prefixes = [PROMPT, "import os\n\n", "class A:\n    def f(self):\n        "]

    def request(i: int, doc: str) -> p.Complete:
        return p.Complete(id=0, session=f"ed{i}", document=doc, prefix=prefixes[i],
                          max_tokens=40, multiline=True)

    clients = [client_for(daemon) for _ in prefixes]
    together = await asyncio.wait_for(asyncio.gather(
        *(c.run(request(i, "g.py")) for i, c in enumerate(clients))), TIMEOUT)
    counts = daemon.scheduler.counters
    assert counts.batched_steps > 0 and counts.batched_jobs >= 2 * counts.batched_steps
    alone = [await clients[0].run(request(i, "h.py")) for i in range(len(prefixes))]
    assert [d.text for d in together] == [d.text for d in alone]
    info = await clients[0].status()
    assert info["counts"]["batched_steps"] == counts.batched_steps
    for c in clients:
        await c.close()


async def test_a_time_budget_returns_the_text_so_far(daemon: Server) -> None:
    client = client_for(daemon)
    done = await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=400, k=0, budget_ms=30,
                                       stop_loops=False))
    assert done.finish_reason == "deadline" and 0 < done.stats.tokens < 400 and done.text
    # A multi-line suggestion is cut back to whole lines.
    done = await client.run(p.Complete(id=0, session="s", document="f.py", prefix=PROMPT,
                                       max_tokens=400, budget_ms=30, multiline=True,
                                       stop_loops=False))
    assert done.finish_reason == "deadline"
    assert done.text == "" or done.text.endswith("\n")
    await client.close()


@pytest.mark.parametrize("payload", [
    b"\x00\x00\x00\x05garbage-and-more",  # a body that is not msgpack
    b"\xff\xff\xff\xff",  # a length far over the limit
    b"\x00\x00\x01\x00abc",  # a frame cut off midway, then the client leaves
    p.encode(p.Cancel(id=1))[:-1] + b"\xc1",  # msgpack's one invalid byte
])
async def test_hostile_bytes_get_an_error_or_a_clean_close(daemon: Server, payload: bytes) -> None:
    reader, writer = await raw(daemon)
    await hello(writer, reader)
    writer.write(payload)
    writer.write_eof()
    got = await replies(reader)
    assert all(isinstance(r, p.Error) and r.code in ("bad_frame", "bad_request") for r in got)
    await hang_up(writer)
    # The daemon still serves everybody else.
    client = client_for(daemon)
    assert (await client.run(p.Generate(id=0, prompt="x", max_tokens=2))).text
    await client.close()


@pytest.mark.parametrize("raw_msg", [
    {"op": "explode", "id": 1},
    {"op": "generate", "id": "one", "prompt": "x"},
    {"op": "complete", "id": 1},
])
async def test_invalid_messages_get_a_validation_error(daemon: Server, raw_msg: dict) -> None:
    reader, writer = await raw(daemon)
    await hello(writer, reader)
    body = msgspec.msgpack.encode(raw_msg)
    writer.write(len(body).to_bytes(4, "big") + body)
    writer.write(p.encode(p.Status(id=9)))  # the connection stays usable
    writer.write_eof()
    got = await replies(reader)
    assert isinstance(got[0], p.Error) and got[0].code == "bad_request"
    assert isinstance(got[1], p.StatusReply)
    await hang_up(writer)


async def test_the_first_frame_must_be_a_matching_hello(daemon: Server) -> None:
    reader, writer = await raw(daemon)
    writer.write(p.encode(p.Hello(version=p.PROTOCOL_VERSION + 1)))
    writer.write(p.encode(p.Status(id=1)))
    writer.write_eof()
    got = await replies(reader)
    assert [type(r) for r in got] == [p.Error, p.Error]
    assert got[0].code == "version" and "not supported" in got[0].message
    await hang_up(writer)


async def test_a_client_that_leaves_mid_generation_stops_its_work(daemon: Server) -> None:
    reader, writer = await raw(daemon)
    await hello(writer, reader)
    writer.write(p.encode(p.Generate(id=1, prompt=PROMPT, max_tokens=400, k=0)))
    body = await asyncio.wait_for(p.read_frame(reader), TIMEOUT)  # the first chunk
    assert isinstance(p.reply_decoder().decode(body), p.Chunk)
    await hang_up(writer)
    assert await asyncio.to_thread(daemon.scheduler.wait_idle, TIMEOUT)
    counters = daemon.scheduler.counters
    steps = counters.steps
    assert counters.cancelled == 1
    client = client_for(daemon)
    await client.run(p.Generate(id=0, prompt="x", max_tokens=1))
    await client.close()
    assert counters.steps - steps <= 2  # at most one stray step, plus the new request's


async def test_socket_and_directory_are_private(daemon: Server) -> None:
    assert stat.S_IMODE(daemon.socket_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(daemon.socket_path.parent.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="only root can become another user")
async def test_another_user_is_refused(daemon: Server) -> None:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child becomes nobody and tries the socket; nothing else
        os.close(read_end)
        try:
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(str(daemon.socket_path))
            outcome = b"answered:" + s.recv(200)
        except OSError as e:
            outcome = f"refused:{e.errno}".encode()
        os.write(write_end, outcome)
        os._exit(0)
    os.close(write_end)
    await asyncio.to_thread(os.waitpid, pid, 0)
    with os.fdopen(read_end, "rb") as f:
        outcome = f.read()
    assert outcome.startswith(b"refused:") or b"forbidden" in outcome, outcome


def test_peer_uid_is_ours() -> None:
    from daemon.instance import peer_uid

    a, b = socket.socketpair()
    with a, b:
        assert peer_uid(a) == os.getuid()


# A daemon in its own process, as users run it.

def serve_cmd(model: Path) -> list[str]:
    return [sys.executable, "-m", "clients.cli", "serve", "--model", str(model),
            "--k-max", "4", "--max-seq-len", "512"]


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("AHEAD_RUNTIME_DIR", str(tmp_path / "rt"))
    monkeypatch.setenv("AHEAD_STATE_DIR", str(tmp_path / "st"))
    return dict(os.environ)


async def test_autostart_kill9_restart_and_single_instance(trained_dir: Path,
                                                           env: dict[str, str]) -> None:
    args = ["--model", str(trained_dir), "--k-max", "4", "--max-seq-len", "512"]
    client = Client(serve_args=args)
    welcome = await client.connect()
    assert (await client.run(p.Generate(id=0, prompt="x", max_tokens=3))).text
    # A second daemon refuses to start, with a clear message.
    second = await asyncio.to_thread(subprocess.run, serve_cmd(trained_dir), env=env,
                                     capture_output=True, text=True, timeout=TIMEOUT)
    assert second.returncode == 1
    assert "another ahead daemon is running" in second.stderr
    # kill -9: the next request restarts the daemon and succeeds.
    os.kill(welcome.pid, signal.SIGKILL)
    done = await client.run(p.Generate(id=0, prompt="x", max_tokens=3))
    assert done.text and client.welcome is not None and client.welcome.pid != welcome.pid
    await client.shutdown()
    await client.close()


async def test_a_client_waits_for_a_daemon_that_is_still_loading(
        trained_engine: Engine, trained_dir: Path, env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon holds the single-instance lock from the start but listens only once its
    model is loaded (seconds, a minute when it compiles). A client that comes meanwhile finds
    no socket, starts a daemon that says another is running, and then waits for that one,
    instead of failing with "does not answer"."""
    from daemon import client as client_module
    from daemon import paths

    lock = InstanceLock(paths.lock_path())  # as `ahead serve` takes it, before its model
    lock.acquire()
    tried = asyncio.Event()
    loop = asyncio.get_running_loop()
    real_start = client_module.start_daemon

    def start_daemon(args: list[str], timeout: float) -> bool:  # the real one, observed
        ours = real_start(args, timeout)
        loop.call_soon_threadsafe(tried.set)
        return ours

    monkeypatch.setattr(client_module, "start_daemon", start_daemon)
    client = Client(serve_args=["--model", str(trained_dir)])
    connecting = asyncio.create_task(client.connect())
    await asyncio.wait_for(tried.wait(), TIMEOUT)  # the new daemon found the lock taken
    assert not connecting.done()  # ... and the client waits
    server = Server(LocalBackend(trained_engine), paths.socket_path(), lock, model_name="late")
    serving_task = asyncio.create_task(server.serve())
    welcome = await asyncio.wait_for(connecting, TIMEOUT)
    assert welcome.pid == os.getpid()  # the daemon that was loading, not a second one
    await client.close()
    server.stop()
    await asyncio.wait_for(serving_task, TIMEOUT)


def wait_exit(pid: int, timeout: float) -> bool:
    """Wait for a process to end without polling: a pidfd becomes readable when it does."""
    import select

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


async def test_idle_exit_saves_stats_and_removes_the_socket(trained_dir: Path,
                                                            env: dict[str, str]) -> None:
    client = Client(serve_args=["--model", str(trained_dir), "--k-max", "2",
                                "--max-seq-len", "512", "--idle-timeout", "1"])
    welcome = await client.connect()
    await client.run(p.Generate(id=0, prompt="x", max_tokens=3))
    await client.close()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)
    rt, st = Path(env["AHEAD_RUNTIME_DIR"]), Path(env["AHEAD_STATE_DIR"])
    assert not (rt / "daemon.sock").exists()
    saved = json.loads((st / "stats.json").read_text())
    assert saved["lifetime"]["requests_completed"] == 1
    assert "idle" in (st / "daemon.log").read_text()


async def test_what_the_k_policy_learned_survives_a_restart(trained_dir: Path,
                                                          env: dict[str, str],
                                                          tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    args = ["--model", str(model), "--k-max", "4", "--max-seq-len", "512", "--no-watch",
            "--threads", "1"]
    client = Client(serve_args=args)
    welcome = await client.connect()
    status = await client.status()
    assert status["policy_restored"] is False  # nothing learned yet
    assert status["model_threads"] == 1
    for i in range(6):  # adaptive K: the policy learns acceptance from these steps
        await client.run(p.Generate(id=i, prompt=PROMPT, max_tokens=24))
    learned = (await client.status())["acceptance_by_position"]
    await client.shutdown()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)
    saved = list((Path(env["AHEAD_STATE_DIR"]) / "policy").glob("*.json"))
    assert len(saved) == 1

    # The next daemon for this model starts where the last one stopped.
    welcome = await client.connect()
    status = await client.status()
    assert status["policy_restored"] is True
    assert status["acceptance_by_position"] == learned
    await client.shutdown()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)

    # A changed checkpoint is another model: it starts afresh.
    weights = next(model.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    welcome = await client.connect()
    assert (await client.status())["policy_restored"] is False
    await client.shutdown()
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)
    await client.close()


async def test_sigterm_ends_in_flight_work_and_exits(trained_dir: Path,
                                                     env: dict[str, str]) -> None:
    client = Client(serve_args=["--model", str(trained_dir), "--k-max", "2",
                                "--max-seq-len", "512"])
    welcome = await client.connect()
    stream = client.stream(p.Generate(id=0, prompt="x", max_tokens=400, k=0))
    assert isinstance(await anext(stream), p.Chunk)
    os.kill(welcome.pid, signal.SIGTERM)
    rest = [r async for r in stream]
    assert isinstance(rest[-1], p.Error) and "shutdown" in rest[-1].message
    assert await asyncio.to_thread(wait_exit, welcome.pid, TIMEOUT)
    assert not (Path(env["AHEAD_RUNTIME_DIR"]) / "daemon.sock").exists()
    await client.close()


async def test_hot_swap_keeps_serving_through_a_corrupt_checkpoint(
        trained_engine: Engine, trained_dir: Path, random_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(trained_dir, model)
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    backend = LocalBackend(trained_engine, model_dir=model,
                           loader=lambda path: Engine.load(path, max_seq_len=256, k_max=2))
    server = Server(backend, rt / "daemon.sock", InstanceLock(rt / "daemon.lock"),
                    model_name=str(model), watch_debounce_ms=100)
    ready = asyncio.Event()
    task = asyncio.create_task(server.serve(on_ready=ready.set))
    await asyncio.wait_for(ready.wait(), TIMEOUT)
    assert server.reloader is not None
    client = client_for(server)
    before = await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=8))
    # A truncated checkpoint lands in the watched directory: reported, old model serves on.
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = await asyncio.wait_for(server.reloader.results.get(), TIMEOUT)
    assert result.startswith("error") and "model.safetensors" in result
    again = await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=8))
    assert again.text == before.text
    info = await client.status()
    assert info["reloads"] == 0 and "model.safetensors" in info["last_reload_error"]
    # A good checkpoint (another model) is loaded beside the old one and swapped in.
    for f in random_dir.iterdir():
        shutil.copy(f, model / f.name)
    while (result := await asyncio.wait_for(server.reloader.results.get(), TIMEOUT)) != "ok":
        pass  # a copy of several files may be seen half done first
    swapped = await client.run(p.Generate(id=0, prompt=PROMPT, max_tokens=8))
    assert backend.engine is not trained_engine  # swapped before this request
    assert swapped.text != before.text
    await client.close()
    server.stop()
    await asyncio.wait_for(task, TIMEOUT)


async def test_sync_client_streams_and_cancels_when_the_caller_stops(daemon: Server) -> None:
    from daemon.client import SyncClient

    def use() -> tuple[str, str]:
        with SyncClient(socket_path=daemon.socket_path, autostart=False) as c:
            whole = c.run(p.Generate(id=0, prompt=PROMPT, max_tokens=10)).text
            streamed = "".join(c.stream(p.Generate(id=0, prompt=PROMPT, max_tokens=10)))
            for _ in c.stream(p.Generate(id=0, prompt=PROMPT, max_tokens=300, k=0)):
                break  # the caller walks away after the first piece
            return whole, streamed

    whole, streamed = await asyncio.to_thread(use)
    assert whole == streamed and whole
    assert await asyncio.to_thread(daemon.scheduler.wait_idle, TIMEOUT)
    assert daemon.scheduler.counters.cancelled == 1
