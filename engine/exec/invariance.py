"""Which step shapes give a row the same bits, measured on the device at load.

A row's tokens are bit-identical to its plain decoding only if the kernels give each row the
same result whatever else shares the call. Matmul libraries choose their kernels by shape
(on this project's CPUs, fp32 matmuls take one path for 1 row, another for 2-3, another from
4; bf16 ones one path for all), and so may attention. Rather than assume, the engine runs
the trunk on a prefix and then verifies a window of W tokens in B slots for every W and B it
may use, and compares the logits of the window's first position bit for bit:

- `min_width`: the narrowest verify whose logits equal those of every wider one (the engine
  then never verifies fewer tokens: narrower windows are padding), else the widest;
- `batch_invariant`: whether the number of slots in a step leaves the bits alone (else every
  step pads the batch to all slots, so that every row always runs in the same call shape);
- `key_invariant`: whether attending over more (masked) keys leaves them alone (else every
  forward reads the whole cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.decode.prefill import kv_blocks
from engine.model.transformer import Transformer


@dataclass(frozen=True, slots=True)
class Invariance:
    min_width: int  # verify at least this many tokens per row
    batch_invariant: bool  # else pad every step to all slots
    key_invariant: bool  # else attend over the whole cache, not a multiple of a block


@torch.inference_mode()
def probe(model: Transformer, width_max: int, max_batch: int, prefix: int = 300,
          seed: int = 0) -> Invariance:
    cfg = model.cfg
    caches = Caches(model, max_batch, prefix + 2 * width_max, scratch=width_max,
                    widest=width_max)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, prefix + width_max), generator=gen)
    ids = ids.to(caches.device)
    slots = torch.arange(max_batch, device=caches.device)
    pos = torch.arange(prefix, device=caches.device)[None].expand(max_batch, -1)
    model.trunk(ids[:, :prefix].expand(max_batch, -1), caches.rope(pos),
                CacheBatch(slots, pos, kv_blocks(prefix, caches.length)), caches.trunk)
    caches.commit(slots, torch.zeros_like(slots))

    def first_row(width: int, batch: int, kv_len: int) -> torch.Tensor:
        window = ids[:, prefix:prefix + width].expand(batch, -1)
        p = prefix + torch.arange(width, device=caches.device)[None].expand(batch, -1)
        h = model.trunk(window, caches.rope(p), CacheBatch(slots[:batch], p, kv_len,
                                                           per_position=True), caches.trunk)
        return model.head(h)[:, 0]  # [B, V], the head run as the step runs it

    full = caches.length
    results = {(w, b, kv): first_row(w, b, kv)
               for w in range(1, width_max + 1) for b in sorted({1, max_batch})
               for kv in sorted({kv_blocks(prefix + w, full), full})}

    def same(w: int, batches: set[int], keys: set[int | None]) -> bool:
        """Whether every window of w or more tokens, in these batch sizes, reading keys
        bucketed (None) or all of them (full), gives the widest window's bits."""
        ref = results[(width_max, min(batches), full)][0]
        return all(torch.equal(r, ref.expand_as(r)) for (w2, b, kv), r in results.items()
                   if w2 >= w and b in batches and (kv == full or None in keys))

    bucketed = {None, full}
    key_invariant = same(width_max, {1}, bucketed) or same(width_max, {max_batch}, bucketed)
    keys: set[int | None] = bucketed if key_invariant else {full}
    batch_invariant = same(width_max, {1, max_batch}, keys)
    batches = {1, max_batch} if batch_invariant else {max_batch}
    min_width = next(w for w in range(1, width_max + 1) if same(w, batches, keys))
    return Invariance(min_width, batch_invariant, key_invariant)
