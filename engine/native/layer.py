"""A decoder block of a cached forward in one call of layer.c, where every part of it runs
in our kernels: bf16 on a CPU, its four products in our int8 or int4 layouts, the exact
attention, or (a Gated DeltaNet block: Qwen3.5's linear-attention layers) gdn.c's and
deltanet.c's kernels. The bits are the block's Python forward's (the same kernels, the same
order); what goes is the Python and torch between them, ~35 calls a layer of a decode step.

`run_block` is `Transformer.block_runner` on such an engine, `run_linear_block` its
`linear_runner` (exec/compile.py `step_fns`; trunk.py's `run_blocks`, its `trunk_runner`,
runs a trunk of full-attention blocks in one call); a block, or a call, they do not take runs
model/block.py's `run_block` instead.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from typing import Any, cast

import torch
from torch import Tensor, nn

from engine import native
from engine.cache.kv import CacheBatch, KVCache
from engine.cache.state import StateCache, Unsettled
from engine.model import block as block_py
from engine.model.codes import Packed, QuantLinear
from engine.model.layers import RMSNorm
from engine.native import rows

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _Product(ctypes.Structure):
    _fields_ = [("w", ptr), ("bits", i64), ("n", i64), ("group", i64), ("bias", ptr)]


class _Plan(ctypes.Structure):
    _fields_ = [("qkv", _Product), ("o", _Product), ("gate_up", _Product), ("down", _Product),
                ("input_norm", ptr), ("post_norm", ptr), ("q_norm", ptr), ("k_norm", ptr),
                ("eps", ctypes.c_float), ("offset", ctypes.c_float), ("scale", ctypes.c_float),
                ("upcast", i64), ("hidden", i64), ("heads", i64), ("kv_heads", i64),
                ("head_dim", i64), ("inter", i64), ("bf16_dot", i64), ("gated", i64)]


class _GdnPlan(ctypes.Structure):
    _fields_ = [("in_", _Product), ("out", _Product), ("gate_up", _Product), ("down", _Product),
                ("input_norm", ptr), ("post_norm", ptr), ("eps", ctypes.c_float),
                ("offset", ctypes.c_float), ("upcast", i64), ("hidden", i64), ("inter", i64),
                ("k_heads", i64), ("v_heads", i64), ("k_dim", i64), ("v_dim", i64),
                ("kernel", i64), ("conv_weight", ptr), ("a_log", ptr), ("dt_bias", ptr),
                ("norm_weight", ptr), ("norm_eps", ctypes.c_float)]


class Plan:
    """A block's weights as layer.c takes them, with the tensors that hold them (kept alive
    while the plan is)."""

    __slots__ = ("c", "held")

    def __init__(self, c: _Plan, held: list[object]) -> None:
        self.c, self.held = c, held


class GdnPlan:
    """A Gated DeltaNet block's, as layer.c's `gdn_block_forward` takes them."""

    __slots__ = ("c", "held")

    def __init__(self, c: _GdnPlan, held: list[object]) -> None:
        self.c, self.held = c, held


# Each block's plan, with what it was made from (`_key`, `_gdn_key`); gone with the block.
_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], Plan | None]] = \
    weakref.WeakKeyDictionary()
_GDN_PLANS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple[object, ...], GdnPlan | None]] = \
    weakref.WeakKeyDictionary()


@functools.cache
def _fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.layer_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Plan), ptr, i64, i64, ptr, ptr, i64, ptr, ptr, i64, i64,
                   ptr, ptr, i64, i64, ctypes.c_int, ptr]
    return fn


def _forward(*args: Any) -> int:
    """layer.c's `layer_forward` (a function of its own: `ahead bench engine` times it)."""
    return int(_fn()(*args))


@functools.cache
def _gdn_fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.gdn_block_forward
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_GdnPlan), ptr, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr,
                   ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, i64, ctypes.c_int, ptr]
    return fn


def _gdn_forward(*args: Any) -> int:
    """layer.c's `gdn_block_forward` (timed by `ahead bench engine` as layer.c's blocks)."""
    return int(_gdn_fn()(*args))


