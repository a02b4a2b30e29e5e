"""Which step shapes give a row the bits of its plain decoding, measured on the device at load.

A row's tokens are bit-identical to its plain decoding only if the kernels give each row the
same result whatever else shares the call and wherever in the call it sits. Matmul libraries
choose their kernels by shape (fp32 matmuls take one path for 1 row, another for a few,
another for many), elementwise loops round the tail of a tensor unlike its body, and so on;
which of these holds differs from CPU to CPU (AVX2, AVX-512, AMX) and GPU to GPU. Rather than
assume, the engine runs the trunk on a prefix in every slot, then:

- verifies a window of W tokens in B slots for every W and B it may use, over bucketed and
  over all keys, and keeps every row's logits;
- decodes the same positions the way plain decoding does: one token a pass, at the first row
  of the call, committing each before the next, in calls of all slots and of one (the
  references);

and compares each row of each window with the reference at its position, bit for bit. The
trunk runs its first layers alone, up to one of each kind (Qwen3.5: three Gated DeltaNet
layers and a full-attention one; the layers after them repeat their shapes, hence their
kernels), then the head: a 2B model's probe spent 17 s of a 78 s cold load in all 24. A
model's few positions can miss what a library does rarely (on an AVX-512 CPU without
AVX512-BF16, oneDNN's bf16 products round a row otherwise now and then as the call's rows
change: the tiny test model's windows all agreed, its prefills did not), so on the CPU the
dense products the forward makes are also run on random rows in calls of every size the engine
makes (windows, slots, prefill chunks) and compared with one call of all the rows: the
narrowest call from which they agree bounds the window. Of the step shapes in which all
agree it returns the one whose plain step runs the fewest rows (the common case: one
editor, one slot live), then the one reading the fewest keys:

- `key_invariant`: attending over more (masked) keys leaves the bits alone (else every
  forward reads the whole cache);
- `batch_invariant`: the number of slots in a step leaves them alone (else every step pads
  the batch to all slots);
- `alone`: a row's bits depend on which batch row it runs in, so each slot runs in a call of
  its own (as plain decoding with nothing else live does);
- `min_width`: the narrowest verify that agrees (the engine then never verifies fewer tokens:
  narrower windows are padding);

or, when none does, says so (`exact` False) and why: a verify's row j sits at row j of its
call while plain decoding computes that position at row 0, so a device whose rows differ by
where they sit in a call cannot keep the contract in any shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import product
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.decode.prefill import kv_blocks
from engine.model.transformer import Transformer

BY_POSITION = "rows of one call differ by position"
BY_SIZE = "a matmul's rows differ by the call's size"
BY_RUN = "the same call gives other bits from run to run"
KEY_ROOM = 512


@dataclass(frozen=True, slots=True)
class Invariance:
    min_width: int  # verify at least this many tokens per row
    batch_invariant: bool  # else pad every step to all slots, or run each slot alone
    key_invariant: bool  # else attend over the whole cache, not a multiple of a block
    alone: bool = False  # each slot's rows run in a call of their own
    exact: bool = True  # some shape above keeps every row's bits
    reason: str | None = None  # why none does

    @classmethod
    def unconstrained(cls) -> Invariance:
        """No promise asked for: the cheapest shapes."""
        return cls(1, batch_invariant=True, key_invariant=True)


@torch.inference_mode()
def probe(model: Transformer, width_max: int, max_batch: int, prefix: int = 64,
          seed: int = 0) -> Invariance:
    cfg = model.cfg
    depth = probe_depth(cfg.layer_types)
    # Slot max_batch decodes alone; room past the windows, so that a bucket of keys is not
    # the whole cache.
    caches = Caches(model, max_batch + 1, prefix + 2 * width_max + KEY_ROOM,
                    scratch=width_max, widest=width_max)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prefix + 2 * width_max), generator=gen)
    ids = ids.to(caches.device)
    slots = torch.arange(max_batch + 1, device=caches.device)
    for s in range(max_batch + 1):  # one slot a pass, as prefills of hybrid models run
        pos = torch.arange(prefix, device=caches.device)[None]
        model.trunk(ids[:, :prefix], caches.rope(pos),
                    CacheBatch(slots[s:s + 1], pos, kv_blocks(prefix, caches.length)),
                    caches.trunk, depth)
    caches.commit(slots, torch.zeros_like(slots))
    full = caches.length

    def window(start: int, width: int, batch: int, kv_len: int, first: int = 0) -> Tensor:
        """The logits [B, W, V] of a verify of `width` tokens from `start` in `batch` slots
        from `first`; the committed state is left as it was (the ring keeps it)."""
        tokens = ids[:, start:start + width].expand(batch, -1)
        p = start + torch.arange(width, device=caches.device)[None].expand(batch, -1)
        rows = CacheBatch(slots[first:first + batch], p, kv_len, per_position=True)
        return model.head(model.trunk(tokens, caches.rope(p), rows, caches.trunk, depth))

    results = {(w, b, kv): window(prefix, w, b, kv)
               for w, b in product(range(1, width_max + 1), sorted({1, max_batch}))
               for kv in sorted({kv_blocks(prefix + w, full), full})}
    with _Linears() as linears:  # the run again, noting its dense products
        again = window(prefix, width_max, max_batch, full)
    if not torch.equal(again, results[(width_max, max_batch, full)]):
        return _none(width_max, BY_RUN)

    def plain(batch: int, first: int) -> Tensor:
        """Plain decoding in calls of `batch` slots: position prefix + j at the first row of
        a pass of its own, committed before the next; the first slot's logits [1, W, V]."""
        rows = []
        for j in range(width_max):
            rows.append(window(prefix + j, width_max, batch, full, first)[:1, 0])
            caches.commit(slots[first:first + batch], torch.zeros(batch, dtype=torch.long,
                                                                  device=caches.device))
        return torch.stack(rows, dim=1)

    padded, lone = plain(max_batch, 0), plain(1, max_batch)

    def agree(min_width: int, batch: int | None, bucketed: bool, ref: Tensor) -> bool:
        """Whether every window of min_width or more tokens in calls of `batch` slots (None:
        any), over all keys (and bucketed ones), gives each row, in any batch row, the
        reference's bits at its position."""
        return all(torch.equal(r, ref[:, :w].expand_as(r)) for (w, b, kv), r in results.items()
                   if w >= min_width and batch in (None, b) and (kv == full or bucketed))

    shapes = {"invariant": (None, lone if torch.equal(lone, padded) else None),
              "alone": (1, lone), "padded": (max_batch, padded)}
    # the narrowest call in which the products agree (a GPU's steps run one shape)
    kernels = _kernel_width(linears.seen, width_max, max_batch, seed) \
        if caches.device.type == "cpu" else 1
    narrowest = width_max + 1 if kernels is None else kernels
    found, blocked = [], False
    for (kind, (batch, ref)), bucketed in product(shapes.items(), (True, False)):
        w = next((w for w in range(1, width_max + 1)
                  if ref is not None and agree(w, batch, bucketed, ref)), None)
        if w is None:
            continue
        w = max(w, narrowest)  # wider windows agree as well: fewer of them to check
        if w > width_max:
            blocked = True
            continue
        rows = w * (max_batch if kind == "padded" else 1)  # in a lone slot's plain step
        found.append((rows, not bucketed, list(shapes).index(kind),
                      Invariance(w, kind == "invariant", bucketed, alone=kind == "alone")))
    if not found:
        return _none(width_max, BY_SIZE if blocked else BY_POSITION)
    # The fewest rows a lone slot's plain step runs (the common case: one editor, one slot
    # live); then bucketed keys; then one call for all slots.
    return min(found, key=lambda f: f[:3])[3]


