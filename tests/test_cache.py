"""Incremental decoding through the KV cache equals a full forward, at every position; a
slot's records of its recurrent state checkpoints (which one a new prompt resumes from)."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches, Slot
from engine.decode.prefill import checkpoint_marks
from engine.model.presets import PRESETS
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


def test_checkpoints_are_allocated_for_recurrent_layers_only_and_counted() -> None:
    hybrid = Transformer(PRESETS["tiny-qwen3.5"]).eval()
    none, four = (Caches(hybrid, num_slots=2, max_seq_len=64, scratch=0, checkpoints=n)
                  for n in (0, 4))
    assert four.checkpoints == 4 and four.snapshots == 2
    assert four.state_nbytes() == 3 * none.state_nbytes()  # (2 + 4) states, not 2
    assert four.nbytes() - none.nbytes() == 2 * none.state_nbytes()
    dense = Caches(Transformer(PRESETS["tiny-llama"]).eval(), num_slots=2, max_seq_len=64,
                   scratch=0)
    assert dense.checkpoints == 0 and dense.state_nbytes() == 0


def test_checkpoint_marks_are_the_latest_multiples_of_64_in_the_span() -> None:
    assert checkpoint_marks(0, 200, 4) == [64, 128, 192]
    assert checkpoint_marks(64, 200, 4) == [128, 192]
    assert checkpoint_marks(0, 1000, 4) == [768, 832, 896, 960]
    assert checkpoint_marks(0, 63, 4) == checkpoint_marks(128, 128, 4) == []
    assert checkpoint_marks(0, 1000, 0) == []


def test_a_slot_resumes_from_its_latest_checkpoint_before_the_cut() -> None:
    slot = Slot(0, 1024, recurrent=True, checkpoints=2)
    seq = list(range(300))
    assert slot.cut_to(seq) == (0, None)
    entries = [slot.checkpoint(p) for p in (64, 128, 192)]  # two entries: 64 is evicted
    assert entries[2] == entries[0] and sorted(slot.saved) == [128, 192]
    assert slot.checkpoint(128) == entries[1]  # saved again in place
    slot.hold(seq, 299)
    slot.mtp_len = 299
    assert slot.cut_to([*seq, 7]) == (299, None)  # it extends all the slot holds
    assert slot.cut_to(seq[:150]) == (128, entries[1])
    assert slot.saved == [0, 128] and slot.length == slot.mtp_len == 128  # 192: old tokens
    slot.hold(seq, 299)
    assert slot.cut_to([*seq[:128], -1]) == (0, None)  # the state after 128 runs no token
    assert slot.saved == [0, 128] and slot.length == 0
    slot.reset()
    assert slot.saved == [0, 0]
    dense = Slot(0, 1024, checkpoints=0)
    dense.hold(seq, 299)
    assert dense.cut_to(seq[:150]) == (149, None)


def test_recurrent_layers_share_their_ring_offsets_until_a_commit_moves_them() -> None:
    """Every recurrent layer of a pass reads and writes the same ring entries: the first
    layer's offsets serve the rest (`RingOffsets`), and a commit, which moves the committed
    entries, makes them computed again."""
    model = Transformer(PRESETS["tiny-qwen3.5"]).eval()
    caches = Caches(model, num_slots=3, max_seq_len=64, scratch=0, widest=4)
    states = caches.states()
    assert len(states) > 1 and all(s.offsets is caches.offsets for s in states)

    def fresh(slots: torch.Tensor, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = states[0].state_offsets(slots, positions)
        return src.to(torch.int64), dst.to(torch.int64)

    for slots, n in ((torch.tensor([1]), torch.tensor([2])),
                     (torch.tensor([2, 0]), torch.tensor([0, 3])),
                     (torch.tensor([1]), torch.tensor([3]))):
        for positions in (1, 4):
            want = fresh(slots, positions)
            first = states[0].kernel_offsets(slots, positions)
            for cache in states:
                got = cache.kernel_offsets(slots, positions)
                assert got[0] is first[0] and got[1] is first[1]  # computed once a pass
                assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        before = fresh(slots, 4)
        caches.commit(slots, n)  # the committed entries move: new offsets
        assert not torch.equal(fresh(slots, 4)[0], before[0])
        assert all(torch.equal(g, w) for g, w in
                   zip(states[-1].kernel_offsets(slots, 4), fresh(slots, 4), strict=True))
