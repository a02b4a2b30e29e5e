"""Incremental decoding through the KV cache equals a full forward, at every position."""

from __future__ import annotations

import pytest
import torch

from engine.cache.slots import SlotCache
from engine.model.config import PRESETS
from engine.model.transformer import Transformer


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("chunks", [[1] * 24, [5, 1, 7, 3, 8], [24]])
def test_cached_trunk_and_modules_equal_full_forward(preset: str, chunks: list[int]) -> None:
    torch.manual_seed(0)
    model = Transformer(PRESETS[preset]).eval()
    slot = SlotCache(model, max_seq_len=64)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, sum(chunks)))
    with torch.inference_mode():
        full_logits, full_mtp = model(tokens)
        hidden, start = [], 0
        for size in chunks:  # trunk, chunk by chunk through the cache
            pos = slot.positions[start:start + size]
            hidden.append(model.trunk(tokens[:, start:start + size], slot.rope(pos), pos,
                                      slot.trunk_kv, slot.mask(pos, start + size - 1)))
            start += size
        h = torch.cat(hidden, dim=1)
        torch.testing.assert_close(model.head(h), full_logits, atol=1e-4, rtol=1e-4)
        start = 0
        for size in chunks:  # each module over (h_t, x_{t+1}), chunk by chunk
            size = min(size, tokens.shape[1] - 1 - start)
            if size <= 0:
                break
            pos = slot.positions[start:start + size]
            for m, kv in enumerate(slot.mtp_kv):
                out = model.mtp_forward(m, h[:, start:start + size],
                                        tokens[:, start + 1:start + 1 + size], slot.rope(pos),
                                        pos, kv, slot.mask(pos, start + size - 1))
                torch.testing.assert_close(model.mtp_logits(m, out),
                                           full_mtp[m][:, start:start + size],
                                           atol=1e-4, rtol=1e-4)
            start += size


def test_rollback_is_moving_the_length_back() -> None:
    """Stale entries past the committed length are never attended to."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny-llama"]).eval()
    slot = SlotCache(model, max_seq_len=64)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 20))
    with torch.inference_mode():
        pos = slot.positions[:20]
        model.trunk(tokens, slot.rope(pos), pos, slot.trunk_kv, slot.mask(pos, 19))
        # Roll back to 12 and write different tokens at 12..15.
        new = torch.randint(0, model.cfg.vocab_size, (1, 4))
        pos = slot.positions[12:16]
        h = model.trunk(new, slot.rope(pos), pos, slot.trunk_kv, slot.mask(pos, 15))
        want, _ = model(torch.cat([tokens[:, :12], new], dim=1))
        torch.testing.assert_close(model.head(h), want[:, 12:], atol=1e-4, rtol=1e-4)
