"""A greedy draft of an MTP module in one call of mtp.c, where every part runs in our kernels:
the chain's hidden state, the module's input (the next token's embedding and that state,
normed, side by side), its projection, its block (layer.c, as layer.py takes it), its final
norm and the draft's pick; given the chain's state, the draft chain's rule after it. The bits
are the Python path's (decode/draft.py `draft_one`: the same kernels, the same order, the
rule's float32 operations); what goes is ~25 calls of Python and torch a draft, and the
rule's dozen.

`draft` is `Transformer.draft_runner` on the engines whose blocks run by layer.py
(exec/compile.py `step_fns`); a module, a head or a call it does not take returns None, and
the Python path runs. `chain`, its `chain_runner`, makes the drafts the last module chains on
itself (all after the first, with one module) in one call, `draft` for each in turn: what
goes is the Python between drafts.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from engine import native
from engine.cache.kv import KVCache
from engine.model.codes import Packed
from engine.model.layers import RMSNorm
from engine.model.mtp import MTPModule
from engine.model.transformer import Transformer
from engine.native import layer, rows

i64, ptr = ctypes.c_int64, ctypes.c_void_p


class _MtpPlan(ctypes.Structure):
    _fields_ = [("block", layer._Plan), ("eh_proj", layer._Product), ("embed", ptr),
                ("enorm", ptr), ("hnorm", ptr), ("norm", ptr), ("chain_norm", ptr),
                ("vocab", i64), ("hidden_first", i64), ("head", layer._Product),
                ("coarse", ptr), ("candidates", i64), ("ids", ptr)]


class _Chain(ctypes.Structure):
    _fields_ = [("j", ptr), ("tokens", ptr), ("tokens_stride", i64), ("rows", i64),
                ("confidence", ptr), ("conf_stride", i64), ("accept", ptr), ("limit", ptr),
                ("positions", i64), ("bins", i64), ("k_limit", ptr), ("floor", ptr),
                ("adaptive", ptr), ("count", ptr), ("alive", ptr), ("survival", ptr)]


class ChainArgs(NamedTuple):
    """The draft chain's state and the slots' buffers, for mtp.c to run the chain's rule
    after draft j (decode/draft.py `Chain`, decode/state.py `DecodeState`): updated in
    place."""

    j: Tensor  # [1] int64: the draft's number (read by the kernel: no value to the host)
    tokens: Tensor  # [slots, k_max + 1] int64
    confidence: Tensor | None  # [slots, k] float32, or None: no probabilities computed
    accept: Tensor  # [k, bins] float32
    limit: Tensor  # [k + 1] float32
    k_limit: Tensor  # [B] int64
    floor: Tensor  # [B] int64
    adaptive: Tensor  # [B] bool
    made: Tensor  # [B] int64: drafts kept so far
    alive: Tensor  # [B] bool
    survival: Tensor  # [B] float32


class Drafted(NamedTuple):
    out: Tensor  # [B, 1, H] the module's output
    tok: Tensor  # [B, 1] the draft
    prob: Tensor | None  # [B, 1] its probability, where asked for (none where the chain ran)
    live: int | None  # with a chain: the rows still drafting


class Plan:
    """A module's draft as mtp.c takes it (with its block's layer.py plan), with the tensors
    that hold it."""

    __slots__ = ("block", "c", "held")

    def __init__(self, c: _MtpPlan, block: layer.Plan, held: list[object]) -> None:
        self.c, self.block, self.held = c, block, held


# Per module, and per module its chain comes from: (what the plan was made from, the plan or
# None); gone with the module.
_PLANS: weakref.WeakKeyDictionary[
    nn.Module, dict[int, tuple[tuple[object, ...], Plan | None]]] = weakref.WeakKeyDictionary()


@functools.cache
def _fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.mtp_draft
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_MtpPlan), ctypes.c_int, ptr, ptr, i64, ptr, ptr, i64, ptr,
                   ptr, i64, i64, ptr, ptr, i64, i64, ctypes.c_int, ptr, ptr, ptr, ptr]
    return fn


def _draft(*args: Any) -> int:
    """mtp.c's `mtp_draft` (a function of its own: `ahead bench engine` times it)."""
    return int(_fn()(*args))


@functools.cache
def _chain_fn() -> Any:  # the ctypes function
    fn = native.kernels().lib.mtp_chain
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_MtpPlan), ptr, ptr, i64, i64, i64, ptr, ptr, i64, ptr, ptr,
                   i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, ctypes.c_int, ctypes.c_int,
                   ctypes.POINTER(_Chain), ptr, ptr, ptr]
    return fn


