"""Decide how much of a raw model completion to show, and clean it up.

A fill-in-the-middle model happily keeps writing past the point a person would stop: into
the next function, or back over code that is already below the cursor. These rules cut it
back to what reads as one suggestion. Standard library only: `ahead lsp` must start fast.
"""

from __future__ import annotations

from dataclasses import dataclass

# Text right of the cursor made only of these still lets a completion be shown before it
# (editors auto-insert closing pairs, so the cursor often sits just before them).
_CLOSERS = frozenset(")]}\"'`:;,")
_CLOSING_BRACKETS = {")": "(", "]": "[", "}": "{"}
_QUOTES = frozenset("\"'`")
# End of a line that opens a block: Python's ":" and the C family's "{".
_BLOCK_OPENERS = (":", "{")
_COMMENT_STARTS = ("#", "//", "/*", "*", "--")
# A shorter overlap with the suffix may be chance; this much is a repeat.
_MIN_REPEAT_CHARS = 8


@dataclass(frozen=True, slots=True)
class CursorLines:
    """The lines around the cursor that `wants_multiline` and `postprocess` look at."""

    before: str  # the cursor's line up to the cursor
    after: str  # the rest of the cursor's line, without its line ending
    prev_line: str | None  # nearest non-blank line above the cursor's line
    next_line: str | None  # nearest non-blank line below the cursor's line


def cursor_lines(prefix: str, suffix: str) -> CursorLines:
    """Find the cursor's surroundings in a prefix/suffix window; `\\r` line ends are dropped."""
    above = prefix.split("\n")
    below = suffix.split("\n")
    return CursorLines(
        before=above[-1],
        after=below[0].rstrip("\r"),
        prev_line=next((line.rstrip("\r") for line in reversed(above[:-1]) if line.strip()), None),
        next_line=next((line.rstrip("\r") for line in below[1:] if line.strip()), None),
    )


def wants_multiline(
    line_before_cursor: str,
    line_after_cursor: str,
    next_line: str | None = None,
    *,
    prev_line: str | None = None,
) -> bool:
    """Whether to ask for (and show) a multi-line suggestion rather than the rest of a line.

    `prev_line` and `next_line` are the nearest non-blank lines above and below the cursor's
    line (see `cursor_lines`). Multi-line only at the start of an empty block: the cursor is
    on a blank line under a block opener (`:` or `{`), or at the end of the opener's line.
    A block that already has a body below (`next_line` indented deeper than the opener) gets
    one line, as does any cursor with real text to its right.
    """
    opener = _opener(line_before_cursor, line_after_cursor, prev_line)
    if opener is None:
        return False
    return next_line is None or not next_line.strip() or _indent(next_line) <= _indent(opener)


def ask_for(c: CursorLines) -> tuple[bool, int]:
    """What to ask the model for at the cursor: whether a multi-line suggestion (else the
    rest of the line), and the indentation floor that ends a multi-line one (0: none). The
    editor, `ahead complete` and the quality bench ask alike."""
    multiline = wants_multiline(c.before, c.after, c.next_line, prev_line=c.prev_line)
    return multiline, indent_floor(c.before, c.after, c.prev_line) if multiline else 0


def indent_floor(line_before_cursor: str, line_after_cursor: str, prev_line: str | None) -> int:
    """For a multi-line suggestion, the indentation below which a line ends it (the daemon
    stops the model there, engine/decode/indent.py): one character past the opener's when
    the block ends by indentation (Python's `:`); 0 for a `{` block, whose closing line
    `_block_lines` keeps."""
    opener = _opener(line_before_cursor, line_after_cursor, prev_line)
    if opener is None or not opener.rstrip().endswith(":"):
        return 0
    return len(opener) - len(opener.lstrip(" \t")) + 1


def _opener(line_before_cursor: str, line_after_cursor: str, prev_line: str | None,
            ) -> str | None:
    """The block opener the cursor starts the body of: its own line (the cursor at its end)
    or the line above a blank cursor line; None when there is none."""
    after = line_after_cursor.strip()
    if any(char not in _CLOSERS for char in after):
        return None
    if not line_before_cursor.strip():
        opener = prev_line
    elif not after or _closes_brace(line_before_cursor, after):
        opener = line_before_cursor
    else:
        return None
    return opener if opener is not None and _opens_block(opener) else None


def _opens_block(line: str) -> bool:
    # "# Note:" ends in a colon but opens nothing.
    text = line.strip()
    return text.endswith(_BLOCK_OPENERS) and not text.startswith(_COMMENT_STARTS)


def _closes_brace(line_before_cursor: str, after: str) -> bool:
    """`{|}` from an auto-paired brace; not `{"key":|}`, where `:` opens no block."""
    return line_before_cursor.rstrip().endswith("{") and after.startswith("}")


def _indent(line: str) -> int:
    expanded = line.expandtabs(4)
    return len(expanded) - len(expanded.lstrip())


def postprocess(
    completion: str,
    *,
    line_before_cursor: str,
    line_after_cursor: str,
    suffix: str,
    multiline: bool,
) -> str:
    """The part of `completion` to show at the cursor, or "" for nothing.

    Lines in the result end in "\\n" (the editor adapts them to the document's line ends).
    `suffix` is the document text after the cursor, `line_after_cursor` its first line.
    """
    lines = completion.replace("\r\n", "\n").split("\n")
    lines = _block_lines(lines, line_before_cursor, suffix) if multiline else lines[:1]
    if not line_after_cursor.strip():
        lines = _before_repeated_lines(lines, line_before_cursor, suffix)
    text = "\n".join(line.rstrip() for line in lines)
    text = _drop_repeated_suffix(text, line_after_cursor, suffix)
    if "\n" not in text:
        text = _drop_doubled_closers(text, line_before_cursor, line_after_cursor)
    text = text.rstrip()
    return text if text.strip() else ""


