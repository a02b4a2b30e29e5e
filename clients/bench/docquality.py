"""The docstring half of `ahead bench quality`: functions whose authors wrote a docstring
have it taken out and written as the hook writes it, then judged.

Each is judged twice: by the hook's own rules (the quality rules, the threshold and the
docstring gate, engine/decode/docgate.py) and by `junk`, this module's own check of what a
person would delete by hand, which shares no code with the gate, so the gate does not grade
itself. `outside_code` finds code from outside the standard library to run it on: installed
projects that ahead depends on and that the bundled model never saw in training.
"""

from __future__ import annotations

import ast
import builtins
import difflib
import hashlib
import importlib.metadata
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clients.docstring_edit import (
    QUOTES,
    Target,
    clean,
    fim_request,
    module_names,
    parameters,
    split_lines,
)
from engine import Engine, GenParams
from engine.bundled import bundled_model_dir
from engine.decode import docgate, quality

# Permissively licensed projects ahead installs and its training corpus does not hold.
OUTSIDE = ("pygls", "watchfiles")
_WORDS = re.compile(r"\w+")
_HEADER = re.compile(r"^(async\s+def|def|class|if|elif|else|for|while|with|try|except|"
                     r"finally|return|yield|raise|import|from|assert|@)\b")
_PARAM_LINES = (re.compile(r"^\s*:param\s+(?:[\w\[\], .]+\s+)?\*{0,2}(\w+)\s*:"),  # reST
                re.compile(r"^\s*\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s"),  # Google, in Args
                re.compile(r"^\s*\*{0,2}(\w+)\s+:\s"))  # numpydoc, in Parameters
_ARGS_HEADERS = {"args", "arguments", "parameters", "params", "keyword arguments",
                 "other parameters"}
_LABEL_ROLES = ("ref", "doc", "term", "pep", "rfc", "envvar", "option", "kbd", "file", "math")
_SECTIONS = {"returns", "return", "yields", "raises", "examples", "example", "notes", "note",
             "see also", "references", "attributes", "warns", "warnings"}


@dataclass(frozen=True, slots=True)
class DocCase:
    source: str
    prefix: str
    suffix: str
    expected: str  # the first line of the authors' docstring
    context: docgate.DocContext  # what the docstring may name (the hook's gate)
    params: tuple[str, ...] = ()  # for `junk`: every parameter name, as written


def sample_docstrings(files: list[Path], num: int, seed: int) -> list[DocCase]:
    """Functions with a docstring of their own on its own lines, the docstring taken out."""
    found: list[DocCase] = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines, names = split_lines(text), module_names(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            doc = ast.get_docstring(node)
            first = node.body[0]
            if not doc or first.end_lineno is None or first.lineno <= node.lineno \
                    or not lines[first.lineno - 1].lstrip().startswith(QUOTES):
                continue
            rest = [*lines[:first.lineno - 1], *lines[first.end_lineno:]]
            indent = lines[first.lineno - 1][:len(lines[first.lineno - 1])
                                             - len(lines[first.lineno - 1].lstrip())]
            target = Target(node.name, node.lineno, first.lineno - 1, indent, "\n")
            prefix, suffix = fim_request(rest, target)
            args = node.args
            every = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs,
                                     *filter(None, (args.vararg, args.kwarg)))]
            found.append(DocCase(f"{f.name}:{node.lineno}", prefix, suffix,
                                 doc.strip().split("\n")[0],
                                 docgate.DocContext(node.name, parameters(node), *names),
                                 tuple(every)))
    random.Random(seed).shuffle(found)
    return found[:num]


def degenerate(text: str) -> bool:
    """No words, or a word trigram said twice."""
    words = [w.lower() for w in _WORDS.findall(text)]
    grams = list(zip(words, words[1:], words[2:], strict=False))
    return not words or len(set(grams)) < len(grams)


def junk(text: str, case: DocCase) -> str | None:
    """Why a person would delete this docstring by hand, or None: it says nothing or goes
    round in a loop; a line of it is Python code (outside a doctest's lines and an indented
    block after a `::` line); it documents a parameter the function does not have; its
    example imports a module the file does not."""
    if degenerate(text):
        return "no words, or words said over again"
    params = set(case.params)
    in_args = literal = doctest = False
    for raw in text.split("\n"):
        line = raw.strip()
        if not line:
            doctest = False
            continue
        if literal and raw[:1].isspace():
            continue
        literal = line.endswith("::")
        if line.startswith((">>>", "...")):
            doctest = True
            m = re.match(r"(?:>>>|\.\.\.)\s*(?:from|import)\s+(\w+)", line)
            if m and m.group(1) not in case.context.imports:
                return f"its example imports {m.group(1)}, which the file does not"
            continue
        if doctest:  # a doctest's expected output
            continue
        header = line.rstrip(":").lower()
        if header in _ARGS_HEADERS or header in _SECTIONS:
            in_args = header in _ARGS_HEADERS
            continue
        if set(line) <= set("-="):  # a numpydoc underline
            continue
        for i, pattern in enumerate(_PARAM_LINES):
            m = pattern.match(raw)
            if m and (i == 0 or in_args) and m.group(1) not in params:
                return f"documents a parameter it does not have: {m.group(1)}"
        if _is_code(line):
            return f"a line of code: {line!r}"
        if why := _references(line, case):
            return why
    return None


