"""The engine on a hybrid Qwen3.5-shaped model (Gated DeltaNet layers, one MTP module): its
speculative output is its plain decoding, for every K, alone and with three slots sharing
steps, in fp32 and bf16; rejected drafts leave no trace in the recurrent state (the step
commits the state of the accepted position by a pick). A prompt that shares a prefix with
what its slot held resumes from the latest state checkpoint within it (never from one saved
past a cut), before the suffix of a PSM prompt, with the output of an empty slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, Generation, GenParams
from tests.conftest import load_exact
from tests.test_identity import run_batched
from training.synthetic import write_checkpoint

K_MAX = 4


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Briefly trained on the synthetic chain (which the trunk and the module both learn
    within a few steps: every draft is kept)."""
    path = tmp_path_factory.mktemp("qwen35")
    write_checkpoint(path, "tiny-qwen3.5", train_steps=20, seed=0, mtp_naming="mtp")
    return path


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def engine(request: pytest.FixtureRequest, hybrid_dir: Path) -> Engine:
    """With noise on the module's input projection, so that some drafts are rejected."""
    engine = load_exact(hybrid_dir, dtype=request.param, max_seq_len=256, k_max=K_MAX,
                        slots=3)
    w = engine.model.mtp[0].eh_proj.weight
    with torch.no_grad():
        noise = torch.randn(w.shape, generator=torch.Generator().manual_seed(1))
        w.add_((noise * 2.5 * w.float().std()).to(w.dtype))
    return engine


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(300, 396, (n,), generator=gen).tolist() for n in (9, 70, 23)][:count]


def test_speculative_equals_plain_decoding_for_every_k(engine: Engine) -> None:
    assert engine.model.cfg.hybrid and engine.caches.state_nbytes() > 0
    kept = rejected = 0
    for prompt in prompts(2):
        plain = engine.generate(prompt, GenParams(40, speculative=False)).tokens
        for k in [*range(1, K_MAX + 1), None]:
            gen = engine.generate(prompt, GenParams(40, k=k))
            assert gen.tokens == plain, f"k={k}"
            kept += gen.stats.accepted
            rejected += gen.stats.drafted - gen.stats.accepted
    assert kept > 0 and rejected > 0  # both paths of the commit ran


def test_three_slots_equal_each_ones_plain_decoding(engine: Engine) -> None:
    ps = prompts(3)
    alone = [engine.generate(p, GenParams(n, speculative=False), slot="alone").tokens
             for p, n in zip(ps, (30, 18, 25), strict=True)]
    for ks in ((1, K_MAX, None), (None, 3, 2)):
        params = [GenParams(n, k=k, speculative=k != 2)
                  for n, k in zip((30, 18, 25), ks, strict=True)]
        assert run_batched(engine, ps, params) == alone, ks


