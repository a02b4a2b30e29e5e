"""A Gated DeltaNet block in one call of our kernels (engine/native/layer.c
`gdn_block_forward`): the bits of the block's Python forward (deltanet.py `_step_native`), in
its output and in the state cache it leaves (conv states, delta-rule states, what a verify
window keeps for the commit, the commit's deferred write taken by the next pass), for decode
steps, verify windows and two slots; generation through it; and what it does not take."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams, native
from engine.cache.kv import CacheBatch, KVCache
from engine.cache.state import StateCache, commit
from engine.model import block as block_py
from engine.native import layer, trunk
from training.synthetic import write_checkpoint

pytestmark = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")


def _same_cache(a: StateCache, b: StateCache) -> None:
    assert torch.equal(a.conv, b.conv) and torch.equal(a.state, b.state)
    assert torch.equal(a.index, b.index)
    assert (a.unsettled is None) == (b.unsettled is None)
    if a.unsettled is not None and b.unsettled is not None:
        for name in ("src", "dst", "k", "factors", "decay"):
            assert torch.equal(getattr(a.unsettled, name), getattr(b.unsettled, name)), name
    assert list(a.pending) == list(b.pending)


def _warm_toy(path: Path, quant: str) -> Engine:
    """A Qwen3.5 toy's engine of two slots whose recurrent states are no longer zero."""
    write_checkpoint(path, "tiny-qwen3.5", seed=4)
    engine = Engine.load(path, dtype=torch.bfloat16, max_seq_len=64, k_max=3, slots=2,
                         quant=quant)
    engine.generate(engine.tokenizer.encode("def f(x):\n    return x"),
                    GenParams(6, speculative=False, stop_loops=False))
    return engine


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_gated_deltanet_block_in_one_call_gives_the_python_forwards_bits(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, quant: str) -> None:
    """Every Gated DeltaNet layer of a Qwen3.5 toy: a step of one slot, a verify window of
    four, the commit deferring the state it keeps and the next step taking it, then two slots
    of three positions and of one; each against the Python forward from the same cache."""
    engine = _warm_toy(tmp_path, quant)
    model = engine.model
    assert model.linear_runner is layer.run_linear_block
    linear = [(b, c) for b, c in zip(model.model.layers, engine.caches.trunk, strict=True)
              if b.linear]
    assert linear and all(layer.gdn_plan(b) is not None for b, _ in linear)
    python_forward = block_py.run_block

    def no_fallback(*args: object) -> torch.Tensor:
        raise AssertionError("layer.run_linear_block ran the Python forward")

    gen = torch.Generator().manual_seed(2)
    hidden = model.cfg.hidden_size
    for i, (block, cache) in enumerate(linear):
        assert isinstance(cache, StateCache)
        ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
        # (slots, rows a slot, the position each slot keeps after the pass: a commit)
        for slots, seqlen, kept in [([0], 1, None), ([0], 4, [1]), ([0], 1, None),
                                    ([0, 1], 3, [2, 0]), ([0, 1], 1, None)]:
            index = torch.tensor(slots)
            pos = torch.arange(seqlen).repeat(len(slots), 1) + 20  # (not read by the layer)
            batch = CacheBatch(index, pos, 64, (slots[0], slots[-1] + 1), per_position=True)
            x = (torch.randn(len(slots), seqlen, hidden, generator=gen) * 2).bfloat16()
            rope = engine.caches.rope(pos)
            with torch.inference_mode():
                monkeypatch.setattr(block_py, "run_block", no_fallback)
                got = layer.run_linear_block(block, x, rope, batch, ours)
                monkeypatch.setattr(block_py, "run_block", python_forward)
                want = block_py.run_block(block, x, rope, batch, theirs)
            assert torch.equal(got, want), (i, slots, seqlen)
            _same_cache(ours, theirs)
            if kept is not None:  # the commit: the kept position's state deferred
                for c in (ours, theirs):
                    assert c.unsettled is not None
                    c.defer(c.unsettled.kept(index, torch.tensor(kept)))
                    c.index[index] = (c.index[index] + 1 + torch.tensor(kept)) % c.ring
                _same_cache(ours, theirs)
                assert ours.pending  # the next pass of these slots takes it
        assert not torch.equal(ours.conv, cache.conv) and not torch.equal(ours.state,
                                                                          cache.state)


