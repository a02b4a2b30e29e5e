"""Speculative decoding is lossless, and the drafts are the ones a fresh forward would make."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from engine import Engine
from engine import GenParams as Params
from engine.decode.draft import catch_up, draft_chain
from engine.decode.sampling import RowSampling
from engine.model.layers import rope_tables
from engine.model.transformer import Transformer
from tests.conftest import CHAIN_VOCAB

# These tests are about decoding, not about what is worth showing: the synthetic chain and the
# random model go round in loops by construction, so the loop rule (quality.py) is off here.
GenParams = functools.partial(Params, stop_loops=False)


def chain_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(CHAIN_VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def text_prompts(engine: Engine) -> list[list[int]]:
    texts = ["def fib(n):\n    ", "import os\n\nclass Path:\n", "# comment é 中文 🎉\nx = '", "\n"]
    return [engine.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize("which", ["trained", "random"])
def test_greedy_speculative_equals_autoregressive_for_every_k(which: str, request) -> None:
    engine: Engine = request.getfixturevalue(f"{which}_engine")
    prompts = chain_prompts(5, seed=1) + text_prompts(engine)
    for prompt in prompts:
        ar = engine.generate(prompt, GenParams(max_new_tokens=40, speculative=False))
        assert len(ar.tokens) == 40 or ar.finish_reason == "stop"
        for k in [*range(9), None]:
            spec = engine.generate(prompt, GenParams(max_new_tokens=40, k=k))
            assert spec.tokens == ar.tokens, (prompt, k)
            assert spec.text == ar.text
            assert spec.finish_reason == ar.finish_reason


def test_trained_model_accepts_long_runs(trained_engine: Engine) -> None:
    """Guards the tests above: without accepted runs they would prove little."""
    gen = trained_engine.generate(chain_prompts(1, seed=2)[0], GenParams(max_new_tokens=64, k=8))
    assert gen.stats.accepted / gen.stats.steps > 3


def test_stops_inside_an_accepted_run(trained_engine: Engine) -> None:
    prompt = chain_prompts(1, seed=3)[0]
    ar = trained_engine.generate(prompt, GenParams(max_new_tokens=48, speculative=False))
    for j in (3, 5, 11, 17):  # positions that land inside an 8-draft run
        stop_tok = ar.tokens[j]
        first = ar.tokens.index(stop_tok)
        params = {"max_new_tokens": 48, "stop_ids": frozenset({stop_tok})}
        want = trained_engine.generate(prompt, GenParams(**params, speculative=False))
        assert want.tokens == ar.tokens[:first] and want.finish_reason == "stop"
        for k in (2, 5, 8, None):
            got = trained_engine.generate(prompt, GenParams(**params, k=k))
            assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")
    for limit in (1, 2, 7, 13):  # the token limit inside a run
        want = trained_engine.generate(prompt, GenParams(max_new_tokens=limit, speculative=False))
        got = trained_engine.generate(prompt, GenParams(max_new_tokens=limit, k=8))
        assert got.tokens == want.tokens and len(got.tokens) == limit
        assert got.finish_reason == "length"


def test_stop_strings_inside_an_accepted_run(trained_engine: Engine) -> None:
    prompt = chain_prompts(1, seed=4)[0]
    ar = trained_engine.generate(prompt, GenParams(max_new_tokens=40, speculative=False))
    for cut in (5, 20, 33):
        stop = ar.text[cut:cut + 3]
        want = ar.text[:ar.text.find(stop)]
        for k in (0, 4, 8):
            got = trained_engine.generate(prompt, GenParams(max_new_tokens=40, k=k, stop=(stop,)))
            assert got.text == want and got.finish_reason == "stop"


def reference_drafts(model: Transformer, seq: list[int], k: int) -> list[int]:
    """Greedy drafts after `seq` (whose last token is not yet in the trunk), from scratch.

    Every module runs full causal forwards over its committed entries (h_t, x_{t+1}) for
    t < N and the chained entries after them; nothing is cached.
    """
    n = len(seq) - 1
    tokens = torch.tensor([seq])
    rope = rope_tables(model.cfg, n + k + 1, tokens.device, torch.float32)
    h = model.trunk(tokens[:, :n], (rope[0][:n], rope[1][:n]))
    chains: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
    drafts: list[int] = []
    m, tok, out = 0, seq[-1], h
    for step in range(1, k + 1):
        if step > 1:
            hid = model.chain_hidden(m, out[:, -1:])
            m = min(step, model.num_mtp) - 1
        hs, ts = chains.setdefault(m, ([h], list(seq[1:n + 1])))
        if step > 1:
            hs.append(hid)
            ts.append(tok)
        full_h = torch.cat(hs, dim=1)
        length = full_h.shape[1]
        out = model.mtp_forward(m, full_h, torch.tensor([ts]), (rope[0][:length], rope[1][:length]))
        tok = int(model.mtp_logits(m, out[:, -1]).argmax(-1))
        drafts.append(tok)
    return drafts


@pytest.mark.parametrize("which", ["trained", "random"])
def test_draft_parity_with_fresh_forward(which: str, request) -> None:
    engine: Engine = request.getfixturevalue(f"{which}_engine")
    with torch.inference_mode():
        for prompt in chain_prompts(3, seed=5) + text_prompts(engine)[:2]:
            for k in (1, 3, 8):
                gen = engine.start(prompt, GenParams(max_new_tokens=30, k=k, drafts="mtp"))
                checked = 0
                for _ in gen:
                    got = engine.drafts(gen.slot)
                    if not got or gen.finish_reason is not None:
                        continue
                    assert got == reference_drafts(engine.model, gen.sequence, len(got))
                    checked += 1
                assert checked >= 2


def test_prefix_reuse_gives_the_same_output(trained_engine: Engine) -> None:
    base = chain_prompts(1, seed=6)[0] * 3
    first = trained_engine.generate(base, GenParams(max_new_tokens=20, k=4))
    # A prompt that extends what is cached: only the new tokens are prefilled.
    longer = base + first.tokens[:10] + [CHAIN_VOCAB[0]]
    again = trained_engine.generate(longer, GenParams(max_new_tokens=20, k=4))
    # The last common token is run again: its module entry depends on the token after it.
    assert again.stats.reused_tokens == len(base) + 10 - 1
    trained_engine.clear_cache()
    fresh = trained_engine.generate(longer, GenParams(max_new_tokens=20, k=4))
    assert fresh.stats.reused_tokens == 0
    assert again.tokens == fresh.tokens
    # An edit in the middle keeps only the prefix before it.
    other = CHAIN_VOCAB[1] if base[5] != CHAIN_VOCAB[1] else CHAIN_VOCAB[2]
    edited = [*base[:5], other, *base[6:]]
    third = trained_engine.generate(edited, GenParams(max_new_tokens=20, k=4))
    assert third.stats.reused_tokens == 4
    trained_engine.clear_cache()
    assert trained_engine.generate(edited, GenParams(max_new_tokens=20, k=4)).tokens == third.tokens


def test_chained_training_sees_what_decoding_sees(random_engine: Engine) -> None:
    """Depth-d logits of the chained training loss at the last row are the logits decoding
    drafts token d from, when the chain's inputs are the drafts themselves."""
    from training.chain_loss import chain_logits

    model = random_engine.model
    with torch.inference_mode():
        for prompt in chain_prompts(3, seed=8):
            seq = [*prompt, CHAIN_VOCAB[3]]
            drafts = reference_drafts(model, seq, 3)
            tokens = torch.tensor([seq + drafts[:2] + [0, 0]])  # the two pads end the rows
            students, _ = chain_logits(model, tokens, depth=3)
            row = len(seq) - 2  # depth 1 sits at position N-1
            assert [int(s[0, row].argmax()) for s in students] == drafts


