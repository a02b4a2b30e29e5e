"""The verify step: each row's pending token and drafts through the trunk in one forward,
the acceptance rule on each row, and what it commits.

Rows are padded to the batch's most drafts (K); a row without the room for that padding
verifies alone. Eager and not capturable as a graph yet: positions and masks are built per
row, the mask's width follows each row's length, and attention loops over the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.slots import ContextOverflow
from engine.decode.accept import accept
from engine.decode.rows import Row, batch_kv
from engine.model.transformer import Transformer


def verify(model: Transformer, rows: Sequence[Row]) -> list[list[int]]:
    """Verify every row's drafts; the tokens each row committed (its accepted drafts, then
    one of the target's own), already appended to its sequence."""
    k_top = max(r.drafts.count for r in rows)
    committed: dict[int, list[int]] = {}
    for group in _padding_groups(rows, k_top):
        news = _verify_group(model, [rows[b] for b in group])
        committed.update(zip(group, news, strict=True))
    return [committed[b] for b in range(len(rows))]


def _padding_groups(rows: Sequence[Row], k_top: int) -> list[list[int]]:
    """Rows that can verify together padded to k_top drafts, then each row without the room
    for that padding on its own."""
    short = [b for b, r in enumerate(rows) if k_top + 1 > r.slot.room()]
    rest = [b for b in range(len(rows)) if b not in short]
    return [rest, *([b] for b in short)] if rest else [[b] for b in short]


@torch.inference_mode()
def _verify_group(model: Transformer, rows: Sequence[Row]) -> list[list[int]]:
    first = rows[0].slot
    k_top = max(r.drafts.count for r in rows)
    for r in rows:
        if k_top + 1 > r.slot.room():
            raise ContextOverflow(f"context of {r.slot.max_seq_len} tokens is full")
        buf = r.drafts.tokens
        buf[0, 0] = r.pending
        buf[0, r.drafts.count + 1:] = 0
    tokens = torch.cat([r.drafts.tokens[:, :k_top + 1] for r in rows])  # [B, K+1]
    pos = torch.stack([r.slot.positions[r.slot.length:r.slot.length + k_top + 1] for r in rows])
    masks = [r.slot.mask(pos[b], r.slot.length + k_top) for b, r in enumerate(rows)]
    h = model.trunk(tokens, first.rope(pos), pos, batch_kv([r.slot.trunk_kv for r in rows],
                                                          masks))
    logits = model.head(h)  # [B, K+1, V]
    committed = []
    for b, r in enumerate(rows):
        k, n0, drafts = r.drafts.count, r.slot.length, r.drafts
        r.slot.hidden[:, n0:n0 + k_top + 1] = h[b:b + 1]
        q = drafts.probs[:k] if k and drafts.probs is not None else None
        out, n = accept(drafts.made(), logits[b, :k + 1], q, r.sampler)
        accepted = int(n)  # the one host sync of a row's step
        new = out[:accepted + 1].tolist()
        r.slot.advance(accepted + 1)  # the pending token and the accepted drafts
        r.seq.extend(new)
        drafts.count = 0
        committed.append(new)
    return committed
