"""Our logits equal Hugging Face transformers' on tiny random checkpoints that transformers wrote.

Each case builds a tiny Llama / Qwen2 / Qwen3 with transformers, perturbs every parameter (so
norms are not all ones and biases not all zeros), saves it with `save_pretrained` and loads the
directory through our loader. The reference runs with eager attention: an implementation
independent of the SDPA call ours makes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from engine.model.config import ModelConfig
from engine.model.weights import load_model

VOCAB, SEQLEN, ATOL = 300, 40, 1e-4
BASE: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
}
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
            "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


def _rope(rope_type: str = "default", theta: float = 10000.0, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": theta, **params}}


LLAMA3 = _rope("llama3", 500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=16)
YARN = {"factor": 4.0, "original_max_position_embeddings": 32}
# name -> (family, config overrides); every detail that changes the maths gets a case.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {"attention_bias": False}),
    "llama-bias": ("llama", {"attention_bias": True, "num_hidden_layers": 3}),
    "llama-mlp-bias": ("llama", {"mlp_bias": True}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-linear": ("llama", _rope("linear", factor=4.0)),
    "llama-llama3": ("llama", LLAMA3),
    "qwen2": ("qwen2", _rope(theta=1000000.0)),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "qwen2-yarn": ("qwen2", _rope("yarn", **YARN)),
    "qwen2-yarn-notrunc": ("qwen2", _rope("yarn", truncate=False, beta_fast=16, beta_slow=2,
                                          **YARN)),
    "qwen2-yarn-attnfactor": ("qwen2", _rope("yarn", attention_factor=1.3, **YARN)),
    "qwen2-yarn-mscale": ("qwen2", _rope("yarn", mscale=0.9, mscale_all_dim=0.6, **YARN)),
    "qwen3": ("qwen3", {"head_dim": 32, "num_hidden_layers": 3}),
    "qwen3-tied": ("qwen3", {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen3-bias": ("qwen3", {"head_dim": 24, "attention_bias": True}),
    "qwen3-yarn": ("qwen3", {"head_dim": 32, **_rope("yarn", **YARN)}),
}


def _hf_model(family: str, seed: int = 0, **overrides: Any) -> PreTrainedModel:
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(**{**BASE, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb everything
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def _tokens(seed: int = 1, bsz: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (bsz, SEQLEN), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _reference(hf: PreTrainedModel, tokens: torch.Tensor) -> torch.Tensor:
    return hf(input_ids=tokens).logits.float()


@torch.no_grad()
def _ours(model_dir: Path, tokens: torch.Tensor,
          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    model = load_model(model_dir, dtype=dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    logits, mtp = model(tokens)
    assert mtp == []
    return logits.float()


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(case: str, tmp_path: Path) -> None:
    family, overrides = CASES[case]
    hf = _hf_model(family, **overrides)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokens = _tokens()
    ref = _reference(hf, tokens)
    assert ref.abs().max() > 1.0, "logits too small for the tolerance to mean anything"
    ours = _ours(tmp_path, tokens)
    assert ours.shape == ref.shape == (2, SEQLEN, VOCAB)
    assert (ours - ref).abs().max().item() <= ATOL


def _drop_original_len(raw: dict[str, Any]) -> None:
    del raw["rope_parameters"]["original_max_position_embeddings"]


# config.json edits after saving -> (case); transformers reloads the edited file as the reference.
EDITS = {
    "yarn-null-factor": ("qwen2-yarn", lambda raw: raw["rope_parameters"].update(factor=None)),
    "yarn-toplevel-original-len": (
        "qwen2-yarn", lambda raw: raw.update(original_max_position_embeddings=64)),
    "yarn-no-original-len": ("qwen2-yarn", _drop_original_len),
    "llama3-toplevel-original-len": (
        "llama-llama3", lambda raw: raw.update(original_max_position_embeddings=64)),
}


@pytest.mark.parametrize("edit", EDITS)
def test_hand_edited_rope_config_reads_as_transformers_reads_it(edit: str, tmp_path: Path) -> None:
    case, change = EDITS[edit]
    family, overrides = CASES[case]
    _hf_model(family, **overrides).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    change(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = FAMILIES[family][1].from_pretrained(tmp_path, attn_implementation="eager").eval()
    tokens = _tokens()
    assert (_ours(tmp_path, tokens) - _reference(hf, tokens)).abs().max().item() <= ATOL


def test_config_read_from_transformers_output(tmp_path: Path) -> None:
    """What transformers 5 writes (`rope_parameters`) reads to the config we expect."""
    _hf_model("qwen3", head_dim=32, tie_word_embeddings=True, eos_token_id=[5, 7],
              **_rope("yarn", 50000.0, **YARN)).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    assert (cfg.family, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads) == ("qwen3", 32, 4, 2)
    assert cfg.qk_norm and cfg.tie_word_embeddings and not cfg.qkv_bias
    assert cfg.rope_theta == 50000.0
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling["original_max_position_embeddings"] == 32
    assert raw["eos_token_id"] == [5, 7] and cfg.eos_token_ids == (5, 7)


@pytest.mark.parametrize("case", ["llama-llama3", "qwen2-yarn", "llama-linear", "qwen2"])
def test_legacy_rope_layout_reads_the_same(case: str, tmp_path: Path) -> None:
    """A transformers 4.x config.json (`rope_theta` + `rope_scaling` with `type`) reads the same."""
    family, overrides = CASES[case]
    _hf_model(family, **overrides).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    legacy = dict(raw)
    params = dict(legacy.pop("rope_parameters"))
    legacy["rope_theta"] = params.pop("rope_theta")
    rope_type = params.pop("rope_type")
    legacy["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, **params}
    assert ModelConfig.from_hf(legacy) == ModelConfig.from_hf(raw)


def test_bf16_load(tmp_path: Path) -> None:
    hf = _hf_model("qwen2", **_rope("yarn", **YARN))
    hf.save_pretrained(tmp_path)
    tokens = _tokens()
    ref = _reference(hf, tokens)
    ours = _ours(tmp_path, tokens, dtype=torch.bfloat16)
    assert (ours - ref).abs().max() <= 5e-2 * ref.abs().max()


def test_sharded_checkpoint_from_transformers(tmp_path: Path) -> None:
    hf = _hf_model("llama", attention_bias=True)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert not (tmp_path / "model.safetensors").exists()
    tokens = _tokens()
    assert (_ours(tmp_path, tokens) - _reference(hf, tokens)).abs().max().item() <= ATOL


def test_reference_is_sensitive(tmp_path: Path) -> None:
    """A different checkpoint gives different logits: the tolerance is not vacuous."""
    _hf_model("llama", seed=0).save_pretrained(tmp_path)
    tokens = _tokens()
    other = _reference(_hf_model("llama", seed=1), tokens)
    assert (_ours(tmp_path, tokens) - other).abs().max() > 0.1
