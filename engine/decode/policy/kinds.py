"""Kinds of text that draft differently: code drafts well, comments and prose less."""

from __future__ import annotations

from enum import StrEnum


class TextKind(StrEnum):
    CODE = "code"
    COMMENT = "comment"
    STRING = "string"


def classify(tail: str) -> TextKind:
    """The kind of text at the end of `tail` (a window of recent text), for Python/C-like code."""
    parts = tail.split('"""')
    if len(parts) % 2 == 0:  # an odd number of triple quotes: inside a docstring
        return TextKind.STRING
    line = parts[-1].rsplit("\n", 1)[-1]
    quote: str | None = None
    i = 0
    while i < len(line):
        ch = line[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" or line.startswith("//", i):
            return TextKind.COMMENT
        i += 1
    return TextKind.STRING if quote else TextKind.CODE
