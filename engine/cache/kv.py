"""KV caches: every slot's keys and values for one attention layer, allocated once at the full
context and written in place by position; and what a forward tells the attention layers
about the rows it runs (which slot, which positions, which keys each query may see).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from engine import native
from engine.cache import zeros

# Keys are read in whole blocks of this many: a cache holds whole blocks, an eager forward
# reads the blocks up to its last position, and attention may sum block by block.
KEY_BLOCK = 256


class KVCache:
    """One attention layer's cache for all slots: k and v [slots, kv_heads, length, head_dim]."""

    __slots__ = ("k", "v")

    def __init__(self, num_slots: int, num_kv_heads: int, length: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_slots, num_kv_heads, length, head_dim)  # [S, Hkv, T, D]
        self.k = zeros(*shape, device=device, dtype=dtype)
        self.v = zeros(*shape, device=device, dtype=dtype)

    def update(self, batch: CacheBatch, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, S, D] at each row's slot and positions; the keys and values
        of those slots' first kv_len positions [B, Hkv, kv_len, D]."""
        if not native.kv_write(self.k, self.v, k, v, batch.slots, batch.pos):
            slots = batch.slots[:, None]  # [B, 1] against positions [B, S]
            self.k[slots, :, batch.pos] = k.transpose(1, 2)  # indexed: [B, S, Hkv, D]
            self.v[slots, :, batch.pos] = v.transpose(1, 2)
        return self.read(batch)

    def read(self, batch: CacheBatch) -> tuple[Tensor, Tensor]:
        """The keys and values of the batch's slots' first kv_len positions [B, Hkv, kv_len,
        D], as they are (a drafter attending over the target's cache reads it so)."""
        if batch.span is not None:  # consecutive slots: a view, no copy
            first, last = batch.span
            return self.k[first:last, :, :batch.kv_len], self.v[first:last, :, :batch.kv_len]
        return (self.k[batch.slots, :, :batch.kv_len], self.v[batch.slots, :, :batch.kv_len])


@dataclass(slots=True)
class CacheBatch:
    """The rows of a cached forward: row b runs in slot slots[b] at positions pos[b]; its
    queries see the keys of positions <= their own among the slot's first kv_len."""

    slots: Tensor  # [B] long
    pos: Tensor  # [B, S] long
    kv_len: int  # keys read per row: a multiple of a block, or the whole cache
    span: tuple[int, int] | None = None  # when the slots are first..last-1, in order
    per_position: bool = False  # recurrent layers keep their state after every position
    mask: Tensor = field(init=False)  # [B, 1, S, kv_len] bool, built on the device

    def __post_init__(self) -> None:
        keys = torch.arange(self.kv_len, device=self.pos.device)
        self.mask = (keys[None, None, :] <= self.pos[:, :, None])[:, None]


def span_of(index: list[int]) -> tuple[int, int] | None:
    """(first, last + 1) when `index` counts up one by one, else None."""
    if index == list(range(index[0], index[0] + len(index))):
        return index[0], index[0] + len(index)
    return None
