"""Running the assistant (model/assistant.py) in the MTP modules' place inside the step.

It keeps no cache, so nothing catches up: after a verify it runs once per row, for the new
pending token (at position p, which the target has not cached) from the target's hidden
state at p - 1, attending over the target's keys of positions < p. Those are what the step
has just committed: keys the verify wrote past p - 1 (rejected drafts) are masked, and
overwritten before the target ever reads them. Every draft of the chain queries from the
same position p over the same keys. Fixed shapes, no host read: it runs inside a captured
step as the modules do.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.cache.kv import KEY_BLOCK, CacheBatch
from engine.cache.slots import Caches
from engine.model.transformer import Transformer


def assist(model: Transformer, caches: Caches, slots: Tensor, h: Tensor, tokens: Tensor,
           pos: Tensor, kv_len: int, span: tuple[int, int] | None = None) -> Tensor:
    """The assistant's output [B, 1, Ha] for each row's query at pos [B] from h [B, 1, H]
    (the target's hidden state at pos - 1, or the previous draft's projected output) and
    tokens [B, 1] (the pending token, or the previous draft)."""
    assert model.assistant is not None
    # A padding row at position 0 sees key 0 rather than none (an all-masked row's NaNs).
    seen = CacheBatch(slots, (pos - 1).clamp(min=0)[:, None], kv_len, span)
    return model.assistant(h, model.embed(tokens), caches.rope(pos[:, None]), seen,
                           caches.trunk)


@torch.inference_mode()
def assist_at(model: Transformer, caches: Caches, slot: int, seq: list[int],
              end: int) -> Tensor:
    """The assistant's output [1, 1, Ha] for the token seq[end] of one slot whose trunk
    has cached positions < end (a prefill's first drafts)."""
    device = caches.device
    kv_len = min(caches.length, -(-(end + 1) // KEY_BLOCK) * KEY_BLOCK)
    return assist(model, caches, torch.tensor([slot], device=device),
                  caches.hidden[slot:slot + 1, end - 1:end],
                  torch.tensor([[seq[end]]], device=device),
                  torch.tensor([end], device=device), kv_len, (slot, slot + 1))
