"""Gemma 4's dense text model against transformers' `gemma4` classes in fp32: prefill logits
and cached decoding over mixes of sliding and full layers (KV sharing, per-layer inputs,
keys as values, soft-capped logits), prompts past the sliding window; the multimodal
wrapper's naming; the config's forms and its refusal of the MoE variant. Then the engine on
a Gemma 4 checkpoint with a Gemma-style tokenizer (no FIM tokens, no MTP modules): greedy
output equals transformers', speculative output (context drafts) equals plain decoding for
every K, alone and with three slots, in fp32 and bf16, and a prompt sharing a prefix longer
than the window with what its slot holds gives what an empty slot gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import Engine, GenParams
from engine.cache.kv import CacheBatch
from engine.cache.slots import Caches
from engine.model.codes import QuantLinear, decode, encode
from engine.model.config import ConfigError, ModelConfig
from engine.model.quant import quantize_model, targets
from engine.model.weights import CheckpointError, load_model
from tests.conftest import load_exact
from tests.gemma4 import WINDOW, F, S, text_config, write, write_tokenizer
from tests.test_identity import run_batched

VARIANTS: dict[str, dict] = {
    "plain": {},
    "kv shared": {"num_kv_shared_layers": 2},
    "per-layer inputs": {"hidden_size_per_layer_input": 8},
    "k as v": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "capped, wide": {"final_logit_softcapping": 5.0, "use_double_wide_mlp": True,
                     "num_kv_shared_layers": 2},
    "all": {"num_kv_shared_layers": 3, "hidden_size_per_layer_input": 8,
            "attention_k_eq_v": True, "num_global_key_value_heads": 1,
            "final_logit_softcapping": 10.0, "use_double_wide_mlp": True},
}
LAYERS = {"2:1": [S, S, F, S, S, F], "mixed": [S, F, S, S, F], "full only": [F, F, F]}
TOL = 2e-5


def ids(n: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(seed))


def reference_logits(ref: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # output_hidden_states: transformers' slicing before KV-shared layers (an optimisation
    # that fails without per-layer inputs) stays off.
    with torch.no_grad():
        return ref(input_ids=tokens, use_cache=False, output_hidden_states=True).logits


# Every variant on every layer mix, but sharing more caches than three full layers have.
PREFILL_CASES = [(variant, layers) for layers in LAYERS for variant in VARIANTS
                 if layers != "full only" or VARIANTS[variant].get("num_kv_shared_layers", 0) <= 2]


@pytest.mark.parametrize(("variant", "layers"), PREFILL_CASES)
def test_prefill_logits_match_transformers(tmp_path: Path, variant: str, layers: str) -> None:
    ref = write(tmp_path, LAYERS[layers], **VARIANTS[variant])
    ours = load_model(tmp_path)
    assert ours.cfg.family == "gemma4" and ours.num_mtp == 0
    tokens = ids(3 * WINDOW + 5)
    with torch.no_grad():
        got, _ = ours(tokens)
    torch.testing.assert_close(got, reference_logits(ref, tokens), rtol=0, atol=TOL)


def cached_logits(ours: torch.nn.Module, tokens: torch.Tensor, prompt: int,
                  window: int) -> torch.Tensor:
    """A prefill of `prompt` tokens into slot 1, then `window` tokens a pass (the verify's
    shape), through the slots' caches: every position's logits."""
    caches = Caches(ours, 2, 256, 8, widest=4)
    slots, n = torch.tensor([1]), tokens.shape[1]
    out = []
    with torch.no_grad():
        for start in [0, *range(prompt, n, window)]:
            end = prompt if start == 0 else min(start + window, n)
            pos = torch.arange(start, end)[None]
            h = ours.trunk(tokens[:, start:end], caches.rope(pos),
                           CacheBatch(slots, pos, caches.length), caches.trunk)
            out.append(ours.head(h))
    return torch.cat(out, 1)


@pytest.mark.parametrize("window", [1, 3])
@pytest.mark.parametrize("variant", ["plain", "kv shared", "all"])
def test_cached_decoding_matches_transformers(tmp_path: Path, variant: str,
                                              window: int) -> None:
    """A prefill past the window's edge, then decoding across it again."""
    ref = write(tmp_path, LAYERS["mixed"], **VARIANTS[variant])
    ours = load_model(tmp_path)
    ours.fuse()
    tokens = ids(2 * WINDOW + 20, 1)
    got = cached_logits(ours, tokens, WINDOW + 5, window)
    torch.testing.assert_close(got, reference_logits(ref, tokens), rtol=0, atol=TOL)


