"""`ahead bench draft-vocab`: how much of your code the drafts' reduced head can write.

Drafts score a reduced vocabulary (engine/decode/draft_vocab.py: the tokens most frequent
in the interpreter's standard library, then the lowest ids); a token outside it can never
be drafted, so the share of a code base's tokens inside it bounds what drafting keeps there.
This counts that share for the model's own tokenizer, language by language, at several
sizes, on the files given (a repository's, say), without loading the weights.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from engine.decode.draft_vocab import SIZE, ranked_ids
from engine.model.config import ModelConfig
from engine.tokenizer import Tokenizer

LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".cjs": "javascript", ".jsx": "javascript", ".ts": "typescript", ".tsx": "typescript",
    ".c": "c", ".h": "c/c++ header", ".cc": "c++", ".cpp": "c++", ".cxx": "c++",
    ".hpp": "c++", ".rs": "rust", ".go": "go", ".java": "java", ".kt": "kotlin",
    ".scala": "scala", ".cs": "c#", ".swift": "swift", ".rb": "ruby", ".php": "php",
    ".lua": "lua", ".sh": "shell", ".bash": "shell", ".zig": "zig", ".hs": "haskell",
    ".ml": "ocaml", ".ex": "elixir", ".sql": "sql", ".r": "r", ".jl": "julia",
}


def source_files(paths: list[Path]) -> list[Path]:
    """The files given, and the source files (by LANGUAGES' extensions) under the
    directories given, hidden directories and node_modules left out; sorted."""
    found: set[Path] = set()
    for path in paths:
        if path.is_file():
            found.add(path)
        elif path.is_dir():
            for root, dirs, names in os.walk(path):
                dirs[:] = [d for d in dirs if not d.startswith(".") and d != "node_modules"]
                found.update(Path(root) / n for n in names
                             if Path(n).suffix.lower() in LANGUAGES)
        else:
            raise FileNotFoundError(f"{path} does not exist")
    return sorted(found)


def bench_draft_vocab(model_dir: Path, paths: list[Path], sizes: list[int], *,
                      chars: int = 400_000, cache: Path | None = None) -> dict[str, Any]:
    """Per language (and over all), the tokens read (at most `chars` characters of each
    language's files, in order) and the share of them inside the reduced vocabulary of
    each size. `cache`: where the rankings are kept (default ~/.cache/ahead/draft-vocab)."""
    if not sizes or min(sizes) <= 0:
        raise ValueError(f"sizes must be positive, not {sizes}")
    tokenizer = Tokenizer.from_dir(model_dir)
    vocab = ModelConfig.from_file(model_dir / "config.json").vocab_size
    files = source_files(paths)
    if not files:
        raise ValueError("no source files among the paths given")
    texts: dict[str, list[str]] = defaultdict(list)
    for f in files:
        lang = LANGUAGES.get(f.suffix.lower(), f.suffix.lower() or f.name)
        left = chars - sum(map(len, texts[lang]))
        if left > 0:
            texts[lang].append(f.read_text(encoding="utf-8", errors="replace")[:left])
    kept = {n: set(ranked_ids(tokenizer, vocab, n, cache)) for n in sizes}
    rows: dict[str, dict[str, Any]] = {}
    inside_all: Counter[int] = Counter()
    for lang in sorted(texts):
        ids = [i for ids in tokenizer.encode_batch(texts[lang]) for i in ids]
        inside = {n: sum(i in kept[n] for i in ids) for n in sizes}
        inside_all.update(inside)
        rows[lang] = {"files": len(texts[lang]), "tokens": len(ids),
                      "coverage": {str(n): round(inside[n] / max(len(ids), 1), 4)
                                   for n in sizes}}
    tokens = sum(row["tokens"] for row in rows.values())
    overall = {str(n): round(inside_all[n] / max(tokens, 1), 4) for n in sizes}
    return {"model": str(model_dir), "vocab_size": vocab, "sizes": sizes,
            "default_size": SIZE, "reduced": {str(n): vocab > 2 * n for n in sizes},
            "languages": rows, "overall": {"tokens": tokens, "coverage": overall}}


def format_report(r: dict[str, Any]) -> str:
    sizes = [str(n) for n in r["sizes"]]
    lines = [f"{r['model']}: vocabulary {r['vocab_size']}; the share of code tokens the drafts "
             f"can write with a reduced head of each size (the engine's: {r['default_size']})",
             f"{'language':<16} {'files':>6} {'tokens':>9}  " + "  ".join(f"{n:>7}" for n in sizes)]
    for lang, row in r["languages"].items():
        lines.append(f"{lang:<16} {row['files']:>6} {row['tokens']:>9}  "
                     + "  ".join(f"{row['coverage'][n]:>7.1%}" for n in sizes))
    o = r["overall"]
    lines.append(f"{'all':<16} {'':>6} {o['tokens']:>9}  "
                 + "  ".join(f"{o['coverage'][n]:>7.1%}" for n in sizes))
    full = [n for n in sizes if not r["reduced"][n]]
    if full:
        lines.append(f"(sizes {', '.join(full)}: more than half the vocabulary, so the model's "
                     "drafts would score the whole head there)")
    return "\n".join(lines)