def _chain(*args: Any) -> int:
    """mtp.c's `mtp_chain` (timed by `ahead bench engine` with the drafts in one call)."""
    return int(_chain_fn()(*args))


def _head(model: Transformer) -> tuple[Packed | None, Tensor | None, Tensor | None]:
    """The drafts' head as mtp.c takes it: (its rows in our layout, the reduced head's 2-bit
    layout or None, the reduced head's ids or None); (None, None, None) where it does not."""
    reduced = model.draft_head
    if reduced is not None:
        coarse = reduced.coarse()
        head = layer._product(reduced.rows)
        return (head, coarse, reduced.ids) if head is not None else (None, None, None)
    if model.cfg.final_logit_softcapping:
        return None, None, None
    return layer._product(model.head_weight), None, None


def _key(model: Transformer, module: MTPModule, chain: MTPModule | None
         ) -> tuple[object, ...]:
    """What a plan is made from: the block's plan (itself remade when its block changes),
    the projection, the embedding, the norms' weights, the drafts' head (tensors by where
    they are: a tuple of them would compare their values)."""
    block = module.blocks[0] if len(module.blocks) == 1 else None
    head = model.draft_head
    return (None if block is None else layer.plan(block), module.eh_proj,
            model.model.embed_tokens.weight.data_ptr(),
            *(n.weight.data_ptr() for n in (module.enorm, module.hnorm, module.norm)),
            None if chain is None else chain.norm.weight.data_ptr(),
            head, None if head is None else (head.rows, layer._data_ptr(head.coarse()),
                                             head.candidates),
            model.head_weight)


def plan(model: Transformer, m: int, m_in: int) -> Plan | None:
    """mtp.c's plan of module m's draft chained on module m_in's output, or None where it
    does not take them."""
    module, chain = model.mtp[m], model.mtp[m_in] if model.chain_normed else None
    assert isinstance(module, MTPModule) and (chain is None or isinstance(chain, MTPModule))
    key = _key(model, module, chain)
    plans = _PLANS.setdefault(module, {})
    got = plans.get(m_in)
    if got is not None and got[0] == key:
        return got[1]
    made = _make(model, module, chain, key)
    plans[m_in] = (key, made)
    return made


def _make(model: Transformer, module: MTPModule, chain: MTPModule | None,
          key: tuple[object, ...]) -> Plan | None:
    block_plan = key[0]
    eh_proj = layer._product(module.eh_proj)
    head, coarse, ids = _head(model)
    embed = model.model.embed_tokens.weight
    norms: list[RMSNorm] = [module.enorm, module.hnorm, module.norm]
    if chain is not None:
        norms.append(chain.norm)
    if not isinstance(block_plan, layer.Plan) or eh_proj is None or head is None \
            or embed.dtype != torch.bfloat16 or not embed.is_contiguous() \
            or any(not isinstance(n, RMSNorm) or n.weight.dtype != torch.bfloat16
                   or ctypes.c_float(n.eps).value != block_plan.c.eps
                   or float(n.offset) != block_plan.c.offset
                   or int(n.upcast) != block_plan.c.upcast for n in norms):
        return None
    hidden = block_plan.c.hidden
    if eh_proj.out_features != hidden or embed.shape[1] != hidden:
        return None
    weights = [n.weight.detach().contiguous() for n in norms]
    held: list[object] = [embed, *weights]
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        held.append(ids)
    if coarse is not None:
        held.append(coarse)
    candidates = 0 if model.draft_head is None else model.draft_head.candidates
    c = _MtpPlan(block_plan.c, layer.c_product(eh_proj, held), embed.data_ptr(),
                 *(w.data_ptr() for w in weights[:3]),
                 weights[3].data_ptr() if chain is not None else None, embed.shape[0],
                 int(module.hidden_first), layer.c_product(head, held),
                 None if coarse is None else coarse.data_ptr(), candidates,
                 None if ids is None else ids.data_ptr())
    return Plan(c, block_plan, held)


