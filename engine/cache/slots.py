"""Slots: one sequence's caches each, and which key (an editor's document, say) has which.

A slot holds, for the sequence it was last given (its holder's token list, which only
grows), the trunk's KV entries and output h_t for positions 0..length-1, and each MTP
module's KV entries for positions t < mtp_len (entry t made from h_t and x_{t+1}). All of it
is allocated once at the full context, batch 1 per slot, and written in place by position;
rolling back is moving `length` back: entries past it are overwritten before they are ever
attended to.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch
from torch import Tensor

from engine.cache.kv import LayerKV
from engine.model.layers import rope_tables
from engine.model.transformer import Transformer


class ContextOverflow(ValueError):
    """The prompt plus the tokens to generate do not fit in the allocated context."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SlotCache:
    """One slot: caches, hidden states and position tables for one sequence at a time."""

    def __init__(self, model: Transformer, max_seq_len: int, kv_block: int = 64) -> None:
        cfg = model.cfg
        p = model.model.embed_tokens.weight
        self.device, self.dtype = p.device, p.dtype
        self.max_seq_len = max_seq_len
        self.kv_block = kv_block  # eager: attend over a multiple of this, not the whole cache

        def layers(n: int) -> list[LayerKV]:
            return [LayerKV(1, cfg.num_kv_heads, max_seq_len, cfg.head_dim, self.device,
                            self.dtype) for _ in range(n)]

        self.trunk_kv = layers(cfg.num_layers)
        self.mtp_kv = [layers(cfg.mtp_layers_per_module) for _ in range(model.num_mtp)]
        self.rope_tables = rope_tables(cfg, max_seq_len, self.device, self.dtype)
        self.positions = torch.arange(max_seq_len, device=self.device)
        self.hidden = torch.zeros(1, max_seq_len, cfg.hidden_size, device=self.device,
                                  dtype=self.dtype)  # trunk output h_t, [1, T, H]
        self.seq: list[int] = []  # the holder's tokens: positions < length are cached
        self.length = 0
        self.mtp_len = 0  # module entries are valid for positions < mtp_len
        self._module_out: tuple[int, Tensor] | None = None  # (length, module 0 at length-1)

    def room(self) -> int:
        """Positions left after the cached ones: a verify of k drafts writes k + 1 of them,
        drafting k writes k module entries. Every check of the context's room reads this."""
        return self.max_seq_len - self.length

    def held(self) -> list[int]:
        return self.seq[:self.length]

    def holds(self, seq: list[int]) -> bool:
        """Whether this slot's caches are those of `seq` (the same list, not an equal one)."""
        return self.seq is seq

    def reset(self) -> None:
        self.seq, self.length, self.mtp_len, self._module_out = [], 0, 0, None

    def mask(self, pos: Tensor, last: int) -> Tensor:
        """Which keys the queries at `pos` [S] may see [S, kv_len]: kv_len covers position
        `last`, rounded up to the block."""
        kv_len = min(self.max_seq_len, -(-(last + 1) // self.kv_block) * self.kv_block)
        return self.positions[None, :kv_len] <= pos[:, None]

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        return self.rope_tables[0][pos], self.rope_tables[1][pos]

    def cut_to(self, tokens: list[int]) -> int:
        """Keep only what `tokens` shares with the cached sequence; the position to run the
        trunk from. Module entry t depends on x_{t+1}, so c common positions leave c - 1
        reusable module entries, and the trunk restarts there too (it always runs the last
        token)."""
        start = max(0, min(common_prefix(self.held(), tokens), len(tokens)) - 1)
        self.length = min(self.length, start)
        self.mtp_len = min(self.mtp_len, start)
        return start

    def hold(self, seq: list[int], length: int) -> None:
        """The trunk entries of seq[:length] are written: this slot now holds `seq`."""
        self.seq, self.length = seq, length
        self.mtp_len = min(self.mtp_len, length)

    def advance(self, n: int) -> None:
        """A verify pass wrote the holder's next n positions."""
        self.length += n

    def modules_caught_up(self, out0: Tensor) -> None:
        """Every module's entries now reach the trunk's; `out0` is module 0's output at the
        last position [1, 1, H] (what the first draft is made from)."""
        self.mtp_len = self.length
        self._module_out = (self.length, out0)

    def module_output(self) -> Tensor | None:
        """Module 0's output at the last position if the modules are up to date, else None."""
        out = self._module_out
        if out is None or self.mtp_len != self.length or out[0] != self.length:
            return None
        return out[1]


class SlotTable:
    """Slots by key, at most `size` of them; a new key recycles the least recently used."""

    def __init__(self, make: Callable[[], SlotCache], size: int) -> None:
        if size < 1:
            raise ValueError(f"need at least one KV-cache slot, got {size}")
        self.size, self._make = size, make
        self._slots: OrderedDict[Hashable, SlotCache] = OrderedDict({None: make()})

    def get(self, key: Hashable) -> SlotCache:
        """The key's slot, made most recently used."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        if len(self._slots) < self.size:
            slot = self._make()
        else:
            _, slot = self._slots.popitem(last=False)
            slot.reset()
        self._slots[key] = slot
        return slot
