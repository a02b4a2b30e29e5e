"""`ahead bench quality`: would a person keep what ahead shows?

At cursor positions sampled (seeded) from the given code, the rest of the line is taken out
and the model asked for it the way an editor asks (the LSP's prompt windows, its multi-line
rule and post-processing): line starts (after a line end), mid-line, the first line after a
`def` and lines inside bodies. For each position: whether a suggestion is shown, whether its
first line is exactly the author's, and how much of it, character by character from the
start, is the author's. Docstrings: functions whose docstring the authors wrote have it
taken out and written as the hook writes it; its first line is compared with theirs
(similarity), and each written one judged junk or not by the bench's own check
(clients/bench/docquality.py), with the docstring gate and, as before it, without.

Each position runs twice: without the rules (no loop stop, nothing withheld) and with them
(loop stop, echo rule, threshold); the second is then swept over thresholds.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.bench.docquality import (
    choose_docstring_threshold,
    docstring_at,
    sample_docstrings,
    summary,
)
from engine import Engine, GenParams
from engine.decode import quality
from lsp.postprocess import ask_for, cursor_lines, postprocess

KINDS = ("line_start", "mid_line", "after_def", "body")
THRESHOLDS = (0.0, 0.1, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7)


@dataclass(frozen=True, slots=True)
class Cursor:
    source: str
    kind: str
    prefix: str
    suffix: str
    expected: str  # the rest of the line the author wrote


@dataclass(slots=True)
class Answer:
    text: str  # what would be shown with no threshold (after the rules, if on)
    withheld: str | None  # the rules' verdict at threshold 0
    score: float  # the confidence
    exact: bool
    prefix_share: float  # share of the shown first line that is the author's, from the start


def sample_cursors(files: list[Path], num: int, seed: int, *, prefix_chars: int = 1500,
                   suffix_chars: int = 500) -> list[Cursor]:
    """`num` cursors, the kinds taking turns: line starts, mid-line (after a word or an
    opening bracket, an operator or a space), the first statement of a function after its
    header (and docstring), and lines inside bodies."""
    rng = random.Random(seed)
    texts = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        lines = text.splitlines(keepends=True)
        texts.append((f, text, lines, _def_bodies(text)))
    out: list[Cursor] = []
    tries = 0
    while len(out) < num and tries < num * 200:
        tries += 1
        kind = KINDS[tries % len(KINDS)]  # in turn (a kind a file lacks is skipped)
        f, text, lines, defs = rng.choice(texts)
        i = (rng.choice(defs) if defs else None) if kind == "after_def" \
            else _pick_line(lines, kind, rng)
        if i is None:
            continue
        line = lines[i].rstrip("\n")
        code = len(line) - len(line.lstrip())
        if kind == "mid_line":
            cuts = [m.end() for m in re.finditer(r"[\w)\]]+[ (.=,\[]", line)
                    if code < m.end() < len(line) - 2]
            if not cuts:
                continue
            col = rng.choice(cuts)
        else:
            col = code
        start = sum(map(len, lines[:i]))
        cut, end = start + col, start + len(line)
        expected = text[cut:end]
        if not expected.strip() or line.lstrip().startswith("#"):
            continue
        out.append(Cursor(f"{f.name}:{i + 1}", kind, text[max(0, cut - prefix_chars):cut],
                          text[end:end + suffix_chars], expected))
    return out


def _def_bodies(text: str) -> list[int]:
    """0-based lines of each function's first statement after its docstring, if any."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            if body and body[0].lineno > node.lineno:
                out.append(body[0].lineno - 1)
    return sorted(out)


def _pick_line(lines: list[str], kind: str, rng: random.Random) -> int | None:
    i = rng.randrange(1, len(lines))
    prev = lines[i - 1].strip()
    if not lines[i].strip():
        return None
    if kind == "body":
        indent = len(lines[i]) - len(lines[i].lstrip())
        return i if indent >= 8 and prev and not prev.endswith(":") else None
    return i


def complete_at(engine: Engine, c: Cursor, *, rules: bool, max_tokens: int) -> Answer:
    """The suggestion the editor would get at `c` (threshold 0), and how it compares."""
    cl = cursor_lines(c.prefix, c.suffix)
    multiline, floor = ask_for(cl)
    prompt = engine.fill_in_prompt(c.prefix, c.suffix, max_new_tokens=max_tokens)
    gen = engine.generate(prompt.ids, GenParams(
        max_new_tokens=max_tokens, stop=() if multiline else ("\n",), forced=prompt.forced,
        stop_loops=rules, indent_floor=floor), slot="bench")
    scores = gen.confidence
    text, withheld = quality.judged(gen.text, gen.finish_reason, scores, 0.0, prefix=c.prefix,
                                    suffix=c.suffix) if rules else (gen.text, None)
    shown = "" if withheld else postprocess(text, line_before_cursor=cl.before,
                                            line_after_cursor=cl.after, suffix=c.suffix,
                                            multiline=multiline)
    first, want = shown.split("\n")[0].rstrip(), c.expected.rstrip()
    same = next((i for i, (a, b) in enumerate(zip(first, want, strict=False)) if a != b),
                min(len(first), len(want)))
    return Answer(shown, withheld, scores.score if scores else 0.0,
                  bool(first) and first == want, same / len(first) if first else 0.0)


