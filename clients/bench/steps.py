"""`ahead bench engine --preset NAME`: the decode step on a model of real shapes.

The model is built in memory with random weights (nothing is downloaded), so what is
measured is the machinery, not the model: the prefill of a long prompt, the plain-decoding
step and the step at each K (and a verify-only step of K: what drafting costs), the kernels
a step launches, the weight bytes a plain step reads against the device's own copy bandwidth
measured in the same run, and that every speculative output equals plain decoding (alone,
and with `slots` prompts batched).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from clients.bench.engine import load_line
from engine import Engine, GenParams
from engine.bundled import bundled_model_dir
from engine.exec.calibration import warm_up
from engine.generation import Generation
from engine.model.assistant import Assistant
from engine.model.pages import huge_bytes, huge_mapping, movable
from engine.model.presets import ASSISTANTS, PRESETS
from engine.model.quant import describe, drafts_only, packed_weights, resolve, run_dtype
from engine.model.transformer import Transformer
from engine.native.timing import timed
from engine.tokenizer import Tokenizer

Progress = Callable[[str], None]


def preset_engine(name: str, *, device: str, dtype: torch.dtype | None, max_seq_len: int,
                  k_max: int, slots: int, compile: bool | None = None,
                  graphs: bool | None = None, exact: bool | None = None,
                  quant: str = "none", draft_vocab: int = 32768,
                  drafts: str = "mtp") -> Engine:
    """An engine on the preset's shapes with random weights (any tokenizer does: token ids
    past its vocabulary decode to nothing); `dtype` None: the quantization's, as a loaded
    checkpoint's (quant.run_dtype)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    if dtype is None:
        with torch.device("meta"):
            shapes = Transformer(PRESETS[name])
        kind = torch.device(device).type
        dtype = run_dtype(kind, resolve(shapes, quant, kind))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Transformer(PRESETS[name]).eval()
            if name in ASSISTANTS:  # a Gemma 4 preset drafts with its assistant's shapes
                model.assistant = Assistant(ASSISTANTS[name], model.cfg).eval()
    finally:
        torch.set_default_dtype(default)
    bundled = bundled_model_dir()
    if bundled is None:
        raise ValueError("the bundled model's tokenizer is missing from this install")
    tokenizer = Tokenizer.from_dir(bundled)
    engine = Engine(model, tokenizer, max_seq_len=max_seq_len, k_max=k_max, slots=slots,
                    compile=compile, graphs=graphs, exact=exact, quant=quant,
                    draft_vocab=draft_vocab, drafts=drafts)
    engine.calibrate()
    return engine


