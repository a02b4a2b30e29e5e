"""`ahead bench pipeline`: a typing burst from several editors against a real daemon.

Each simulated editor writes the next characters of a real source file one per keystroke,
every `interval_ms`, and asks for a completion at every keystroke, superseding the previous
one (as an editor's inline-completion requests do). The characters are inserted: the text
after them is in the document from the start and stays put while the user types, as it does
when someone writes a new line in the middle of a file. The daemon runs in its own process, on a
private socket, with the model given, or (`--backend openai`) in front of a remote server,
where it also measures the HTTP hop: the backend's round trip beyond the server's own time,
as the server reports it (llama-server does).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon import protocol as p
from daemon.client import Client, RequestFailed
from daemon.stats import percentiles
from lsp.context import cursor_window


@dataclass(slots=True)
class Editor:
    name: str
    text: str
    cursor: int
    span: int  # the characters the user types, text[cursor:cursor + span]
    latencies: list[float] = field(default_factory=list)  # ms, completed requests
    overheads: list[float] = field(default_factory=list)  # ms, total minus engine time
    hops: list[float] = field(default_factory=list)  # ms, a remote backend's HTTP hop
    final_ms: float = 0.0
    final_typed_through: bool = False  # the final request was answered without the model


def _request(ed: Editor, typed: int, doc: str | None = None) -> p.Complete:
    """What `ahead lsp` sends after `typed` keystrokes (its windows, cut at line
    boundaries): the document holds the typed characters, then the rest of the file."""
    before = ed.text[:ed.cursor + typed]
    window = cursor_window(before + ed.text[ed.cursor + ed.span:], len(before),
                           max_prefix_chars=3000, max_suffix_chars=1000)
    return p.Complete(id=0, session=ed.name, document=doc or f"file:///{ed.name}.py",
                      prefix=window.prefix, suffix=window.suffix, max_tokens=48,
                      multiline=True)


async def _timed(client: Client, req: p.Complete) -> tuple[p.Done | None, float]:
    t0 = time.perf_counter()
    try:
        done = await client.run(req)
    except RequestFailed as e:
        if e.code != "cancelled":
            raise
        return None, (time.perf_counter() - t0) * 1000
    return done, (time.perf_counter() - t0) * 1000


async def _type(client: Client, ed: Editor, keystrokes: int, interval: float) -> None:
    tasks = []
    for k in range(keystrokes + 1):
        tasks.append(asyncio.create_task(_timed(client, _request(ed, k))))
        if k < keystrokes:
            await asyncio.sleep(interval)  # the typist's pace, not synchronisation
    results = await asyncio.gather(*tasks)
    ed.latencies += [ms for done, ms in results if done is not None]
    last_done, ed.final_ms = results[-1]
    if last_done is None:
        raise RuntimeError(f"{ed.name}: the final request was cancelled")
    ed.final_typed_through = last_done.stats.typed_through


async def _idle(client: Client, ed: Editor, keystrokes: int) -> float:
    """On an idle daemon: the pipeline's overhead per request (round trip minus engine time,
    one request at a time), and the final request's latency from a cold cache."""
    for k in range(0, keystrokes, 3):
        done, ms = await _timed(client, _request(ed, k, f"file:///idle-{ed.name}-{k}"))
        if done is not None:
            ed.overheads.append(ms - done.stats.engine_ms)
            ed.hops.append(done.stats.hop_ms)
    await client.run(p.Generate(id=0, prompt="# another file\n" * 20, max_tokens=1))
    _, ms = await _timed(client, _request(ed, keystrokes, f"file:///idle-{ed.name}-final"))
    return ms


