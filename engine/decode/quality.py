"""What makes a suggestion worth showing: the degenerate-output rules and the confidence
score, in one place for every path (inline completion, `ahead generate`, docstrings, bench).

- Loops: a generation stops (finish reason "repetition") when its last tokens repeat a unit
  of text three times in a row ("a list of a list of a list of"), or when a line repeats the
  one before it, or a substantial line comes a third time. Units without a letter (`0, 0, 0`,
  `====`) or too short to be text (`x, x, x`) are code, not loops.
- Echo: a suggestion that only repeats the text around the cursor (the rest of the line, or
  lines already just above or below) adds nothing.
- Confidence: the mean and the minimum log-probability, under the target model at
  temperature 1, of the tokens shown. The verify pass computes them with the logits it
  already has (`token_logprobs`), and they reach the host in the step's one read. The score
  a threshold is set on is the geometric mean of the tokens' probabilities, exp(mean).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only the device half needs torch; clients read the rules without it
    from torch import Tensor

LOOP_UNITS = 3  # a unit of tokens seen this many times in a row is a loop
LOOP_MAX_PERIOD = 32  # longest unit looked for, in tokens
LINE_MIN_CHARS = 8  # a line repeated right after itself is a loop from this many characters
LINE_THIRD_CHARS = 16  # ... and one seen a third time, from this many
ECHO_LINES = 3  # lines above and below the cursor that a suggestion may not merely repeat
_WORD = re.compile(r"[A-Za-z_]{2,}")
_LETTER = re.compile(r"[A-Za-z]")

# Why a suggestion is not shown or written (besides an empty one).
REPETITION, ECHO, LOW_CONFIDENCE, EMPTY = "repetition", "echo", "low_confidence", "empty"


def token_logprobs(logits: Tensor, tokens: Tensor, lse: Tensor | None = None) -> Tensor:
    """log softmax(logits)[token] for logits [..., V] and tokens [...]: log p of each token;
    `lse`: the logits' log-sum-exp where it is known already."""
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    return picked - (logits.float().logsumexp(-1) if lse is None else lse)


@dataclass(frozen=True, slots=True)
class Confidence:
    mean_logprob: float
    min_logprob: float
    tokens: int

    @property
    def score(self) -> float:
        """The geometric mean of the tokens' probabilities, in (0, 1]."""
        return math.exp(self.mean_logprob)


def confidence(logprobs: Sequence[float]) -> Confidence | None:
    """The scores of a suggestion's tokens; None for no tokens."""
    if not logprobs:
        return None
    return Confidence(sum(logprobs) / len(logprobs), min(logprobs), len(logprobs))


