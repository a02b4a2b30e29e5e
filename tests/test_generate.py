"""The generation loop: cancellation between steps, streaming, limits and bad input."""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import ContextOverflow, Engine
from engine import GenParams as Params
from engine.decode.policy import monotone
from tests.conftest import CHAIN_VOCAB
from training.synthetic import write_checkpoint

# The generation loop, not what is worth showing: the synthetic chain goes round in loops by
# construction, so the loop rule (quality.py, tested in test_quality.py) is off here.
GenParams = functools.partial(Params, stop_loops=False)

PROMPT = list(CHAIN_VOCAB[:12])


def test_cancel_stops_within_one_step_and_leaves_the_cache_consistent(
        trained_engine: Engine) -> None:
    steps = []
    gen = trained_engine.generate(PROMPT, GenParams(max_new_tokens=200, k=2),
                                  on_step=steps.append, cancelled=lambda: len(steps) >= 3)
    assert gen.finish_reason == "cancelled" and len(steps) == 3
    # What comes next is what a fresh engine state would give.
    after = trained_engine.generate(PROMPT[:7], GenParams(max_new_tokens=30))
    assert after.stats.reused_tokens == 6
    trained_engine.clear_cache()
    assert trained_engine.generate(PROMPT[:7], GenParams(max_new_tokens=30)).tokens == after.tokens


def test_streamed_text_adds_up_to_the_whole(trained_engine: Engine) -> None:
    pieces: list[str] = []
    prompt = trained_engine.tokenizer.encode("x = 'é 中文 🎉")
    gen = trained_engine.generate(prompt, GenParams(max_new_tokens=40),
                                  on_step=lambda s: pieces.append(s.text))
    assert "".join(pieces) == gen.text
    assert gen.text == trained_engine.tokenizer.decode(gen.tokens, skip_special=True)


def test_context_overflow_is_a_clear_error(trained_engine: Engine) -> None:
    too_long = PROMPT * 100
    with pytest.raises(ContextOverflow, match="does not fit"):
        trained_engine.generate(too_long)


def test_generation_ends_when_the_context_is_full(trained_engine: Engine) -> None:
    room = trained_engine.max_seq_len
    prompt = (PROMPT * 100)[: room - trained_engine.k_max - 2]
    gen = trained_engine.generate(prompt, GenParams(max_new_tokens=500))
    assert gen.finish_reason == "length"
    assert len(prompt) + len(gen.tokens) <= room + 1


@pytest.mark.parametrize("bad", [{"max_new_tokens": 0}, {"k": -1}])
def test_bad_parameters_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        GenParams(**bad)


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}])
def test_bad_sampling_parameters_are_refused(trained_engine: Engine, bad: dict) -> None:
    with pytest.raises(ValueError, match="temperature"):
        trained_engine.generate(PROMPT, GenParams(**bad))


def test_empty_prompt_is_refused(trained_engine: Engine) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        trained_engine.generate([])


def test_a_model_without_mtp_modules_drafts_from_the_context_alone(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "tiny-llama", num_mtp_modules=0)
    engine = Engine.load(tmp_path, max_seq_len=256)
    assert not engine.mtp and engine.k_max == 8
    gen = engine.generate(PROMPT, GenParams(max_new_tokens=10, k=4, drafts="mtp"))
    assert len(gen.tokens) == 10 and set(gen.stats.k_hist) == {0}
    gen = engine.generate(PROMPT, GenParams(max_new_tokens=10, k=4))
    assert len(gen.tokens) == 10 and set(gen.stats.by_source) <= {"context"}


def test_interleaved_generations_equal_solo_ones(trained_engine: Engine) -> None:
    """Steps of several generations can alternate: each takes the cache back (reusing the
    common prefix) and its output is unchanged. This is what lets the daemon switch work."""
    prompts = [PROMPT, [*PROMPT[:5], CHAIN_VOCAB[40]], [CHAIN_VOCAB[7]] * 9]
    solo = [trained_engine.generate(p, GenParams(max_new_tokens=30, k=3)).tokens for p in prompts]
    gens = [trained_engine.start(p, GenParams(max_new_tokens=30, k=3)) for p in prompts]
    live = list(gens)
    while live:
        for g in list(live):
            if next(g, None) is None:
                live.remove(g)
    assert [g.tokens for g in gens] == solo
    assert all(g.stats.resumed > 0 for g in gens)


def _run_batched(engine: Engine, gens: list) -> None:
    live = list(gens)
    while live:
        for g, step in zip(list(live), engine.step(live), strict=True):
            if step is None or g.finish_reason is not None:
                live.remove(g)