def bench_steps(engine: Engine, *, context: int = 2000, new_tokens: int = 48,
                ks: list[int] | None = None, slots: int = 1,
                synthetic: list[float] | None = None, progress: Progress | None = None,
                peer: Callable[[list[int], int], dict[str, Any]] | None = None,
                rounds: int = 2) -> dict[str, Any]:
    """`synthetic`: per draft position, the probability of keeping a draft, in place of the
    acceptance rule (random weights accept nothing): speculative speed at that acceptance.
    Output then is not the model's, and `identical_to_ar` is None. `peer(prompt, new_tokens)`:
    another engine's figures on the same prompt (`peer.peer_steps`), under "peer". Each
    step figure is the median over `rounds` generations, the modes taking turns."""
    say = progress or (lambda _: None)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, not {rounds}")
    if synthetic is not None:
        rates = [*synthetic, *[0.0] * engine.k_max][:max(engine.k_max, 1)]
        engine.state.synthetic = torch.tensor(rates, device=engine.device)
        if engine.compiled or engine.graphs:
            # A captured step is keyed by the rates and a compiled one guards on them: else
            # the timed runs would compile or capture each shape (on the H200, Qwen2-1.5B's
            # shapes: K=8 at 225 tokens/s from a 5.35 ms step, at these rates 3.1 tokens).
            say("compiling and capturing the steps again: they now keep drafts at the rates "
                "given")
            warm_up(engine)
    vocab = engine.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(0)
    context = min(context, engine.prompt_budget(new_tokens))
    prompts = [torch.randint(vocab, (context,), generator=gen).tolist() for _ in range(slots)]
    ks = bench_ks(ks, engine.k_max)
    out: dict[str, Any] = {"context": context, "new_tokens": new_tokens, "slots": slots,
                           "exact": engine.exactness, "quant": describe(engine.model),
                           "load_s": engine.load_seconds}
    say("prefill")
    out["prefill_ms"] = statistics.median(_prefill_s(engine, prompts[0]) for _ in range(3)) * 1e3
    # Plain decoding, each K and each verify-only K take turns, `rounds` times: a machine
    # whose speed drifts during the run moves all of them alike, and their ratios hold.
    # Step by step where each mode can have a slot of its own and a lone generation's step
    # runs its own row alone (a drift of a second then moves every mode alike); else a
    # whole generation each.
    modes = bench_modes(ks)
    stepwise = engine.max_slots >= len(modes) and engine.step_rows(1) == 1
    out["turns"] = "steps" if stepwise else "generations"
    times: dict[tuple[str, int], list[float]] = {m: [] for m in modes}
    by_round: dict[tuple[str, int], list[float]] = {m: [] for m in modes}  # median per round
    made: dict[tuple[str, int], int] = dict.fromkeys(modes, 0)
    plain: list[int] | None = None
    identical = True
    k_hist: Counter[int] = Counter()  # the adaptive rows' Ks, steps of each
    # where each mode's steps spend their time: our CPU kernels timed as they run
    parts: dict[tuple[str, int], dict[str, list[float]]] = {m: {} for m in modes}
    breakdown = stepwise and engine.device.type == "cpu"
    empty: dict[str, list[float]] = {}
    timing: contextlib.AbstractContextManager[dict[str, list[float]]] = \
        timed() if breakdown else contextlib.nullcontext(empty)
    with timing as totals:
        for r in range(rounds):
            say(f"plain decoding, K={','.join(map(str, ks))}, verify-only K and adaptive K, "
                f"taking turns {'step by step' if stepwise else 'by generations'} (round "
                f"{r + 1} of {rounds})")
            # One seed for every mode of a round: the synthetic acceptance's draws are then
            # the same at the same positions, and modes differ by their drafts, not by luck.
            seed = r + 1
            runs = _stepped(engine, prompts[0], modes, new_tokens, totals, parts, seed) \
                if stepwise else {mode: _stepped(engine, prompts[0], [mode], new_tokens,
                                                 seed=seed)[mode] for mode in modes}
            for mode, (run, ts) in runs.items():
                if run is not None:  # (verify-only modes make no tokens of their own)
                    made[mode] += len(run.tokens) - 1
                    plain = plain or run.tokens  # the first generation is plain decoding's
                    identical &= run.tokens == plain
                    if mode[0] == "adaptive":
                        k_hist.update(run.stats.k_hist)
                        if r == 0:  # the policy as it was loaded
                            out["adaptive_first_round_tokens_per_s"] = \
                                (len(run.tokens) - 1) / sum(ts)
                times[mode] += ts
                by_round[mode].append(statistics.median(ts))
    assert plain is not None
    out["rounds"] = rounds
    out["ar_step_ms"] = statistics.median(times["plain", 0]) * 1e3
    out["ar_tokens_per_s"] = 1e3 / out["ar_step_ms"]
    out["step_ms_by_k"], out["tokens_per_s_by_k"], out["tokens_per_step_by_k"] = {}, {}, {}
    out["verify_ms_by_k"], out["draft_ms_by_k"] = {}, {}
    for k in ks:
        step = out["step_ms_by_k"][str(k)] = statistics.median(times["k", k]) * 1e3
        out["tokens_per_s_by_k"][str(k)] = made["k", k] / sum(times["k", k])
        out["tokens_per_step_by_k"][str(k)] = made["k", k] / len(times["k", k])
        verify = out["verify_ms_by_k"][str(k)] = statistics.median(times["verify", k]) * 1e3
        out["draft_ms_by_k"][str(k)] = (step - verify) / k
    # each round's K step over its plain step, the median of those: drift between rounds
    # cancels (a whole-run median would mix a fast round's plain with a slow one's K)
    out["step_ratio_by_k"] = {
        str(k): statistics.median(a / b for a, b in zip(by_round["k", k], by_round["plain", 0],
                                                        strict=True)) for k in ks}
    out["round_step_ms"] = {_mode_name(mode): [t * 1e3 for t in ts]
                            for mode, ts in by_round.items()}
    out["draft_share_by_k"] = {k: ms / out["ar_step_ms"]
                               for k, ms in out["draft_ms_by_k"].items()}
    if breakdown:
        out["breakdown_ms"] = {_mode_name(m): _per_step(parts[m], times[m]) for m in modes}
        out["breakdown_calls"] = {_mode_name(m): {p: calls / max(len(times[m]), 1)
                                                  for p, (_, calls) in parts[m].items() if calls}
                                  for m in modes}
    # The policy learns from round to round, as a daemon's does from one request to the next.
    adaptive = ("adaptive", 0)
    out["adaptive_tokens_per_s"] = made[adaptive] / sum(times[adaptive])
    out["adaptive_k_histogram"] = {str(k): n for k, n in sorted(k_hist.items())}
    if slots > 1:
        say(f"{slots} slots batched")
        out |= _batched(engine, prompts, new_tokens)
        identical &= out.pop("batched_identical")
    out["identical_to_ar"] = identical if synthetic is None else None
    if synthetic is not None:
        out["synthetic_acceptance"] = synthetic
    if peer is not None:
        say("peer")
        out["peer"] = peer(prompts[0], new_tokens)
    say("kernels and bandwidth")
    out["launches_per_ar_step"] = _launches(engine, prompts[0])
    weight_bytes = _weight_bytes(engine.model)
    out["weight_mb"] = weight_bytes / 1e6
    out["copy_gb_per_s"] = _copy_bandwidth(engine.device) / 1e9
    achieved = weight_bytes / (out["ar_step_ms"] / 1e3)
    out["weight_bandwidth_share"] = achieved / (out["copy_gb_per_s"] * 1e9)
    placed = movable(packed_weights(engine.model).values())
    if placed and (huge := huge_bytes(placed[0].packed)) is not None:  # the mapping they share
        out["weight_huge_page_mb"] = huge / 1e6
    return out