def test_quantized_layers_include_gemmas_own(tmp_path: Path) -> None:
    """int8 reaches the per-layer inputs' and the shared layers' projections too, and the
    logits stay near those of the model with each weight rounded as int8 rounds it (the
    tiny random model's own spread: about 4%, from the activations in 8 bits)."""
    # Per-layer inputs 32 wide: torch's int8 kernel (where ours do not run) crashes on
    # 8 inputs.
    write(tmp_path, LAYERS["mixed"], **{**VARIANTS["all"], "hidden_size_per_layer_input": 32})
    ours, rounded = load_model(tmp_path), load_model(tmp_path)
    ours.fuse()
    rounded.fuse()
    with torch.no_grad():
        for name, (owner, attr) in targets(rounded).items():
            if name != "head":
                weight = getattr(owner, attr).weight
                weight.copy_(decode(*encode(weight, "int8")[:2], "int8", 0))
    quantize_model(ours, "int8")
    shared = ours.model.layers[4].self_attn
    assert shared.fused is None and isinstance(shared.q_proj, QuantLinear)
    assert isinstance(ours.model.layers[0].per_layer_input_gate, QuantLinear)
    tokens = ids(2 * WINDOW, 2)
    with torch.no_grad():
        got, want = ours(tokens)[0], rounded(tokens)[0]
    assert (got - want).norm() < 0.1 * want.norm()


def test_the_multimodal_wrappers_text_model_loads(tmp_path: Path) -> None:
    """Weights under model.language_model., the vision tower's present and skipped."""
    ref = write(tmp_path, LAYERS["mixed"], wrapper=True, **VARIANTS["per-layer inputs"])
    names = load_file(str(tmp_path / "model.safetensors"))
    assert any(n.startswith("model.vision_tower.") for n in names)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma4"
    ours = load_model(tmp_path)
    assert ours.cfg.hidden_size_per_layer_input == 8
    tokens = ids(2 * WINDOW, 3)
    with torch.no_grad():
        want = ref(input_ids=tokens).logits
        got, _ = ours(tokens)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_shared_layers_own_kv_weights_are_skipped_and_unknown_ones_named(
        tmp_path: Path) -> None:
    write(tmp_path, LAYERS["mixed"], **VARIANTS["kv shared"])
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.layers.4.self_attn.k_proj.weight"] = torch.zeros(64, 48)  # transformers
    save_file(tensors, str(path))  # ignores these too
    load_model(tmp_path)
    tensors["model.layers.1.self_attn.gate.weight"] = torch.zeros(4)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.gate\.weight'"):
        load_model(tmp_path)
    del tensors["model.layers.1.self_attn.gate.weight"]
    tensors["model.layers.0.layer_scalar"] = torch.ones(2)
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.layer_scalar' has shape"):
        load_model(tmp_path)


def test_config_reads_both_forms_of_the_full_layers_settings() -> None:
    """Release configs name global_head_dim and num_global_key_value_heads; newer
    transformers write per_layer_config; both read the same, and ours round-trips."""
    hf = text_config([S, F, S, F], attention_k_eq_v=True, num_global_key_value_heads=1,
                     num_kv_shared_layers=2).to_dict()
    assert "per_layer_config" in hf and "global_head_dim" not in hf
    cfg = ModelConfig.from_hf(hf)
    release = {k: v for k, v in hf.items() if k != "per_layer_config"}
    assert ModelConfig.from_hf({**release, "global_head_dim": 32,
                                "num_global_key_value_heads": 1}) == cfg
    full = cfg.for_kind(F)
    assert (full.head_dim, full.num_kv_heads, full.rotary_dim) == (32, 1, 32)
    assert cfg.for_kind(S).head_dim == 16 and cfg.kv_sources == (0, 1, 0, 1)
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    wrapped = ModelConfig.from_hf({"model_type": "gemma4", "text_config": hf,
                                   "tie_word_embeddings": True})
    assert wrapped == cfg


