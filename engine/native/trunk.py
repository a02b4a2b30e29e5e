"""A trunk of decoder blocks in one call of layer.c (`trunk_forward`): each block as layer.py
calls it, in turn, with the same bits; full-attention blocks (`run_block`) and Qwen3.5's Gated
DeltaNet blocks (`run_linear_block`) alike. What goes is the Python before each block's
call, which a trunk's weights streaming past leave cold: ~10 us a block in a loop of its own,
~75 us in a step of Qwen2-1.5B's shapes (2.1 ms a plain step), ~150 us a block of Qwen3.5-2B's
(3.6 ms). The Gated DeltaNet blocks' state-cache bookkeeping (`run_linear_block`'s: the
deferred write a commit left, the rows' ring offsets, what a window keeps for the commit) is
done for all of them before the call, in one loop that stays warm.

`run_blocks` is `Transformer.trunk_runner` where layer.py runs the blocks (exec/compile.py
`step_fns`); a trunk it does not take (a block without a plan, a prefill's pass through Gated
DeltaNet blocks) runs a block a call.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from engine import native
from engine.cache.kv import CacheBatch, KVCache
from engine.cache.state import Pending, StateCache, Unsettled
from engine.native import layer, rows

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _TrunkLayer(ctypes.Structure):
    """layer.h's `TrunkLayer`: a full-attention block (plan, its KV cache) or a Gated
    DeltaNet one (gdn, its state cache and the rest of its call's arguments)."""

    _fields_ = [("plan", ctypes.POINTER(layer._Plan)), ("gdn", ctypes.POINTER(layer._GdnPlan)),
                ("ck", ptr), ("cv", ptr), ("conv", ptr), ("ring", i64), ("conv_slots", i64),
                ("index", ptr), ("states", ptr), ("src", ptr), ("dst", ptr), ("k", ptr),
                ("decay", ptr), ("d", ptr), ("base", ptr), ("pk", ptr), ("pd", ptr),
                ("pa", ptr), ("pn", ptr), ("P", i64)]


@functools.cache
def _trunk_fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.trunk_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64,
                   ctypes.c_int, ptr]
    return fn


def _trunk(*args: Any) -> int:
    """layer.c's `trunk_forward` (timed by `ahead bench engine` as layer.c's blocks)."""
    return int(_trunk_fn()(*args))


# Per trunk (by its first block; gone with it): what its array of blocks was made from (the
# plans, which hold what they point to, and the caches' tensors' addresses) and the array,
# whose Gated DeltaNet blocks' per-call fields each call sets.
_TRUNKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], Any]] = \
    weakref.WeakKeyDictionary()


def run_blocks(layers: Sequence[nn.Module], x: Tensor, rope: tuple[Tensor, Tensor],
               batch: CacheBatch | None, caches: Sequence[KVCache | StateCache] | None
               ) -> Tensor | None:
    """Every block of `layers` (a trunk's, in order, each with its cache) in one call of
    layer.c (`trunk_forward`: `run_block`'s or `run_linear_block`'s call for each in turn),
    where it takes them all: blocks with plans, each cache as those take it, the KV caches of
    one shape, the Gated DeltaNet blocks of one shape. None where it does not: the caller
    runs them one at a time."""
    if batch is None or caches is None or batch.span is None or not layers \
            or not rows.usable(x) or x.dim() != 3 or not x.is_contiguous() \
            or len(caches) < len(layers):
        return None
    bsz, seqlen, hidden = x.shape
    plans: list[layer.Plan | layer.GdnPlan] = []
    kv: KVCache | None = None  # the first full-attention block's cache
    gdn: list[tuple[int, StateCache]] = []
    for i, (block, cache) in enumerate(zip(layers, caches, strict=False)):
        if isinstance(cache, StateCache):
            got_gdn = layer.gdn_plan(block)
            if got_gdn is None or got_gdn.c.hidden != hidden \
                    or not layer.takes_state_call(cache, batch, seqlen) \
                    or (gdn and not _same_shape(got_gdn, plans[gdn[0][0]])):
                return None
            plans.append(got_gdn)
            gdn.append((i, cache))
            continue
        got = layer.plan(block)
        if got is None or not isinstance(cache, KVCache) or got.c.hidden != hidden \
                or not layer.takes_cache(got, cache, batch.kv_len, batch.span, bsz) \
                or (kv is not None and cache.k.shape != kv.k.shape):  # (one slot count, length)
            return None
        kv = kv or cache
        plans.append(got)
    full = [p for p in plans if isinstance(p, layer.Plan)]
    cos = sin = None
    rot = 0
    if full:
        if (args := layer.rope_args(full[0], rope, bsz, seqlen)) is None \
                or any(args[2] > p.c.head_dim for p in full):
            return None
        cos, sin, rot = args
    array = _array(layers[0], plans, caches)
    slots = batch.slots if batch.slots.dtype == torch.int64 else batch.slots.long()
    pos = batch.pos if batch.pos.dtype == torch.int64 else batch.pos.long()
    slots, pos = slots.contiguous(), pos.contiguous()
    # (what the array points to is held in `calls` until the call has returned)
    calls = _gdn_calls(array, gdn, plans, x, batch, seqlen) if gdn else []
    out = torch.empty_like(x)
    done = _trunk(ctypes.cast(array, ptr), len(plans), x.data_ptr(), bsz, seqlen,
                  None if cos is None else cos.data_ptr(),
                  None if sin is None else sin.data_ptr(), rot, slots.data_ptr(),
                  pos.data_ptr(), batch.span[0], batch.kv_len,
                  0 if kv is None else kv.k.shape[0], 0 if kv is None else kv.k.shape[2],
                  torch.get_num_threads(), out.data_ptr())
    if done == -2:  # a slot or position outside a cache, nothing run: the blocks one at a
        for cache, held, _, _ in calls:  # time say which, finding the deferred writes again
            if held is not None:
                cache.pending[held[0]] = held[1]
        return None
    if done == -3:
        raise ValueError("the decoder blocks' kernel does not take their plans")
    if done == -4:
        raise ValueError("the Gated DeltaNet blocks' kernels do not take their call")
    if done != 0:
        raise MemoryError("the decoder blocks' kernel could not allocate its scratch memory")
    for cache, _, unsettled, _ in calls:
        cache.unsettled = unsettled
    return out


