"""The one prompt recipe: token healing, then FIM with the model's own tokens cut to a token
budget (editor completions and docstrings), or the text as it is (generate).

Clients send generous character windows; the budget is enforced here in tokens, cutting at
line boundaries: the prefix keeps its last lines, the suffix its first lines, and context
chunks from other files fill what room is left, most recent first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    # How many ids come before the text that moves while the user types (what follows the
    # cursor, in PSM order): the part a recurrent state checkpoint may be kept for.
    stable: int
    forced: str = ""  # what the answer must start with (healing); not part of the answer


def fill_in(tok: Tokenizer, prefix: str, suffix: str, *, budget: int,
            extra: Sequence[tuple[str, str]] = ()) -> Prompt:
    """The prompt for the text between `prefix` and `suffix` (FIM, or the prefix alone for a
    model without FIM tokens), within `budget` tokens; `extra`: (path, text) context."""
    prefix, forced = heal(prefix)
    return replace(completion_prompt(tok, prefix, suffix, max_tokens=budget, extra=extra),
                   forced=forced)


def continuation(tok: Tokenizer, text: str) -> Prompt:
    """The prompt that continues `text`, whole (a prompt too long for the context is refused
    at the prefill, not cut)."""
    text, forced = heal(text) if text.strip() else (text, "")
    ids = [*tok.bos_ids, *tok.encode_text(text)]
    return Prompt(ids, stable=len(ids), forced=forced)


def heal(prefix: str) -> tuple[str, str]:
    """Token healing for the common case: (prompt prefix, text the answer must start with).

    Byte-level BPE attaches one space to the word after it ("    return" is "   " + " return"),
    so a prefix ending in a space (indentation, "return ") stops at a token boundary the
    model never saw in training, and it answers badly. The space moves into the answer: the
    prompt ends one character earlier, and the answer's first token must start with it.
    """
    if prefix.endswith(" "):
        return prefix[:-1], " "
    return prefix, ""


def _fit_lines(tok: Tokenizer, lines: list[str], budget: int, *, from_end: bool,
               anchor: int = 1) -> str:
    """The most lines (from the end or the start) whose text encodes within `budget` tokens,
    leaving out a multiple of `anchor` lines at the other end."""
    lo, hi = 0, len(lines)
    while lo < hi:  # binary search on how many lines to keep
        mid = (lo + hi + 1) // 2
        text = "".join(lines[-mid:] if from_end else lines[:mid])
        if len(tok.encode_text(text)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    if lo < len(lines):  # never more than a quarter of what fits
        snapped = len(lines) - -(-(len(lines) - lo) // anchor) * anchor
        lo = snapped if snapped >= lo - lo // 4 else lo
    return "".join(lines[len(lines) - lo:] if from_end else lines[:lo])


def completion_prompt(tok: Tokenizer, prefix: str, suffix: str, *, max_tokens: int,
                      extra: Sequence[tuple[str, str]] = (), suffix_share: float = 0.2,
                      extra_share: float = 0.2, anchor_lines: int = 16) -> Prompt:
    """A FIM prompt within `max_tokens` (a plain prefix if the model has no FIM).

    The suffix and the context chunks get at most their shares; the prefix gets the rest. The
    line the cursor is on is kept whole on the prefix side (cut from its start only if it
    alone exceeds the budget), since the completion continues it. A prefix that must be cut
    loses a multiple of `anchor_lines` lines from its start (if that costs at most a quarter
    of the lines that fit), so that the prompt's start stays put while the user types and
    the KV cache keeps it, as the editor's window does.
    """
    if max_tokens < 16:
        raise ValueError(f"a prompt budget of {max_tokens} tokens is too small")
    room = max_tokens - 8 - len(tok.bos_ids)  # FIM markers and separators
    kept_suffix = ""
    if tok.fim and suffix:
        kept_suffix = _fit_lines(tok, suffix.splitlines(keepends=True),
                                 int(room * suffix_share), from_end=False)
    chunks, left = [], int(room * extra_share) if tok.fim else 0
    for path, text in extra:  # most relevant first; each whole or not at all
        cost = len(tok.encode_text(f"{path}\n{text}")) + 2
        if cost <= left:
            chunks.append((path, text))
            left -= cost
    budget = room - len(tok.encode_text(kept_suffix)) - (int(room * extra_share) - left
                                                         if tok.fim else 0)
    body = prefix.splitlines(keepends=True)
    current = "" if not body or body[-1].endswith("\n") else body.pop()
    current_ids = tok.encode_text(current)
    if len(current_ids) > budget:  # one enormous line
        kept_prefix = tok.decode(current_ids[-budget:])
    else:
        kept_prefix = _fit_lines(tok, body, budget - len(current_ids), from_end=True,
                                 anchor=anchor_lines) + current
    if not tok.fim:
        ids = [*tok.bos_ids, *tok.encode_text(kept_prefix)]
        return Prompt(ids, stable=len(ids))
    ids, stable = tok.fim_parts(kept_prefix, kept_suffix, extra=chunks)
    return Prompt(ids, stable=stable)