def _c_chain(chain: ChainArgs, bsz: int) -> _Chain | None:
    """The chain as mtp.c takes it, or None where its tensors are not as it reads them."""
    conf = chain.confidence
    tensors = [(chain.j, torch.int64), (chain.tokens, torch.int64),
               (chain.accept, torch.float32), (chain.limit, torch.float32),
               (chain.k_limit, torch.int64), (chain.floor, torch.int64),
               (chain.adaptive, torch.bool), (chain.made, torch.int64),
               (chain.alive, torch.bool), (chain.survival, torch.float32)]
    if conf is not None:
        tensors.append((conf, torch.float32))
    if any(t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu"
           for t, dtype in tensors) \
            or any(t.shape != (bsz,) for t in chain[5:]) or chain.tokens.dim() != 2 \
            or chain.accept.dim() != 2 or chain.limit.shape != (chain.accept.shape[0] + 1,) \
            or chain.j.numel() != 1 or (conf is not None and conf.dim() != 2):
        return None
    tokens, accept = chain.tokens, chain.accept
    return _Chain(chain.j.data_ptr(), tokens.data_ptr(), tokens.shape[1], tokens.shape[0],
                  None if conf is None else conf.data_ptr(), 0 if conf is None else conf.shape[1],
                  accept.data_ptr(), chain.limit.data_ptr(), accept.shape[0], accept.shape[1],
                  chain.k_limit.data_ptr(), chain.floor.data_ptr(), chain.adaptive.data_ptr(),
                  chain.made.data_ptr(), chain.alive.data_ptr(), chain.survival.data_ptr())


def draft(model: Transformer, m: int, out: Tensor, *, prob: bool, m_in: int = 0,
          prev: Tensor | None = None, rope: tuple[Tensor, Tensor] | None = None,
          slots: Tensor | None = None, pos: Tensor | None = None, kv_len: int = 0,
          span: tuple[int, int] | None = None, caches: Sequence[object] = (),
          chain: ChainArgs | None = None) -> Drafted | None:
    """Module m's greedy draft for each row: from `out` [B, 1, H], module m_in's output at
    the previous position, and `prev` [B], the previous drafts, at positions `pos` [B, 1]
    (their rotary `rope`) in the slots' `caches` of the module (its block's); or, without
    `prev`, from `out` as the module's own output (a chain's first draft). Returns the
    module's output [B, 1, H], the draft and (`prob`) the softmax's probability of it,
    [B, 1] each: what `Transformer.mtp_forward` and `mtp_greedy` give. With `chain` (and
    `slots`), the drafts and (`prob`) their probabilities go into its buffers and the
    chain's rule runs, in place: what `draft_one` does after the draft; then `live`, the
    rows still drafting. None where mtp.c does not take the call."""
    if model.assistant is not None or not rows.usable(out) or out.dim() != 3 \
            or out.shape[1] != 1 or not out.is_contiguous() \
            or (got := plan(model, m, m_in)) is None or out.shape[-1] != got.block.c.hidden:
        return None
    bsz = out.shape[0]
    c_chain = None
    if chain is not None and (slots is None or (prob != (chain.confidence is not None))
                              or (c_chain := _c_chain(chain, bsz)) is None):
        return None
    if slots is not None:
        slots = slots.to(torch.int64).contiguous()
    tok = torch.empty(bsz, 1, dtype=torch.int64)
    top = torch.empty(bsz, 1)
    lse = torch.empty(bsz, 1) if prob else None
    by_ref = None if c_chain is None else ctypes.byref(c_chain)
    if prev is None:
        done = _draft(ctypes.byref(got.c), 0, out.data_ptr(), None, bsz, None, None, 0,
                      None if slots is None else slots.data_ptr(), None, 0, 0, None, None, 0,
                      0, torch.get_num_threads(), None, tok.data_ptr(), top.data_ptr(),
                      None if lse is None else lse.data_ptr(), by_ref)
        new = out
    else:
        assert rope is not None and slots is not None and pos is not None
        if len(caches) != 1 or not isinstance(cache := caches[0], KVCache) \
                or not layer.takes_cache(got.block, cache, kv_len, span, bsz) \
                or (args := layer.rope_args(got.block, rope, bsz, 1)) is None:
            return None
        assert span is not None  # (takes_cache)
        cos, sin, rot = args
        k, v = cache.k, cache.v
        tokens = prev.reshape(bsz).to(torch.int64).contiguous()
        pos = pos.to(torch.int64).contiguous()
        new = torch.empty_like(out)
        done = _draft(ctypes.byref(got.c), 1, out.data_ptr(), tokens.data_ptr(), bsz,
                      cos.data_ptr(), sin.data_ptr(), rot, slots.data_ptr(), pos.data_ptr(),
                      span[0], kv_len, k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[2],
                      torch.get_num_threads(), new.data_ptr(), tok.data_ptr(), top.data_ptr(),
                      None if lse is None else lse.data_ptr(), by_ref)
    if done in (-2, -4):  # a slot, position or token out of range: the Python path says which
        return None
    if done == -3:
        raise ValueError("the MTP draft's kernel does not take its plan")
    if done < 0:
        raise MemoryError("the MTP draft's kernel could not allocate its scratch memory")
    if c_chain is not None:
        return Drafted(new, tok, None, done)
    return Drafted(new, tok, None if lse is None else rows.probability(top, lse), None)


