"""`ahead bench engine`: autoregressive vs MTP decoding (each fixed K and adaptive K) side by side.

Every prompt is run in every mode in turn, from a cold cache, so all modes see the same
machine noise; tokens per second are reported as medians over prompts, and speed-ups as the
median of per-prompt ratios.
"""

from __future__ import annotations

import random
import statistics
import sysconfig
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.generate import Engine, Generation, GenParams


def heldout_files() -> list[Path]:
    """The default prompt source: standard-library modules held out by a fixed rule.

    The rule (crc32 of the file name divisible by 10) is the one training uses to keep these
    files out of the training set.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(f for f in root.glob("*.py") if zlib.crc32(f.name.encode()) % 10 == 0)


@dataclass(slots=True)
class Prompt:
    source: str
    ids: list[int]


def cursor_prompts(engine: Engine, files: list[Path], num: int, seed: int, *,
                   max_tokens: int, prefix_chars: int = 1500,
                   suffix_chars: int = 500) -> list[Prompt]:
    """FIM prompts cut at random cursor positions (start of a non-blank line's code),
    shortened from the far ends until they fit `max_tokens`."""
    rng = random.Random(seed)
    texts = []
    for f in files:
        try:
            texts.append((f, f.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read prompt file {f}: {e}") from None
    texts = [(f, t) for f, t in texts if len(t) > 200]
    if not texts:
        raise ValueError("no usable prompt files (each needs over 200 characters of text)")
    tok = engine.tokenizer
    prompts = []
    for _ in range(num):
        f, text = rng.choice(texts)
        lines = text.splitlines(keepends=True)
        i = rng.randrange(1, len(lines))
        cut = sum(map(len, lines[:i])) + len(lines[i]) - len(lines[i].lstrip())
        before, after = prefix_chars, suffix_chars
        while True:
            prefix, suffix = text[max(0, cut - before):cut], text[cut:cut + after]
            ids = tok.fim_prompt(prefix, suffix) if tok.fim else tok.encode_text(prefix)
            if len(ids) <= max_tokens or before < 16:
                break
            before, after = before * 3 // 4, after * 3 // 4
        prompts.append(Prompt(f"{f.name}:{i + 1}", ids))
    return prompts


def _run(engine: Engine, prompt: Prompt, params: GenParams) -> Generation:
    engine.runner.reset()  # every mode prefills from scratch
    return engine.generate(prompt.ids, params)


def bench_engine(engine: Engine, prompts: list[Prompt], *, max_new_tokens: int = 64,
                 ks: list[int] | None = None,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    ks = list(range(1, engine.k_max + 1)) if ks is None else ks
    modes: dict[str, GenParams] = {"ar": GenParams(max_new_tokens, speculative=False)}
    if engine.k_max:
        modes |= {f"fixed.{k}": GenParams(max_new_tokens, k=k) for k in ks}
        modes["adaptive"] = GenParams(max_new_tokens)
    _run(engine, prompts[0], modes["adaptive" if engine.k_max else "ar"])  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in modes}
    steps: dict[str, list[int]] = {m: [0, 0] for m in modes}  # tokens, verify steps
    k_hist: Counter[int] = Counter()
    acc_pos: list[list[int]] = [[0, 0] for _ in range(engine.k_max)]
    identical = True
    for n, prompt in enumerate(prompts):
        ar_tokens: list[int] = []
        for mode, params in modes.items():
            gen = _run(engine, prompt, params)
            s = gen.stats
            rates[mode].append((len(gen.tokens) - 1) / max(s.decode_s, 1e-9))
            steps[mode][0] += s.steps + s.accepted
            steps[mode][1] += s.steps
            if mode == "ar":
                ar_tokens = gen.tokens
            identical &= gen.tokens == ar_tokens
            if mode == "adaptive":
                k_hist.update(s.k_hist)
            if mode == f"fixed.{engine.k_max}":
                for i, (a, v) in enumerate(zip(s.accepted_by_pos, s.verified_by_pos, strict=True)):
                    acc_pos[i][0] += a
                    acc_pos[i][1] += v
        if progress:
            progress(n + 1, len(prompts))
    return _summary(modes, rates, steps, k_hist, acc_pos, identical, len(prompts))


def _summary(modes: dict[str, GenParams], rates: dict[str, list[float]],
             steps: dict[str, list[int]], k_hist: Counter[int], acc_pos: list[list[int]],
             identical: bool, num_prompts: int) -> dict[str, Any]:
    out: dict[str, Any] = {"num_prompts": num_prompts, "identical_to_ar": identical}
    for mode in modes:
        ratio = [r / a for r, a in zip(rates[mode], rates["ar"], strict=True)]
        entry = {"tokens_per_s": statistics.median(rates[mode]),
                 "tokens_per_step": steps[mode][0] / max(steps[mode][1], 1),
                 "speedup_vs_ar": statistics.median(ratio)}
        if mode.startswith("fixed."):
            out.setdefault("fixed", {})[mode.split(".")[1]] = entry
        else:
            out[mode] = entry
    if "adaptive" in out:
        out["adaptive"]["k_histogram"] = {str(k): v for k, v in sorted(k_hist.items())}
    out["acceptance_by_position"] = [a / v if v else None for a, v in acc_pos]
    return out


def format_report(result: dict[str, Any]) -> str:
    rows = [("autoregressive", result["ar"])]
    rows += [(f"MTP K={k}", e) for k, e in result.get("fixed", {}).items()]
    if "adaptive" in result:
        rows.append(("MTP adaptive K", result["adaptive"]))
    lines = [f"{'mode':<16}{'tokens/s':>10}{'tokens/step':>13}{'vs AR':>8}"]
    lines += [f"{name:<16}{e['tokens_per_s']:>10.1f}{e['tokens_per_step']:>13.2f}"
              f"{e['speedup_vs_ar']:>7.2f}x" for name, e in rows]
    acc = ", ".join("-" if a is None else f"{a:.2f}" for a in result["acceptance_by_position"])
    lines.append(f"acceptance by draft position (K=max): {acc or '-'}")
    if "adaptive" in result:
        hist = " ".join(f"{k}:{v}" for k, v in result["adaptive"]["k_histogram"].items())
        lines.append(f"adaptive K histogram (K:steps): {hist}")
    lines.append(f"identical to autoregressive: {result['identical_to_ar']} "
                 f"({result['num_prompts']} prompts, medians over prompts)")
    return "\n".join(lines)
