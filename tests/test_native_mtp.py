"""A greedy MTP draft in one call of our kernels (engine/native/mtp.c): the bits of the Python
path (`Transformer.mtp_forward` and `mtp_greedy`, blocks by their Python forward) in the
module's output, the draft, its probability and the cache entries the module writes, for
the whole head, a reduced head's rows and its coarse pass; the same drafts, so the same
acceptance, through generation; and the calls it does not take left to the Python path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams, native
from engine.cache.kv import CacheBatch, KVCache
from engine.model import block as block_py
from engine.native import layer, mtp
from training.synthetic import write_checkpoint

pytestmark = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")

# The drafts' head: the whole vocabulary (512 tokens); 64 of its tokens, their int4 rows
# scored whole (four tiles of 16 rows as candidates: no coarse pass pays), or one tile of
# them after a coarse pass.
HEADS = {"whole": (0, 0), "rows": (64, 4), "coarse": (64, 1)}


def _load(path: Path, quant: str, head: str, slots: int = 2) -> Engine:
    size, candidates = HEADS[head]
    engine = Engine.load(path, dtype=torch.bfloat16, max_seq_len=64, k_max=3, slots=slots,
                         quant=quant, draft_vocab=size)
    if engine.model.draft_head is not None:
        engine.model.draft_head.candidates = candidates
    return engine


def _copy(cache: KVCache) -> KVCache:
    out = KVCache.__new__(KVCache)
    out.k, out.v = cache.k.clone(), cache.v.clone()
    return out


@pytest.mark.parametrize(("quant", "head"), [("int8", "whole"), ("int4", "whole"),
                                             ("int8", "rows"), ("int4", "coarse")])
@pytest.mark.parametrize("preset", ["tiny-qwen2", "tiny-qwen3", "tiny-qwen3.5"])
def test_a_draft_in_one_call_gives_the_python_paths_bits(
        tmp_path: Path, preset: str, quant: str, head: str) -> None:
    """Qwen2 and Qwen3 modules (the chain's states as they are) and Qwen3.5's (normed); the
    head whole, a reduced head's int8 rows, its int4 rows' coarse pass; a chain's first
    draft and a later one; one slot and two, with and without the draft's probability."""
    write_checkpoint(tmp_path, preset, seed=4)
    engine = _load(tmp_path, quant, head)
    model = engine.model
    assert model.draft_runner is mtp.draft and model.num_mtp
    reduced = model.draft_head
    assert (reduced is None) == (head == "whole")
    if reduced is not None:
        assert (reduced.coarse() is not None) == (head == "coarse")
    assert mtp.plan(model, 0, 0) is not None
    cache = engine.caches.modules[0][0]
    assert isinstance(cache, KVCache)
    gen = torch.Generator().manual_seed(2)
    hidden, vocab = model.cfg.hidden_size, model.cfg.vocab_size
    for slots, starts in [([0], [5]), ([0, 1], [9, 3]), ([1], [6])]:
        bsz = len(slots)
        pos = torch.tensor(starts)[:, None]
        out = (torch.randn(bsz, 1, hidden, generator=gen) * 2).bfloat16()
        prev = torch.randint(0, vocab, (bsz,), generator=gen)
        span = (slots[0], slots[-1] + 1)
        for prob in (True, False):
            ours, theirs = _copy(cache), _copy(cache)
            with torch.inference_mode():
                first = mtp.draft(model, 0, out, prob=prob)
                got = mtp.draft(model, 0, out, prob=prob, m_in=0, prev=prev,
                                rope=engine.caches.rope(pos), slots=torch.tensor(slots),
                                pos=pos, kv_len=cache.k.shape[2], span=span, caches=[ours])
                model.block_runner = block_py.run_block
                new = model.mtp_forward(0, model.chain_hidden(0, out), prev[:, None],
                                        engine.caches.rope(pos),
                                        CacheBatch(torch.tensor(slots), pos, cache.k.shape[2],
                                                   span), [theirs])
                want, want_first = model.mtp_greedy(0, new, prob), model.mtp_greedy(0, out, prob)
                model.block_runner = layer.run_block
            assert first is not None and got is not None and want is not None \
                and want_first is not None
            assert first[0] is out and torch.equal(first[1], want_first[0])
            assert torch.equal(got[0], new) and torch.equal(got[1], want[0])
            for made, expected in ((first[2], want_first[1]), (got[2], want[1])):
                assert (made is None) == (not prob) == (expected is None)
                assert made is None or torch.equal(made, expected)
            assert torch.equal(ours.k, theirs.k) and torch.equal(ours.v, theirs.v)
            assert not torch.equal(ours.k, cache.k)  # (the module's keys written)
            if reduced is not None:
                assert set(got[1].flatten().tolist()) <= set(reduced.ids.tolist())


@pytest.mark.parametrize("head", ["whole", "coarse"])
def test_generation_drafts_the_same_tokens_through_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, head: str) -> None:
    """The same drafts, so the same acceptance step by step, at fixed and adaptive K; output
    plain decoding's. (The steps' measured seconds left out of the K policy's costs: the
    two paths take different times, and adaptive K would choose by them.)"""
    write_checkpoint(tmp_path, "tiny-qwen3", seed=5, train_steps=40)
    engine = _load(tmp_path, "int4", head, slots=1)
    model = engine.model
    for costs in (engine.policy.costs, engine.policy.verify):
        monkeypatch.setattr(costs, "observe", lambda *args: None)
    prompt = engine.tokenizer.encode("def add(a, b):\n    return")
    plain = engine.generate(prompt, GenParams(24, speculative=False, stop_loops=False)).tokens
    runs = {}
    for runner in (mtp.draft, None):
        model.draft_runner = runner
        for k in (3, None):
            engine.clear_cache()
            with engine.policy.aside():
                out = engine.generate(prompt, GenParams(24, k=k, stop_loops=False,
                                                        drafts="mtp"))
            assert out.tokens == plain
            runs[runner is None, k] = (out.stats.steps, out.stats.accepted,
                                       sorted(out.stats.k_hist.items()))
    assert runs[True, 3] == runs[False, 3] and runs[True, None] == runs[False, None], runs
    assert runs[False, 3][1] > 0  # (drafts accepted: the trained toy drafts)


