"""`ahead docstrings FILE...`: the model writes the docstrings that functions and classes lack.

Every `def`, `async def` and `class` (top level, nested, methods; private and dunder names
included) whose body starts on a line of its own and has no docstring gets one, written by the
model as a fill-in-the-middle completion just after the opening quotes, with the file around it
as context. Nothing else in the file changes, byte for byte: the new lines take the line ending
of the header they follow and the body's indentation. Insertions go bottom-up so earlier line
numbers stay valid, and each is kept only if the file still parses. Files are written
atomically (a temporary file beside the original, then `os.replace`), keeping their mode.

Exit status, for pre-commit: 1 when a file was changed (with `--check`: would be); otherwise
2 when a file was skipped because it could not be read, is not UTF-8 or does not parse;
otherwise 0. Files not ending in `.py` are skipped with a note; they do not set the status.
`--check` runs the model as a real run does, so it reports exactly what that run would change.
A function the model has nothing usable for is reported and left alone; it does not set the
status either. A fatal error (no model, a daemon that cannot start) exits 1 with a message, as
every `ahead` command does.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import itertools
import os
import re
import stat
import sys
import tempfile
import textwrap
import tokenize
import unicodedata
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

# Completion: (document, prefix, suffix) -> the model's text for the middle.
Completer = Callable[[str, str, str], str]

PREFIX_CHARS, SUFFIX_CHARS = 6000, 2000  # generous: the engine trims the prompt to its budget
QUOTES = '"""'
BOM = b"\xef\xbb\xbf"
EXIT_CHANGED, EXIT_SKIPPED_FILE = 1, 2
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
    return Target(qualname, node.lineno, colon_line, indent.group(), eol) if eol else None


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


def add_docstrings(text: str, complete: Completer, document: str) -> tuple[str, Outcome]:
    """The text with docstrings added where the model wrote a usable one, and what happened."""
    lines = split_lines(text)
    outcome = Outcome()
    for target in sorted(find_targets(text, lines), key=lambda t: t.at, reverse=True):
        prefix, suffix = fim_request(lines, target)
        try:
            doc = clean(complete(f"{document}#{target.qualname}", prefix, suffix))
        except NoCompletion as e:
            outcome.skipped.append((target, str(e)))
            continue
        if not doc:
            outcome.skipped.append((target, "the model wrote nothing usable"))
            continue
        candidate = [*lines[:target.at], render(doc, target), *lines[target.at:]]
        try:
            parse("".join(candidate))
        except SourceError:
            outcome.skipped.append((target, "the model's text would not parse"))
            continue
        lines = candidate
        outcome.added.append((target, doc))
    outcome.added.reverse()
    outcome.skipped.reverse()
    return "".join(lines), outcome