def probe_depth(layer_types: Sequence[str]) -> int:
    """The layers the probe runs: the first ones, up to one of each kind."""
    return 1 + max(layer_types.index(kind) for kind in set(layer_types))


class _Linears(TorchDispatchMode):
    """The dense products (`F.linear`) a forward makes: one of each kind (weight shape and
    dtype, input dtype, with or without a bias), with its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[tuple, tuple[Tensor, Tensor | None, torch.dtype]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if func is torch.ops.aten.linear.default:
            x, w, *rest = args
            bias = rest[0] if rest else None
            self.seen.setdefault((tuple(w.shape), w.dtype, x.dtype, bias is None),
                                 (w, bias, x.dtype))
        return func(*args, **(kwargs or {}))


KERNEL_ROWS = 64  # the widest prefill call swept (a chunk's calls past it: as wide ones)
KERNEL_OUT = 8192  # a weight's first outputs swept (a vocabulary's head: a slice of it)
KERNEL_WORK = 1 << 22  # weight elements a sweep covers at least, by drawing rows again


def _kernel_width(linears: dict[tuple, tuple[Tensor, Tensor | None, torch.dtype]],
                  width_max: int, max_batch: int, seed: int,
                  matmul: Callable[..., Tensor] = F.linear) -> int | None:
    """The narrowest call (in rows, at most width_max) from which every product of
    `linears` gives each row the bits one call of all the rows gives it, in calls of every
    size a step or a prefill makes, each row at two places in them; None: none."""
    gen = torch.Generator().manual_seed(seed + 1)
    sizes = sorted({*range(1, width_max * max_batch + 1), 16, 17, 31, 32, 33, 48, 63,
                    KERNEL_ROWS})
    ok = dict.fromkeys(sizes, True)
    for w, bias, dtype in linears.values():
        w = w[:KERNEL_OUT]
        b = None if bias is None else bias[:KERNEL_OUT]
        # a small weight's rows rarely round otherwise: more of them (the same work)
        for _ in range(max(1, min(16, KERNEL_WORK // w.numel()))):
            x = torch.randn(1, KERNEL_ROWS + 5, w.shape[1], generator=gen).to(w.device, dtype)
            whole = matmul(x, w, b)
            for m in sizes:
                ok[m] = ok[m] and all(torch.equal(matmul(x[:, s:s + m], w, b),
                                                  whole[:, s:s + m]) for s in (0, 5))
    return next((n for n in range(1, width_max + 1) if all(ok[m] for m in sizes if m >= n)),
                None)


class ExactnessUnavailable(ValueError):
    """Exact decoding was asked for on a device whose rows differ in every step shape."""


def promised(asked: bool | None, exact: bool, reason: str | None = None) -> str:
    """What the engine says of exactness (`ahead status`, the benches): asked for (True),
    refused (False) or left to auto (None); whether it holds; why not, where it cannot."""
    if reason is not None:
        if asked:
            raise ExactnessUnavailable(
                f"exact decoding is unavailable on this device ({reason}): speculative output "
                "could differ from plain decoding at near-ties; set exact = \"auto\" or "
                "\"off\" to run without that promise")
        return f"unavailable on this device ({reason})"
    if exact:
        return "on"
    return "off" if asked is False else "off (auto: fp32 on the CPU, where it costs)"


def _none(width: int, reason: str) -> Invariance:
    return Invariance(width, batch_invariant=False, key_invariant=False, exact=False,
                      reason=reason)
