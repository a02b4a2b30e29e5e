"""Prompts into a slot: run the tokens its cache lacks (the longest common prefix with what
it holds is kept), then pick the first token; or take a slot back for an interrupted row."""

from __future__ import annotations

import torch
from torch import Tensor

from engine.cache.slots import ContextOverflow
from engine.decode.rows import Row
from engine.model.transformer import Transformer


@torch.inference_mode()
def sync(model: Transformer, row: Row, n: int, chunk: int = 512) -> int:
    """Make the row's slot hold the first n tokens of its sequence in its trunk cache.
    Returns how many positions were reused."""
    slot, tokens = row.slot, row.seq[:n]
    if n == 0:
        raise ValueError("empty prompt")
    spare = row.drafts.k_max + 2
    if n + spare > slot.max_seq_len:
        raise ContextOverflow(f"prompt of {n} tokens does not fit a context of "
                              f"{slot.max_seq_len} (with {spare} spare)")
    start = slot.cut_to(tokens)
    ids = torch.tensor([tokens], dtype=torch.long, device=slot.device)
    for s in range(start, n, chunk):
        e = min(s + chunk, n)
        pos = slot.positions[s:e]
        slot.hidden[:, s:e] = model.trunk(ids[:, s:e], slot.rope(pos), pos, slot.trunk_kv,
                                          slot.mask(pos, e - 1))
    slot.hold(row.seq, n)
    row.drafts.count = 0
    return start


def prefill(model: Transformer, row: Row, allowed: Tensor | None = None) -> tuple[int, int]:
    """Run the whole sequence (the prompt) and append the first token to it. Returns (first
    token, reused positions). `allowed` [V] restricts the first token (token healing)."""
    reused = sync(model, row, len(row.seq))
    with torch.inference_mode():
        logits = model.head(row.slot.hidden[:, len(row.seq) - 1])
        if allowed is not None:
            logits = logits.masked_fill(~allowed, float("-inf"))
        first, _ = row.sampler.pick(logits)
    row.seq.append(int(first))
    return row.seq[-1], reused


def restore(model: Transformer, row: Row) -> int:
    """Take the slot back for a row another one interrupted: all but its pending token."""
    return sync(model, row, len(row.seq) - 1)
