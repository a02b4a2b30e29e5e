"""Incremental decoding through the KV cache equals a full forward, at every position."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.model.config import PRESETS
from engine.model.transformer import Transformer

SLOT = 1  # a slot other than the first: rows index their own slot's caches


def rows(start: int, size: int) -> tuple[torch.Tensor, CacheBatch]:
    pos = torch.arange(start, start + size)[None]  # [1, S]
    return pos, CacheBatch(torch.tensor([SLOT]), pos, kv_len=64)


@pytest.mark.parametrize("preset", sorted(p for p, c in PRESETS.items() if c.hidden_size <= 256))
@pytest.mark.parametrize("chunks", [[1] * 24, [5, 1, 7, 3, 8], [24]])
def test_cached_trunk_and_modules_equal_full_forward(preset: str, chunks: list[int]) -> None:
    torch.manual_seed(0)
    model = Transformer(PRESETS[preset]).eval()
    caches = Caches(model, num_slots=2, max_seq_len=64, scratch=0)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, sum(chunks)))
    with torch.inference_mode():
        full_logits, full_mtp = model(tokens)
        hidden, start = [], 0
        for size in chunks:  # trunk, chunk by chunk through the cache
            pos, batch = rows(start, size)
            hidden.append(model.trunk(tokens[:, start:start + size], caches.rope(pos), batch,
                                      caches.trunk))
            # Recurrent layers keep their state after the chunk's last position (as prefill).
            caches.commit(batch.slots, torch.zeros(1, dtype=torch.long))
            start += size
        h = torch.cat(hidden, dim=1)
        torch.testing.assert_close(model.head(h), full_logits, atol=1e-4, rtol=1e-4)
        start = 0
        for size in chunks:  # each module over (h_t, x_{t+1}), chunk by chunk
            size = min(size, tokens.shape[1] - 1 - start)
            if size <= 0:
                break
            pos, batch = rows(start, size)
            for m, kv in enumerate(caches.modules):
                out = model.mtp_forward(m, h[:, start:start + size],
                                        tokens[:, start + 1:start + 1 + size], caches.rope(pos),
                                        batch, kv)
                torch.testing.assert_close(model.mtp_logits(m, out),
                                           full_mtp[m][:, start:start + size],
                                           atol=1e-4, rtol=1e-4)
            start += size


def test_rollback_is_moving_the_length_back() -> None:
    """Stale entries past the committed length are never attended to."""
    torch.manual_seed(0)
    model = Transformer(PRESETS["tiny-llama"]).eval()
    caches = Caches(model, num_slots=2, max_seq_len=64, scratch=0)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 20))
    with torch.inference_mode():
        pos, batch = rows(0, 20)
        model.trunk(tokens, caches.rope(pos), batch, caches.trunk)
        # Roll back to 12 and write different tokens at 12..15.
        new = torch.randint(0, model.cfg.vocab_size, (1, 4))
        pos, batch = rows(12, 4)
        h = model.trunk(new, caches.rope(pos), batch, caches.trunk)
        want, _ = model(torch.cat([tokens[:, :12], new], dim=1))
        torch.testing.assert_close(model.head(h), want[:, 12:], atol=1e-4, rtol=1e-4)
