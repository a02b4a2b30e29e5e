"""Adding docstrings to Python source text: where they go, the model's request for each, and
the insertion (kept only while the file still parses). No files, no model: see
`clients/docstrings.py` for the command around it."""

from __future__ import annotations

import ast
import io
import itertools
import re
import textwrap
import tokenize
import unicodedata
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

# Completion: (document, prefix, suffix) -> the model's text for the middle.
Completer = Callable[[str, str, str], str]

PREFIX_CHARS, SUFFIX_CHARS = 6000, 2000  # generous: the engine trims the prompt to its budget
QUOTES = '"""'
_INDENT = re.compile(r"[ \t\f]*")
_Def = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


class SourceError(Exception):
    """A file that cannot be read as UTF-8 Python source or does not parse."""


class NoCompletion(Exception):
    """The model gave no answer for one definition (the daemon refused or dropped it)."""


@dataclass(frozen=True, slots=True)
class Target:
    qualname: str
    lineno: int  # of the def or class keyword, 1-based, in the file as read
    at: int  # index of the line the docstring goes before: the one after the header
    indent: str  # the body's
    eol: str  # the header line's ending
    params: tuple[str, ...] = ()  # its parameters but self and cls (a class: its __init__'s)


@dataclass(slots=True)
class Outcome:
    added: list[tuple[Target, str]] = field(default_factory=list)  # (target, docstring text)
    skipped: list[tuple[Target, str]] = field(default_factory=list)  # (target, why)


def split_lines(text: str) -> list[str]:
    """Lines with their endings, split where Python's tokenizer splits (\\n, \\r\\n, \\r)."""
    return io.StringIO(text, newline="").readlines()