def _product(linear: object) -> Packed | None:
    packed = linear.packed if isinstance(linear, QuantLinear) else linear
    if isinstance(packed, Packed) and packed.native and packed.mode in ("int4", "int8"):
        return packed
    return None


def _key(block: block_py.DecoderBlock) -> tuple[object, ...]:
    """What a plan is made from: the products (replaced when quantized), the attention's
    exactness, where the norms' weights are. Read from the modules' own dicts, as
    nn.Module's __getattr__ finds them, without its cost: this runs for every block of every
    step (half the Python a block ran in one call took, through __getattr__)."""
    attn, mlp = block._modules["self_attn"], block._modules["mlp"]
    assert attn is not None and mlp is not None
    a, am = attn.__dict__, attn._modules
    return (a["fused"], am["o_proj"], mlp.__dict__["fused"], mlp._modules["down_proj"],
            a["exact"], *(_data_ptr(n._parameters["weight"]) for n in _norms(block)))


def _gdn_key(block: block_py.DecoderBlock) -> tuple[object, ...]:
    """`_key` for a Gated DeltaNet block: its products, its fp32 parameters (the tuple
    `fuse` makes, by identity: the plan holds it), its norms."""
    attn, mlp = block._modules["linear_attn"], block._modules["mlp"]
    assert attn is not None and mlp is not None
    a = attn.__dict__
    norms = _block_norms(block)
    return (a["fused"], attn._modules["out_proj"], mlp.__dict__["fused"],
            mlp._modules["down_proj"], id(a["step_params"]),
            _data_ptr(norms[0]._parameters["weight"]), _data_ptr(norms[1]._parameters["weight"]))


def _block_norms(block: block_py.DecoderBlock) -> tuple[RMSNorm, RMSNorm]:
    mods = block._modules
    return cast(tuple[RMSNorm, RMSNorm],
                (mods["input_layernorm"], mods["post_attention_layernorm"]))


def _norms(block: block_py.DecoderBlock) -> tuple[RMSNorm, ...]:
    """The block's RMSNorms layer.c runs: before attention, after it, and q's and k's where
    the attention has them (from the modules' own dicts: see `_key`)."""
    mods = block._modules
    attn = mods["self_attn"]
    assert attn is not None
    own: tuple[nn.Module | None, ...] = (mods["input_layernorm"], mods["post_attention_layernorm"])
    if attn.__dict__["qk_norm"]:
        own += (attn._modules["q_norm"], attn._modules["k_norm"])
    return cast(tuple[RMSNorm, ...], own)


def _data_ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def plan(block: nn.Module) -> Plan | None:
    """layer.c's plan of a block, or None where it does not take the block: not a
    full-attention `DecoderBlock` (Gated DeltaNet, Gemma 4), an inexact attention, GELU, a
    product not in our layouts, norms not in bf16."""
    if not isinstance(block, block_py.DecoderBlock) or block.linear:
        return None
    key = _key(block)
    got = _PLANS.get(block)
    if got is not None and got[0] == key:  # (products compare as themselves)
        return got[1]
    made = _make(block)
    _PLANS[block] = (key, made)  # None too: made again only when the block changes
    return made


def _alike(norms: tuple[RMSNorm, ...]) -> bool:
    """Whether layer.c takes these norms: bf16 weights, one eps, offset and upcast."""
    first = norms[0]
    return all(n.weight.dtype == torch.bfloat16 and n.eps == first.eps
               and n.offset == first.offset and n.upcast == first.upcast for n in norms)