def test_calls_it_does_not_take_run_the_python_path(tmp_path: Path) -> None:
    """A draft token outside the vocabulary, slots that are not consecutive, weights not in
    our layouts: None, and the Python path runs (and says what is wrong)."""
    write_checkpoint(tmp_path, "tiny-qwen2", seed=2)
    engine = _load(tmp_path, "int8", "whole")
    model, cache = engine.model, engine.caches.modules[0][0]
    assert isinstance(cache, KVCache)
    out = torch.randn(1, 1, model.cfg.hidden_size).bfloat16()
    pos = torch.tensor([[4]])
    kw = {"m_in": 0, "rope": engine.caches.rope(pos), "slots": torch.tensor([0]), "pos": pos,
          "kv_len": cache.k.shape[2], "caches": [_copy(cache)]}
    with torch.inference_mode():
        assert mtp.draft(model, 0, out, prob=True, prev=torch.tensor([3]), span=(0, 1),
                         **kw) is not None
        bad = torch.tensor([model.cfg.vocab_size])
        assert mtp.draft(model, 0, out, prob=True, prev=bad, span=(0, 1), **kw) is None
        with pytest.raises(IndexError):
            model.mtp_forward(0, out, bad[:, None], kw["rope"],
                              CacheBatch(kw["slots"], pos, cache.k.shape[2], (0, 1)), [cache])
        assert mtp.draft(model, 0, out, prob=True, prev=torch.tensor([3]), span=None,
                         **kw) is None
    unquantized = _load(tmp_path, "none", "whole")
    assert unquantized.model.draft_runner is mtp.draft
    assert mtp.plan(unquantized.model, 0, 0) is None