def bench_quality(engine: Engine, files: list[Path], *, num: int = 120, docs: int = 40,
                  seed: int = 0, max_tokens: int = 48,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    cursors = sample_cursors(files, num, seed)
    cases = sample_docstrings(files, docs, seed)
    runs: dict[str, Any] = {}
    for rules in (False, True):
        name = "after" if rules else "before"
        answers = []
        for i, c in enumerate(cursors):
            answers.append(complete_at(engine, c, rules=rules, max_tokens=max_tokens))
            if progress:
                progress(f"{name}: completion {i + 1}/{len(cursors)}")
        written = []
        for i, d in enumerate(cases):
            written.append((d, *docstring_at(engine, d, rules=rules, max_tokens=max_tokens)))
            if progress:
                progress(f"{name}: docstring {i + 1}/{len(cases)}")
        runs[name] = {"completions": [(c, a) for c, a in zip(cursors, answers, strict=True)],
                      "docstrings": written}
    return summarise(runs)


def _inline(pairs: list[tuple[Cursor, Answer]], threshold: float) -> dict[str, Any]:
    shown = [(c, a) for c, a in pairs if a.text.strip() and a.score >= threshold]
    n = len(shown)
    return {"positions": len(pairs), "shown_rate": n / len(pairs) if pairs else 0.0,
            "exact_of_shown": sum(a.exact for _, a in shown) / n if n else 0.0,
            "prefix_of_shown": sum(a.prefix_share for _, a in shown) / n if n else 0.0,
            "exact_of_all": sum(a.exact for _, a in shown) / len(pairs) if pairs else 0.0,
            "by_kind": {k: sum(a.exact for c, a in shown if c.kind == k) /
                        max(1, sum(c.kind == k for c, _ in shown)) for k in KINDS}}


def summarise(runs: dict[str, Any]) -> dict[str, Any]:
    """"before": no rules (no loop stop, nothing withheld); then each threshold with the rules,
    docstrings judged with the gate and, as before it, by the loop rules alone."""
    before, after = runs["before"], runs["after"]
    return {
        "before": {"inline": _inline(before["completions"], 0.0),
                   "docstrings": summary(before["docstrings"], 0.0, gate=False)},
        "sweep": [{"threshold": t, "inline": _inline(after["completions"], t),
                   "docstrings": summary(after["docstrings"], t, gate=True),
                   "docstrings_no_gate": summary(after["docstrings"], t, gate=False)}
                  for t in THRESHOLDS],
    }


def choose(result: dict[str, Any], *, min_shown: float,
           min_written: float) -> dict[str, float | None]:
    """The thresholds the defaults come from: for inline completions, the one that maximises
    the exact match of what is shown while at least `min_shown` of the positions get a
    suggestion; for docstrings, `choose_docstring_threshold` (None: write none)."""
    sweep = result["sweep"]
    ok = [r for r in sweep if r["inline"]["shown_rate"] >= min_shown] or sweep[:1]
    inline = max(ok, key=lambda r: (r["inline"]["exact_of_shown"], -r["threshold"]))
    positions = result["before"]["inline"]["positions"]
    return {"min_confidence": inline["threshold"] if positions else None,
            "docstring_min_confidence": choose_docstring_threshold(sweep, min_written),
            "docstring_min_written": min_written}


def format_report(result: dict[str, Any]) -> str:
    b = result["before"]
    head = (f"{'':<26}{'shown':>7}{'exact':>7}{'prefix':>8}{'exact/all':>10}"
            f"{'docs':>7}{'sim':>6}{'junk':>7}{'no gate: docs':>15}{'junk':>7}")

    def docs(d: dict[str, Any]) -> str:
        return f"{d['written']:>4d}/{d['cases']:<3d}{d['junk_written']:>6d}"

    def row(label: str, i: dict[str, Any], d: dict[str, Any],
            ungated: dict[str, Any] | None) -> str:
        return (f"{label:<26}{i['shown_rate']:>7.2f}{i['exact_of_shown']:>7.2f}"
                f"{i['prefix_of_shown']:>8.2f}{i['exact_of_all']:>10.2f}"
                f"{d['written']:>4d}/{d['cases']:<3d}{d['similarity']:>5.2f}"
                f"{d['junk_written']:>6d}" + (f"{'':>6}{docs(ungated)}" if ungated else ""))

    lines = [f"{b['inline']['positions']} cursor positions, {b['docstrings']['cases']} "
             "docstrings (junk: the bench's own check, not the gate)", head,
             row("before (no rules)", b["inline"], b["docstrings"], None)]
    for r in result["sweep"]:
        lines.append(row(f"rules, threshold {r['threshold']:.2f}", r["inline"], r["docstrings"],
                         r["docstrings_no_gate"]))
    if "chosen" in result:
        c = result["chosen"]
        doc = c["docstring_min_confidence"]
        inline = c["min_confidence"]
        lines.append(f"chosen: min_confidence = {'-' if inline is None else inline}, "
                     f"docstring_min_confidence = {doc if doc is not None else 'none'}" + (
                         "" if doc is not None else
                         f" (no threshold writes {c['docstring_min_written']:.0%} of the "
                         "docstrings with none junk: the hook writes none with this model)"))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Quality against the threshold, as a PNG (needs matplotlib: the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = [r["threshold"] for r in result["sweep"]]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("shown_rate", "shown rate"), ("exact_of_shown", "exact match of shown"),
                       ("prefix_of_shown", "char-prefix match of shown")):
        ax.plot(ts, [r["inline"][key] for r in result["sweep"]], marker="o", label=label)
    ax.plot(ts, [r["docstrings"]["written_rate"] for r in result["sweep"]], ls="--",
            label="docstrings written")
    ax.plot(ts, [r["docstrings"]["junk_written"] / max(1, r["docstrings"]["written"])
                 for r in result["sweep"]], ls="--", label="junk share of written")
    ax.set_xlabel("confidence threshold (geometric-mean token probability)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
