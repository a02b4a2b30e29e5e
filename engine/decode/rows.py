"""What a step works on: rows, one per sequence, each with its slot, sampler and drafts.

A row's sequence is its generation's token list: the slot caches seq[:length] and the last
token, the pending one, is the next to run through the trunk (between steps, length ==
len(seq) - 1). The steps extend the sequence and the slot together, so they never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine.cache.kv import LayerKV, RowsKV
from engine.cache.slots import SlotCache
from engine.decode.sampling import Sampler


@dataclass(slots=True)
class Drafts:
    """The drafts waiting for a row's next verify, made after its pending token."""

    k_max: int  # the most a step drafts: the verify buffer holds the pending token and these
    tokens: Tensor  # [1, k_max + 1]: the pending token, then the drafts
    count: int = 0
    probs: Tensor | None = None  # [count, V], the distributions sampled drafts came from
    confidence: list[float] = field(default_factory=list)  # each draft's probability, if asked
    seconds: float = 0.0  # what making them took: part of the next step's cost

    @classmethod
    def empty(cls, k_max: int, device: torch.device) -> Drafts:
        return cls(k_max, torch.zeros(1, k_max + 1, dtype=torch.long, device=device))

    def made(self) -> Tensor:
        """The drafts [count]."""
        return self.tokens[0, 1:self.count + 1]


@dataclass(slots=True)
class Row:
    slot: SlotCache
    seq: list[int]
    sampler: Sampler
    drafts: Drafts

    @property
    def pending(self) -> int:
        return self.seq[-1]


def batch_kv(caches: list[list[LayerKV]], masks: list[Tensor]) -> list[RowsKV]:
    """Per-layer batch views of per-row cache lists (each row attends over its own length;
    rows drafting fewer tokens than the batch's longest are padded, and the padding writes
    entries past the row's length, overwritten before they are ever attended to)."""
    return [RowsKV([row[i] for row in caches], masks) for i in range(len(caches[0]))]
