"""Text the editor side sends with a completion request: the cursor window and extra chunks.

The daemon owns the tokenizer and trims the prompt to its token budget, so this side only
cuts generous character windows. Cuts fall on line boundaries because a half line at the
edge of the prompt reads to the model like broken code. Standard library only: `ahead lsp`
must start fast.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Window:
    """The text just before and just after the cursor."""

    prefix: str
    suffix: str


def cursor_window(
    text: str, offset: int, *, max_prefix_chars: int = 8000, max_suffix_chars: int = 2000,
    anchor_lines: int = 16,
) -> Window:
    """Cut `text` around the character `offset` to whole lines within each budget.

    The prefix always reaches back to the start of the cursor's line and the suffix always
    reaches the end of it (newline included); when that alone is over budget the cursor line
    is cut (the prefix keeps its end, the suffix its start), since the text nearest the cursor
    matters most. Line ends are left as they are, so CRLF documents keep their `\\r`.

    A prefix that does not reach the document's start starts on a line whose number is a
    multiple of `anchor_lines` (if that costs at most a quarter of its lines): as the user
    types, the window's start then stays put for many keystrokes instead of moving a line at
    a time, and the daemon's KV cache keeps the whole prompt up to the cursor.
    """
    if not 0 <= offset <= len(text):
        raise ValueError(f"offset {offset} is outside a document of {len(text)} characters")
    if max_prefix_chars < 0 or max_suffix_chars < 0:
        raise ValueError("character budgets must not be negative")
    if anchor_lines < 1:
        raise ValueError(f"anchor_lines must be >= 1, got {anchor_lines}")
    start = _anchored(text, offset, _prefix_start(text, offset, max_prefix_chars), anchor_lines)
    end = _suffix_end(text, offset, max_suffix_chars)
    return Window(prefix=text[start:offset], suffix=text[offset:end])


def _prefix_start(text: str, offset: int, budget: int) -> int:
    start = text.rfind("\n", 0, offset) + 1
    if offset - start > budget:
        return offset - budget
    # Walk back one whole line at a time; stop before the first that would not fit.
    while start > 0:
        line_start = text.rfind("\n", 0, start - 1) + 1
        if offset - line_start > budget:
            break
        start = line_start
    return start


def _anchored(text: str, offset: int, start: int, anchor: int) -> int:
    """`start` moved forward to the next line whose number is a multiple of `anchor`, unless
    that leaves out more than a quarter of the window's lines."""
    if start == 0 or text[start - 1] != "\n":  # the whole document, or a cut cursor line
        return start
    line = text.count("\n", 0, start)
    skip = -line % anchor
    if skip and skip <= text.count("\n", start, offset) // 4:
        for _ in range(skip):
            start = text.index("\n", start) + 1
    return start


def _suffix_end(text: str, offset: int, budget: int) -> int:
    end = _line_end(text, offset)
    if end - offset > budget:
        return offset + budget
    while end < len(text):
        line_end = _line_end(text, end)
        if line_end - offset > budget:
            break
        end = line_end
    return end


def _line_end(text: str, pos: int) -> int:
    """Index just past the newline that ends the line holding `pos` (or the text's end)."""
    newline = text.find("\n", pos)
    return len(text) if newline < 0 else newline + 1


@dataclass(frozen=True, slots=True)
class _Chunk:
    path: str
    first_line: int  # 0-based, inclusive
    last_line: int  # exclusive
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "".join(self.lines)


# Two chunks whose lines agree at least this much carry the same information for the model.
_SIMILAR = 0.9


class ExtraContext:
    """A small ring of snippets from other open and recently edited files.

    In the spirit of llama.vim's ring buffer of chunks: the model sees code the user is
    working with elsewhere, most recent first. Recency is the order of `note` calls (no
    clock), so the same history always gives the same prompt, which also keeps the daemon's
    prefix cache warm.
    """

    def __init__(self, max_chunks: int = 16, chunk_lines: int = 64) -> None:
        if max_chunks < 1 or chunk_lines < 1:
            raise ValueError("max_chunks and chunk_lines must be at least 1")
        self.max_chunks = max_chunks
        self.chunk_lines = chunk_lines
        self._chunks: list[_Chunk] = []  # oldest first

    def __len__(self) -> int:
        return len(self._chunks)

    def note(self, path: str, text: str, line: int | None = None) -> None:
        """Record the `chunk_lines` lines around `line` (the file's start when None) as newest.

        A line past either end of the file is clamped: the editor's view of a file that just
        changed can be a little stale. Whitespace-only chunks are not worth prompt space.
        """
        chunk = self._cut(path, text, line)
        if chunk is None:
            return
        self._chunks = [old for old in self._chunks if not _supersedes(chunk, old)]
        self._chunks.append(chunk)
        del self._chunks[: -self.max_chunks]

    def forget(self, path: str) -> None:
        """Drop every chunk of `path` (the file was closed or deleted)."""
        self._chunks = [chunk for chunk in self._chunks if chunk.path != path]

    def chunks(self, exclude: str | None = None, max_chars: int = 6000) -> list[tuple[str, str]]:
        """(path, text) pairs, most recent first, skipping `exclude` (the current document).

        Chunks go in whole or not at all; one too big for what is left of the budget is
        skipped and smaller, older ones may still fit.
        """
        picked: list[tuple[str, str]] = []
        left = max_chars
        for chunk in reversed(self._chunks):
            text = chunk.text
            if chunk.path == exclude or len(text) > left:
                continue
            picked.append((chunk.path, text))
            left -= len(text)
        return picked

    def _cut(self, path: str, text: str, line: int | None) -> _Chunk | None:
        lines = _split_lines(text)
        if not lines:
            return None
        if line is None:
            first = 0
        else:
            centre = min(max(line, 0), len(lines) - 1)
            first = max(0, min(centre - self.chunk_lines // 2, len(lines) - self.chunk_lines))
        last = min(len(lines), first + self.chunk_lines)
        kept = tuple(lines[first:last])
        if not "".join(kept).strip():
            return None
        return _Chunk(path, first, last, kept)


def _split_lines(text: str) -> list[str]:
    """Lines with their endings kept, split on "\\n" only, as editors count lines.

    `str.splitlines` would also split on form feeds and U+2028, which LSP does not.
    """
    lines = [line + "\n" for line in text.split("\n")]
    lines[-1] = lines[-1][:-1]
    if not lines[-1]:
        lines.pop()
    return lines


def _supersedes(new: _Chunk, old: _Chunk) -> bool:
    """Whether `new` makes `old` redundant: a fresher view of the same lines, or a near copy."""
    if new.path == old.path and new.first_line < old.last_line and old.first_line < new.last_line:
        return True
    return _similarity(new.lines, old.lines) > _SIMILAR


def _similarity(a: tuple[str, ...], b: tuple[str, ...]) -> float:
    """Share of lines the two chunks have in common (as llama.vim's chunk_sim), 0 to 1."""
    if a == b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    return 2 * common / (len(a) + len(b))