def _same_caches(a: list[KVCache | StateCache], b: list[KVCache | StateCache]) -> None:
    for x, y in zip(a, b, strict=True):
        if isinstance(x, StateCache) and isinstance(y, StateCache):
            _same_cache(x, y)
        else:
            assert isinstance(x, KVCache) and isinstance(y, KVCache)
            assert torch.equal(x.k, y.k) and torch.equal(x.v, y.v)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_hybrid_trunk_in_one_call_gives_its_blocks_bits(
        tmp_path: Path, count_trunk: Callable[[], list[int]], quant: str) -> None:
    """Qwen3.5's trunk, Gated DeltaNet and full-attention blocks, in one call (trunk.py
    `run_blocks`, layer.c `trunk_forward`): the output and every cache (keys and values;
    conv and delta-rule states, what a window keeps, the deferred writes) of its blocks one
    call at a time, for a step, a verify window of four, the commit deferring what it keeps
    and the next step taking it, then two slots of three positions and of one. A position
    past the KV caches: nothing run, nothing written, the deferred writes still there for the
    blocks one at a time (which say what is wrong)."""
    engine = _warm_toy(tmp_path, quant)
    model = engine.model
    assert model.trunk_runner is trunk.run_blocks
    layers = model.model.layers
    assert any(b.linear for b in layers) and not all(b.linear for b in layers)
    calls = count_trunk()
    ours, theirs = copy.deepcopy(engine.caches.trunk), copy.deepcopy(engine.caches.trunk)
    length = next(c for c in ours if isinstance(c, KVCache)).k.shape[2]
    gen = torch.Generator().manual_seed(2)
    hidden = model.cfg.hidden_size
    # (slots, each slot's first position, rows a slot, the position each keeps: a commit)
    for slots, starts, seqlen, kept in [([0], [20], 1, None), ([0], [21], 4, [1]),
                                        ([0], [23], 1, None), ([0, 1], [24, 5], 3, [2, 0]),
                                        ([0, 1], [27, 6], 1, None)]:
        index = torch.tensor(slots)
        pos = torch.tensor(starts)[:, None] + torch.arange(seqlen)
        batch = CacheBatch(index, pos, length, (slots[0], slots[-1] + 1), per_position=True)
        x = (torch.randn(len(slots), seqlen, hidden, generator=gen) * 2).bfloat16()
        rope = engine.caches.rope(pos)
        with torch.inference_mode():
            got = trunk.run_blocks(layers, x, rope, batch, ours)
            want = x
            for block, cache in zip(layers, theirs, strict=True):
                run = layer.run_linear_block if block.linear else layer.run_block
                want = run(block, want, rope, batch, cache)
        assert got is not None and torch.equal(got, want), (slots, seqlen)
        _same_caches(ours, theirs)
        if kept is not None:  # the commit: each layer's kept position's state deferred
            for caches in (ours, theirs):
                states = [c for c in caches if isinstance(c, StateCache)]
                for c in states:
                    assert c.unsettled is not None
                    c.defer(c.unsettled.kept(index, torch.tensor(kept)))
                commit(states[0].index, states[0].ring, index, torch.tensor(kept))
                assert states[0].offsets is not None
                states[0].offsets.forget()
            _same_caches(ours, theirs)
            assert all(c.pending for c in ours if isinstance(c, StateCache))
    assert calls == [len(layers)] * 5
    # the last window's deferred writes, then a step at a position past the KV caches
    index = torch.tensor([0])
    for caches in (ours, theirs):
        with torch.inference_mode():
            trunk.run_blocks(layers, torch.randn(1, 4, hidden).bfloat16(),
                             engine.caches.rope(torch.arange(30, 34)[None]),
                             CacheBatch(index, torch.arange(30, 34)[None], length, (0, 1),
                                        per_position=True), caches)
        for c in caches:
            if isinstance(c, StateCache):
                assert c.unsettled is not None
                c.defer(c.unsettled.kept(index, torch.tensor([2])))
    before = copy.deepcopy(ours)
    pos = torch.tensor([[length]])
    with torch.inference_mode():
        assert trunk.run_blocks(layers, torch.randn(1, 1, hidden).bfloat16(),
                                engine.caches.rope(torch.tensor([[0]])),
                                CacheBatch(index, pos, length, (0, 1), per_position=True),
                                ours) is None
    _same_caches(ours, before)
    assert all(c.pending for c in ours if isinstance(c, StateCache))