def test_a_changed_draft_head_makes_a_new_plan(tmp_path: Path) -> None:
    """The reduced head's candidates changed (a coarse pass that no longer pays): the next
    draft reads the new head, with the Python path's bits."""
    write_checkpoint(tmp_path, "tiny-qwen3", seed=7)
    engine = _load(tmp_path, "int4", "coarse")
    model, head = engine.model, engine.model.draft_head
    assert head is not None
    before = mtp.plan(model, 0, 0)
    assert before is not None and before.c.coarse is not None
    head.candidates = 4
    after = mtp.plan(model, 0, 0)
    assert after is not None and after is not before and not after.c.coarse
    assert mtp.plan(model, 0, 0) is after
    out = torch.randn(2, 1, model.cfg.hidden_size).bfloat16()
    with torch.inference_mode():
        got, want = mtp.draft(model, 0, out, prob=True), model.mtp_greedy(0, out, True)
    assert got is not None and want is not None and want[1] is not None
    assert torch.equal(got[1], want[0]) and got[2] is not None and torch.equal(got[2], want[1])


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-qwen2"])  # two modules; one
@pytest.mark.parametrize("confident", [True, False])
def test_the_chain_rule_in_one_call_is_the_python_paths(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, confident: bool, preset: str) -> None:
    """A chain of up to three drafts for two slots, its rule's tables and each row's limit,
    floor and whether it adapts set to make rows stop at different drafts: the drafts, their
    probabilities and the drafts each row keeps are the Python path's, early exit
    included; and so are the drafts the last module chains on itself in one call
    (`mtp.chain`)."""
    from engine.decode.draft import draft_chain
    from engine.decode.policy.calibration import CONFIDENCE_BINS
    from engine.decode.sampling import RowSampling

    write_checkpoint(tmp_path, preset, seed=8)
    engine = _load(tmp_path, "int4", "coarse")
    model, state = engine.model, engine.state
    with torch.no_grad():  # logits 25x as far apart: drafts' probabilities in every bin
        model.mtp[0].norm.weight.mul_(25)
    gen = torch.Generator().manual_seed(3)
    slots = torch.tensor([0, 1])
    base = torch.tensor([7, 12])
    sampling = RowSampling(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long),
                           sampled=False, nucleus=False)
    # each row's (limit, floor, whether it adapts)
    cases = [([3, 3], [1, 1], [1, 1]), ([3, 2], [2, 1], [1, 0]), ([1, 3], [1, 3], [0, 1]),
             ([3, 3], [1, 1], [1, 1]), ([2, 3], [1, 1], [1, 1])]
    chained, kept_drafts = [], set()
    c_draft = mtp._draft

    def counted(*args: object) -> int:
        chained.append(args[-1] is not None)  # the chain's rule given to mtp.c
        return c_draft(*args)

    monkeypatch.setattr(mtp, "_draft", counted)
    c_chain, chains = mtp._chain, []

    def counted_chain(*args: object) -> int:
        chains.append(args[4:6])  # the drafts it makes
        return c_chain(*args)

    monkeypatch.setattr(mtp, "_chain", counted_chain)
    ended = []

    def chain_runner(*args: object, **kw: object) -> object:  # how each chain ended
        got = mtp.chain(*args, **kw)  # type: ignore[arg-type]
        ended.append(None if got is None else got[:2])
        return got
    for limit in (0.0, 0.2, 0.4, 0.6, 2.0):  # every row goes on ... each stops at its floor
        for plan in cases:
            accept = torch.rand(state.chain_accept.shape, generator=gen)
            out = (torch.randn(2, 1, model.cfg.hidden_size, generator=gen) * 2).bfloat16()
            results = []
            for runner, chainer in ((mtp.draft, chain_runner), (mtp.draft, None),
                                    (None, None)):
                model.draft_runner, model.chain_runner = runner, chainer
                state.plan[:2] = torch.tensor(plan).t()
                state.chain_accept.copy_(accept)
                state.chain_limit.fill_(limit)
                state.tokens.zero_()
                state.confidence.zero_()
                state.num_drafts.zero_()
                caches = [_copy(c) for c in engine.caches.modules[0]]
                kept = engine.caches.modules[0]
                engine.caches.modules[0] = caches
                with torch.inference_mode():
                    draft_chain(model, engine.caches, state, slots, out, base, 3, 32,
                                sampling, confident=confident, early_exit=True, span=(0, 2))
                engine.caches.modules[0] = kept
                results.append((state.tokens[:2].clone(), state.confidence[:2].clone(),
                                state.num_drafts[:2].clone(), caches[0].k.clone()))
            for got in results[:2]:
                for ours, theirs in zip(got, results[2], strict=True):
                    assert torch.equal(ours, theirs), (limit, plan)
            kept_drafts.add(tuple(results[0][2].tolist()))
    assert state.chain_accept.shape[1] == CONFIDENCE_BINS
    assert chained and all(chained)
    # the drafts after the last module's first in one call: 3 (two modules), 2 and 3 (one)
    assert chains and all(made == (model.num_mtp + 1, 3) for made in chains)
    # each made its drafts to the last, or until no row went on
    assert ended and all(e is not None and (e[0] == 3 or e[1] == 0) for e in ended), ended
    # rows kept different numbers of drafts: the rule (or, without probabilities, the limits)
    assert len(kept_drafts) > (2 if confident else 1), kept_drafts
    model.draft_runner, model.chain_runner = mtp.draft, mtp.chain