def _block_lines(lines: list[str], line_before_cursor: str, suffix: str) -> list[str]:
    """Lines up to the end of the block the completion starts, by indentation.

    The block's indentation is that of the first non-blank generated line, measured on the
    whole cursor line when the completion continues it. A dedented line that only closes
    brackets (`}`, `});`) ends the block and is kept, unless the suffix already closes it.
    """
    if lines[0].strip():
        block: str | None = line_before_cursor + lines[0]
    else:
        block = next((line for line in lines[1:] if line.strip()), None)
    if block is None:
        return lines[:1]
    block_indent = _indent(block)
    for i in range(1, len(lines)):
        line = lines[i]
        if not line.strip():
            if i >= 2 and not lines[i - 1].strip():
                return lines[: i - 1]
            continue
        if _indent(line) < block_indent:
            closes = all(char in _CLOSERS for char in line.strip())
            return lines[: i + 1] if closes and not _already_closed(line, suffix) else lines[:i]
    return lines


def _already_closed(line: str, suffix: str) -> bool:
    """Whether the suffix starts with the closing line `line` (an auto-paired `}` counts)."""
    rest, _, below = suffix.partition("\n")
    if rest.strip():
        return rest.strip().startswith(line.strip())
    following = next((other for other in below.split("\n") if other.strip()), "")
    return following.rstrip() == line.rstrip()


def _before_repeated_lines(lines: list[str], line_before_cursor: str, suffix: str) -> list[str]:
    """Cut where the completion starts writing the lines that already follow the cursor.

    Lines are compared whole, indentation included, so a `}` closing an inner block is not
    mistaken for the `}` below that closes the outer one.
    """
    below = [line.rstrip() for line in suffix.split("\n")[1:] if line.strip()]
    if not below:
        return lines
    full = [(line_before_cursor + lines[0]).rstrip(), *(line.rstrip() for line in lines[1:])]
    for i, line in enumerate(full):
        if line == below[0] and _runs_into(full[i:], below):
            return lines[:i]
    return lines


def _runs_into(generated: list[str], below: list[str]) -> bool:
    """Whether the non-blank `generated` lines are the start of `below`.

    The last generated line may stop part way (the token limit cuts lines anywhere).
    """
    rest = [line for line in generated if line]
    if len(rest) > len(below):
        return rest[: len(below)] == below
    return rest[:-1] == below[: len(rest) - 1] and below[len(rest) - 1].startswith(rest[-1])


def _drop_repeated_suffix(text: str, line_after_cursor: str, suffix: str) -> str:
    """Remove an ending of `text` that the suffix starts with (whitespace aside).

    A repeat counts when it is at least `_MIN_REPEAT_CHARS` long or is the whole rest of the
    cursor's line; shorter overlaps are often chance. A rest of line made only of closers is
    left to `_drop_doubled_closers`: in `print(|)` the `)` of `len(x)` is no repeat.
    """
    head = suffix.lstrip()
    body = text.rstrip()
    rest_of_line = line_after_cursor.strip()
    if all(char in _CLOSERS for char in rest_of_line):
        rest_of_line = ""
    for size in range(min(len(body), len(head)), 0, -1):
        repeat = head[:size]
        if not body.endswith(repeat):
            continue
        if len(repeat) >= _MIN_REPEAT_CHARS or (rest_of_line and repeat == rest_of_line):
            return body[:-size]
    return text


def _drop_doubled_closers(text: str, line_before_cursor: str, line_after_cursor: str) -> str:
    """Strip closing brackets, quotes or punctuation the text right of the cursor already has.

    Only when that makes the finished line better formed: in `print(|)` the completion
    `len(x)` keeps its `)`, but `len(x))` loses one.
    """
    closers = _leading_closers(line_after_cursor)
    best, best_score = text, _badness(line_before_cursor, text, line_after_cursor)
    for size in range(1, len(closers) + 1):
        if not text.endswith(closers[:size]):
            continue
        kept = text[:-size]
        score = _badness(line_before_cursor, kept, line_after_cursor)
        if score < best_score:
            best, best_score = kept, score
    return best


def _leading_closers(line: str) -> str:
    end = 0
    while end < len(line) and line[end] in _CLOSERS:
        end += 1
    return line[:end]


def _badness(before: str, inserted: str, after: str) -> int:
    """How malformed the finished line looks: stray closing brackets, an unterminated string,
    or punctuation doubled where the insertion meets the existing text (`x::`, `a;;`)."""
    line = before + inserted + after
    stack: list[str] = []
    stray = 0
    quote: str | None = None
    escaped = False
    for char in line:
        if quote is not None:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = None
        elif char in _QUOTES:
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in _CLOSING_BRACKETS:
            if stack and stack[-1] == _CLOSING_BRACKETS[char]:
                stack.pop()
            else:
                stray += 1
    doubled = bool(inserted and after) and inserted[-1] == after[0] and after[0] in ":;,"
    return stray + (quote is not None) + doubled