class LoopWatch:
    """Fed a generation's tokens one at a time; says when the output has fallen into a loop.
    `piece` gives a token's text."""

    def __init__(self, piece: Callable[[int], str]) -> None:
        self._piece = piece
        self.tokens: list[int] = []
        self._line = ""  # the current line so far
        self._lines: list[str] = []  # finished non-blank lines, normalised
        self._seen: Counter[str] = Counter()

    def push(self, token: int) -> bool:
        """Take the next token; True when it completes a loop."""
        self.tokens.append(token)
        return self._token_loop() or self._line_loop(self._piece(token))

    def _token_loop(self) -> bool:
        toks, n = self.tokens, len(self.tokens)
        for p in range(1, min(LOOP_MAX_PERIOD, n // LOOP_UNITS) + 1):
            if toks[-1] != toks[-1 - p]:
                continue
            unit = toks[n - p:]
            if all(toks[n - (i + 1) * p:n - i * p] == unit for i in range(1, LOOP_UNITS)) \
                    and _wordy("".join(self._piece(t) for t in unit)):
                return True
        return False

    def _line_loop(self, text: str) -> bool:
        *done, self._line = (self._line + text).split("\n")
        for line in done:
            norm = " ".join(line.split())
            if not norm:
                continue
            if self._lines and norm == self._lines[-1] and len(norm) >= LINE_MIN_CHARS:
                return True
            self._seen[norm] += 1
            if self._seen[norm] >= 3 and len(norm) >= LINE_THIRD_CHARS:
                return True
            self._lines.append(norm)
        return False


def _wordy(unit: str) -> bool:
    """Whether a repeated unit is text rather than data: a word, or a letter among three
    or more other characters ("k``) = ``(", not "0, " or "x, ")."""
    return bool(_WORD.search(unit)) or (bool(_LETTER.search(unit)) and
                                        len("".join(unit.split())) >= 3)


def loops(tokens: Sequence[int], piece: Callable[[int], str]) -> bool:
    """Whether these tokens contain a loop (the rule a generation stops on)."""
    watch = LoopWatch(piece)
    return any(watch.push(t) for t in tokens)


def echoes(text: str, prefix: str, suffix: str) -> bool:
    """Whether a suggestion only repeats the text around the cursor: the rest of the cursor's
    line, or lines that are already among the ECHO_LINES above and below."""
    shown = _norm(text)
    if not shown:
        return False
    if _norm(suffix).startswith(shown):
        return True
    above, below = prefix.split("\n"), suffix.split("\n")
    near = {_norm(x) for x in [*above[-1 - ECHO_LINES:-1], *below[1:1 + ECHO_LINES]]}
    lines = text.split("\n")
    lines[0] = above[-1] + lines[0]  # the cursor's line as it would read
    real = [_norm(x) for x in lines if _norm(x)]
    return bool(real) and all(x in near for x in real)


def _norm(text: str) -> str:
    return " ".join(text.split())


def before_loop(text: str) -> str:
    """The complete lines of a suggestion that ended in a loop (finish reason REPETITION)
    before the loop began: the line it was caught in goes, and from the first copy of a line
    that the line rules find repeated. `return a + b` stays when a block repeats after it."""
    lines = text.split("\n")[:-1]  # the loop was caught in the last line
    first: dict[str, int] = {}
    count: Counter[str] = Counter()
    prev: tuple[str, int] | None = None
    for i, line in enumerate(lines):
        norm = _norm(line)
        if not norm:
            continue
        if prev is not None and norm == prev[0] and len(norm) >= LINE_MIN_CHARS:
            return "\n".join(lines[:first[norm]]).rstrip()
        first.setdefault(norm, i)
        count[norm] += 1
        if count[norm] >= 3 and len(norm) >= LINE_THIRD_CHARS:
            return "\n".join(lines[:first[norm]]).rstrip()
        prev = (norm, i)
    return "\n".join(lines).rstrip()


def judged(text: str, finish_reason: str | None, scores: Confidence | None,
           min_confidence: float, *, prefix: str | None = None,
           suffix: str | None = None) -> tuple[str, str | None]:
    """What of an inline suggestion or a generated text to show, and why nothing is (see
    `verdict`): one that fell into a loop keeps its complete lines before the loop, judged
    by the other rules (its scores are those of the whole answer)."""
    if finish_reason == REPETITION:
        text = before_loop(text)
        if not text.strip():
            return "", REPETITION
        finish_reason = "stop"
    why = verdict(text, finish_reason, scores, min_confidence, prefix=prefix, suffix=suffix)
    return ("" if why else text), why


def verdict(text: str, finish_reason: str | None, scores: Confidence | None,
            min_confidence: float, *, prefix: str | None = None,
            suffix: str | None = None) -> str | None:
    """Why this suggestion must not be shown (REPETITION, ECHO, LOW_CONFIDENCE, EMPTY), or
    None to show it. `min_confidence` 0 turns the threshold off; the echo rule needs the text
    around the cursor. Scores unknown (a server that gives none) pass the threshold."""
    if not text.strip():
        return EMPTY
    if finish_reason == REPETITION:
        return REPETITION
    if prefix is not None and suffix is not None and echoes(text, prefix, suffix):
        return ECHO
    if scores is not None and scores.score < min_confidence:
        return LOW_CONFIDENCE
    return None
