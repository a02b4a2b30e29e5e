"""`ahead generate` and `ahead complete`: code from the command line.

Both go through the daemon (started when nobody answers) unless `--no-daemon` runs the
engine in this process. Ctrl-C cancels the daemon's work for the request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from clients.common import CliError, load_engine, model_dir, serve_args, settings


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_generate(args: argparse.Namespace) -> int:
    """Print the completion if it passes the quality rules (engine/decode/quality.py), else
    nothing and one line saying why; `--raw` streams whatever the model writes, then why
    it stopped."""
    from engine.decode import quality

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise CliError("empty prompt")
    if args.model:
        model_dir(args)  # a clear error for a bad --model, before any output
    threshold = settings().min_confidence if args.min_confidence is None \
        else args.min_confidence
    stream = args.raw and not args.json
    if stream:
        _write(prompt)
    t0 = time.perf_counter()
    text, reason, stats = (_generate_here if args.no_daemon else _generate_daemon)(
        args, prompt, _write if stream else None)
    stats["total_ms"] = round((time.perf_counter() - t0) * 1000, 1)
    mean, low = stats.pop("mean_logprob"), stats.pop("min_logprob")
    scores = None if mean is None else quality.Confidence(mean, low, stats["tokens"])
    if not args.raw:  # a text that fell into a loop keeps what came before it
        text, withheld = quality.judged(text, reason, scores, threshold)
    else:
        withheld = None
    stats.update(finish_reason=reason, withheld=withheld,
                 confidence=None if scores is None else round(scores.score, 3),
                 min_logprob=None if scores is None else round(scores.min_logprob, 2))
    if args.json:
        verdict = {k: stats[k] for k in ("finish_reason", "withheld", "confidence",
                                          "min_logprob")}
        json.dump({"prompt": prompt, "completion": text, **verdict, "stats": stats}, sys.stdout)
        sys.stdout.write("\n")
    elif withheld is None:
        _write(("" if stream else prompt + text) + "\n")
    if args.stats and not args.json:
        print(" ".join(f"{k}={v}" for k, v in stats.items()), file=sys.stderr)
    if not args.json and (withheld or reason not in ("stop", "length")):
        print(f"ahead: {_why(withheld, reason, scores, threshold)}", file=sys.stderr)
    return 0


def _why(withheld: str | None, reason: str | None, scores: Any, threshold: float) -> str:
    """One line on why nothing was shown, or why the text stopped where it did."""
    if withheld is None:
        return f"stopped: {reason}" + (" (the model's text went round in a loop)"
                                       if reason == "repetition" else "")
    said = {"repetition": "the model's text went round in a loop",
            "empty": "the model wrote nothing",
            "low_confidence": f"the model is not sure of it (confidence "
                              f"{scores.score if scores else 0:.2f} < {threshold:.2f})"}
    return f"no completion: {said.get(withheld, withheld)} [--raw shows it]"


def _generate_here(args: argparse.Namespace, prompt: str,
                   emit: Any) -> tuple[str, str | None, dict[str, Any]]:
    from engine import GenParams

    engine = load_engine(args)
    built = engine.text_prompt(prompt)
    params = GenParams(max_new_tokens=args.max_tokens, temperature=args.temperature,
                       top_p=args.top_p, stop=tuple(args.stop), seed=args.seed, k=args.k,
                       speculative=not args.no_spec, forced=built.forced)
    gen = engine.generate(built.ids, params, on_step=lambda s: emit(s.text) if emit else None)
    s = gen.stats
    decoded = max(len(gen.tokens) - 1, 0)
    return gen.text, gen.finish_reason, {
        "tokens": len(gen.tokens),
        "tokens_per_s": round(decoded / s.decode_s, 1) if s.decode_s else None,
        "accepted_per_step": round(s.accepted / s.steps, 2) if s.steps else None,
        "k_histogram": dict(sorted(s.k_hist.items())),
        "prefill_ms": round(s.prefill_s * 1000, 1),
        "mean_logprob": s.mean_logprob, "min_logprob": s.min_logprob}


def _generate_daemon(args: argparse.Namespace, prompt: str,
                     emit: Any) -> tuple[str, str | None, dict[str, Any]]:
    from daemon import protocol as p

    msg = p.Generate(id=0, prompt=prompt, max_tokens=args.max_tokens,
                     temperature=args.temperature, top_p=args.top_p, stop=list(args.stop),
                     k=args.k, speculative=not args.no_spec, seed=args.seed)
    done = _through_daemon(args, msg, emit)
    return done.text, done.finish_reason, {**_daemon_stats(done.stats),
                                           "mean_logprob": done.mean_logprob,
                                           "min_logprob": done.min_logprob}


def _through_daemon(args: argparse.Namespace, msg: Any, emit: Any) -> Any:
    from daemon.client import DaemonUnavailable, RequestFailed, SyncClient

    try:
        with SyncClient(serve_args=serve_args(args), client_name="ahead-cli") as client:
            for text in client.stream(msg):
                if emit:
                    emit(text)
            assert client.done is not None
            return client.done
    except DaemonUnavailable as e:
        raise CliError(f"{e} (or run with --no-daemon)") from None
    except RequestFailed as e:
        raise CliError(f"the daemon refused the request: {e.message}") from None


def _daemon_stats(s: Any) -> dict[str, Any]:
    decoded = max(s.tokens - 1, 0)
    return {"tokens": s.tokens,
            "tokens_per_s": round(decoded / (s.engine_ms / 1000), 1) if s.engine_ms else None,
            "accepted_per_step": round(s.accepted / s.steps, 2) if s.steps else None,
            "k_histogram": {int(k): v for k, v in sorted(s.k_histogram.items())},
            "queue_ms": round(s.queue_ms, 1), "engine_ms": round(s.engine_ms, 1)}


def parse_location(spec: str) -> tuple[Path, int, int]:
    """FILE:LINE:COL, 1-based like compilers print them; COL counts characters."""
    try:
        path, line, col = spec.rsplit(":", 2)
        return Path(path), int(line), int(col)
    except ValueError:
        raise CliError(f"expected FILE:LINE:COL (1-based), got {spec!r}") from None


def cmd_complete(args: argparse.Namespace) -> int:
    from lsp.context import cursor_window
    from lsp.postprocess import ask_for, cursor_lines, postprocess

    path, line, col = parse_location(args.location)
    try:
        text = sys.stdin.read() if str(path) == "-" else path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CliError(f"cannot read {path}: {e}") from None
    lines = text.split("\n")
    if not 1 <= line <= len(lines) or not 1 <= col <= len(lines[line - 1]) + 1:
        raise CliError(f"{path} has no line {line}, column {col}")
    offset = sum(len(x) + 1 for x in lines[:line - 1]) + col - 1
    window = cursor_window(text, offset)
    c = cursor_lines(window.prefix, window.suffix)
    multiline, floor = ask_for(c)
    raw = _complete_here(args, window.prefix, window.suffix, multiline, floor) \
        if args.no_daemon else \
        _complete_daemon(args, path, window.prefix, window.suffix, multiline, floor)
    shown = postprocess(raw, line_before_cursor=c.before, line_after_cursor=c.after,
                        suffix=window.suffix, multiline=multiline)
    if args.json:
        json.dump({"file": str(path), "line": line, "column": col, "completion": shown,
                   "multiline": multiline}, sys.stdout)
        sys.stdout.write("\n")
    elif shown:
        _write(shown + "\n")
    return 0


def _complete_here(args: argparse.Namespace, prefix: str, suffix: str, multiline: bool,
                   floor: int) -> str:
    from engine import GenParams
    from engine.decode import quality

    engine = load_engine(args)
    prompt = engine.fill_in_prompt(prefix, suffix, max_new_tokens=args.max_tokens)
    params = GenParams(max_new_tokens=args.max_tokens, stop=() if multiline else ("\n",),
                       forced=prompt.forced, indent_floor=floor)
    gen = engine.generate(prompt.ids, params)
    shown, _ = quality.judged(gen.text, gen.finish_reason, gen.confidence,
                              settings().min_confidence, prefix=prefix, suffix=suffix)
    return shown  # as the daemon answers an editor


def _complete_daemon(args: argparse.Namespace, path: Path, prefix: str, suffix: str,
                     multiline: bool, floor: int) -> str:
    from daemon import protocol as p

    msg = p.Complete(id=0, session="cli", document=str(path.resolve()), prefix=prefix,
                     suffix=suffix, path=str(path), max_tokens=args.max_tokens,
                     multiline=multiline, indent_floor=floor, priority="cli")
    return str(_through_daemon(args, msg, None).text)