def test_batched_generations_equal_solo_ones(model_dir: Path) -> None:
    """Stepping several generations as one batch (rows of different lengths, drafting
    different K, joining late and ending early) gives each the output it has alone. The
    bundled model, on real code: its output depends on every row's own context."""
    engine = Engine.load(model_dir, max_seq_len=1024, slots=5)
    fixtures = Path(__file__).parent / "fixtures" / "prompts"  # real code: the engine's own
    sources = [(fixtures / name).read_text(encoding="utf-8")
               for name in ("runner.py.txt", "generate.py.txt")]
    cases = [("def fib(n):\n    ", GenParams(max_new_tokens=30)),
             (sources[0], GenParams(max_new_tokens=40, k=4)),
             (sources[1], GenParams(max_new_tokens=25, k=2)),
             (sources[0][:900], GenParams(max_new_tokens=7, k=8)),
             ("import os\n", GenParams(max_new_tokens=40, k=0))]
    prompts = [engine.tokenizer.encode(text) for text, _ in cases]
    alone = [engine.generate(p, params, slot="solo")
             for p, (_, params) in zip(prompts, cases, strict=True)]
    solo = [g.tokens for g in alone]
    gens = [engine.start(p, params, slot=f"row{i}")
            for i, (p, (_, params)) in enumerate(zip(prompts, cases, strict=True))]
    next(gens[-1])  # one row is already decoding when the others join
    _run_batched(engine, gens)
    assert [g.tokens for g in gens] == solo
    assert len({tuple(t) for t in solo}) == len(solo)  # the rows really differ
    fixed = [i for i, (_, params) in enumerate(cases) if params.k]
    # Lossless either way; the same drafts show as the same acceptance at a fixed K.
    assert [gens[i].stats.accepted_by_pos for i in fixed] == \
        [alone[i].stats.accepted_by_pos for i in fixed]


def test_batched_sampling_equals_solo_sampling(trained_engine: Engine) -> None:
    """Each row samples with its own generator: a seeded row's output does not depend on
    the rows beside it."""
    cases = [(PROMPT, 1), ([CHAIN_VOCAB[9]] * 5, 2), (PROMPT[:3], 3)]

    def params(seed: int) -> GenParams:
        return GenParams(max_new_tokens=30, temperature=0.8, top_p=0.95, seed=seed, k=3)

    solo = [trained_engine.generate(p, params(seed), slot="solo").tokens for p, seed in cases]
    gens = [trained_engine.start(p, params(seed), slot=f"s{seed}") for p, seed in cases]
    _run_batched(trained_engine, gens)
    assert [g.tokens for g in gens] == solo


def test_a_batch_needs_distinct_slots(trained_engine: Engine) -> None:
    gens = [trained_engine.start(PROMPT, slot="same") for _ in range(2)]
    with pytest.raises(ValueError, match="distinct slots"):
        trained_engine.step(gens)


def test_each_slot_keeps_its_own_prefix(trained_dir: Path) -> None:
    engine = Engine.load(trained_dir, max_seq_len=256, slots=2)
    a, b, c = PROMPT, [CHAIN_VOCAB[50]] * 12, [CHAIN_VOCAB[60]] * 12
    first_a = engine.generate(a, GenParams(max_new_tokens=8), slot="a")
    engine.generate(b, GenParams(max_new_tokens=8), slot="b")
    again = engine.start(a + first_a.tokens[:4], GenParams(max_new_tokens=8), slot="a")
    next(again)
    assert again.stats.reused_tokens == len(a) + 3  # slot a kept its cache while b ran
    engine.generate(c, GenParams(max_new_tokens=8), slot="c")  # recycles b's, the oldest
    engine.generate(a, GenParams(max_new_tokens=8), slot="a")
    back = engine.start(b, GenParams(max_new_tokens=8), slot="b")
    next(back)
    assert back.stats.reused_tokens == 0  # b's slot had been recycled
    with pytest.raises(ValueError, match="slot"):
        Engine.load(trained_dir, slots=0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.001, 100.0), min_size=1, max_size=12))
def test_step_costs_are_made_monotone_by_least_squares(costs: list[float]) -> None:
    fitted = monotone(costs)
    assert len(fitted) == len(costs)
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(fitted))
    assert sum(fitted) == pytest.approx(sum(costs))  # pooling keeps each block's mean
    if all(a <= b for a, b in itertools.pairwise(costs)):
        assert fitted == pytest.approx(costs)


def test_one_disturbed_measurement_bends_the_cost_curve_locally() -> None:
    assert monotone([4.4, 5.9, 7.9, 7.7, 7.7, 7.8, 8.7, 11.5, 9.6]) == pytest.approx(
        [4.4, 5.9, 7.7667, 7.7667, 7.7667, 7.8, 8.7, 10.55, 10.55], abs=1e-3)
