"""A sliding-window layer's cache as a ring (Gemma 4): each slot keeps only the keys and values
of its last positions, the key of position t at entry t mod size, instead of a cache as long
as the context.

Size: a forward from position s reads the keys of [s - need, s) (need: the window, plus one
for Gemma 4's assistant, whose sliding layers see window + 1 keys) and writes up to `chunk`
positions (a prefill pass) or `widest` (a verify, drafts included) before its queries read;
size = need + max(chunk, widest) keeps every key a query reads from being overwritten by
the same pass. Entry `size` takes what padding rows write at the cache's scratch position.

Rolling back is free while the keys [s - need, s) are still there (`Ring.keeps`): a cut back
by up to about size - need - widest positions; a deeper one resumes from a saved window (the
last `need` keys after a checkpoint's position, as hybrid models keep recurrent state
checkpoints) or runs from the start. The attention reads a ring by position, in the order a
full-length cache gives (engine/native/attention.c), so its output has the same bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine import native
from engine.cache import zeros
from engine.cache.kv import CacheBatch, KVCache


@dataclass(frozen=True, slots=True)
class Ring:
    """The rings' sizes, as the host's record of a slot (cache/slots.py) needs them."""

    size: int  # entries: position t at t mod size
    need: int  # keys before a position that a forward from it reads
    widest: int  # positions a step writes from the committed length on

    def keeps(self, start: int, floor: int, top: int) -> bool:
        """Whether a forward from `start` finds the keys it reads, [start - need, start),
        in a slot's rings: written since its rings last started over (from `floor` on) and
        not overwritten since (a write at p overwrites p - size, and writes reach
        top + widest - 1, `top` the furthest length the slot has held since)."""
        lo = max(0, start - self.need)
        return lo >= floor and lo >= top + self.widest - self.size


class RingCache(KVCache):
    """One sliding-window layer's ring for all slots: k and v [slots, kv_heads, size + 1, D],
    and saved windows [slots, P, kv_heads, need, D] each."""

    __slots__ = ("need", "saved_k", "saved_v", "scratch", "size")

    def __init__(self, num_slots: int, num_kv_heads: int, ring: Ring, head_dim: int,
                 device: torch.device, dtype: torch.dtype, scratch: int, saved: int) -> None:
        super().__init__(num_slots, num_kv_heads, ring.size + 1, head_dim, device, dtype)
        self.size, self.need, self.scratch = ring.size, ring.need, scratch
        shape = (num_slots, saved, num_kv_heads, ring.need, head_dim)
        self.saved_k = zeros(*shape, device=device, dtype=dtype)
        self.saved_v = zeros(*shape, device=device, dtype=dtype)

    def entries(self, pos: Tensor) -> Tensor:
        """The ring entries of positions `pos` (the scratch position's: the spare one)."""
        return torch.where(pos == self.scratch, self.size, pos % self.size)

    def update(self, batch: CacheBatch, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k, v [B, Hkv, S, D] at each row's slot and positions' entries; the rows'
        whole rings [B, Hkv, size + 1, D]."""
        slots, at = batch.slots[:, None], self.entries(batch.pos)  # [B, 1], [B, S]
        if not native.kv_write(self.k, self.v, k, v, batch.slots, at):
            self.k[slots, :, at] = k.transpose(1, 2)  # indexed: [B, S, Hkv, D]
            self.v[slots, :, at] = v.transpose(1, 2)
        return self.read(batch)

    def read(self, batch: CacheBatch) -> tuple[Tensor, Tensor]:
        """The batch's slots' whole rings [B, Hkv, size + 1, D] (a view for a span)."""
        if batch.span is not None:
            first, last = batch.span
            return self.k[first:last], self.v[first:last]
        return self.k[batch.slots], self.v[batch.slots]

    def _window(self, position: int) -> Tensor:
        """The entries of the keys a forward from `position` reads, oldest first."""
        first = max(0, position - self.need)
        return torch.arange(first, position, device=self.k.device) % self.size

    def save(self, slots: Tensor, entry: int, position: int) -> None:
        """The keys before `position` that a forward from there reads, into saved `entry`."""
        at = self._window(position)
        self.saved_k[slots, entry, :, :len(at)] = self.k[slots][:, :, at]
        self.saved_v[slots, entry, :, :len(at)] = self.v[slots][:, :, at]

    def restore(self, slots: Tensor, entry: int, position: int) -> None:
        """Saved `entry` (made at `position`) back into the rings of `slots`."""
        at = self._window(position)
        rows = slots[:, None], at[None]  # [B, 1], [1, n]: indexed [B, n, Hkv, D]
        self.k[rows[0], :, rows[1]] = self.saved_k[slots, entry, :, :len(at)].transpose(1, 2)
        self.v[rows[0], :, rows[1]] = self.saved_v[slots, entry, :, :len(at)].transpose(1, 2)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.k, self.v, self.saved_k, self.saved_v))


def ring_mask(pos: Tensor, window: int, size: int) -> Tensor:
    """Which of a ring's size + 1 entries each row at pos [B, S] sees [B, 1, S, size + 1]:
    the last `window` of its keys 0..pos (the entry t mod size of position t)."""
    entries = torch.arange(size + 1, device=pos.device)
    back = (pos[:, :, None] - entries) % size  # [B, S, E]: how far back the entry's key is
    return ((back < window) & (back <= pos[:, :, None]) & (entries < size))[:, None]