def test_the_moe_variant_is_refused_by_name() -> None:
    hf = text_config([S, F]).to_dict()
    with pytest.raises(ConfigError, match=r"mixture-of-experts.*enable_moe_block.*num_experts"):
        ModelConfig.from_hf({**hf, "enable_moe_block": True, "num_experts": 4,
                             "top_k_experts": 2, "moe_intermediate_size": 16})


# The engine

K_MAX = 4


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma4")
    write(path, [S, S, F, S, F], seed=3, vocab=384, eos_token_id=1,
          **{**VARIANTS["all"], "num_kv_shared_layers": 2})
    write_tokenizer(path)
    return path


def prompts(count: int) -> list[list[int]]:
    """Token lists of a small alphabet (repeats give context drafts to make), past the
    window's edge."""
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(270, 300, (n,), generator=gen).tolist() for n in (40, 9, 23)][:count]


def test_greedy_output_equals_transformers_greedy(gemma_dir: Path) -> None:
    from transformers import Gemma4ForCausalLM

    ref = Gemma4ForCausalLM.from_pretrained(gemma_dir).eval()
    engine = Engine.load(gemma_dir, max_seq_len=256, k_max=K_MAX, slots=2)
    assert engine.tokenizer.fim is None and engine.model.num_mtp == 0
    for prompt in prompts(2):
        with torch.no_grad():
            want = ref.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                                min_new_tokens=30, eos_token_id=None,
                                pad_token_id=0)[0, len(prompt):].tolist()
        params = GenParams(30, speculative=False, ignore_eos=True, stop_loops=False)
        assert engine.generate(prompt, params).tokens == want


def test_a_text_prompt_without_fim_tokens_generates(gemma_dir: Path) -> None:
    engine = Engine.load(gemma_dir, max_seq_len=256, k_max=K_MAX, slots=1)
    prompt = engine.fill_in_prompt("def f(x):\n    return ", "\n", max_new_tokens=8)
    assert prompt.ids[0] == 2  # <bos>
    gen = engine.generate(prompt.ids, GenParams(8, ignore_eos=True, stop_loops=False))
    assert len(gen.tokens) == 8


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def engine(request: pytest.FixtureRequest, gemma_dir: Path) -> Engine:
    return load_exact(gemma_dir, dtype=request.param, max_seq_len=256, k_max=K_MAX, slots=3)


def plain(engine: Engine, prompt: list[int], n: int, slot: object = None) -> list[int]:
    return engine.generate(prompt, GenParams(n, speculative=False, ignore_eos=True,
                                             stop_loops=False), slot=slot).tokens


def test_speculative_equals_plain_decoding_for_every_k(engine: Engine) -> None:
    assert engine.model.num_mtp == 0
    kept = rejected = 0
    for prompt in prompts(2):
        want = plain(engine, prompt, 40)
        for k in [*range(1, K_MAX + 1), None]:
            gen = engine.generate(prompt, GenParams(40, k=k, ignore_eos=True,
                                                    stop_loops=False))
            assert gen.tokens == want, f"k={k}"
            kept += gen.stats.accepted
            rejected += gen.stats.drafted - gen.stats.accepted
    assert kept > 0 and rejected > 0  # drafts were made, some kept and some not


