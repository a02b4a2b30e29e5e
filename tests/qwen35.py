"""Tiny Qwen3.5 checkpoints written with transformers' own classes (the reference), with an
MTP module added to the safetensors as the real checkpoints ship it (`mtp.*`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
)

L, F = "linear_attention", "full_attention"


def text_config(layers: list[str], *, tied: bool = False, vocab: int = 512,
                mtp: bool = True, dims: tuple[int, int] = (8, 12)) -> Qwen3_5TextConfig:
    """`dims`: the linear layers' key and value head sizes (multiples of 16 run our CPU
    kernels for the step's positions, others torch's operators)."""
    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=96, num_hidden_layers=len(layers),
        layer_types=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=dims[0],
        linear_value_head_dim=dims[1], linear_conv_kernel_dim=4, tie_word_embeddings=tied,
        max_position_embeddings=1024, eos_token_id=vocab - 1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.5},
        **({"mtp_num_hidden_layers": 1} if mtp else {}))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Norm weights off their (1 + w) zero start, so that the offset is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def mtp_tensors(cfg: Qwen3_5TextConfig, seed: int) -> dict[str, torch.Tensor]:
    """One MTP module in the checkpoints' naming: fc over [norm(embedding), norm(hidden)],
    one full-attention layer, the final norm."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    torch.manual_seed(seed)
    layer_cfg = Qwen3_5TextConfig(**{**cfg.to_dict(), "layer_types": [F], "num_hidden_layers": 1})
    layer = Qwen3_5DecoderLayer(layer_cfg, 0)
    hidden = cfg.hidden_size
    out = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    for k, v in out.items():
        if "proj" in k:
            v.normal_(0, 0.05)
        else:
            v.normal_(0, 0.2)
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) * 0.05
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.randn(hidden) * 0.2
    return out


def write(path: Path, layers: list[str], *, tied: bool = False, wrapper: bool = False,
          mtp: bool = True, seed: int = 0, vocab: int = 512,
          dims: tuple[int, int] = (8, 12)) -> torch.nn.Module:
    """Save a random model with transformers (and its MTP module); return the HF model."""
    torch.manual_seed(seed)
    text = text_config(layers, tied=tied, vocab=vocab, mtp=mtp, dims=dims)
    model: torch.nn.Module
    if wrapper:
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2,
                  "out_hidden_size": text.hidden_size, "patch_size": 4,
                  "temporal_patch_size": 2, "spatial_merge_size": 2}
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(
            text_config=text.to_dict(), vision_config=vision, tie_word_embeddings=tied))
    else:
        model = Qwen3_5ForCausalLM(text)
    _randomise(model, seed)
    model.eval().save_pretrained(path)
    if mtp:
        weights = path / "model.safetensors"
        tensors = load_file(str(weights))
        tensors.update(mtp_tensors(text, seed + 1))
        save_file(tensors, str(weights), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    assert (raw.get("text_config") or raw).get("mtp_num_hidden_layers") == (1 if mtp else None)
    return model
