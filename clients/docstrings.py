"""`ahead docstrings FILE...`: the model writes the docstrings that functions and classes lack.

Every `def`, `async def` and `class` (top level, nested, methods; private and dunder names
included) whose body starts on a line of its own and has no docstring gets one, written by the
model as a fill-in-the-middle completion just after the opening quotes, with the file around it
as context. Nothing else in the file changes, byte for byte: the new lines take the line ending
of the header they follow and the body's indentation. Every definition of a pass is asked
about the same text; those left are asked again once the pass's docstrings are in, until a
pass adds none, so a second run over the result changes nothing (pre-commit passes). Each
insertion is kept only if the file still parses. Files are written
atomically (a temporary file beside the original, then `os.replace`), keeping their mode.

Exit status, for pre-commit: 1 when a file was changed (with `--check`: would be); otherwise
2 when a file was skipped because it could not be read, is not in its encoding (UTF-8, or
what a PEP 263 declaration names: it is written back in that encoding) or does not parse;
otherwise 0. Files not ending in `.py` are skipped with a note; they do not set the status.
`--check` runs the model as a real run does, so it reports exactly what that run would change.
A function the model has nothing usable for is reported as skipped and left alone; it does
not set the status either. Usable means: it passes the quality rules (engine/decode/quality.py:
no loop, and a confidence of at least the threshold: `--min-confidence`, else the config's
`docstring_min_confidence`, else the model's own, which `ahead bench quality --save` chose
and keeps in quality.json beside it, else 0.25) and reads as documentation of that
definition (engine/decode/docgate.py: prose with no line of code, English words or the
module's own names, parameter sections naming its real parameters, examples that call it,
references to what the module names, a summary sentence); the reason for a skip says which
rule it failed. `--check` lists what would be added and what would be skipped. A model whose
quality.json says that no threshold passes writes none: the hook says so and exits 0. A
fatal error (no model, a daemon that cannot start) exits 1 with a message, as every `ahead`
command does.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import stat
import sys
import tempfile
import tokenize
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from clients.docstring_edit import (
    QUOTES,
    Completer,
    NoCompletion,
    SourceError,
    add_docstrings,
    clean,
    find_targets,
    split_lines,
)

EXIT_CHANGED, EXIT_SKIPPED_FILE = 1, 2

def read_source(path: Path) -> tuple[bytes, str, str]:
    """The file's bytes, its text (without a byte-order mark) and its encoding: UTF-8, or
    what a PEP 263 declaration (`# -*- coding: latin-1 -*-`) names, as Python reads it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SourceError(f"cannot be read: {e.strerror or e}") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as e:  # an unknown codec, a first line not UTF-8 and no declaration
        raise SourceError(f"is not UTF-8 nor in an encoding it declares ({e.msg})") from None
    try:
        text = data.decode(encoding)  # utf-8-sig drops the BOM
    except UnicodeDecodeError as e:
        name = "UTF-8" if encoding.startswith("utf-8") else encoding
        raise SourceError(f"is not {name} ({e.reason} at byte {e.start})") from None
    return data, text, encoding


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
    data, text, encoding = read_source(path)
    if not find_targets(text, split_lines(text)):
        return False
    new, outcome = add_docstrings(text, complete(), str(path))
    verb = "would add" if check else "added"
    for target, _ in outcome.added:
        print(f"{path}:{target.lineno}: {verb} a docstring to {target.qualname}", file=out)
    for target, why in outcome.skipped:
        print(f"{path}:{target.lineno}: skipped {target.qualname}: {why}", file=err)
    if not outcome.added:
        return False
    if not check:
        if path.read_bytes() != data:
            raise SourceError("changed while the docstrings were written; left as it is")
        try:
            encoded = new.encode(encoding)  # utf-8-sig puts the BOM back
        except UnicodeEncodeError as e:
            raise SourceError(f"the docstrings have {e.object[e.start:e.end]!r}, which "
                              f"{encoding} cannot hold; left as it is") from None
        try:
            write_atomic(path, encoded)
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


def judged(text: str, reason: str | None, scores: Any, threshold: float) -> str:
    """The model's text if it passes the quality rules at `threshold`; else NoCompletion,
    saying why."""
    from engine.decode import quality

    withheld = quality.verdict(clean(text), reason, scores, threshold)
    if withheld == quality.REPETITION:
        raise NoCompletion("the model's text went round in a loop")
    if withheld == quality.LOW_CONFIDENCE:
        raise NoCompletion(f"the model is not sure of it (confidence {scores.score:.2f} < "
                           f"{threshold:.2f})")
    return text


def engine_completer(engine: Any, max_tokens: int, threshold: float = 0.0) -> Completer:
    """Completions from an engine in this process, prompted as the daemon prompts."""
    from engine import GenParams

    def complete(document: str, prefix: str, suffix: str) -> str:
        prompt = engine.fill_in_prompt(prefix, suffix, max_new_tokens=max_tokens)
        params = GenParams(max_new_tokens=max_tokens, stop=(QUOTES,), forced=prompt.forced)
        gen = engine.generate(prompt.ids, params, slot="docstrings")
        return judged(str(gen.text), gen.finish_reason, gen.confidence, threshold)

    return complete


def daemon_completer(client: Any, max_tokens: int, threshold: float = 0.0) -> Completer:
    """Completions from the daemon at batch priority, so editors' requests go first."""
    from daemon import protocol as p
    from daemon.client import RequestFailed
    from engine.decode.quality import Confidence

    def complete(document: str, prefix: str, suffix: str) -> str:
        path = document.rpartition("#")[0]
        try:
            done = client.run(p.Complete(id=0, session="docstrings", document=document,
                                         prefix=prefix, suffix=suffix, language="python",
                                         path=path, max_tokens=max_tokens, multiline=True,
                                         stop=['"""'], priority="batch", judge=False))
        except RequestFailed as e:
            raise NoCompletion(f"the daemon answered {e}") from None
        scores = None if done.mean_logprob is None or done.min_logprob is None else \
            Confidence(done.mean_logprob, done.min_logprob, done.stats.tokens)
        return judged(str(done.text), done.finish_reason, scores, threshold)

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

    def threshold() -> float:
        """Resolved when the model is first needed (a file with nothing to do needs none)."""
        if args.min_confidence is not None:
            return float(args.min_confidence)
        from daemon.config import docstring_threshold, load_settings

        value, source = docstring_threshold(load_settings(), model_dir(args))
        if value is None:
            raise WritesNone(source)
        return value

    try:
        if args.no_daemon:
            return run(args.files, lambda: engine_completer(
                load_engine(args), args.max_tokens, threshold()), check=args.check)
        from daemon.client import SyncClient

        with contextlib.ExitStack() as stack:
            def make() -> Completer:
                limit = threshold()
                client = stack.enter_context(SyncClient(serve_args=serve_args(args, model_dir),
                                                        client_name="ahead docstrings"))
                return daemon_completer(client, args.max_tokens, limit)

            return run(args.files, make, check=args.check)
    except WritesNone as e:
        print(f"ahead docstrings: this model's docstrings do not pass; nothing written "
              f"(`ahead bench quality` found no threshold at which it writes docstrings that "
              f"are not junk: {e}; --min-confidence overrides)", file=sys.stderr)
        return 0


class WritesNone(Exception):
    """The model's measured docstrings pass at no threshold (its quality.json, the source)."""
