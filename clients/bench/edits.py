"""The editing workload of `ahead bench engine --workload edit`: code to write that repeats
code before it, as editing makes it.

Each prompt is cut from a real file: a function of it is copied right after itself, with
its name and one of its parameters renamed in its code (a second test case after a first, a
variant of a helper, a renamed variable carried through a body), and the cursor at the
start of the copy's body, after its indentation; the text to write is the original body
under the new names. Any Python file serves: nothing here knows the files it is given.
"""

from __future__ import annotations

import ast
import io
import random
import tokenize
from pathlib import Path

from clients.bench.engine import CursorPrompt
from engine import Engine

MIN_LINES, MAX_LINES = 3, 40  # body lines of a function worth copying


def edit_prompts(engine: Engine, files: list[Path], num: int, seed: int, *,
                 max_new_tokens: int, prefix_chars: int = 1500,
                 suffix_chars: int = 500) -> list[CursorPrompt]:
    """`num` prompts from the functions of `files` (see the module's docstring), the prefix
    reaching back at least to the original's first line."""
    rng = random.Random(seed)
    sites: list[tuple[Path, str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError) as e:
            raise ValueError(f"cannot read prompt file {f}: {e}") from None
        sites += [(f, text, node) for node in ast.walk(tree)
                  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                  and MIN_LINES <= (node.end_lineno or 0) - node.body[0].lineno + 1 <= MAX_LINES
                  and node.body[0].lineno > node.lineno]
    if not sites:
        raise ValueError(f"no function of {MIN_LINES}-{MAX_LINES} lines in the prompt files")
    prompts = []
    for _ in range(num):
        f, text, node = rng.choice(sites)
        lines = text.splitlines(keepends=True)
        start, body, end = node.lineno - 1, node.body[0].lineno - 1, node.end_lineno or 0
        renames = _renames(node, rng)
        header, code = (_rename("".join(lines[a:b]), renames)
                        for a, b in ((start, body), (body, end)))
        original_end = sum(map(len, lines[:end]))
        gap = "\n" if not lines[end - 1].endswith("\n") else ""
        indent = code[:len(code) - len(code.lstrip(" \t"))]
        prefix = text[:original_end] + gap + "\n" + header + indent
        reach = max(prefix_chars, len(prefix) - sum(map(len, lines[:start])))
        built = engine.fill_in_prompt(prefix[-reach:], text[original_end:][:suffix_chars],
                                      max_new_tokens=max_new_tokens)
        line = code.split("\n", 1)[0].strip()
        prompts.append(CursorPrompt(f"{f.name}:{node.lineno}+copy", built.ids, line,
                                    built.forced))
    return prompts


def _renames(node: ast.FunctionDef | ast.AsyncFunctionDef,
             rng: random.Random) -> dict[str, str]:
    """The copy's new names: the function's, and one parameter's (not self or cls)."""
    out = {node.name: node.name + "_other"}
    params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)
              if a.arg not in ("self", "cls")]
    if params:
        p = rng.choice(params)
        out[p] = p + "_new"
    return out


def _rename(code: str, renames: dict[str, str]) -> str:
    """`code` with its names renamed, its strings and comments as they were."""
    spans = []  # (start, end) offsets of the names to rename
    starts = [0]
    for line in code.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type == tokenize.NAME and tok.string in renames:
                at = starts[tok.start[0] - 1] + tok.start[1]
                spans.append((at, at + len(tok.string)))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass  # the names found before the piece stopped parsing are renamed
    for a, b in reversed(spans):
        code = code[:a] + renames[code[a:b]] + code[b:]
    return code