def test_state_memory_is_k_max_plus_two_states_and_the_checkpoints_per_slot_and_layer(
        engine: Engine) -> None:
    cfg, caches = engine.model.cfg, engine.caches
    linear = cfg.layer_types.count("linear_attention")
    conv = 2 * cfg.linear_num_k_heads * cfg.linear_k_head_dim + \
        cfg.linear_num_v_heads * cfg.linear_v_head_dim
    per_state = (conv * (cfg.linear_conv_kernel - 1) * engine.model.model.embed_tokens.weight
                 .element_size() + cfg.linear_num_v_heads * cfg.linear_k_head_dim
                 * cfg.linear_v_head_dim * 4)
    assert caches.snapshots == K_MAX + 2 and caches.checkpoints == 4
    assert caches.state_nbytes() == (caches.num_slots * (caches.snapshots + caches.checkpoints)
                                     * linear * per_state)
    assert caches.nbytes() > caches.state_nbytes()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(300, 396, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def output(gen: Generation) -> tuple[list[int], list[float]]:
    return gen.tokens, gen.logprobs


def fresh(engine: Engine, prompt: list[int], params: GenParams,
          stable: int | None = None) -> tuple[list[int], list[float]]:
    """The output from an empty slot, with its log-probabilities: a resumed prefill runs the
    passes a fresh one runs from the checkpoint on (they end at the same multiples of 64),
    so it gets the same bits; a wrong state changes them even where the tokens agree."""
    engine.clear_cache("fresh")
    return output(engine.generate(prompt, params, slot="fresh", stable=stable))


@pytest.mark.parametrize("params", [GenParams(16, speculative=False), GenParams(16, k=K_MAX),
                                    GenParams(16, k=2)], ids=["plain", f"k{K_MAX}", "k2"])
def test_a_shared_prefix_resumes_from_the_latest_checkpoint_in_it(engine: Engine,
                                                                   params: GenParams) -> None:
    old = tokens(210, 1)
    new = old[:150] + tokens(40, 2)  # typed over at 150
    assert new[150] != old[150]
    engine.clear_cache("typing")
    assert engine.generate(old, GenParams(8), slot="typing").stats.reused_tokens == 0
    assert sorted(engine.slots.get("typing").saved) == [0, 64, 128, 192]
    gen = engine.generate(new, params, slot="typing")
    assert gen.stats.reused_tokens == 128  # 192 is past the cut
    assert gen.tokens and output(gen) == fresh(engine, new, params)
    assert gen.tokens == fresh(engine, new, GenParams(16, speculative=False))[0]
    # A prompt that extends all the slot holds still reuses all of it.
    more = [*gen.sequence, *tokens(5, 3)]
    assert engine.generate(more, params, slot="typing").stats.reused_tokens == \
        len(gen.sequence) - 1


def test_checkpoints_past_a_cut_are_forgotten(engine: Engine) -> None:
    """A later prompt that shares more with the sequence that saved a checkpoint than with
    the one the slot holds does not resume from it."""
    a = tokens(200, 4)
    b = a[:100] + tokens(60, 5)  # stable 110: b saves no checkpoint of its own past 64
    c = b[:150] + tokens(20, 6)  # shares 150 tokens with b, and 100 with a
    assert b[100] != a[100] and c[150] != b[150]
    engine.clear_cache("typing")
    engine.generate(a, GenParams(4), slot="typing")  # saves 64, 128 and 192
    assert engine.generate(b, GenParams(4), slot="typing", stable=110).stats.reused_tokens == 64
    assert sorted(engine.slots.get("typing").saved) == [0, 0, 0, 64]
    params = GenParams(16, k=K_MAX)
    gen = engine.generate(c, params, slot="typing")
    assert gen.stats.reused_tokens == 64  # not a's state after 128
    assert output(gen) == fresh(engine, c, params)


PREFIX = "SCALE = 2\nOFFSET = 3\n\n" + "".join(
    f"def area_{i}(width, height):\n    return width * height + {i}\n\n" for i in range(4)
) + "def total(shapes):\n    return sum("
SUFFIX = "".join(f"\nprint(total([{i}, {i + 1}]))" for i in range(6)) + "\n"


def test_psm_prompts_keep_their_checkpoints_before_the_suffix(engine: Engine) -> None:
    fim = engine.tokenizer.fim
    assert fim is not None and engine.tokenizer.fim_order == "psm"
    params = GenParams(8, k=K_MAX, stop_loops=False)
    before = engine.fill_in_prompt(PREFIX, SUFFIX, max_new_tokens=8)
    mark = before.stable // 64 * 64
    assert before.ids[before.stable] == fim.suffix
    assert before.stable - mark > 4 and len(before.ids) >= mark + 64  # a mark in the suffix
    engine.clear_cache("typing")
    engine.generate(before.ids, params, slot="typing", stable=before.stable)
    assert max(engine.slots.get("typing").saved) == mark
    after = engine.fill_in_prompt(PREFIX + "x", SUFFIX, max_new_tokens=8)
    gen = engine.generate(after.ids, params, slot="typing", stable=after.stable)
    assert gen.stats.reused_tokens == mark
    assert output(gen) == fresh(engine, after.ids, params, after.stable)