def chain(model: Transformer, m: int, out: Tensor, tok: Tensor, *, j0: int, j1: int,
          draft_index: Tensor, base: Tensor, offset: int, tables: tuple[Tensor, Tensor],
          slots: Tensor, kv_len: int, span: tuple[int, int] | None, caches: Sequence[object],
          chain: ChainArgs, early_exit: bool) -> tuple[int, int | None, Tensor, Tensor] | None:
    """Module m's greedy drafts j0 .. j1, each chained on the one before (module m on its
    own output: the last module's drafts), in one call of mtp.c, their chain's rule after
    each (`draft` with `chain` for each of them, in turn): from `out` [B, 1, H] and `tok` [B],
    the module's output and the drafts of draft j0 - 1; draft j at positions base + j +
    offset [B] of the module's cache, their rotary rows from the cache's `tables` (cos, sin
    [T, 1, R]); chain.j unused (draft j's number is draft_index[j]). With `early_exit`, the
    chain ends after a draft that leaves no row drafting. Returns the last draft made, the
    rows still drafting after it (None: not counted), and its module's output [B, 1, H] and
    drafts [B] (where a draft does not run in mtp.c, the caller's path goes on from there);
    None where mtp.c does not take the call (nothing made)."""
    if model.assistant is not None or not rows.usable(out) \
            or out.dim() != 3 or out.shape[1] != 1 or not out.is_contiguous() \
            or (got := plan(model, m, m)) is None or out.shape[-1] != got.block.c.hidden:
        return None
    bsz = out.shape[0]
    cos, sin = tables
    if (c_chain := _c_chain(chain, bsz)) is None or len(caches) != 1 \
            or not isinstance(cache := caches[0], KVCache) \
            or not layer.takes_cache(got.block, cache, kv_len, span, bsz) \
            or cos.dtype != torch.bfloat16 or sin.dtype != torch.bfloat16 \
            or cos.shape != sin.shape or cos.dim() != 3 or cos.shape[1] != 1 \
            or not (cos.is_contiguous() and sin.is_contiguous()) \
            or cos.shape[-1] % 2 or cos.shape[-1] > got.block.c.head_dim \
            or draft_index.dtype != torch.int64 or not draft_index.is_contiguous() \
            or draft_index.numel() <= j1:
        return None
    assert span is not None  # (takes_cache)
    k, v = cache.k, cache.v
    slots = slots.to(torch.int64).contiguous()
    base = base.to(torch.int64).contiguous()
    tokens = tok.reshape(bsz).to(torch.int64).contiguous()
    last, last_tok = torch.empty_like(out), torch.empty(bsz, dtype=torch.int64)
    made = torch.zeros(1, dtype=torch.int64)
    done = _chain(ctypes.byref(got.c), out.data_ptr(), tokens.data_ptr(), bsz, j0, j1,
                  draft_index.data_ptr(), base.data_ptr(), offset, cos.data_ptr(),
                  sin.data_ptr(), cos.shape[0], cos.shape[-1], slots.data_ptr(), span[0],
                  kv_len, k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[2],
                  torch.get_num_threads(), int(early_exit), ctypes.byref(c_chain),
                  last.data_ptr(), last_tok.data_ptr(), made.data_ptr())
    if done == -3:
        raise ValueError("the MTP draft's kernel does not take its plan")
    if done == -1:
        raise MemoryError("the MTP draft's kernel could not allocate its scratch memory")
    last_made = int(made.item())
    if done >= 0:
        return last_made, done, last, last_tok
    # -2, -4: draft last_made + 1 did not run (a position or token out of range): the
    # caller's path makes it, and says what is wrong
    return None if last_made < j0 else (last_made, None, last, last_tok)