def bench_engine(make: Callable[[int], Engine], slots: int, ks: list[int] | None, k_max: int,
                 progress: Progress) -> Engine:
    """An engine for `bench_steps` from `make(slots)`: with a slot for each mode where a
    lone generation's step runs its own row alone (the modes then take turns step by step),
    else with the `slots` asked for (by whole generations: more slots would put a row for
    each of them into every step)."""
    engine = make(max(slots, len(bench_modes(bench_ks(ks, k_max)))))
    if engine.step_rows(1) > 1 and engine.max_slots > slots:
        progress("a lone step here runs a row for every slot; the modes take turns by "
                 "generations, in an engine of the slots asked for")
        del engine
        engine = make(slots)
    return engine


def bench_ks(ks: list[int] | None, k_max: int) -> list[int]:
    """The Ks the bench times: those asked for, else 1, 2, 4 and k_max (up to k_max)."""
    return list(dict.fromkeys(ks or [k for k in (1, 2, 4, k_max) if 0 < k <= k_max]))


def bench_modes(ks: list[int]) -> list[tuple[str, int]]:
    """What the bench times: plain decoding, each K, each K's verify alone, and adaptive K."""
    return [("plain", 0), *(("k", k) for k in ks), *(("verify", k) for k in ks),
            ("adaptive", 0)]


def _mode_params(mode: tuple[str, int], new_tokens: int, seed: int | None = None) -> GenParams:
    kind, k = mode
    kinds: dict[str, dict[str, Any]] = {"plain": {"speculative": False}, "k": {"k": k},
                                        "verify": {"k": 0}, "adaptive": {}}
    return _params(new_tokens, seed=seed, **kinds[kind])


