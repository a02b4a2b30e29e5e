"""Recurrent state: every slot's conv and delta-rule state for one Gated DeltaNet layer, with
the snapshots a verify pass keeps, allocated once.

A KV cache rolls back by moving a length; a recurrent state cannot be cut, so each slot keeps
a ring of R = width + 1 states per layer (width: the widest verify, k_max + 1). `index[slot]`
names the committed one. A pass that runs S positions writes the state after each of them
(or, for a prefill chunk, only after its last) into the ring entries after the committed one,
never over it; the step then commits the state after the accepted position by moving the
index (`commit`): a pick, and no copy. On the CPU our kernel writes no state of a verify
window and keeps each position's factor; the commit defers the write of the state after
the kept position to the next pass, which makes it from the state the window read and
those factors as it reads it (`Pending`: the same bits; one state read and one written a
step, as a plain step's, where the window's own write and a settle made more), or, for
any other reader, `settle` writes it first. One entry more than the k_max + 1
snapshots a verify makes: the committed state must survive the pass that reads it, so that a
pass can be run again (the invariance probe does) and nothing is copied at commit.

Next to the ring, P saved entries per slot (checkpoints): a prefill copies the committed state
into one after a pass (`save`), and a later prefill that shares the tokens up to there copies
it back into the committed entry (`restore`) instead of running them again. Which position
each entry holds is the host's record (`Slot`, cache/slots.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from engine import native
from engine.cache import zeros


class StateCache:
    """One layer's states for all slots: conv [slots, R, C, K-1] (the last K-1 inputs of
    the convolution) and the delta rule's [slots, R, H, Dk, Dv] in fp32; and as many saved
    ones, [slots, P, ...] each."""

    __slots__ = ("conv", "index", "offsets", "pending", "ring", "saved_conv", "saved_state",
                 "state", "unsettled")

    def __init__(self, num_slots: int, ring: int, conv_size: int, kernel: int, num_heads: int,
                 k_dim: int, v_dim: int, index: Tensor, dtype: torch.dtype,
                 saved: int = 0, offsets: RingOffsets | None = None) -> None:
        device = index.device
        self.ring, self.index = ring, index  # index [slots]: shared by every layer
        # Shared by the layers of one model, which all have this one's shapes (Caches).
        self.offsets = offsets

        def states(n: int) -> tuple[Tensor, Tensor]:
            return (zeros(num_slots, n, conv_size, kernel - 1, device=device, dtype=dtype),
                    zeros(num_slots, n, num_heads, k_dim, v_dim, device=device,
                          dtype=torch.float32))

        self.conv, self.state = states(ring)
        self.saved_conv, self.saved_state = states(saved)
        # The last window's pass, which wrote no state (`delta_rule_window`): `settle`
        # writes the one a commit keeps.
        self.unsettled: Unsettled | None = None
        # Commits' writes of the states they keep, put off to the next pass (`defer`), by the
        # slots of the pass that made them.
        self.pending: dict[tuple[int, ...], Pending] = {}

    def delta_rule_window(self, q: Tensor, k: Tensor, v: Tensor, decay: Tensor,
                          beta: Tensor, slots: Tensor, pending: native.Pending | None = None
                          ) -> Tensor | None:
        """`native.delta_rule` over a verify window of `slots` that writes none of the states
        after its positions (`delta_rule` writes S) and keeps each position's factor d_t
        [B, H, S, Dv], from which the next pass (`defer`) or `settle` writes the state after
        the position the commit keeps. The output, or None where the kernel does not take
        these tensors (eager CPU passes only)."""
        if torch.compiler.is_compiling():  # a compiled pass writes every state
            return None
        k, decay = k.float().contiguous(), decay.float().contiguous()  # as the kernel reads
        src, dst = self.kernel_offsets(slots, q.shape[2])
        factors = torch.empty(v.shape, dtype=torch.float32)
        out = native.delta_rule(q, k, v, decay, beta, self.state, src, dst, factors, pending)
        if out is not None:
            self.unsettled = Unsettled(slots, src, dst, k, factors, decay)
        return out

    def settle(self, slots: Tensor, n: Tensor, kept: Tensor | None = None) -> None:
        """Before slots commit the state after position n [B] of the last pass: that state
        written into its ring entry where the pass left it out (`unsettled`). `kept`: what
        `Unsettled.kept` gives for them, where the caller has it already."""
        if self.unsettled is not None:
            u = self.unsettled
            u.settle(self.state, u.kept(slots, n) if kept is None else kept)
            self.unsettled = None

    def defer(self, kept: Tensor) -> None:
        """What `settle` would write for a commit keeping position kept [rows] of the last
        pass's rows (`Unsettled.kept`), left to the next pass of the same rows (`take`) or
        to whatever reads their states first (`settle_pending`). Each set of rows keeps its
        own: a batch's slots stepping by turns (a benchmark's modes) each make theirs."""
        u = self.unsettled
        if u is None:
            return
        self.unsettled = None
        rows = tuple(u.slots.tolist())
        self._settle(set(rows))  # (a pass of these rows has taken theirs)
        self.pending[rows] = Pending(u, kept)

    def take(self, slots: Tensor) -> native.Pending | None:
        """For a pass of our kernel over `slots`: the deferred write of these rows, which the
        pass then makes (native.Pending); None where they have none (any other that shares a
        row with them is made now)."""
        if not self.pending:
            return None
        rows = tuple(slots.tolist())
        p = self.pending.pop(rows, None)
        self._settle(set(rows))
        if p is None:
            return None
        u = p.window  # the committed state has positions 0..kept of it (none: kept = -1)
        return u.src, u.k, u.factors, u.decay, p.kept + 1

    def settle_pending(self, slots: Tensor | None = None) -> None:
        """The deferred writes of `slots` (every slot's, when None) made now, for a reader
        other than our kernel's pass (`defer`)."""
        if self.pending:
            self._settle(None if slots is None else set(slots.tolist()))

    def _settle(self, rows: set[int] | None) -> None:
        for key in [k for k in self.pending if rows is None or rows.intersection(k)]:
            p = self.pending.pop(key)
            p.window.settle(self.state, p.kept)

    def read_conv(self, slots: Tensor) -> Tensor:
        """The committed conv states [B, C, K-1] of `slots`."""
        return self.conv[slots, self.index[slots]]

    def read_state(self, slots: Tensor) -> Tensor:
        """The committed delta-rule states [B, H, Dk, Dv] of `slots`."""
        self.settle_pending(slots)
        return self.state[slots, self.index[slots]]

    def write(self, slots: Tensor, conv: Tensor, state: Tensor) -> None:
        """The states after each of S positions, conv [B, S, C, K-1] and state
        [B, S, H, Dk, Dv], into the ring entries after the committed one."""
        self.write_conv(slots, conv)
        self.state[slots[:, None], self._after(slots, state.shape[1])] = state

    def write_conv(self, slots: Tensor, conv: Tensor) -> None:
        """The conv states after each of S positions [B, S, C, K-1] (as `write`)."""
        self.settle_pending(slots)
        self.unsettled = None  # a pass of its own: an earlier window's is stale
        self.conv[slots[:, None], self._after(slots, conv.shape[1])] = conv.to(self.conv.dtype)

    def state_offsets(self, slots: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        """Where in `self.state` (elements from its start) the committed delta-rule state of
        each of `slots` is [B], and where the state after each of `positions` goes [B, S]
        (the ring entries `write` fills)."""
        entry, first = self.state[0, 0].numel(), slots * self.ring
        return (first + self.index[slots]) * entry, \
            (first[:, None] + self._after(slots, positions)) * entry

    def kernel_offsets(self, slots: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        """`state_offsets` as the kernels take them (int64, contiguous), from the shared
        `offsets` where this cache has them (not in a compiled pass: computed in its graph)."""
        if self.offsets is not None and not torch.compiler.is_compiling():
            self.settle_pending(slots)  # (a pass that makes theirs has taken it: `take`)
            return self.offsets.get(self, slots, positions)
        src, dst = self.state_offsets(slots, positions)
        return src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()

    def _after(self, slots: Tensor, positions: int) -> Tensor:
        """The ring entries [B, S] of the states after each of `positions` positions."""
        steps = torch.arange(1, positions + 1, device=slots.device)
        return (self.index[slots, None] + steps) % self.ring

    def clear(self, slots: Tensor) -> None:
        """The committed states of `slots` back to zero (nothing seen yet)."""
        self.settle_pending(slots)
        self.unsettled = None
        at = self.index[slots]
        self.conv[slots, at] = 0
        self.state[slots, at] = 0

    def save(self, slots: Tensor, entry: int) -> None:
        """The committed states of `slots` into their saved entry `entry`."""
        self.settle_pending(slots)
        at = self.index[slots]
        self.saved_conv[slots, entry] = self.conv[slots, at]
        self.saved_state[slots, entry] = self.state[slots, at]

    def restore(self, slots: Tensor, entry: int) -> None:
        """The saved entry `entry` of `slots` back into their committed states."""
        self.settle_pending(slots)
        self.unsettled = None
        at = self.index[slots]
        self.conv[slots, at] = self.saved_conv[slots, entry]
        self.state[slots, at] = self.saved_state[slots, entry]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.conv, self.state, self.saved_conv, self.saved_state))


class RingOffsets:
    """`StateCache.kernel_offsets` for the pass under way, shared by the recurrent layers of
    one model: they share `index` and their shapes, so their offsets are the same, and the
    first layer of a pass computes them for the rest. Forgotten at each commit, which is what
    moves `index`. CPU passes only (the kernels' own): the key reads the slots on the host.
    Qwen3.5-2B's 18 layers, with the settle's kept positions likewise once a commit
    (Caches.commit): 2.3 ms off a plain step, 3.3 off a verify of 4 positions."""

    __slots__ = ("_memo",)

    def __init__(self) -> None:
        self._memo: dict[tuple[tuple[int, ...], int], tuple[Tensor, Tensor]] = {}

    def get(self, cache: StateCache, slots: Tensor, positions: int) -> tuple[Tensor, Tensor]:
        key = (tuple(slots.tolist()), positions)
        got = self._memo.get(key)
        if got is None:
            src, dst = cache.state_offsets(slots, positions)
            got = self._memo[key] = (src.to(torch.int64).contiguous(),
                                     dst.to(torch.int64).contiguous())
        return got

    def forget(self) -> None:
        self._memo.clear()


def commit(index: Tensor, ring: int, slots: Tensor, n: Tensor) -> None:
    """Make the state after position n [B] of the last pass (0: its first, or a prefill
    chunk's last) the committed one of `slots`."""
    index[slots] = (index[slots] + 1 + n) % ring


class Pending(NamedTuple):
    """A commit's deferred write (`StateCache.defer`): the window it came from and the
    position each of its rows keeps ([rows], -1: none)."""

    window: Unsettled
    kept: Tensor


class Unsettled:
    """A verify window's delta rule that wrote none of its states
    (`StateCache.delta_rule_window`): what `settle` needs to write the state after one."""

    __slots__ = ("decay", "dst", "factors", "k", "slots", "src")

    def __init__(self, slots: Tensor, src: Tensor, dst: Tensor, k: Tensor, factors: Tensor,
                 decay: Tensor) -> None:
        self.slots, self.src, self.dst = slots, src, dst
        self.k, self.factors, self.decay = k, factors, decay

    def kept(self, slots: Tensor, n: Tensor) -> Tensor:
        """Where `slots` commit position n [B]: the position each of this window's rows keeps
        [rows], -1 for rows not committing (the same for every layer of a pass). No host read
        (a fixed-shape step's commit)."""
        match = self.slots[:, None] == slots[None, :]  # [window's rows, committed rows]
        return torch.where(match.any(1), (match.long() * n[None, :]).sum(1), -1).contiguous()

    def settle(self, states: Tensor, kept: Tensor) -> None:
        """The state after position kept[row] of each of this window's rows that keeps one
        (`kept`), written into its ring entry by deltanet.c `delta_settle`, bit for bit what
        writing every position would have put there; the kernel skips the other rows."""
        native.kernels().run_delta_settle(self.k, self.factors, self.decay, states, self.src,
                                          self.dst, kept)