def _make(block: block_py.DecoderBlock) -> Plan | None:
    attn, mlp = block.self_attn, block.mlp
    products = [_product(p) for p in (attn.fused, attn.o_proj, mlp.fused, mlp.down_proj)]
    norms = _norms(block)
    first = norms[0]
    hq, hkv, hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if not attn.exact or mlp.gelu or any(p is None for p in products) or not _alike(norms) \
            or hd % 16 or hd > 512 or hq % hkv:  # (else the Python forward's attention is torch's)
        return None
    qkv_n, o_n, gate_up_n, down_n = (p.out_features for p in products)  # type: ignore[union-attr]
    if qkv_n != (hq * (1 + attn.gated) + 2 * hkv) * hd or gate_up_n % 2 or o_n != down_n:
        return None
    weights = [n.weight.detach().contiguous() for n in norms]
    held: list[object] = [*weights]
    ptrs = [w.data_ptr() for w in weights] + [None] * (4 - len(weights))
    qkv, o, gate_up, down = (c_product(p, held) for p in products)  # type: ignore[arg-type]
    c = _Plan(qkv, o, gate_up, down, *ptrs, first.eps, float(first.offset), hd ** -0.5,
              int(first.upcast), o.n, hq, hkv, hd, gate_up.n // 2,
              native.kernels().attention_dot(torch.bfloat16), int(attn.gated))
    return Plan(c, held)


def gdn_plan(block: nn.Module) -> GdnPlan | None:
    """layer.c's plan of a Gated DeltaNet block, or None where it does not take it: not such
    a block, its projections not fused, a product not in our layouts, norms not in bf16, GELU,
    shapes gdn.c's or deltanet.c's kernels do not take."""
    if not isinstance(block, block_py.DecoderBlock) or not block.linear:
        return None
    attn = block.linear_attn
    if attn.fused is None or len(attn.step_params) != 4:
        return None
    key = _gdn_key(block)
    got = _GDN_PLANS.get(block)
    if got is not None and got[0] == key:
        return got[1]
    made = _make_gdn(block)
    _GDN_PLANS[block] = (key, made)
    return made


def _make_gdn(block: block_py.DecoderBlock) -> GdnPlan | None:
    attn, mlp = block.linear_attn, block.mlp
    products = [_product(p) for p in (attn.fused, attn.out_proj, mlp.fused, mlp.down_proj)]
    norms = _block_norms(block)
    first = norms[0]
    hk, hv, dk, dv = attn.num_k_heads, attn.num_v_heads, attn.k_dim, attn.v_dim
    params = attn.step_params
    if mlp.gelu or any(p is None for p in products) or not _alike(norms) \
            or any(t.dtype != torch.float32 or not t.is_contiguous() for t in params) \
            or dk % 16 or dv % 16 or dv > 256 or dk > 512 or hv % hk \
            or not 2 <= attn.kernel <= 8:  # (else its Python forward runs torch's forms)
        return None
    in_n, out_n, gate_up_n, down_n = (p.out_features for p in products)  # type: ignore[union-attr]
    if in_n != attn.conv_size + attn.value_size + 2 * hv or gate_up_n % 2 or out_n != down_n:
        return None
    weights = [n.weight.detach().contiguous() for n in norms]
    held: list[object] = [*weights, params]  # (the tuple: `_gdn_key` names it by identity)
    into, out, gate_up, down = (c_product(p, held) for p in products)  # type: ignore[arg-type]
    c = _GdnPlan(into, out, gate_up, down, *(w.data_ptr() for w in weights), first.eps,
                 float(first.offset), int(first.upcast), out.n, gate_up.n // 2, hk, hv, dk, dv,
                 attn.kernel, *(t.data_ptr() for t in params), attn.norm.eps)
    return GdnPlan(c, held)


def c_product(p: Packed, held: list[object]) -> _Product:
    """A product as layer.c (and mtp.c) take it; the tensors it points to go into `held`."""
    held.append(p.packed)
    if p.bias32 is not None:
        held.append(p.bias32)
    return _Product(p.packed.data_ptr(), 4 if p.mode == "int4" else 8, p.out_features,
                    p.native_group, None if p.bias32 is None else p.bias32.data_ptr())


