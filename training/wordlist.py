"""The docstring gate's English words (engine/decode/words.txt): every word that the prose of
the standard library (its docstrings and comments) uses at least `MIN_COUNT` times, from the
training split only (corpus.is_heldout), so the held-out modules that `ahead bench quality`
judges lend it nothing. Rerun with `python -m training.wordlist` after changing the rule;
the file it writes is shipped.
"""

from __future__ import annotations

import ast
import io
import re
import sysconfig
import tokenize
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from training.corpus import digest, is_heldout

MIN_COUNT = 3  # once or twice is a typo or a name as often as a word
WORD = re.compile(r"[A-Za-z]+")
OUT = Path(__file__).resolve().parent.parent / "engine" / "decode" / "words.txt"


def prose(text: str) -> Iterator[str]:
    """The docstrings and comments of one module."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.string


def count_words(root: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or "test" in path.parts or "tests" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8")
            if is_heldout(digest(text)):
                continue
            counts.update(w.lower() for chunk in prose(text) for w in WORD.findall(chunk))
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError, tokenize.TokenError):
            continue
    return counts


def main() -> None:
    counts = count_words(Path(sysconfig.get_paths()["stdlib"]))
    words = sorted(w for w, n in counts.items() if n >= MIN_COUNT)
    OUT.write_text("\n".join(words) + "\n", encoding="utf-8")
    print(f"{len(words)} words -> {OUT}")


if __name__ == "__main__":
    main()
