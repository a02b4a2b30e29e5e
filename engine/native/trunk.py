"""A trunk of full-attention decoder blocks in one call of layer.c (`layers_forward`): each
block as layer.py's `run_block` calls it, in turn, with the same bits. What goes is the
Python before each block's call, which a trunk's weights streaming past leave cold: ~10 us a
block in a loop of its own, ~75 us in a step of Qwen2-1.5B's shapes (2.1 ms a plain step).

`run_blocks` is `Transformer.trunk_runner` where layer.py runs the blocks (exec/compile.py
`step_fns`); a trunk it does not take (a hybrid one, a block without a plan) runs a block a
call.
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
from engine.cache.state import StateCache
from engine.native import layer, rows

i64, ptr = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _layers_fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.layers_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64, ptr, ptr, i64,
                   i64, ctypes.c_int, ptr]
    return fn


def _layers(*args: Any) -> int:
    """layer.c's `layers_forward` (timed by `ahead bench engine` as layer.c's blocks)."""
    return int(_layers_fn()(*args))


# Per trunk (by its first block; gone with it): what `run_blocks`' arrays were made from (the
# plans, which hold what they point to, and the caches' addresses) and the arrays, as
# layers_forward takes them.
_TRUNKS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], tuple[Any, Any, Any]]] \
    = weakref.WeakKeyDictionary()


def run_blocks(layers: Sequence[nn.Module], x: Tensor, rope: tuple[Tensor, Tensor],
               batch: CacheBatch | None, caches: Sequence[KVCache | StateCache] | None
               ) -> Tensor | None:
    """Every block of `layers` (a trunk's, in order, each with its cache) in one call of
    layer.c (`layers_forward`: `run_block`'s call for each in turn), where it takes them all:
    full-attention blocks with plans, each cache as `takes_cache` says. None where it does
    not (a Gated DeltaNet block, a block without a plan, a call `run_block` does not take):
    the caller runs them one at a time."""
    if batch is None or caches is None or batch.span is None or not layers \
            or not rows.usable(x) or x.dim() != 3 or not x.is_contiguous() \
            or len(caches) < len(layers):
        return None
    bsz, seqlen, hidden = x.shape
    if not isinstance(head := caches[0], KVCache):
        return None
    plans: list[layer.Plan] = []
    for block, cache in zip(layers, caches, strict=False):
        got = layer.plan(block)
        if got is None or not isinstance(cache, KVCache) or got.c.hidden != hidden \
                or not layer.takes_cache(got, cache, batch.kv_len, batch.span, bsz) \
                or cache.k.shape != head.k.shape:  # (one slot count and length for all)
            return None
        plans.append(got)
    if not plans or (args := layer.rope_args(plans[0], rope, bsz, seqlen)) is None \
            or any(args[2] > p.c.head_dim for p in plans):
        return None
    cos, sin, rot = args
    kvs = [c for c in caches[:len(plans)] if isinstance(c, KVCache)]
    key = (*plans, *(t.data_ptr() for c in kvs for t in (c.k, c.v)))
    known = _TRUNKS.get(layers[0])
    if known is None or known[0] != key:
        n = len(plans)
        known = key, ((ctypes.POINTER(layer._Plan) * n)(*(ctypes.pointer(p.c) for p in plans)),
                      (ptr * n)(*(c.k.data_ptr() for c in kvs)),
                      (ptr * n)(*(c.v.data_ptr() for c in kvs)))
        _TRUNKS[layers[0]] = known
    plan_array, ck, cv = known[1]
    slots = batch.slots if batch.slots.dtype == torch.int64 else batch.slots.long()
    pos = batch.pos if batch.pos.dtype == torch.int64 else batch.pos.long()
    slots, pos = slots.contiguous(), pos.contiguous()
    first = kvs[0]
    out = torch.empty_like(x)
    done = _layers(ctypes.cast(plan_array, ptr), len(plans), x.data_ptr(), bsz, seqlen,
                   cos.data_ptr(), sin.data_ptr(), rot, slots.data_ptr(), pos.data_ptr(),
                   batch.span[0], batch.kv_len, ctypes.cast(ck, ptr), ctypes.cast(cv, ptr),
                   first.k.shape[0], first.k.shape[2], torch.get_num_threads(), out.data_ptr())
    if done == -2:  # a slot or position outside a cache: the blocks one at a time say which
        return None  # (the blocks before it wrote what those will write again)
    if done == -3:
        raise ValueError("the decoder blocks' kernel does not take their plans")
    if done != 0:
        raise MemoryError("the decoder blocks' kernel could not allocate its scratch memory")
    return out
