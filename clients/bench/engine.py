"""`ahead bench engine`: autoregressive decoding vs speculative decoding side by side: the MTP
modules' drafts at each fixed K and at adaptive K, the context's drafts, and both sources
chosen live (what serving runs).

Every prompt is run in every mode in turn, from a cold cache, so all modes see the same
machine noise; tokens per second are reported as medians over prompts, and speed-ups as the
median of per-prompt ratios.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine import Engine, Generation, GenParams

# Another engine: greedy tokens after the prompt ids, its decode rate in tokens/s, and the
# decode steps it took (as many as tokens unless it drafts).
Peer = Callable[[list[int], int], tuple[list[int], float, int]]


@dataclass(slots=True)
class CursorPrompt:
    source: str
    ids: list[int]
    line: str  # the rest of the line at the cursor, as the file has it
    forced: str  # what the answer must start with (token healing)


def cursor_prompts(engine: Engine, files: list[Path], num: int, seed: int, *,
                   max_new_tokens: int, prefix_chars: int = 1500, suffix_chars: int = 500,
                   middle_lines: int = 4) -> list[CursorPrompt]:
    """FIM prompts as an editor makes them: the cursor at the start of a random non-blank
    line's code, the next `middle_lines` lines taken out (the code to write), the text before
    and after as prefix and suffix, shortened from the far ends to leave room for
    `max_new_tokens`."""
    rng = random.Random(seed)
    texts = []
    for f in files:
        try:
            texts.append((f, f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read prompt file {f}: {e}") from None
    texts = [(f, t) for f, t in texts if len(t.splitlines()) > middle_lines + 2]
    if not texts:
        raise ValueError(f"no usable prompt files (each needs over {middle_lines + 2} lines)")
    prompts: list[CursorPrompt] = []
    while len(prompts) < num:
        f, text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        i = rng.randrange(1, len(lines) - middle_lines)
        if not lines[i].strip():
            continue
        line_start = sum(map(len, lines[:i]))
        cut = line_start + len(lines[i]) - len(lines[i].lstrip())
        resume = line_start + sum(map(len, lines[i:i + middle_lines])) - 1  # keep the "\n"
        # The prompt the daemon would build for an editor sending these windows.
        built = engine.fill_in_prompt(text[max(0, cut - prefix_chars):cut],
                                      text[resume:resume + suffix_chars],
                                      max_new_tokens=max_new_tokens)
        line = lines[i][cut - line_start:].rstrip()
        prompts.append(CursorPrompt(f"{f.name}:{i + 1}", built.ids, line, built.forced))
    return prompts


@torch.inference_mode()
def heldout_loss(engine: Engine, files: list[Path], windows: int = 16,
                 seq_len: int = 512) -> float:
    """Mean next-token loss of the trunk on windows of the files' tokens."""
    model = engine.model
    ids: list[int] = []
    for f in files:
        ids += engine.tokenizer.encode_text(f.read_text(encoding="utf-8"))
    seq_len = min(seq_len, len(ids) // 2, engine.max_seq_len)
    if seq_len < 8:
        raise ValueError("too little text for a held-out loss")
    rng = random.Random(0)
    total = 0.0
    for _ in range(windows):
        s = rng.randrange(0, len(ids) - seq_len)
        x = torch.tensor([ids[s:s + seq_len]], device=engine.device)
        logits, _ = model(x)
        total += F.cross_entropy(logits[0, :-1].float(), x[0, 1:]).item()
    return total / windows


def _run(engine: Engine, prompt: CursorPrompt, params: GenParams) -> Generation:
    engine.clear_cache()  # every mode prefills from scratch
    return engine.generate(prompt.ids, params)


DRAFT_MODES = {"mtp": "adaptive", "context": "context", "both": "both"}  # --drafts -> mode


def bench_engine(engine: Engine, prompts: list[CursorPrompt], *, max_new_tokens: int = 64,
                 ks: list[int] | None = None, drafts: tuple[str, ...] = ("mtp", "context", "both"),
                 peer: Peer | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every prompt in every mode; with `peer`, also in another engine (greedy tokens and
    its decode rate for prompt ids and a number of new tokens), after ours. `drafts`: the
    adaptive modes to run, by source (the modules' need a model that has them)."""
    mtp = engine.mtp and "mtp" in drafts
    ks = [] if not mtp else list(range(1, engine.k_max + 1)) if ks is None else ks
    # Decode speed over the same lengths as before the loop rule (and as the peer decodes).
    modes: dict[str, GenParams] = {"ar": GenParams(max_new_tokens, speculative=False,
                                                   stop_loops=False)}
    modes |= {f"fixed.{k}": GenParams(max_new_tokens, k=k, stop_loops=False, drafts="mtp")
              for k in ks}
    modes |= {DRAFT_MODES[d]: GenParams(max_new_tokens, stop_loops=False, drafts=d)
              for d in drafts if engine.k_max and (d != "mtp" or engine.mtp)}
    by_source: dict[str, list[int]] = {}  # in the "both" mode: [steps, drafted, accepted]
    for mode in modes:  # warm-up: the policy's first steps are not timed
        _run(engine, prompts[0], modes[mode])
    rates: dict[str, list[float | None]] = {m: [] for m in modes}
    steps: dict[str, list[int]] = {m: [0, 0] for m in modes}  # tokens, verify steps
    k_hist: Counter[int] = Counter()
    top = max(ks, default=0)  # the largest fixed K run: its acceptance by draft position
    acc_pos: list[list[int]] = [[0, 0] for _ in range(top)]
    identical, line_hits = True, 0
    peer_rates: list[float] = []
    peer_steps = [0, 0]  # tokens, steps
    peer_same: list[bool] = []  # per prompt without a forced start: the peer's tokens ours?
    for n, prompt in enumerate(prompts):
        ar_tokens: list[int] = []
        for mode, params in modes.items():
            gen = _run(engine, prompt, replace(params, forced=prompt.forced))
            s = gen.stats
            # A completion that ends after a few tokens says nothing about speed.
            decoded = len(gen.tokens) - 1
            rates[mode].append(decoded / s.decode_s if decoded >= 4 and s.decode_s else None)
            steps[mode][0] += s.steps + s.accepted
            steps[mode][1] += s.steps
            if mode == "ar":
                ar_tokens = gen.tokens
                line_hits += gen.text.split("\n", 1)[0].rstrip() == prompt.line
            identical &= gen.tokens == ar_tokens
            if mode == "adaptive":
                k_hist.update(s.k_hist)
            if mode == "both":
                for source, counts in s.by_source.items():
                    total = by_source.setdefault(source, [0, 0, 0])
                    total[:] = [a + b for a, b in zip(total, counts, strict=True)]
            if mode == f"fixed.{top}":
                for i, (a, v) in enumerate(zip(s.accepted_by_pos, s.verified_by_pos, strict=True)):
                    acc_pos[i][0] += a
                    acc_pos[i][1] += v
        if peer is not None:
            tokens, rate, taken = peer(prompt.ids, max_new_tokens)
            peer_rates.append(rate)
            peer_steps[0] += len(tokens)
            peer_steps[1] += taken
            if not prompt.forced:
                peer_same.append(tokens[:len(ar_tokens)] == ar_tokens)
        if progress:
            progress(n + 1, len(prompts))
    out = _summary(modes, rates, steps, k_hist, acc_pos, identical, len(prompts))
    if "both" in out:
        out["both"]["by_source"] = {src: {"steps": n, "drafted": d, "accepted": a}
                                    for src, (n, d, a) in sorted(by_source.items())}
    out["first_line_exact_match"] = line_hits / len(prompts)
    if peer is not None:
        out["peer"] = _peer_summary(rates, peer_rates, peer_same)
        out["peer"]["tokens_per_step"] = peer_steps[0] / max(peer_steps[1], 1)
    return out


def _peer_summary(rates: dict[str, list[float | None]], peer_rates: list[float],
                  peer_same: list[bool]) -> dict[str, Any]:
    timed = [i for i, r in enumerate(rates["ar"]) if r is not None]
    out: dict[str, Any] = {"tokens_per_s": statistics.median(peer_rates[i] for i in timed),
                           "same_tokens": sum(peer_same), "compared": len(peer_same)}
    for mode in ("ar", "adaptive", "context", "both"):
        if mode in rates:  # ours over the peer's, per prompt
            out[f"{mode}_vs_peer"] = statistics.median(
                (rates[mode][i] or 0.0) / peer_rates[i] for i in timed)
    return out


def _summary(modes: dict[str, GenParams], rates: dict[str, list[float | None]],
             steps: dict[str, list[int]], k_hist: Counter[int], acc_pos: list[list[int]],
             identical: bool, num_prompts: int) -> dict[str, Any]:
    timed = [i for i, r in enumerate(rates["ar"]) if r is not None]
    if not timed:
        raise ValueError("every completion ended within 4 tokens: nothing to time "
                         "(try more prompts or other files)")
    out: dict[str, Any] = {"num_prompts": num_prompts, "timed_prompts": len(timed),
                           "identical_to_ar": identical}
    for mode in modes:
        mode_rates = [rates[mode][i] or 0.0 for i in timed]
        ratio = [r / (rates["ar"][i] or 1.0) for r, i in zip(mode_rates, timed, strict=True)]
        entry = {"tokens_per_s": statistics.median(mode_rates),
                 "tokens_per_step": steps[mode][0] / max(steps[mode][1], 1),
                 "speedup_vs_ar": statistics.median(ratio)}
        if mode.startswith("fixed."):
            out.setdefault("fixed", {})[mode.split(".")[1]] = entry
        else:
            out[mode] = entry
    if "adaptive" in out:
        out["adaptive"]["k_histogram"] = {str(k): v for k, v in sorted(k_hist.items())}
        # Paired: each prompt's adaptive rate over its fixed-K rate, so that how hard a
        # prompt is (and the autoregressive run's own noise) drops out.
        out["adaptive"]["vs_fixed"] = {
            mode.split(".")[1]: statistics.median(
                (rates["adaptive"][i] or 0.0) / (rates[mode][i] or 1.0) for i in timed)
            for mode in modes if mode.startswith("fixed.")}
    if "both" in out:  # paired, as above: both sources against each alone
        out["both"]["vs_single"] = {
            mode: statistics.median((rates["both"][i] or 0.0) / (rates[mode][i] or 1.0)
                                    for i in timed)
            for mode in ("adaptive", "context") if mode in modes}
    out["acceptance_by_position"] = [a / v if v else None for a, v in acc_pos]
    return out


def format_report(result: dict[str, Any]) -> str:
    drafter = result.get("drafter", "MTP")  # the MTP modules, or an assistant in their place
    rows = [("autoregressive", result["ar"])]
    rows += [(f"{drafter} K={k}", e) for k, e in result.get("fixed", {}).items()]
    rows += [(name, result[mode]) for mode, name in (
        ("adaptive", f"{drafter} adaptive K"), ("context", "context drafts"),
        ("both", "both, chosen live")) if mode in result]
    width = max(18, *(len(name) + 2 for name, _ in rows))
    lines = [f"{'mode':<{width}}{'tokens/s':>10}{'tokens/step':>13}{'vs AR':>8}"]
    lines += [f"{name:<{width}}{e['tokens_per_s']:>10.1f}{e['tokens_per_step']:>13.2f}"
              f"{e['speedup_vs_ar']:>7.2f}x" for name, e in rows]
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in result["acceptance_by_position"])
    if acc:  # of the largest fixed K run
        top = len(result["acceptance_by_position"])
        lines.append(f"acceptance by draft position ({drafter} K={top}): {acc}")
    if "adaptive" in result:
        hist = " ".join(f"{k}:{v}" for k, v in result["adaptive"]["k_histogram"].items())
        lines.append(f"adaptive K histogram (K:steps): {hist}")
        vs = " ".join(f"K={k}:{r:.3f}" for k, r in result["adaptive"]["vs_fixed"].items())
        lines.append(f"adaptive / fixed K, median of per-prompt ratios: {vs or '-'}")
    if "both" in result:
        vs = " ".join(f"{drafter if m == 'adaptive' else m}:{r:.3f}"
                      for m, r in result["both"]["vs_single"].items())
        lines.append(f"both / one source, median of per-prompt ratios: {vs or '-'}")
        used = ", ".join(f"{src} {c['steps']} steps, {c['accepted']}/{c['drafted']} kept"
                         for src, c in result["both"]["by_source"].items())
        lines.append(f"both: drafts by source: {used or 'none'}")
    if "peer" in result:
        peer = result["peer"]
        vs = ", ".join(f"{'autoregressive' if m == 'ar' else m} {peer[f'{m}_vs_peer']:.2f}x"
                       for m in ("ar", "adaptive", "context", "both") if f"{m}_vs_peer" in peer)
        spec = f", {peer['args']}" if peer.get("args") else ""
        steps = f", {peer['tokens_per_step']:.2f} tokens/step" \
            if peer.get("tokens_per_step") else ""
        lines.append(f"peer (llama-server, greedy, same threads{spec}): "
                     f"{peer['tokens_per_s']:.1f} tokens/s{steps}; "
                     f"ours vs the peer, median of per-prompt ratios: {vs}; "
                     f"same tokens as ours: {peer['same_tokens']} of {peer['compared']} "
                     "prompts without a forced start")
    lines.append(f"first line exact match: {result['first_line_exact_match']:.2f}")
    if "heldout_loss" in result:
        lines.append(f"held-out loss (nats/token): {result['heldout_loss']:.3f}")
    lines.append(f"identical to autoregressive: {result['identical_to_ar']} "
                 f"({result['num_prompts']} prompts, {result['timed_prompts']} timed, "
                 f"medians over prompts; exact: {result.get('exact', '-')})")
    if "load_s" in result:
        lines.append(load_line(result["load_s"]))
    return "\n".join(lines)


def load_line(seconds: dict[str, float]) -> str:
    """Where loading went (`Engine.load_seconds`); "costs" holds compiling and capturing."""
    names = {"weights": "weights (reading, quantizing)",
             "costs": "step costs (compiling, capturing)"}
    return "load: " + ", ".join(f"{names.get(k, k)} {v:.1f} s" for k, v in seconds.items())