def test_three_slots_equal_each_ones_plain_decoding(engine: Engine) -> None:
    ps, lengths = prompts(3), (30, 18, 25)
    alone = [plain(engine, p, n, "alone") for p, n in zip(ps, lengths, strict=True)]
    for ks in ((1, K_MAX, None), (None, 3, 2)):
        params = [GenParams(n, k=k, speculative=k != 2, ignore_eos=True, stop_loops=False)
                  for n, k in zip(lengths, ks, strict=True)]
        assert run_batched(engine, ps, params) == alone, ks


@pytest.fixture(scope="module")
def full_length(engine: Engine, gemma_dir: Path) -> Engine:
    """The engine's twin whose sliding-window layers keep caches as long as the context."""
    return load_exact(gemma_dir, dtype=engine.dtype, max_seq_len=256, k_max=K_MAX, slots=3,
                      rings=False)


def test_sliding_layers_keep_rings_of_their_window_and_a_prefill_pass(
        engine: Engine, full_length: Engine) -> None:
    ring = engine.caches.ring
    assert ring is not None and full_length.caches.ring is None
    assert (ring.need, ring.size, engine.caches.chunk) == (WINDOW + 1, WINDOW + 1 + 64, 64)
    rings = engine.caches.rings()
    assert len(rings) == 2  # the unshared sliding layers'; the shared one reads the last
    assert all(c.k.shape[2] == ring.size + 1 for c in rings)
    full = full_length.caches
    saved = sum(c.k.nbytes + c.v.nbytes for c in full.kv_caches()) - \
        sum(c.k.nbytes + c.v.nbytes for c in engine.caches.kv_caches())
    assert saved > 0 and engine.caches.nbytes() == full.nbytes() - saved + \
        sum(c.saved_k.nbytes + c.saved_v.nbytes for c in rings)


@pytest.mark.parametrize("k", [None, K_MAX])
def test_a_shared_prefix_past_the_window_gives_what_full_length_caches_give(
        engine: Engine, full_length: Engine, k: int | None) -> None:
    """Rolling a slot back within its rings: the bits of caches as long as the context (the
    first prompt and its answer run past the ring's length, so it has wrapped)."""
    gen = torch.Generator().manual_seed(11)
    old = torch.randint(270, 300, (90,), generator=gen).tolist()
    new = old[:60] + torch.randint(300, 330, (15,), generator=gen).tolist()
    params = GenParams(24, k=k, ignore_eos=True, stop_loops=False)
    outputs = []
    for e in (engine, full_length):
        e.clear_cache("typing")
        first = e.generate(old, params, slot="typing")
        # stable=60: no checkpoint to save past the cut, so both run the same passes
        got = e.generate(new, params, slot="typing", stable=60)
        assert got.stats.reused_tokens == 59 > 4 * WINDOW
        outputs.append((first.tokens, first.logprobs, got.tokens, got.logprobs))
    assert len(old) + 24 > engine.caches.ring.size  # type: ignore[union-attr]
    assert outputs[0] == outputs[1]


def test_a_cut_further_back_than_the_rings_hold_resumes_from_a_checkpoint(
        engine: Engine, full_length: Engine) -> None:
    """The keys before 149 are gone from the rings: the slot resumes from the window saved
    after 128 (the passes a fresh prefill runs from there on, so the same bits); caches as
    long as the context roll back to 149."""
    gen = torch.Generator().manual_seed(12)
    old = torch.randint(270, 300, (200,), generator=gen).tolist()
    new = old[:150] + torch.randint(300, 330, (20,), generator=gen).tolist()
    params = GenParams(16, k=K_MAX, ignore_eos=True, stop_loops=False)
    engine.clear_cache("typing")
    engine.generate(old, params, slot="typing")
    assert sorted(engine.slots.get("typing").saved) == [0, 64, 128, 192]
    got = engine.generate(new, params, slot="typing")
    assert got.stats.reused_tokens == 128
    engine.clear_cache("fresh")
    want = engine.generate(new, params, slot="fresh")
    assert (got.tokens, got.logprobs) == (want.tokens, want.logprobs)
    full_length.clear_cache("typing")
    full_length.generate(old, params, slot="typing")
    assert full_length.generate(new, params, slot="typing").stats.reused_tokens == 149