def _mode_name(mode: tuple[str, int]) -> str:
    kind, k = mode
    return kind if kind in ("plain", "adaptive") else f"{kind}{k}"


def _per_step(spent: dict[str, list[float]], steps: list[float]) -> dict[str, float]:
    """ms a step (means: parts add up to the step) of each part, of the whole step, and of
    the rest: torch's operators and Python between our kernels."""
    n = max(len(steps), 1)
    out = {part: seconds * 1e3 / n for part, (seconds, _) in spent.items() if seconds > 0}
    step = sum(steps) * 1e3 / n
    return out | {"step": step, "rest": step - sum(out.values())}


def _stepped(engine: Engine, prompt: list[int], modes: list[tuple[str, int]],
             new_tokens: int, totals: dict[str, list[float]] | None = None,
             parts: dict[tuple[str, int], dict[str, list[float]]] | None = None,
             seed: int | None = None,
             ) -> dict[tuple[str, int], tuple[Generation | None, list[float]]]:
    """Every mode's generation at once (one mode: alone), each in a slot of its own, one step
    each in turn until all have ended: each generation (None for a verify-only mode) and the
    seconds of each step after the prefill (a verify-only mode's steps with K drafts given,
    until fewer than K + 1 tokens are left). With `totals` (`timing.timed`'s) and `parts`:
    each part's seconds and calls within each mode's timed steps, added to parts[mode].
    `seed`: every generation's (where acceptance is synthetic, its draws)."""
    gens = {}
    for i, mode in enumerate(modes):
        slot = "bench" if i == 0 else ("bench", i)
        engine.clear_cache(slot)
        gens[mode] = engine.start(prompt, _mode_params(mode, new_tokens, seed), slot=slot)
        engine.step([gens[mode]])  # the prefill, not timed
    times: dict[tuple[str, int], list[float]] = {m: [] for m in modes}
    live = list(modes)
    while live:
        for mode in list(live):
            gen, (kind, k) = gens[mode], mode
            if gen.finish_reason is not None or (kind == "verify" and gen.tokens_left() <= k + 1):
                live.remove(mode)
                continue
            if kind == "verify":
                engine.give_drafts(gen, [gen.sequence[-1]] * k)  # any tokens cost the same
            before = {part: list(got) for part, got in (totals or {}).items()}
            t0 = time.perf_counter()
            engine.step([gen])  # ends with the host reading the step's result: synchronised
            times[mode].append(time.perf_counter() - t0)
            if totals is not None and parts is not None:
                for part, got in totals.items():
                    was = before.get(part, [0.0, 0])
                    mine = parts[mode].setdefault(part, [0.0, 0])
                    mine[0] += got[0] - was[0]
                    mine[1] += got[1] - was[1]
    return {m: (None if m[0] == "verify" else gens[m], times[m]) for m in modes}


def _params(new_tokens: int, **kw: Any) -> GenParams:
    """Every generation here runs its full length: random weights write an end token or fall
    into a loop anywhere, and a step is timed whatever its tokens."""
    return GenParams(new_tokens, stop_loops=False, ignore_eos=True, **kw)


def _prefill_s(engine: Engine, prompt: list[int]) -> float:
    engine.clear_cache("bench")
    gen = engine.start(prompt, _params(1, speculative=False), slot="bench")
    _sync(engine)
    t0 = time.perf_counter()
    engine.step([gen])
    return time.perf_counter() - t0