def test_generation_through_it_is_the_python_forwards_and_speculation_stays_lossless(
        tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "tiny-qwen3.5", seed=6, train_steps=40)
    engine = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=128, k_max=3, slots=1,
                         quant="int4")
    model = engine.model
    prompt = engine.tokenizer.encode("def add(a, b):\n    return")
    assert model.trunk_runner is trunk.run_blocks
    outs = {}
    for runner, whole in ((layer.run_linear_block, trunk.run_blocks),
                          (layer.run_linear_block, None), (block_py.run_block, None)):
        model.linear_runner, model.trunk_runner = runner, whole
        for spec in (False, True):
            out = engine.generate(prompt, GenParams(24, speculative=spec, stop_loops=False))
            outs[runner.__module__, whole is None, spec] = out.tokens
    assert len(set(map(tuple, outs.values()))) == 1, outs


def test_blocks_and_calls_it_does_not_take_run_the_python_forward(tmp_path: Path) -> None:
    """Unquantized products, full-attention blocks, a prefill (not position by position), no
    cache: the Python forward, the same bits; slots past the cache's: its error."""
    write_checkpoint(tmp_path, "tiny-qwen3.5", seed=2)
    plain = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=64, k_max=2, slots=1,
                        quant="none")
    assert all(layer.gdn_plan(b) is None for b in plain.model.model.layers)
    quant = Engine.load(tmp_path, dtype=torch.bfloat16, max_seq_len=64, k_max=2, slots=1,
                        quant="int8")
    layers = quant.model.model.layers
    assert all((layer.gdn_plan(b) is None) != b.linear for b in layers)
    i = next(i for i, b in enumerate(layers) if b.linear)
    block, cache = layers[i], quant.caches.trunk[i]
    assert isinstance(cache, StateCache)
    x = torch.randn(1, 5, quant.model.cfg.hidden_size).bfloat16()
    pos = torch.arange(5)[None]
    for batch in (CacheBatch(torch.tensor([0]), pos, 64, (0, 1)), None):  # a prefill; no cache
        ours, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
        with torch.inference_mode():
            got = layer.run_linear_block(block, x, quant.caches.rope(pos), batch,
                                         ours if batch else None)
            want = block_py.run_block(block, x, quant.caches.rope(pos), batch,
                                      theirs if batch else None)
        assert torch.equal(got, want)
        _same_cache(ours, theirs)
    step, past = torch.tensor([[5]]), cache.conv.shape[0]  # a slot past the cache's
    for bad in (CacheBatch(torch.tensor([past]), step, 64, (past, past + 1), per_position=True),
                CacheBatch(torch.tensor([past + 2]), step, 64, per_position=True)):
        with torch.inference_mode(), pytest.raises((IndexError, RuntimeError)):
            layer.run_linear_block(block, x[:, :1], quant.caches.rope(step), bad,
                                   copy.deepcopy(cache))
