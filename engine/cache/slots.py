"""Slots: the device caches of every slot, and on the host what each slot holds.

All slots' caches are allocated once at load: per attention layer of the trunk and of each
MTP module, keys and values [slots, kv_heads, length, head_dim]; the trunk's output h_t
[slots, length, hidden] (what the modules are run on); rotary tables. `length` is the
context plus scratch room: rows that pad a step (drafts a row did not make, positions past
its end) write there and are never read as real keys. A `Slot` is the host's record of one
slot: the sequence it holds (its holder's token list, which only grows), how many of its
positions the trunk has cached (entry t < length), and how many the MTP modules have (entry
t < mtp_len, made from h_t and x_{t+1}). Rolling back is moving `length` back: entries past
it are overwritten before they are ever attended to.

A hybrid model's recurrent state cannot be rolled back that way (cache/state.py): a slot
reuses it whole when the new sequence extends all it holds, or else resumes from one of its
`checkpoints` saved states, whose positions the `Slot` records (the state after the first p
tokens of the sequence it holds), or runs from the start. Sliding-window layers keep rings
(cache/ring.py) where those are shorter than the context: rolling back is free as long as
the ring still holds the keys a forward from there reads, else a slot resumes from a saved
window as from a recurrent state.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch
from torch import Tensor

from engine.cache import zeros
from engine.cache.kv import KEY_BLOCK, KVCache
from engine.cache.ring import Ring, RingCache
from engine.cache.state import RingOffsets, StateCache, commit
from engine.model.config import LINEAR, SLIDING
from engine.model.layers import rope_tables
from engine.model.transformer import Transformer

PREFILL_CHUNK = 512  # positions a prefill pass runs at most
MIN_CHUNK = 64  # ... and at least, where a ring's size sets it (see `Caches`)


class ContextOverflow(ValueError):
    """The prompt plus the tokens to generate do not fit in the allocated context."""


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Caches:
    """Every slot's device state, allocated once."""

    def __init__(self, model: Transformer, num_slots: int, max_seq_len: int,
                 scratch: int, widest: int = 1, checkpoints: int = 4, rings: bool = True) -> None:
        """`widest`: the most positions a verify writes (hybrid models keep the recurrent
        state after each, and the committed one, per slot and layer); `checkpoints`: the
        saved states per slot and layer that prefix reuse resumes from (none for a model
        without recurrent layers or rings).

        A model with sliding-window layers keeps rings for them where those are shorter
        than the cache: of need + max(chunk, widest) entries (cache/ring.py), its prefill
        passes `chunk` positions, the window's width within [MIN_CHUNK, PREFILL_CHUNK]
        (a small window's ring stays small; a large one's passes stay long); `rings` False
        keeps them as long as the cache."""
        cfg = model.cfg
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.length = -(-(max_seq_len + scratch) // KEY_BLOCK) * KEY_BLOCK  # whole blocks

        def layers(n: int) -> list[KVCache]:
            return [KVCache(num_slots, cfg.num_kv_heads, self.length, cfg.head_dim, self.device,
                            self.dtype) for _ in range(n)]

        # Which recurrent-state snapshot each slot has committed (see cache/state.py).
        self.state_index = torch.zeros(num_slots, dtype=torch.long, device=self.device)
        self.snapshots = widest + 1  # recurrent states per slot and layer
        self.offsets = RingOffsets()  # where in their rings a pass reads and writes them
        window = cfg.sliding_window if SLIDING in cfg.layer_types else 0
        self.chunk = min(PREFILL_CHUNK, max(MIN_CHUNK, window)) if window else PREFILL_CHUNK
        need = window + 1  # the assistant's sliding layers see one key more
        size = need + max(self.chunk, widest)
        self.ring = Ring(size, need, widest) if rings and window and size + 1 < self.length \
            else None
        self.checkpoints = checkpoints if cfg.hybrid or self.ring else 0

        def state() -> StateCache:
            return StateCache(num_slots, self.snapshots, 2 * cfg.linear_num_k_heads *
                              cfg.linear_k_head_dim + cfg.linear_num_v_heads *
                              cfg.linear_v_head_dim, cfg.linear_conv_kernel,
                              cfg.linear_num_v_heads, cfg.linear_k_head_dim,
                              cfg.linear_v_head_dim, self.state_index, self.dtype,
                              self.checkpoints, self.offsets)

        def attention(kind: str) -> KVCache:
            own = cfg.for_kind(kind)  # Gemma 4's layer kinds differ in heads and head size
            if kind == SLIDING and self.ring is not None:
                return RingCache(num_slots, own.num_kv_heads, self.ring, own.head_dim,
                                 self.device, self.dtype, self.length - 1, self.checkpoints)
            return KVCache(num_slots, own.num_kv_heads, self.length, own.head_dim, self.device,
                           self.dtype)

        self.trunk: list[KVCache | StateCache] = []
        for i, kind in enumerate(cfg.layer_types):
            source = cfg.kv_sources[i]  # Gemma 4's KV-shared layers: an earlier one's cache
            self.trunk.append(self.trunk[source] if source != i else state() if kind == LINEAR
                              else attention(kind))
        self.modules = [layers(cfg.mtp_layers_per_module) for _ in range(model.num_mtp)]
        self.hidden = zeros(num_slots, self.length, cfg.hidden_size, device=self.device,
                            dtype=self.dtype)  # trunk output h_t, [S, T, H]
        self.cos, self.sin = rope_tables(cfg, self.length, self.device, self.dtype)

    def rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """cos, sin [..., D] at positions `pos`."""
        return self.cos[pos], self.sin[pos]

    def commit(self, slots: Tensor, n: Tensor) -> None:
        """Commit each slot's recurrent state after position n [B] of the last pass."""
        kept: tuple[Tensor, Tensor] | None = None  # a pass's rows (its layers share them), kept
        for cache in self.states():
            u = cache.unsettled
            if u is None:  # nothing of this layer to settle
                continue
            if kept is None or kept[0] is not u.slots:
                kept = (u.slots, u.kept(slots, n))
            cache.defer(kept[1])
        commit(self.state_index, self.snapshots, slots, n)
        self.offsets.forget()

    def clear_state(self, slots: Tensor) -> None:
        for cache in self.states():
            cache.clear(slots)

    def save_state(self, slots: Tensor, entry: int, position: int) -> None:
        """Keep in saved entry `entry` what a forward from `position` reads: each slot's
        committed recurrent state, the keys before it in the rings."""
        for cache in self.states():
            cache.save(slots, entry)
        for ring in self.rings():
            ring.save(slots, entry, position)

    def restore_state(self, slots: Tensor, entry: int, position: int) -> None:
        """Put back saved entry `entry` (made at `position`) for a forward from there."""
        for cache in self.states():
            cache.restore(slots, entry)
        for ring in self.rings():
            ring.restore(slots, entry, position)

    def nbytes(self) -> int:
        tensors = [self.hidden, self.cos, self.sin]
        for cache in [*self.kv_caches(), *(c for m in self.modules for c in m)]:
            if not isinstance(cache, RingCache):
                tensors += [cache.k, cache.v]
        return sum(t.numel() * t.element_size() for t in tensors) + self.state_nbytes() + \
            self.ring_nbytes()

    def kv_caches(self) -> list[KVCache]:
        """The trunk's KV caches, each once (KV-shared layers hold an earlier layer's)."""
        return list({id(c): c for c in self.trunk if isinstance(c, KVCache)}.values())

    def states(self) -> list[StateCache]:
        return [c for c in self.trunk if isinstance(c, StateCache)]

    def rings(self) -> list[RingCache]:
        return [c for c in self.kv_caches() if isinstance(c, RingCache)]

    def state_nbytes(self) -> int:
        """The recurrent states' memory: conv and delta-rule states with their snapshots and
        checkpoints."""
        return sum(c.nbytes() for c in self.states())

    def ring_nbytes(self) -> int:
        """The sliding-window layers' rings' memory, their saved windows included."""
        return sum(c.nbytes() for c in self.rings())


class Slot:
    """The host's record of one slot (see the module's docstring)."""

    def __init__(self, index: int, max_seq_len: int, recurrent: bool = False,
                 checkpoints: int = 0, ring: Ring | None = None) -> None:
        self.index, self.max_seq_len = index, max_seq_len
        self.recurrent = recurrent  # some layers keep a state that cannot be cut
        self.ring = ring  # sliding-window layers keep rings (cache/ring.py)
        # Since the rings last started over, the earliest position they hold and the
        # furthest length held: what `Ring.keeps` needs.
        self.floor = self.top = 0
        # Saved state entry i holds the state after the first saved[i] tokens of seq (0: none).
        self.saved = [0] * checkpoints
        self.seq: list[int] = []
        self.length = 0
        self.mtp_len = 0
        self.drafts: list[int] = []  # made after the pending token, waiting for the verify
        self.confidence: list[float] = []  # each draft's probability under its module
        self.source = "mtp"  # what made the drafts: "mtp", "context" or "given" (a caller)
        self.bucket: int | None = None  # context drafts': of their match's length

    def set_drafts(self, drafts: list[int], confidence: list[float], source: str = "mtp",
                   bucket: int | None = None) -> None:
        self.drafts, self.confidence, self.source, self.bucket = drafts, confidence, source, \
            bucket

    def room(self) -> int:
        """Positions left in the context after the cached ones: a step commits at most
        this many tokens. Every check of the context's room reads this."""
        return self.max_seq_len - self.length

    def held(self) -> list[int]:
        return self.seq[:self.length]

    def holds(self, seq: list[int]) -> bool:
        """Whether this slot's caches are those of `seq` (the same list, not an equal one)."""
        return self.seq is seq

    def reset(self) -> None:
        self.seq, self.length, self.mtp_len = [], 0, 0
        self.floor = self.top = 0
        self.saved = [0] * len(self.saved)
        self.set_drafts([], [])

    def cut_to(self, tokens: list[int]) -> tuple[int, int | None]:
        """Keep only what `tokens` shares with the cached sequence: the position to run the
        trunk from, and the saved entry to resume from (None: what the caches hold, or
        nothing when the trunk runs from 0).

        Module entry t depends on x_{t+1}, so c common positions leave c - 1 reusable module
        entries, and the trunk restarts there too (it always runs the last token). The
        recurrent state is the one after all `length` positions, kept if they are all
        common; rings keep what a forward from c - 1 reads if it was not overwritten since
        (`Ring.keeps`). Else the latest saved entry within the c - 1 (saved ones past c
        belong to the old sequence: forgotten), or none."""
        common = min(common_prefix(self.held(), tokens), len(tokens))
        keep = max(0, common - 1)
        start, entry = self._resume(common, keep)
        self.mtp_len = min(self.mtp_len, keep, start)
        self.length = min(self.length, start)
        if entry is not None or start == 0:  # the rings start over from the saved window
            self.floor, self.top = max(0, start - self.ring.need) if self.ring else 0, start
        self.set_drafts([], [])
        return start, entry

    def _resume(self, common: int, keep: int) -> tuple[int, int | None]:
        start = self.length if self.recurrent else keep
        if (not self.recurrent or common == self.length) and \
                (self.ring is None or self.ring.keeps(start, self.floor, self.top)):
            return start, None
        self.saved = [p if p <= common else 0 for p in self.saved]
        usable = [i for i, p in enumerate(self.saved) if 0 < p < common]
        entry = max(usable, key=self.saved.__getitem__, default=None)
        return (0, None) if entry is None else (self.saved[entry], entry)

    def checkpoint(self, position: int) -> int:
        """The saved state entry to keep the state after `position` tokens in, recorded as
        holding it: the one that holds it already, else a free one, else the earliest."""
        entry = self.saved.index(position if position in self.saved else min(self.saved))
        self.saved[entry] = position
        return entry

    def hold(self, seq: list[int], length: int) -> None:
        """The trunk entries of seq[:length] are written: this slot now holds `seq`."""
        self.seq, self.length = seq, length
        self.mtp_len = min(self.mtp_len, length)
        self.top = max(self.top, length)

    def advance(self, n: int, modules: bool) -> None:
        """A step wrote the holder's next n positions (and the modules' too, if `modules`)."""
        if modules and self.mtp_len == self.length:
            self.mtp_len += n
        self.length += n
        self.top = max(self.top, self.length)


class SlotTable:
    """Slots by key, at most `size` of them; a new key recycles the least recently used."""

    def __init__(self, size: int, max_seq_len: int, recurrent: bool = False,
                 checkpoints: int = 0, ring: Ring | None = None) -> None:
        if size < 1:
            raise ValueError(f"need at least one KV-cache slot, got {size}")
        self.size = size
        self._free = [Slot(i, max_seq_len, recurrent, checkpoints, ring)
                      for i in reversed(range(size))]
        self._slots: OrderedDict[Hashable, Slot] = OrderedDict()

    def get(self, key: Hashable) -> Slot:
        """The key's slot, made most recently used."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
            slot.reset()
        self._slots[key] = slot
        return slot