def takes_cache(got: Plan, cache: KVCache, kv_len: int, span: tuple[int, int] | None,
                bsz: int) -> bool:
    """Whether layer.c takes the block's cache for `bsz` consecutive slots at `span`: bf16
    keys and values of the block's heads and widths, contiguous, kv_len entries within it,
    the slots within its own."""
    k, v = cache.k, cache.v
    return span is not None and k.dtype == v.dtype == torch.bfloat16 and k.is_contiguous() \
        and v.is_contiguous() and k.shape == v.shape and k.shape[1] == got.c.kv_heads \
        and k.shape[3] == got.c.head_dim and kv_len <= k.shape[2] \
        and span[1] - span[0] == bsz and 0 <= span[0] < span[1] <= k.shape[0]


def rope_args(got: Plan, rope: tuple[Tensor, Tensor], bsz: int, seqlen: int
              ) -> tuple[Tensor, Tensor, int] | None:
    """cos and sin as layer.c takes them (a row a position: rows.py `rope_rows`) and the
    rotated width; None where it does not (not bf16, an odd width or one past the head's)."""
    cos, sin = rope
    rot = cos.shape[-1]
    if cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 or rot % 2 \
            or rot > got.c.head_dim:
        return None
    return (*rows.rope_rows(cos, sin, bsz, seqlen), rot)


def run_block(block: nn.Module, x: Tensor, rope: tuple[Tensor, Tensor],
              batch: CacheBatch | None = None,
              cache: KVCache | StateCache | None = None) -> Tensor:
    """`block_py.run_block`, in one call of layer.c where it takes the block and the call."""
    if batch is None or not isinstance(cache, KVCache) or (got := plan(block)) is None \
            or not rows.usable(x) or x.dim() != 3 or not x.is_contiguous() \
            or x.shape[-1] != got.c.hidden \
            or not takes_cache(got, cache, batch.kv_len, batch.span, x.shape[0]) \
            or (args := rope_args(got, rope, x.shape[0], x.shape[1])) is None:
        return block_py.run_block(block, x, rope, batch, cache)
    assert batch.span is not None  # (takes_cache)
    bsz, seqlen, _ = x.shape
    cos, sin, rot = args
    slots = batch.slots if batch.slots.dtype == torch.int64 else batch.slots.long()
    pos = batch.pos if batch.pos.dtype == torch.int64 else batch.pos.long()
    slots, pos = slots.contiguous(), pos.contiguous()
    out = torch.empty_like(x)
    done = _forward(ctypes.byref(got.c), x.data_ptr(), bsz, seqlen, cos.data_ptr(),
                    sin.data_ptr(), rot, slots.data_ptr(), pos.data_ptr(), batch.span[0],
                    batch.kv_len, cache.k.data_ptr(), cache.v.data_ptr(), cache.k.shape[0],
                    cache.k.shape[2], torch.get_num_threads(), out.data_ptr())
    if done == -2:  # a slot or position outside the cache: the Python path says which
        return block_py.run_block(block, x, rope, batch, cache)
    if done == -3:
        raise ValueError(f"the decoder block's kernel does not take its plan: {got.c.hidden=}, "
                         f"{got.c.heads=}, {got.c.kv_heads=}, {got.c.head_dim=}, {rot=}")
    if done != 0:
        raise MemoryError("the decoder block's kernel could not allocate its scratch memory")
    return out