def _batched(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    alone = [engine.generate(p, _params(new_tokens, speculative=False),
                             slot="bench").tokens
             for p in prompts]
    gens = [engine.start(p, _params(new_tokens), slot=("batch", i))
            for i, p in enumerate(prompts)]
    engine.step(gens)
    t0 = time.perf_counter()
    while live := [g for g in gens if g.finish_reason is None]:
        engine.step(live)
    seconds = time.perf_counter() - t0
    return {"batched_tokens_per_s": sum(len(g.tokens) - 1 for g in gens) / seconds,
            "batched_identical": [g.tokens for g in gens] == alone}


def _launches(engine: Engine, prompt: list[int], steps: int = 8) -> float:
    """Device kernels (CUDA) or operators (CPU) per plain-decoding step."""
    from torch.profiler import ProfilerActivity, profile

    engine.clear_cache("bench")
    gen = engine.start(prompt, _params(steps + 2, speculative=False), slot="bench")
    engine.step([gen])
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step([gen])
    events = prof.events()
    if cuda:
        count = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    else:
        count = sum(1 for e in events if e.name.startswith("aten::") and e.cpu_parent is None)
    return count / steps


def _weight_bytes(model: Transformer) -> int:
    """What one plain step reads: the trunk's weights and the head (not the MTP modules or
    an assistant, nor Gemma 4's per-layer embeddings: a lookup reads one row); quantized,
    their codes and scales (a tied embedding then serves lookups only)."""
    per_layer = getattr(model.model, "embed_tokens_per_layer", None)
    skip = {id(p) for m in (model.mtp, model.assistant, per_layer) if m is not None
            for p in m.parameters()}
    packed = {name: w for name, w in packed_weights(model).items() if not drafts_only(name)}
    if packed and model.cfg.tie_word_embeddings:
        skip.add(id(model.model.embed_tokens.weight))
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip) \
        + sum(w.nbytes() for w in packed.values())


