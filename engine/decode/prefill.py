"""Prompts into slots: run the tokens each slot's cache lacks (the longest common prefix with
what it holds is kept), several slots in one pass, in chunks; then pick the first tokens.

Rows whose spans are shorter than the pass's widest are padded: their padding tokens sit at
the cache's last (scratch) position, which no real query reads. A hybrid model's rows run one
per pass (padding would enter the recurrent state), each chunk committing the state after
its last position, and so do the rows of a model whose sliding-window layers keep rings.
Such a row resumes from the saved entry its slot names (see `Slot.cut_to`), and its passes
also end at the checkpoints: the latest multiples of EVERY tokens (as many as the slot
keeps) in the part of the prompt that stays while the user types (`stable`), after each of
which the committed state and the rings' last keys are saved for the next prompt to resume
from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.kv import KEY_BLOCK, CacheBatch, span_of
from engine.cache.slots import Caches, ContextOverflow, Slot
from engine.decode.quality import token_logprobs
from engine.decode.random import TARGET
from engine.decode.sampling import RowSampling
from engine.model.transformer import Transformer

EVERY = 64  # recurrent state checkpoints sit at multiples of this many positions


@dataclass(slots=True)
class PrefillRow:
    slot: Slot
    seq: list[int]  # the slot is to hold seq[:n]
    n: int
    stable: int  # seq[:stable] stays put while the user types (see `prompt.Prompt`)


def kv_blocks(n: int, limit: int, block: int = KEY_BLOCK) -> int:
    """Keys a forward reading positions < n attends over: n rounded up to a block (eager
    forwards then take a few shapes, not one per length)."""
    return min(limit, -(-n // block) * block)


@torch.inference_mode()
def prefill(model: Transformer, caches: Caches, rows: list[PrefillRow], spare: int) -> list[int]:
    """Make each row's slot hold the first n tokens of its sequence in its trunk cache, in
    passes of at most `caches.chunk` positions. Returns how many positions each reused.
    `spare`: room a row must leave after them."""
    for r in rows:
        if r.n == 0:
            raise ValueError("empty prompt")
        if r.n + spare > r.slot.max_seq_len:
            raise ContextOverflow(f"prompt of {r.n} tokens does not fit a context of "
                                  f"{r.slot.max_seq_len} (with {spare} spare)")
    cuts = [r.slot.cut_to(r.seq[:r.n]) for r in rows]
    starts = [start for start, _ in cuts]
    chunk = caches.chunk
    if model.cfg.hybrid or caches.ring is not None:  # one row a pass, checkpoints kept
        for r, (start, entry) in zip(rows, cuts, strict=True):
            _run_resumable(model, caches, r, start, entry, chunk)
    else:
        longest = max(r.n - s for r, s in zip(rows, starts, strict=True))
        _run(model, caches, rows, starts, [min(chunk, longest - off)
                                           for off in range(0, longest, chunk)])
    for r in rows:
        r.slot.hold(r.seq, r.n)
    return starts


def checkpoint_marks(start: int, end: int, count: int) -> list[int]:
    """The positions after which to save the state: the latest `count` multiples of EVERY in
    (start, end]."""
    return list(range(end // EVERY * EVERY, start, -EVERY))[:count][::-1]


def _run_resumable(model: Transformer, caches: Caches, row: PrefillRow, start: int,
                   entry: int | None, chunk: int) -> None:
    """One row from `start`, from the saved entry `entry` (None: what the caches hold, or
    nothing from 0), in passes of at most `chunk` that end at each checkpoint, saved there."""
    slots = torch.tensor([row.slot.index], device=caches.device)
    if entry is not None:
        caches.restore_state(slots, entry, start)
    elif start == 0:
        caches.clear_state(slots)  # from the start: no state left by a previous holder
    marks = checkpoint_marks(start, min(row.stable, row.n), caches.checkpoints)
    off = start
    for end in sorted({*marks, row.n}):
        _run(model, caches, [row], [off], [min(chunk, end - o) for o in range(off, end, chunk)])
        if end in marks:
            caches.save_state(slots, row.slot.checkpoint(end), end)
        off = end


def _run(model: Transformer, caches: Caches, rows: list[PrefillRow], starts: list[int],
         widths: list[int]) -> None:
    """Passes of `widths` positions over the rows, each from its start on."""
    device, scratch = caches.device, caches.length - 1
    slots = torch.tensor([r.slot.index for r in rows], device=device)
    off = 0
    for width in widths:
        ids, pos = [], []
        for r, s in zip(rows, starts, strict=True):
            span = r.seq[s + off:min(s + off + width, r.n)]
            ids.append(span + [0] * (width - len(span)))
            pos.append(list(range(s + off, s + off + len(span))) + [scratch] * (width - len(span)))
        tokens = torch.tensor(ids, device=device)
        positions = torch.tensor(pos, device=device)  # [B, C]
        real_end = max(min(s + off + width, r.n) for r, s in zip(rows, starts, strict=True))
        batch = CacheBatch(slots, positions, kv_blocks(real_end, caches.length),
                           span_of([r.slot.index for r in rows]))
        h = model.trunk(tokens, caches.rope(positions), batch, caches.trunk)
        caches.hidden[slots[:, None], positions] = h
        caches.commit(slots, torch.zeros_like(slots))  # the state after the chunk's last
        off += width


@torch.inference_mode()
def first_tokens(model: Transformer, caches: Caches, rows: list[PrefillRow],
                 sampling: RowSampling, allowed: Tensor | None) -> Tensor:
    """The token after each row's first n, greedy or sampled at position n among the
    `allowed` tokens [B, V] (token healing) where given, and its log-probability among them:
    [B, 2] float64, for one host read."""
    slots = torch.tensor([r.slot.index for r in rows], device=caches.device)
    last = torch.tensor([r.n - 1 for r in rows], device=caches.device)
    logits = model.head(caches.hidden[slots, last])[:, None]  # [B, 1, V]
    if allowed is not None:
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    tok, _ = sampling.pick(logits, (last + 1)[:, None], TARGET)
    return torch.stack([tok[:, 0].double(), token_logprobs(logits, tok)[:, 0].double()], -1)