def parse(text: str) -> ast.Module:
    """The module's tree; a file's own invalid escapes and the like are not ours to warn of."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return ast.parse(text)
        except (SyntaxError, ValueError) as e:  # ValueError: null bytes before Python 3.12
            raise SourceError(f"does not parse: {e}") from None


def _headers(text: str) -> dict[int, int | None]:
    """Line of each def/class keyword -> the line its header's colon is on, or None when the
    body follows on that same line (`def f(): pass`, a backslash continuation)."""
    text = re.sub(r"\r\n?", "\n", text)  # same lines; tokenize takes a lone \r for no end
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as e:
        raise SourceError(f"does not tokenize: {e}") from None
    out: dict[int, int | None] = {}
    for i, tok in enumerate(toks):
        if tok.type != tokenize.NAME or tok.string not in ("def", "class"):
            continue
        depth, j = 0, i + 1
        while j < len(toks):  # the header ends at the first colon outside brackets
            t = toks[j]
            if t.type == tokenize.OP:
                if t.string in ("(", "[", "{"):
                    depth += 1
                elif t.string in (")", "]", "}"):
                    depth -= 1
                elif t.string == ":" and depth == 0:
                    break
            j += 1
        nxt = next((t for t in itertools.islice(toks, j + 1, None)
                    if t.type != tokenize.COMMENT), None)
        own_line = nxt is not None and nxt.type == tokenize.NEWLINE
        out[tok.start[0]] = toks[j].start[0] if own_line and j < len(toks) else None
    return out


def find_targets(text: str, lines: list[str]) -> list[Target]:
    """The definitions lacking a docstring whose body starts on a line of its own."""
    tree, headers = parse(text), _headers(text)
    found: list[Target] = []

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = scope
            if isinstance(child, _Def):
                name = f"{scope}.{child.name}" if scope else child.name
                target = _target(child, name, lines, headers)
                if target is not None:
                    found.append(target)
            visit(child, name)

    visit(tree, "")
    return found


def _target(node: _Def, qualname: str, lines: list[str],
            headers: dict[int, int | None]) -> Target | None:
    if ast.get_docstring(node, clean=False) is not None:
        return None
    colon_line = headers.get(node.lineno)
    first = node.body[0].lineno
    if colon_line is None or colon_line >= first:
        return None
    header = lines[colon_line - 1]
    eol = header[len(header.rstrip("\r\n")):]
    indent = _INDENT.match(lines[first - 1])
    assert indent is not None
    return Target(qualname, node.lineno, colon_line, indent.group(), eol,
                  parameters(node)) if eol else None


def parameters(node: _Def) -> tuple[str, ...]:
    """What a docstring may document as its parameters (a class: its __init__'s)."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                     and n.name == "__init__"), None)
        return parameters(init) if init else ()
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return tuple(n for n in names if n not in ("self", "cls"))


def module_names(tree: ast.Module) -> tuple[frozenset[str], frozenset[str]]:
    """Every identifier the module defines, uses or imports; and the modules it imports."""
    names: set[str] = set()
    imports: set[str] = set()
    for node in ast.walk(tree):
        match node:
            case ast.Name(id=name) | ast.Attribute(attr=name) | ast.arg(arg=name):
                names.add(name)
            case ast.FunctionDef(name=name) | ast.AsyncFunctionDef(name=name) | \
                    ast.ClassDef(name=name):
                names.add(name)
            case ast.Import(names=aliases) | ast.ImportFrom(names=aliases):
                if isinstance(node, ast.ImportFrom):
                    imports.add((node.module or "").split(".")[0])
                else:
                    imports.update(alias.name.split(".")[0] for alias in aliases)
                for alias in aliases:
                    names.update([*alias.name.split("."), alias.asname or ""])
    return frozenset(names - {""}), frozenset(imports - {""})


def fim_request(lines: list[str], target: Target) -> tuple[str, str]:
    """Prefix up to the opening quotes at the body's indentation; suffix from the next line,
    each a window of whole lines."""
    before, after = lines[:target.at], lines[target.at:]
    used, start = 0, len(before)
    while start > 0 and used + len(before[start - 1]) <= PREFIX_CHARS:
        start -= 1
        used += len(before[start])
    used, end = 0, 0
    while end < len(after) and used + len(after[end]) <= SUFFIX_CHARS:
        used += len(after[end])
        end += 1
    prefix = "".join(before[start:]) + target.indent + QUOTES
    return prefix, target.eol + "".join(after[:end])


def clean(middle: str) -> str:
    """The docstring's text from what the model wrote after the opening quotes: up to its
    closing quotes, without control characters or edges that would end the literal early."""
    text = middle.split(QUOTES, 1)[0]
    text = "\n".join("".join(c for c in line if c == "\t" or unicodedata.category(c)[0] != "C")
                     for line in text.splitlines())
    return re.sub(r"[\\\s]+\Z", "", text.strip())  # a backslash would escape the quotes


def render(text: str, target: Target) -> str:
    """The lines to insert: a one-line docstring, or the first line after the quotes, the
    rest at the body's indentation and the closing quotes on a line of their own."""
    opening = ("r" if "\\" in text else "") + QUOTES
    first, *rest = text.split("\n")
    if not rest:  # a quote just before the closing ones would end the literal early
        gap = " " if first.endswith('"') else ""
        return f"{target.indent}{opening}{first}{gap}{QUOTES}{target.eol}"
    body = [line.rstrip() for line in textwrap.dedent("\n".join(rest)).split("\n")]
    lines = [f"{target.indent}{opening}{first.rstrip()}",
             *(f"{target.indent}{line}" if line else "" for line in body),
             f"{target.indent}{QUOTES}"]
    return "".join(line + target.eol for line in lines)


MAX_PASSES = 4  # a pass that adds nothing ends the run well before this


def add_docstrings(text: str, complete: Completer, document: str) -> tuple[str, Outcome]:
    """The text with docstrings added where the model wrote a usable one, and what happened.

    Idempotent: a second run over the result adds nothing. Within a pass every definition is
    asked about the same text, so no verdict depends on what its neighbours got in that pass;
    the definitions left are asked again about the text with those docstrings, until a pass
    adds none, so the run ends on the text a second run would see."""
    outcome = Outcome()
    names = module_names(parse(text))
    pending: list[Target] | None = None  # the first pass's targets still undocumented
    for _ in range(MAX_PASSES):
        lines = split_lines(text)
        targets = find_targets(text, lines)
        # the same definitions, as the file was read (line numbers for the report)
        pending = targets if pending is None else pending
        assert [t.qualname for t in targets] == [t.qualname for t in pending]
        answers = [_ask(complete, document, lines, t, names) for t in targets]
        added, outcome.skipped = [], []  # a pass's skips: those of its last pass stand
        for target, first, (doc, why) in sorted(zip(targets, pending, answers, strict=True),
                                                key=lambda a: a[0].at, reverse=True):
            if doc is not None:  # bottom-up: the lines above keep their places
                candidate = [*lines[:target.at], render(doc, target), *lines[target.at:]]
                try:
                    parse("".join(candidate))
                    lines = candidate
                    added.append((first, doc))
                    continue
                except SourceError:
                    why = "the model's text would not parse"
            outcome.skipped.append((first, why or ""))
        text = "".join(lines)
        outcome.added += added
        done = {id(t) for t, _ in added}
        pending = [t for t in pending if id(t) not in done]
        if not added or not pending:
            break
    outcome.added.sort(key=lambda a: a[0].at)
    outcome.skipped.sort(key=lambda a: a[0].at)
    return text, outcome


def _ask(complete: Completer, document: str, lines: list[str], target: Target,
         names: tuple[frozenset[str], frozenset[str]]) -> tuple[str | None, str | None]:
    """The model's docstring for one definition, or None and why not (engine/decode/docgate.py
    says whether it reads as documentation of this definition)."""
    from engine.decode import docgate

    prefix, suffix = fim_request(lines, target)
    try:
        doc = clean(complete(f"{document}#{target.qualname}", prefix, suffix))
    except NoCompletion as e:
        return None, str(e)
    if not doc:
        return None, "the model wrote nothing usable"
    ctx = docgate.DocContext(target.qualname.rpartition(".")[2], target.params, *names)
    why = docgate.problem(doc, ctx)
    return (None, f"not a docstring for it: {why}") if why else (doc, None)