def _same_shape(a: layer.GdnPlan, b: layer.Plan | layer.GdnPlan) -> bool:
    """Whether two Gated DeltaNet blocks' calls take scratch of one shape."""
    return isinstance(b, layer.GdnPlan) and (a.c.v_heads, a.c.k_dim, a.c.v_dim) \
        == (b.c.v_heads, b.c.k_dim, b.c.v_dim)


def _array(first: nn.Module, plans: list[layer.Plan | layer.GdnPlan],
           caches: Sequence[KVCache | StateCache]) -> Any:
    """The trunk's array of blocks with their plans and caches (made again where either
    changed)."""
    held = [t for c in caches[:len(plans)]
            for t in ((c.k, c.v) if isinstance(c, KVCache) else (c.conv, c.state, c.index))]
    key = (*plans, *(t.data_ptr() for t in held))
    known = _TRUNKS.get(first)
    if known is not None and known[0] == key:
        return known[1]
    array = (_TrunkLayer * len(plans))()
    for entry, p, c in zip(array, plans, caches, strict=False):
        if isinstance(p, layer.Plan) and isinstance(c, KVCache):
            entry.plan = ctypes.pointer(p.c)
            entry.ck, entry.cv = c.k.data_ptr(), c.v.data_ptr()
        elif isinstance(p, layer.GdnPlan) and isinstance(c, StateCache):
            entry.gdn = ctypes.pointer(p.c)
            entry.conv, entry.conv_slots, entry.ring = c.conv.data_ptr(), *c.conv.shape[:2]
            entry.index, entry.states = c.index.data_ptr(), c.state.data_ptr()
    _TRUNKS[first] = key, array
    return array


# A Gated DeltaNet block's call (`_gdn_calls`): its cache, the deferred write it had, its
# window's record, the tensors its entry points to.
_Call = tuple[StateCache, tuple[tuple[int, ...], Pending] | None, Unsettled | None,
              tuple[object, ...]]


def _gdn_calls(array: Any, gdn: list[tuple[int, StateCache]],
               plans: list[layer.Plan | layer.GdnPlan], x: Tensor, batch: CacheBatch,
               seqlen: int) -> list[_Call]:
    """Each Gated DeltaNet block's state-cache bookkeeping for the call, in
    `run_linear_block`'s order, into its entry of `array`: the deferred write a commit left
    (`take`), the rows' ring offsets, scratch for k and the decays (a window's: what it keeps
    for the commit, with each position's factor). Each block's cache, the deferred write it
    had (to give back where the call runs nothing), its window's record and the tensors its
    entry points to (held until the call returns)."""
    c = plans[gdn[0][0]].c
    assert isinstance(c, layer._GdnPlan)
    bsz, n = x.shape[0], len(gdn)
    window = seqlen > 1  # a step's scratch is read by none after its block: one for all
    ks = x.new_empty(n if window else 1, bsz, c.v_heads, seqlen, c.k_dim, dtype=torch.float32)
    decays = x.new_empty(n if window else 1, bsz, c.v_heads, seqlen, dtype=torch.float32)
    factors = x.new_empty(n, bsz, c.v_heads, seqlen, c.v_dim, dtype=torch.float32) \
        if window else None
    key = tuple(batch.slots.tolist())
    k_at, decay_at = ks.data_ptr(), decays.data_ptr()  # (a step's: every block's)
    made: list[_Call] = []
    for j, (i, cache) in enumerate(gdn):
        cache.unsettled = None  # this pass writes the ring entries after the committed one
        found = cache.pending.get(key) if cache.pending else None
        pending = cache.take(batch.slots)  # the committed states a commit left unwritten
        src, dst = cache.kernel_offsets(batch.slots, seqlen)
        entry = array[i]
        entry.src, entry.dst = src.data_ptr(), dst.data_ptr()
        unsettled = None
        if factors is None:
            entry.k, entry.decay, entry.d = k_at, decay_at, None
        else:
            k, decay, d = ks[j], decays[j], factors[j]
            entry.k, entry.decay, entry.d = k.data_ptr(), decay.data_ptr(), d.data_ptr()
            unsettled = Unsettled(batch.slots, src, dst, k, d, decay)
        entry.base, entry.pk, entry.pd, entry.pa, entry.pn, entry.P = layer.pending_args(pending)
        made.append((cache, None if found is None else (key, found), unsettled,
                     (ks, decays, factors, src, dst, pending)))
    return made
