"""Prompts into slots: run the tokens each slot's cache lacks (the longest common prefix with
what it holds is kept), several slots in one pass, in chunks; then pick the first tokens.

Rows whose spans are shorter than the pass's widest are padded: their padding tokens sit at
the cache's last (scratch) position, which no real query reads. A hybrid model's rows run one
per pass (padding would enter the recurrent state), each chunk committing the state after
its last position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.cache.kv import CacheBatch, span_of
from engine.cache.slots import Caches, ContextOverflow, Slot
from engine.decode.quality import token_logprobs
from engine.decode.random import TARGET
from engine.decode.sampling import RowSampling
from engine.model.transformer import Transformer


@dataclass(slots=True)
class PrefillRow:
    slot: Slot
    seq: list[int]  # the slot is to hold seq[:n]
    n: int


def kv_blocks(n: int, limit: int, block: int = 256) -> int:
    """Keys a forward reading positions < n attends over: n rounded up to a block (eager
    forwards then take a few shapes, not one per length)."""
    return min(limit, -(-n // block) * block)


@torch.inference_mode()
def prefill(model: Transformer, caches: Caches, rows: list[PrefillRow], spare: int,
            chunk: int = 512) -> list[int]:
    """Make each row's slot hold the first n tokens of its sequence in its trunk cache.
    Returns how many positions each reused. `spare`: room a row must leave after them."""
    for r in rows:
        if r.n == 0:
            raise ValueError("empty prompt")
        if r.n + spare > r.slot.max_seq_len:
            raise ContextOverflow(f"prompt of {r.n} tokens does not fit a context of "
                                  f"{r.slot.max_seq_len} (with {spare} spare)")
    starts = [r.slot.cut_to(r.seq[:r.n]) for r in rows]
    # Recurrent layers would carry padding into a row's state: there, one row per pass.
    groups = [[i] for i in range(len(rows))] if model.cfg.hybrid else [list(range(len(rows)))]
    for group in groups:
        _run(model, caches, [rows[i] for i in group], [starts[i] for i in group], chunk)
    for r in rows:
        r.slot.hold(r.seq, r.n)
    return starts


def _run(model: Transformer, caches: Caches, rows: list[PrefillRow], starts: list[int],
         chunk: int) -> None:
    device, scratch = caches.device, caches.length - 1
    slots = torch.tensor([r.slot.index for r in rows], device=device)
    longest = max(r.n - s for r, s in zip(rows, starts, strict=True))
    if model.cfg.hybrid and starts == [0]:
        caches.clear_state(slots)  # from the start: no state left by a previous holder
    for off in range(0, longest, chunk):
        width = min(chunk, longest - off)
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
