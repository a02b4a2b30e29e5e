"""A decoder block in one call of our kernels (engine/native/layer.c): the bits of the block's
Python forward, in its output and in the KV cache it writes, for decode steps, verifies,
prefills and batches of slots; and the blocks it does not take run that forward."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams, native
from engine.cache.kv import CacheBatch, KVCache
from engine.model import block as block_py
from engine.native import layer, trunk
from training.synthetic import write_checkpoint

pytestmark = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")


def _copy(cache: KVCache) -> KVCache:
    out = KVCache.__new__(KVCache)
    out.k, out.v = cache.k.clone(), cache.v.clone()
    return out


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-llama", "tiny-qwen3.5"])
def test_a_block_in_one_call_gives_the_python_forwards_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, preset: str, quant: str) -> None:
    """QKV bias (Qwen2), q/k norms (Qwen3), neither (Llama), q/k norms with the norms'
    offset, partial rotary and the output gate (Qwen3.5's full-attention layers); every
    full-attention trunk block and MTP block; one row, a verify's four, a prefill's twenty,
    and two slots of three rows at different positions (the cache already holding keys
    there)."""
    write_checkpoint(tmp_path, preset, seed=3)
    engine = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=64, k_max=3, slots=2,
                         quant=quant)
    model = engine.model
    assert model.block_runner is layer.run_block
    trunk = [(b, kv) for b, kv in zip(model.model.layers, engine.caches.trunk, strict=True)
             if not b.linear]  # (Qwen3.5's Gated DeltaNet layers: not blocks layer.c takes)
    first = trunk[0][1]  # the modules' blocks: a cache of the same shapes
    blocks = [*trunk, *((b, first) for m in model.mtp for b in m.blocks)]
    assert all(layer.plan(b) is not None for b, _ in blocks)
    python_forward = block_py.run_block

    def no_fallback(*args: object) -> torch.Tensor:
        raise AssertionError("layer.run_block ran the Python forward")

    gen = torch.Generator().manual_seed(1)
    hidden = model.cfg.hidden_size
    assert isinstance(first, KVCache)
    kv_len = first.k.shape[2]
    # (slots, first positions, rows a slot)
    for slots, starts, seqlen in [([0], [0], 20), ([0], [20], 1), ([0], [21], 4),
                                  ([0, 1], [24, 5], 3)]:
        pos = torch.tensor(starts)[:, None] + torch.arange(seqlen)
        batch = CacheBatch(torch.tensor(slots), pos, kv_len, (slots[0], slots[-1] + 1))
        rope = engine.caches.rope(pos)
        x = (torch.randn(len(slots), seqlen, hidden, generator=gen) * 2).bfloat16()
        for i, (block, kv) in enumerate(blocks):
            assert isinstance(kv, KVCache)
            ours, theirs = _copy(kv), _copy(kv)
            with torch.inference_mode():
                monkeypatch.setattr(block_py, "run_block", no_fallback)
                got = layer.run_block(block, x, rope, batch, ours)
                monkeypatch.setattr(block_py, "run_block", python_forward)
                want = block_py.run_block(block, x, rope, batch, theirs)
            assert torch.equal(got, want), (slots, seqlen, i)
            assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
            assert not torch.equal(ours.k, kv.k)  # (the keys written)
            kv.k.copy_(ours.k)  # the next case finds these keys in the cache
            kv.v.copy_(ours.v)


def test_generation_through_it_is_the_python_forwards_and_speculation_stays_lossless(
        tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "tiny-qwen3", seed=5, train_steps=40)
    engine = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=128, k_max=3, slots=1,
                         quant="int8")
    model = engine.model
    prompt = engine.tokenizer.encode("def add(a, b):\n    return")
    outs = {}
    for runner, whole in ((layer.run_block, trunk.run_blocks), (layer.run_block, None),
                          (block_py.run_block, None)):
        model.block_runner, model.trunk_runner = runner, whole
        for spec in (False, True):
            out = engine.generate(prompt, GenParams(24, speculative=spec, stop_loops=False))
            outs[runner.__module__, whole is None, spec] = out.tokens
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_blocks_it_does_not_take_run_the_python_forward(tmp_path: Path) -> None:
    """Gated DeltaNet layers (Qwen3.5), weights not in our layouts (unquantized), a batch of
    slots that are not consecutive: the Python forward, the same bits."""
    write_checkpoint(tmp_path / "hybrid", "tiny-qwen3.5", seed=2)
    hybrid = Engine.load(tmp_path / "hybrid", dtype=torch.bfloat16, max_seq_len=64, k_max=2,
                         slots=1, quant="int8")
    linear = [b for b in hybrid.model.model.layers if b.linear]
    assert linear and all(layer.plan(b) is None for b in linear)
    write_checkpoint(tmp_path / "plain", "tiny-qwen2", seed=2)
    plain = Engine.load(tmp_path / "plain", dtype=torch.bfloat16, max_seq_len=64, k_max=2,
                        slots=3, quant="none")
    assert layer.plan(plain.model.model.layers[0]) is None
    quant = Engine.load(tmp_path / "plain", dtype=torch.bfloat16, max_seq_len=64, k_max=2,
                        slots=3, quant="int8")
    block, kv = quant.model.model.layers[0], quant.caches.trunk[0]
    assert layer.plan(block) is not None and isinstance(kv, KVCache)
    quant.model.set_exact(False)  # a changed block, a new plan: torch's fused attention
    assert layer.plan(block) is None
    quant.model.set_exact(True)
    assert layer.plan(block) is not None
    pos = torch.tensor([[3], [7]])
    batch = CacheBatch(torch.tensor([2, 0]), pos, kv.k.shape[2])  # no span
    x = torch.randn(2, 1, quant.model.cfg.hidden_size).bfloat16()
    ours, theirs = _copy(kv), _copy(kv)
    with torch.inference_mode():
        got = layer.run_block(block, x, quant.caches.rope(pos), batch, ours)
        want = block_py.run_block(block, x, quant.caches.rope(pos), batch, theirs)
    assert torch.equal(got, want) and torch.equal(ours.k, theirs.k)
    bad = CacheBatch(torch.tensor([5]), pos[:1], kv.k.shape[2], (5, 6))  # past the slots
    with torch.inference_mode(), pytest.raises((IndexError, RuntimeError)):
        layer.run_block(block, x[:1], quant.caches.rope(pos[:1]), bad, _copy(kv))


@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-llama"])
def test_a_trunk_in_one_call_gives_its_blocks_bits(
        tmp_path: Path, count_trunk: Callable[[], list[int]], preset: str, quant: str) -> None:
    """Every block of the trunk in one call (`run_blocks`, layer.c `trunk_forward`): the
    output and every cache of its blocks one call at a time, for a prefill, a step, a
    verify's four rows and two slots; a prefill through a hybrid trunk (Gated DeltaNet
    blocks, which run those position by position only) it leaves to them
    (tests/test_native_gdn_block.py: the hybrid trunk's steps and windows)."""
    write_checkpoint(tmp_path, preset, seed=3)
    engine = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=64, k_max=3, slots=2,
                         quant=quant)
    model = engine.model
    assert model.trunk_runner is trunk.run_blocks
    layers, caches = model.model.layers, engine.caches.trunk
    calls = count_trunk()
    gen = torch.Generator().manual_seed(1)
    hidden = model.cfg.hidden_size
    for slots, starts, seqlen in [([0], [0], 20), ([0], [20], 1), ([0], [21], 4),
                                  ([0, 1], [24, 5], 3)]:
        pos = torch.tensor(starts)[:, None] + torch.arange(seqlen)
        batch = CacheBatch(torch.tensor(slots), pos, caches[0].k.shape[2],
                           (slots[0], slots[-1] + 1))
        rope = engine.caches.rope(pos)
        x = (torch.randn(len(slots), seqlen, hidden, generator=gen) * 2).bfloat16()
        ours = [_copy(c) for c in caches]
        theirs = [_copy(c) for c in caches]
        with torch.inference_mode():
            got = trunk.run_blocks(layers, x, rope, batch, ours)
            want = x
            for block, cache in zip(layers, theirs, strict=True):
                want = layer.run_block(block, want, rope, batch, cache)
        assert got is not None and torch.equal(got, want), (slots, seqlen)
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        for c, a in zip(caches, ours, strict=True):  # the next case finds these keys
            c.k.copy_(a.k)
            c.v.copy_(a.v)
    assert calls == [len(layers)] * 4
    write_checkpoint(tmp_path / "hybrid", "tiny-qwen3.5", seed=2)
    hybrid = Engine.load(tmp_path / "hybrid", dtype=torch.bfloat16, max_seq_len=64, k_max=2,
                         slots=1, quant="int8")
    pos = torch.tensor([[3]])
    with torch.inference_mode():
        assert trunk.run_blocks(hybrid.model.model.layers,
                                torch.randn(1, 1, hybrid.model.cfg.hidden_size).bfloat16(),
                                hybrid.caches.rope(pos),
                                CacheBatch(torch.tensor([0]), pos, 64, (0, 1)),
                                hybrid.caches.trunk) is None
