"""The engine on a hybrid Qwen3.5-shaped model (Gated DeltaNet layers, one MTP module): its
speculative output is its plain decoding, for every K, alone and with three slots sharing
steps, in fp32 and bf16; rejected drafts leave no trace in the recurrent state (the step
commits the state of the accepted position by a pick)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
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
    engine = Engine.load(hybrid_dir, dtype=request.param, max_seq_len=256, k_max=K_MAX,
                         slots=3, exact=True)
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
    assert caches.ring == K_MAX + 2 and caches.checkpoints == 4
    assert caches.state_nbytes() == (caches.num_slots * (caches.ring + caches.checkpoints)
                                     * linear * per_state)
    assert caches.nbytes() > caches.state_nbytes()
