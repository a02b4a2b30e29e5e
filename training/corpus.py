"""The training corpus: Python source that ships with this machine's interpreter.

Files are deduplicated by content and split into train and held-out by a fixed rule on the
content hash, so the split does not depend on where a file lives, and the benchmark can tell
held-out files without the manifest.
"""

from __future__ import annotations

import hashlib
import json
import site
import sysconfig
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

HELDOUT_MODULUS = 10  # one file in ten is held out


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_heldout(sha256: str) -> bool:
    return int(sha256[:8], 16) % HELDOUT_MODULUS == 0


@dataclass(frozen=True, slots=True)
class SourceFile:
    path: str
    sha256: str
    chars: int
    split: str  # "train" or "heldout"


def source_roots() -> list[Path]:
    """The standard library, then the interpreter's and the environment's site-packages."""
    paths = sysconfig.get_paths()
    roots = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    seen: list[Path] = []
    for r in map(Path, roots):
        if r.is_dir() and r.resolve() not in [s.resolve() for s in seen]:
            seen.append(r)
    return seen


def _readable(path: Path, max_bytes: int) -> str | None:
    """The file's text when it looks like hand-written Python, else None."""
    try:
        if path.stat().st_size > max_bytes:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if len(text) < 200 or max(map(len, text.splitlines()), default=0) > 400:
        return None  # tiny stubs and generated tables teach little
    return text


def iter_sources(roots: list[Path], max_file_bytes: int = 150_000) -> Iterator[tuple[str, str]]:
    """(name, text) of usable files; the name is relative to its root ("stdlib/json/x.py",
    "site-packages/numpy/y.py"), so the manifest says nothing about this machine."""
    for root in roots:
        label = "stdlib" if root == Path(sysconfig.get_paths()["stdlib"]) else root.name
        for path in sorted(root.rglob("*.py")):
            if "ahead" in path.parts or path.name.startswith("__editable__"):
                continue  # never our own code
            text = _readable(path, max_file_bytes)
            if text is not None:
                yield f"{label}/{path.relative_to(root)}", text


def collect(roots: list[Path], max_chars: int) -> tuple[list[SourceFile], dict[str, str]]:
    """Deduplicated files up to `max_chars` in all: the first root (the standard library)
    whole, then the others in hash order (a fixed, even sample of the installed packages)."""
    files: list[SourceFile] = []
    texts: dict[str, str] = {}
    total = 0
    for group in (roots[:1], roots[1:]):
        by_hash: dict[str, tuple[str, str]] = {}
        for path, text in iter_sources(group):
            by_hash.setdefault(digest(text), (path, text))
        for sha in sorted(by_hash):
            path, text = by_hash[sha]
            if sha in texts or total + len(text) > max_chars:
                continue
            total += len(text)
            split = "heldout" if is_heldout(sha) else "train"
            files.append(SourceFile(path, sha, len(text), split))
            texts[sha] = text
    return files, texts


def write_manifest(files: list[SourceFile], path: Path) -> None:
    lines = [json.dumps(asdict(f), sort_keys=True) for f in files]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def heldout_stdlib_files() -> list[Path]:
    """Standard-library modules the training split holds out (the benchmark's default)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.glob("*.py")):
        text = _readable(path, 150_000)
        if text is not None and is_heldout(digest(text)):
            out.append(path)
    return out