def run_linear_block(block: nn.Module, x: Tensor, rope: tuple[Tensor, Tensor],
                     batch: CacheBatch | None = None,
                     cache: KVCache | StateCache | None = None) -> Tensor:
    """`block_py.run_block` for a Gated DeltaNet block, in one call of layer.c where it takes
    the block and the call: a decode step's or a verify window's positions (not a prefill's),
    eager. The state cache's bookkeeping stays here, in deltanet.py `_step_native`'s order:
    the deferred write a commit left (`take`), where each row's state is and where a step's
    go (`kernel_offsets`), and what a window keeps for the commit (`Unsettled`)."""
    if batch is None or not isinstance(cache, StateCache) or (got := gdn_plan(block)) is None \
            or not rows.usable(x) or x.dim() != 3 or not x.is_contiguous() \
            or x.shape[-1] != got.c.hidden or not takes_state_call(cache, batch, x.shape[1]):
        return block_py.run_block(block, x, rope, batch, cache)
    bsz, seqlen, _ = x.shape
    c = got.c
    slots = batch.slots.to(torch.int64).contiguous()
    cache.unsettled = None  # this pass writes the ring entries after the committed one
    pending = cache.take(batch.slots)  # the committed states a commit left unwritten
    src, dst = cache.kernel_offsets(batch.slots, seqlen)
    k = x.new_empty(bsz, c.v_heads, seqlen, c.k_dim, dtype=torch.float32)
    decay = x.new_empty(bsz, c.v_heads, seqlen, dtype=torch.float32)
    # a verify window writes no state: each position's factor, for the commit's write
    factors = x.new_empty(bsz, c.v_heads, seqlen, c.v_dim, dtype=torch.float32) \
        if seqlen > 1 else None
    p = pending_args(pending)
    out = torch.empty_like(x)
    done = _gdn_forward(ctypes.byref(c), x.data_ptr(), bsz, seqlen, cache.conv.data_ptr(),
                        cache.conv.shape[1], cache.conv.shape[0], slots.data_ptr(),
                        cache.index.data_ptr(),
                        cache.state.data_ptr(), src.data_ptr(), dst.data_ptr(), k.data_ptr(),
                        decay.data_ptr(), None if factors is None else factors.data_ptr(), *p,
                        torch.get_num_threads(), out.data_ptr())
    if done == -1:
        raise MemoryError("the Gated DeltaNet block's kernel could not allocate its scratch "
                          "memory")
    if done == -2:  # (takes_state_call checked the slots: their entries in the ring, not)
        raise IndexError(f"a slot or its state outside the state cache: slots "
                         f"{batch.slots.tolist()}, entries {cache.index.tolist()}, ring "
                         f"{cache.conv.shape[1]}")
    if done != 0:
        raise ValueError(f"the Gated DeltaNet block's kernel does not take its plan or call "
                         f"({done}): {c.hidden=}, {c.k_heads=}, {c.v_heads=}, {c.k_dim=}, "
                         f"{c.v_dim=}, {seqlen=}")
    if factors is not None:
        cache.unsettled = Unsettled(batch.slots, src, dst, k, factors, decay)
    return out


def pending_args(pending: native.Pending | None) -> tuple[int | None, ...]:
    """A deferred write (`StateCache.take`'s) as `gdn_block_forward` takes it: its window's
    offsets, k, factors, decays and kept counts, then that window's positions (none: NULLs
    and 0)."""
    if pending is None:
        return (None,) * 5 + (0,)
    return (*(t.data_ptr() for t in pending), pending[1].shape[2])


def takes_state_call(cache: StateCache, batch: CacheBatch, seqlen: int) -> bool:
    """Whether `run_linear_block`'s call takes a pass of `seqlen` positions of `batch`'s rows
    through the layer's state cache: a decode step's or a verify window's (per position, up
    to 64), eager, the cache as gdn.c and deltanet.c take it (`_takes_state`), the rows' slots
    within it (those kernels index the cache by them unchecked)."""
    if not batch.per_position or seqlen > 64 or torch.compiler.is_compiling() \
            or not _takes_state(cache, seqlen):
        return False
    count = min(cache.conv.shape[0], cache.state.shape[0], cache.index.shape[0])
    if batch.span is not None:
        return batch.span[0] >= 0 and batch.span[1] <= count
    return batch.slots.numel() > 0 and int(batch.slots.min()) >= 0 \
        and int(batch.slots.max()) < count


def _takes_state(cache: StateCache, seqlen: int) -> bool:
    """Whether gdn.c and deltanet.c take the layer's state cache for a pass of `seqlen`
    positions: bf16 conv states and fp32 delta-rule states, contiguous, a ring with room for
    the states after them, the index in int64."""
    conv, state = cache.conv, cache.state
    return conv.dtype == torch.bfloat16 and conv.is_contiguous() \
        and state.dtype == torch.float32 and state.is_contiguous() \
        and cache.index.dtype == torch.int64 and cache.index.is_contiguous() \
        and seqlen + 1 <= conv.shape[1]

