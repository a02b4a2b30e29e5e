"""Drafts from the context: after a row's last few tokens, the tokens that followed their
latest earlier occurrence in its own sequence (the prompt, with the other files the editor
sent, then everything generated).

The index maps every n-gram (n = 1..MAX_N) to the position after its latest occurrence
that has a token after it; it catches up with the sequence as tokens arrive (MAX_N dict
writes a token), and a lookup is MAX_N dict reads, then a bounded look back to measure how
long the match really is: constant work a step, whatever the context's length. An index
serves one sequence at a time, and is kept per KV-cache slot: the next prompt in the slot
(the next keystroke's) shares most of the last one's tokens, so only what follows their
common prefix is indexed again; entries left from the old tokens are checked against the
sequence when found, and dropped if they no longer match. The match's
length is what says most about whether its continuation will be accepted (a one-token match
is a guess, a retyped line is not), so drafts carry it (`bucket`), and the K policy keeps
acceptance per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.cache.slots import common_prefix

MAX_N = 4  # longest n-gram indexed
LOOK_BACK = 32  # the most tokens a match's length is measured over
BUCKETS = (1, 2, 3, 4, 8, 16)  # a match of length m falls in the last bucket <= m


def bucket_of(length: int) -> int:
    """The index in BUCKETS of a match of `length` tokens (>= 1)."""
    return max(i for i, b in enumerate(BUCKETS) if b <= length)


@dataclass(frozen=True, slots=True)
class ContextDraft:
    tokens: list[int]  # the continuation, as long as asked for and the sequence has
    bucket: int  # of the match's length (see BUCKETS)
    start: int  # the position in the sequence of the continuation's first token


class ContextIndex:
    def __init__(self) -> None:
        self._after: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_N)]
        self._indexed = 0  # positions i < _indexed have their n-grams ending before i indexed
        self._seq: list[int] = []  # the sequence indexed (a generation's: it only grows)

    def catch_up(self, seq: list[int]) -> None:
        """Index the n-grams that now have a token after them: those ending just before
        each position up to len(seq) - 1. Another sequence than the last one indexed keeps
        what the two have in common."""
        if seq is not self._seq:
            self._indexed = min(self._indexed, common_prefix(self._seq, seq))
            self._seq = seq
        for i in range(max(self._indexed, 1), len(seq)):
            for n in range(1, min(MAX_N, i) + 1):
                self._after[n - 1][tuple(seq[i - n:i])] = i
        self._indexed = max(self._indexed, len(seq))

    def draft(self, seq: list[int], limit: int,
              tail: Sequence[int] = ()) -> ContextDraft | None:
        """Up to `limit` tokens of `seq` that followed the longest earlier match of the end of
        `seq` + `tail` (None: no n-gram of it occurred before, or limit < 1). `tail`: tokens
        not committed yet (drafts), matched but never indexed."""
        if limit < 1 or not seq:
            return None
        self.catch_up(seq)
        recent = [*seq[-(MAX_N + LOOK_BACK):], *tail]
        for n in range(min(MAX_N, len(recent)), 0, -1):
            key = tuple(recent[-n:])
            at = self._after[n - 1].get(key)
            if at is None or at >= len(seq) or tuple(seq[at - n:at]) != key:
                continue  # absent, or left from another sequence's tokens
            length = n
            while (length < min(LOOK_BACK, len(recent) - 1) and at - length - 1 >= 0
                   and seq[at - length - 1] == recent[-length - 1]):
                length += 1
            return ContextDraft(seq[at:at + limit], bucket_of(length), at)
        return None
