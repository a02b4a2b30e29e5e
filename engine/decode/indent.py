"""The end of a block by its indentation (llama-server's `n_indent`, which llama.vim sends):
with a floor of n, the text ends before the first line, after the first, whose first
non-blank character stands in a column below n (spaces and tabs count one each). The first
line continues the cursor's line, so it is never judged; blank lines are not either.

The editor side sets the floor one past a block opener's indentation, so that a suggestion
for the body of `def f():` ends where the model starts the next function, and the model
stops writing there rather than at its token limit. Pure Python: the remote backend applies
it to a server's stream as the engine does to its own.
"""

from __future__ import annotations

_INDENT = " \t"


class IndentFloor:
    """Fed a generation's text as it streams; passes it on up to the end of the block.

    A line's indentation is known once its first non-blank character has come, so the text
    from a newline to there is held back until then (or until the generation ends)."""

    def __init__(self, floor: int) -> None:
        if floor < 0:
            raise ValueError(f"the indentation floor must be >= 0, got {floor}")
        self.floor = floor
        self.ended = False
        self._held = ""  # from the newline of a line whose indentation is not known yet

    def push(self, text: str, final: bool = False) -> str:
        """The text to pass on; sets `ended` at the block's end. `final`: the generation
        ends here for another reason, so nothing is held back."""
        if self.ended:
            return ""
        if self.floor == 0:
            return text
        buf, self._held = self._held + text, ""
        start = 0
        while (nl := buf.find("\n", start)) >= 0:
            col = nl + 1
            while col < len(buf) and buf[col] in _INDENT:
                col += 1
            if col == len(buf):  # the line's indentation so far, no character after it
                return buf if final else self._hold(buf, _line_end(buf, nl))
            if buf[col] not in "\r\n" and col - nl - 1 < self.floor:
                self.ended = True
                return buf[:_line_end(buf, nl)]
            start = col
        if buf.endswith("\r") and not final:  # perhaps a line end: kept with its "\n"
            return self._hold(buf, len(buf) - 1)
        return buf

    def _hold(self, buf: str, at: int) -> str:
        self._held = buf[at:]
        return buf[:at]


def _line_end(buf: str, nl: int) -> int:
    """Where the line that the newline at `nl` ends stops ("\r\n" ends included)."""
    return nl - 1 if nl > 0 and buf[nl - 1] == "\r" else nl