def test_the_chain_rule_cuts_one_rows_drafts_and_sees_each_ones_probability(
        trained_engine: Engine) -> None:
    """The step's draft chain stops an adaptive row where the rule says (here: after two
    drafts) while a fixed-K row beside it goes on; the drafts each keeps are the ones an
    uncut chain makes, and each draft's probability is the module's softmax at it."""
    engine = trained_engine
    gens = [engine.start(prompt, GenParams(max_new_tokens=30, k=5), slot=("cut", i))
            for i, prompt in enumerate(chain_prompts(2, seed=9))]
    engine.step(gens)  # the prefills
    slots = [engine.slots.get(g.slot) for g in gens]
    state = engine.state
    state.set_rows([s.index for s in slots], plan=[[6, 1, 1], [5, 5, 0]])
    state.chain_accept.fill_(1.0)
    state.chain_limit.copy_(torch.tensor([0.0, 0.0] + [2.0] * (engine.k_max - 1)))
    with torch.inference_mode():
        outs = [catch_up(engine.model, engine.caches, s.index, g.sequence, s.length - 1,
                         s.length) for g, s in zip(gens, slots, strict=True)]
        index = torch.tensor([s.index for s in slots])
        sampling = RowSampling(state.temperature[index], state.top_p[index], state.seed[index],
                               sampled=False, nucleus=False)
        draft_chain(engine.model, engine.caches, state, index, torch.cat(outs),
                    torch.tensor([s.length for s in slots]), 6, 256, sampling, confident=True)
        counts = state.num_drafts[index].tolist()
        assert counts == [2, 5]
        for g, s, n in zip(gens, slots, counts, strict=True):
            made = state.tokens[s.index, 1:n + 1].tolist()
            assert made == reference_drafts(engine.model, g.sequence, n)
        # The probability of draft 1 is the module's softmax at the drafted token.
        top = engine.model.mtp_logits(0, outs[0])[0, -1].softmax(-1).max()
        assert float(state.confidence[slots[0].index, 0]) == pytest.approx(float(top), rel=1e-4)
    for s in slots:
        s.reset()


def test_adaptive_drafting_is_lossless_and_varies_k(trained_engine: Engine) -> None:
    engine = trained_engine
    for prompt in chain_prompts(4, seed=10) + text_prompts(engine):
        ar = engine.generate(prompt, GenParams(max_new_tokens=40, speculative=False))
        adaptive = engine.generate(prompt, GenParams(max_new_tokens=40))
        assert adaptive.tokens == ar.tokens
    assert sum(n for _, n in engine.policy.calibration.pooled) > 0  # confidences were recorded