def read_source(path: Path) -> tuple[bytes, str]:
    """The file's bytes and its text without a byte-order mark."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SourceError(f"cannot be read: {e.strerror or e}") from None
    try:
        text = data.removeprefix(BOM).decode("utf-8")
    except UnicodeDecodeError as e:
        raise SourceError(f"is not UTF-8 ({e.reason} at byte {e.start})") from None
    return data, text


def write_atomic(path: Path, data: bytes) -> None:
    """Replace the file's contents in one step, keeping its mode (through a symlink, the
    file it points to)."""
    real = Path(os.path.realpath(path))
    mode = stat.S_IMODE(real.stat().st_mode)
    fd, tmp = tempfile.mkstemp(dir=real.parent, prefix=f".{real.name}.", suffix=".ahead")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, real)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def process_file(path: Path, complete: Callable[[], Completer], *, check: bool,
                 out: TextIO, err: TextIO) -> bool:
    """Add the docstrings one file lacks; True if it changed (with `check`: would change).
    The completer is made only when a file needs one, so a clean run loads no model."""
    data, text = read_source(path)
    if not find_targets(text, split_lines(text)):
        return False
    new, outcome = add_docstrings(text, complete(), str(path))
    verb = "would add" if check else "added"
    for target, _ in outcome.added:
        print(f"{path}:{target.lineno}: {verb} a docstring to {target.qualname}", file=out)
    for target, why in outcome.skipped:
        print(f"{path}:{target.lineno}: no docstring for {target.qualname}: {why}", file=err)
    if not outcome.added:
        return False
    if not check:
        if path.read_bytes() != data:
            raise SourceError("changed while the docstrings were written; left as it is")
        try:
            write_atomic(path, BOM * data.startswith(BOM) + new.encode("utf-8"))
        except OSError as e:
            raise SourceError(f"cannot be written: {e.strerror or e}") from None
    return True


def run(files: list[str], make_completer: Callable[[], Completer], *, check: bool = False,
        out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Process the files; the exit status (see the module's docstring)."""
    completer: Completer | None = None

    def complete() -> Completer:
        nonlocal completer
        if completer is None:
            completer = make_completer()
        return completer

    changed = skipped = False
    for name in files:
        path = Path(name)
        if path.suffix != ".py":
            print(f"{path}: skipped: not a .py file", file=err)
            continue
        try:
            changed |= process_file(path, complete, check=check, out=out, err=err)
        except SourceError as e:
            print(f"{path}: skipped: {e}", file=err)
            skipped = True
    return EXIT_CHANGED if changed else EXIT_SKIPPED_FILE if skipped else 0


def engine_completer(engine: Any, max_tokens: int) -> Completer:
    """Completions from an engine in this process, prompted as the daemon prompts."""
    from engine.generate import GenParams
    from engine.prompt import completion_prompt

    params = GenParams(max_new_tokens=max_tokens, stop=(QUOTES,))
    budget = engine.max_seq_len - max_tokens - engine.k_max - 4

    def complete(document: str, prefix: str, suffix: str) -> str:
        ids = completion_prompt(engine.tokenizer, prefix, suffix, max_tokens=budget)
        return str(engine.generate(ids, params, slot="docstrings").text)

    return complete


def daemon_completer(client: Any, max_tokens: int) -> Completer:
    """Completions from the daemon at batch priority, so editors' requests go first."""
    from daemon import protocol as p
    from daemon.client import RequestFailed

    def complete(document: str, prefix: str, suffix: str) -> str:
        path = document.rpartition("#")[0]
        try:
            done = client.run(p.Complete(id=0, session="docstrings", document=document,
                                         prefix=prefix, suffix=suffix, language="python",
                                         path=path, max_tokens=max_tokens, multiline=True,
                                         stop=['"""'], priority="batch"))
        except RequestFailed as e:
            raise NoCompletion(f"the daemon answered {e}") from None
        return str(done.text)

    return complete


def serve_args(args: argparse.Namespace, model_dir: Callable[[argparse.Namespace], Path],
               ) -> list[str]:
    """The model flags given, for a daemon this command starts."""
    flags = ["--model", str(model_dir(args).resolve())]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype),
                        ("--max-seq-len", args.max_seq_len), ("--k-max", args.k_max)):
        if value is not None:
            flags += [flag, str(value)]
    return flags


def command(args: argparse.Namespace, load_engine: Callable[[argparse.Namespace], Any],
            model_dir: Callable[[argparse.Namespace], Path]) -> int:
    """`ahead docstrings`, given the CLI's engine loader and model-directory resolution."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.no_daemon:
        return run(args.files, lambda: engine_completer(load_engine(args), args.max_tokens),
                   check=args.check)
    from daemon.client import SyncClient

    with contextlib.ExitStack() as stack:
        def make() -> Completer:
            client = stack.enter_context(SyncClient(serve_args=serve_args(args, model_dir),
                                                    client_name="ahead docstrings"))
            return daemon_completer(client, args.max_tokens)

        return run(args.files, make, check=args.check)