def _references(line: str, case: DocCase) -> str | None:
    """A `:role:` marker must be followed by a `target` in backquotes that names something
    of the file's (its last dotted part), a builtin, or a module it imports."""
    line = re.sub(r"^:\w+(?:\s[^:`]*)?:(?=\s|$)", "", line)  # a field: `:param x:`
    for m in re.finditer(r"(?:^|\s|\()(:[\w:+.-]+:?)(`[^`]*`)?", line):
        marker, target = m.group(1), m.group(2)
        if not target:
            return f"a role with no reference: {marker!r}"
        name = target.strip("`~!").removesuffix("()").rpartition(".")[2]
        if name not in case.context.names and name not in case.params \
                and name not in case.context.imports and not hasattr(builtins, name) \
                and not marker.strip(":").endswith(_LABEL_ROLES):
            return f"a reference to {target}, which nothing in the file is called"
    return None


def _is_code(line: str) -> bool:
    if re.match(r"(if|for|while|return|raise|assert|with|elif|import|from)\s", line) \
            and re.search(r"\w\.\w|\w_\w|[()=\[\]]", line):  # `if self.ready`
        return True
    if _HEADER.match(line) and (line.endswith(":") or "(" in line or "=" in line
                                or line.startswith(("return ", "import ", "from ", "@"))):
        return not _sentence(line)
    try:
        body = ast.parse(line).body
    except SyntaxError:
        return False
    return any(_statement(s) for s in body)


_CODE_EXPR = (ast.Call, ast.Attribute, ast.Subscript, ast.BinOp, ast.Lambda, ast.ListComp,
              ast.DictComp, ast.Await, ast.Compare, ast.BoolOp)


def _statement(s: ast.stmt) -> bool:
    """Code, not words: anything but an expression or an annotation without a value (`b: int`
    documents b); an expression that calls, indexes, computes or compares."""
    if isinstance(s, ast.AnnAssign):
        return s.value is not None
    return not isinstance(s, ast.Expr) or isinstance(s.value, _CODE_EXPR)


def _sentence(line: str) -> bool:
    """Prose that starts with a keyword ('Return the sum.', 'If x is set, ...'): a capital
    letter and no operator or bracket a statement would need."""
    return line[:1].isupper() and not re.search(r"[=()\[\]{}]|\.\w+\(", line)


def docstring_at(engine: Engine, d: DocCase, *, rules: bool,
                 max_tokens: int) -> tuple[str, float, str | None]:
    """The docstring the model writes for `d`, its confidence, and why the hook's rules
    (loops, at threshold 0; then the gate) would skip it, or None. Without `rules`: no loop
    stop, and no verdict."""
    prompt = engine.fill_in_prompt(d.prefix, d.suffix, max_new_tokens=max_tokens)
    gen = engine.generate(prompt.ids, GenParams(max_new_tokens=max_tokens, stop=(QUOTES,),
                                                forced=prompt.forced, stop_loops=rules),
                          slot="bench")
    scores, text = gen.confidence, clean(gen.text)
    why = None
    if rules:
        why = quality.verdict(text, gen.finish_reason, scores, 0.0) or \
            ("nothing" if not text else None)
        if why is None and (problem := docgate.problem(text, d.context)) is not None:
            why = f"gate: {problem}"
    return text, (scores.score if scores else 0.0), why


Written = tuple[DocCase, str, float, str | None]  # case, text, confidence, rules' verdict


def summary(written: list[Written], threshold: float, *, gate: bool) -> dict[str, Any]:
    """What the hook writes at `threshold` (with the gate, or with the loop rules alone, as
    before the gate): how many, how close to the authors' first lines, and how many are junk
    by `junk`, each quoted with its reason."""
    kept = [(d, t) for d, t, s, why in written if t and s >= threshold
            and (why is None or (not gate and not why.startswith("gate:")))]
    n = len(kept)
    bad = [(d.source, t, why) for d, t in kept if (why := junk(t, d)) is not None]
    return {"cases": len(written), "written": n,
            "written_rate": n / len(written) if written else 0.0,
            "similarity": sum(_similarity(t.split("\n")[0], d.expected) for d, t in kept) / n
            if n else 0.0,
            "junk_written": len(bad), "junk": bad,
            "texts": [(d.source, t) for d, t in kept]}


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()


def choose_docstring_threshold(sweep: list[dict[str, Any]], min_written: float) -> float | None:
    """Among the thresholds at which the hook writes at least `min_written` of the sample,
    the lowest with no junk docstring; None when none does (an empty sample never does):
    the hook then writes nothing with this model."""
    for r in sweep:
        d = r["docstrings"]
        if d["cases"] and d["written_rate"] >= min_written and d["junk_written"] == 0:
            return float(r["threshold"])
    return None


def outside_code() -> tuple[list[Path], list[dict[str, str]]]:
    """The Python files of OUTSIDE, as installed, with each project's version and licence;
    an error if a file is one the bundled model was trained on."""
    files: list[Path] = []
    record = []
    for name in OUTSIDE:
        dist = importlib.metadata.distribution(name)
        meta = dist.metadata
        licence = meta["License-Expression"] or meta["License"] or next(
            (c.split("::")[-1].strip() for c in meta.get_all("Classifier") or []
             if c.startswith("License ::")), "unknown")
        found = sorted(Path(str(dist.locate_file(f))) for f in dist.files or []
                       if f.suffix == ".py" and f.parts[0] == name)
        files += found
        record.append({"project": name, "version": dist.version, "licence": licence,
                       "files": str(len(found))})
    trained = _trained_hashes()
    seen = [f for f in files if hashlib.sha256(f.read_bytes()).hexdigest() in trained]
    if seen:
        raise ValueError(f"{seen[0]} is in the bundled model's training corpus")
    return files, record


def _trained_hashes() -> set[str]:
    bundled = bundled_model_dir()
    manifest = bundled / "corpus-manifest.jsonl" if bundled else None
    if manifest is None or not manifest.is_file():
        return set()
    return {json.loads(line)["sha256"] for line in manifest.read_text().splitlines()
            if line.strip()}