def _editors(files: list[Path], count: int, seed: int, span: int,
             tag: str = "") -> list[Editor]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        text = rng.choice(files).read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        start = rng.randrange(len(lines) // 4, max(len(lines) // 4 + 1, len(lines) - 10))
        cursor = sum(map(len, lines[:start])) + len(lines[start]) - len(lines[start].lstrip())
        out.append(Editor(f"editor{i}{tag}", text, cursor, min(span, len(text) - cursor)))
    return out


async def bench_pipeline(model: Path, files: list[Path], *, clients: int = 3,
                         keystrokes: int = 30, interval_ms: float = 40.0, seed: int = 0,
                         rounds: int = 3, serve_args: list[str] | None = None,
                         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`rounds` bursts, each from new cursor positions, against one daemon; the figures pool
    them (latency ratios are medians over every editor of every round)."""
    if rounds < 1 or clients < 1 or keystrokes < 1:
        raise ValueError("rounds, clients and keystrokes must be at least 1")
    args = ["--model", str(model), "--idle-timeout", "120", "--no-watch", *(serve_args or [])]
    backend = "local"
    editors: list[Editor] = []
    idle: list[float] = []
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as rt:
        os.environ["AHEAD_RUNTIME_DIR"] = rt  # a private daemon, not the user's
        control = Client(serve_args=args, client_name="bench")
        try:
            await control.connect()
            backend = (await control.status())["backend"]
            for r in range(rounds):
                batch = _editors(files, clients, seed + r, keystrokes, tag=f"r{r}")
                idle += [await _idle(control, ed, keystrokes) for ed in batch]
                before = await control.status()
                conns = [Client(serve_args=args, client_name=ed.name) for ed in batch]
                await asyncio.gather(*(_type(c, ed, keystrokes, interval_ms / 1000)
                                       for c, ed in zip(conns, batch, strict=True)))
                after = await control.status()
                for c in conns:
                    await c.close()
                counts.update({k: v - before["counts"].get(k, 0)
                               for k, v in after["counts"].items()})
                editors += batch
                if progress:
                    progress(r + 1, rounds)
            await control.shutdown()
        finally:
            await control.close()
            os.environ.pop("AHEAD_RUNTIME_DIR", None)
    return {"backend": backend,
            **_summary(editors, idle, counts, clients, keystrokes, interval_ms, rounds)}


def _summary(editors: list[Editor], idle: list[float], counts: Counter[str], clients: int,
             keystrokes: int, interval_ms: float, rounds: int) -> dict[str, Any]:
    superseded = counts["superseded"]
    saved, prefilled = counts["prefix_reused_tokens"], counts["prefilled_tokens"]
    overheads = [o for ed in editors for o in ed.overheads]
    ratios = [ed.final_ms / i for ed, i in zip(editors, idle, strict=True)]
    # A final keystroke typed through costs no model work (well under a millisecond): the
    # figure for those that did need the model, on their own.
    worked = [r for ed, r in zip(editors, ratios, strict=True) if not ed.final_typed_through]
    return {
        "clients": clients, "keystrokes_per_client": keystrokes, "interval_ms": interval_ms,
        "rounds": rounds,
        "requests": counts["completions"],
        "superseded_requests": superseded,
        "superseded_steps_per_request": counts["stale_steps"] / superseded if superseded else 0.0,
        "final_latency_ms": statistics.median(ed.final_ms for ed in editors),
        "idle_latency_ms": statistics.median(idle),
        "final_latency_ratio": statistics.median(ratios),
        "final_latency_ratios": sorted(round(r, 3) for r in ratios),
        "final_latency_ratio_model_work": statistics.median(worked) if worked else None,
        "typed_through_share": counts["typed_through"] / max(counts["completions"], 1),
        "prefill_tokens_saved_share": saved / max(saved + prefilled, 1),
        "batched_share": counts["batched_jobs"] / max(counts["steps"], 1),
        "latency_ms": percentiles([ms for ed in editors for ms in ed.latencies]),
        "overhead_ms": percentiles(overheads),
        "http_hop_ms": percentiles([h for ed in editors for h in ed.hops if h]),
    }


def format_report(r: dict[str, Any]) -> str:
    remote = r.get("backend", "local") != "local"
    hop = r.get("http_hop_ms") or {}
    return "\n".join([
        f"{r['rounds']} rounds of {r['clients']} editors x {r['keystrokes_per_client']} "
        f"keystrokes, {r['interval_ms']:.0f} ms apart: {r['requests']} requests, "
        f"{r['superseded_requests']} superseded",
        f"stale steps per superseded request: {r['superseded_steps_per_request']:.2f}",
        f"final request: {r['final_latency_ms']:.1f} ms vs {r['idle_latency_ms']:.1f} ms idle "
        f"(ratio {r['final_latency_ratio']:.2f}, median over editors and rounds)",
        "final requests that needed the model: ratio " + (
            "-" if r["final_latency_ratio_model_work"] is None
            else f"{r['final_latency_ratio_model_work']:.2f}") + " (median)",
        "job steps taken in batches of several: " + (
            "- (the server batches)" if remote else f"{r['batched_share']:.1%}"),
        f"keystrokes served by typing through: {r['typed_through_share']:.1%}",
        f"prefill tokens saved by prefix reuse: {r['prefill_tokens_saved_share']:.1%}",
        f"pipeline overhead (round trip minus engine): p50 {r['overhead_ms'].get('p50', 0)} ms, "
        f"p99 {r['overhead_ms'].get('p99', 0)} ms",
        *([f"HTTP hop (backend round trip minus the server's own time): p50 "
           f"{hop.get('p50', '-')} ms, p99 {hop.get('p99', '-')} ms"] if remote else []),
    ])