def _copy_bandwidth(device: torch.device, nbytes: int = 1 << 28, reps: int = 5) -> float:
    """Bytes per second a device-to-device copy moves (read plus write), median of reps; on
    the CPU in 2 MB pages where they can be had, as the weights are (model/pages.py)."""
    pages = huge_mapping(2 * nbytes) if device.type == "cpu" else None
    if pages is not None:
        src, dst = pages[:nbytes].fill_(1), pages[nbytes:].fill_(0)  # (touched: pages made)
    else:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        _sync_device(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync_device(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times[1:])


def _sync(engine: Engine) -> None:
    _sync_device(engine.device)


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_report(r: dict[str, Any]) -> str:
    by_k = " ".join(f"K={k}:{ms:.2f}" for k, ms in r["step_ms_by_k"].items())
    rate_k = " ".join(f"K={k}:{t:.1f}" for k, t in r.get("tokens_per_s_by_k", {}).items())
    unit = "kernels" if r.get("device", "cpu").startswith("cuda") else "operators"
    ratio = " ".join(f"K={k}:{x:.2f}x" for k, x in r.get("step_ratio_by_k", {}).items())
    verify = " ".join(f"K={k}:{ms:.2f}" for k, ms in r["verify_ms_by_k"].items())
    per_draft = " ".join(f"K={k}:{ms:.2f}" for k, ms in r["draft_ms_by_k"].items())
    share = " ".join(f"K={k}:{x:.2f}" for k, x in r["draft_share_by_k"].items())
    hist = r.get("adaptive_k_histogram")  # absent from results saved before it was kept
    adaptive_ks = f" (K:steps {' '.join(f'{k}:{n}' for k, n in hist.items())})" if hist else ""
    cold = r.get("adaptive_first_round_tokens_per_s")  # the policy as it was after loading
    first = f"; its first round {cold:.1f}" if cold is not None else ""
    lines = [
        f"{r.get('preset', 'model')} on {r.get('device')} {r.get('dtype')} (quant "
        f"{r.get('quant', 'none')}): context "
        f"{r['context']}, {r['new_tokens']} new tokens",
        f"prefill of {r['context']} tokens: {r['prefill_ms']:.1f} ms",
        f"plain decoding step: {r['ar_step_ms']:.2f} ms ({r['ar_tokens_per_s']:.1f} tokens/s)",
        f"step ms by K: {by_k} (over a plain step, the median of {r.get('rounds', 1)} "
        f"rounds' ratios, the modes taking turns by {r.get('turns', 'generations')}: "
        f"{ratio})",
        f"verify-only step ms by K (K drafts given, none made): {verify}",
        f"draft ms per token by K (step - verify-only) / K: {per_draft} "
        f"(share of a plain step: {share})",
        f"tokens/s by K: {rate_k}",
        f"adaptive K: {r['adaptive_tokens_per_s']:.1f} tokens/s{adaptive_ks}{first}",
        f"{unit} per plain step: {r['launches_per_ar_step']:.0f}",
        f"weights {r['weight_mb']:.0f} MB per step / step time = "
        f"{r['weight_bandwidth_share'] * 100:.0f}% of the copy bandwidth "
        f"({r['copy_gb_per_s']:.0f} GB/s, measured in this run)"
        + (f"; {r['weight_huge_page_mb']:.0f} MB of our kernels' weights in 2 MB pages"
           if "weight_huge_page_mb" in r else ""),
    ]
    if "breakdown_ms" in r:
        lines += _breakdown_lines(r["breakdown_ms"])
    if "batched_tokens_per_s" in r:
        lines.append(f"{r['slots']} slots batched: {r['batched_tokens_per_s']:.1f} tokens/s")
    if r.get("synthetic_acceptance"):
        lines.append("synthetic acceptance by draft position (not the model's output): "
                     + ",".join(f"{p:g}" for p in r["synthetic_acceptance"]))
    else:
        lines.append(f"identical to plain decoding: {r['identical_to_ar']} "
                     f"(exact: {r['exact']})")
    if "load_s" in r:
        lines.append(load_line(r["load_s"]))
    if "peer" in r:
        lines.append(_peer_line(r["peer"], r["ar_tokens_per_s"],
                                max(r.get("tokens_per_s_by_k", {}).values(), default=0.0)))
    return "\n".join(lines)


def _breakdown_lines(parts: dict[str, dict[str, float]]) -> list[str]:
    """A plain step, the largest K's verify-only step and its step, and an adaptive step,
    part by part."""
    k = max((int(name[1:]) for name in parts if name.startswith("k")), default=None)
    names = ["plain"] + ([f"verify{k}", f"k{k}"] if k else []) + ["adaptive"]
    names = [n for n in names if n in parts]
    heads = {"plain": "plain", f"verify{k}": f"verify-only K={k}", f"k{k}": f"K={k}",
             "adaptive": "adaptive K"}
    order = [p for p in dict.fromkeys(p for n in names for p in parts[n])
             if p not in ("step", "rest")]
    lines = [f"where a step's time goes, ms a step, means ({' / '.join(heads[n] for n in names)}"
             "; our kernels timed as they ran, each from its Python call to its return):"]
    for part, label in [*((p, p) for p in order), ("rest", "the rest: torch's operators, "
                                                           "Python"), ("step", "the step")]:
        lines.append(f"  {label}: " + " / ".join(f"{parts[n].get(part, 0.0):.2f}"
                                                 for n in names))
    return lines


def _peer_line(p: dict[str, Any], plain: float, best: float) -> str:
    """The peer's figures, and ours as a share of them (ours / theirs)."""
    parts = [f"peer {Path(p['model']).name}:"]
    if "plain_tokens_per_s" in p:
        theirs = p["plain_tokens_per_s"]
        parts.append(f"plain {theirs:.1f} tokens/s after {p.get('plain_depth', 0)} tokens "
                     f"(ours: plain {plain / theirs:.2f}x, "
                     f"best K {best / theirs:.2f}x);")
    parts.append(f"plain --no-repack {p['plain_no_repack_tokens_per_s']:.1f};")
    if "mtp_tokens_per_s" in p:
        how = "" if p.get("mtp_repack", True) else \
            f"; with --no-repack, its repacked weights failed: {p.get('mtp_repack_error')}"
        parts.append(f"draft-mtp {p['mtp_tokens_per_s']:.1f} tokens/s "
                     f"({p.get('mtp_tokens_per_step', 0):.2f} tokens/step; best K ours "
                     f"{best / p['mtp_tokens_per_s']:.2f}x{how})")
    elif "mtp_error" in p:
        parts.append(f"draft-mtp unavailable ({p['mtp_error']})")
    return " ".join(parts)
