"""Qwen3.5's keys in config.json (`qwen3_5_text`, or the `qwen3_5` wrapper's `text_config`),
read into ModelConfig's fields and written back: its layer kinds and the Gated DeltaNet
layers' shapes. By field name, as gemma4_config.py, so that it needs nothing of config.py's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config_base import FULL, LINEAR


def read(raw: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's hybrid settings; the layer kinds from `layer_types`, else every
    `full_attention_interval`-th layer is full attention."""
    layers = int(raw["num_hidden_layers"])
    interval = int(raw.get("full_attention_interval") or 4)
    kinds = raw.get("layer_types") or [LINEAR if (i + 1) % interval else FULL
                                       for i in range(layers)]
    return {"layer_types": tuple(kinds),
            "linear_num_k_heads": int(raw.get("linear_num_key_heads", 16)),
            "linear_num_v_heads": int(raw.get("linear_num_value_heads", 32)),
            "linear_k_head_dim": int(raw.get("linear_key_head_dim", 128)),
            "linear_v_head_dim": int(raw.get("linear_value_head_dim", 128)),
            "linear_conv_kernel": int(raw.get("linear_conv_kernel_dim", 4)),
            "attn_output_gate": bool(raw.get("attn_output_gate", True)),
            "norm_offset": True}


def to_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's Qwen3.5 keys from ModelConfig's fields (`ModelConfig.as_dict()`)."""
    return {"model_type": "qwen3_5_text", "layer_types": list(cfg["layer_types"]),
            "linear_num_key_heads": cfg["linear_num_k_heads"],
            "linear_num_value_heads": cfg["linear_num_v_heads"],
            "linear_key_head_dim": cfg["linear_k_head_dim"],
            "linear_value_head_dim": cfg["linear_v_head_dim"],
            "linear_conv_kernel_dim": cfg["linear_conv_kernel"],
            "attn_output_gate": cfg["attn_output_gate"],
            "rope_parameters": {"rope_type": "default", "rope_theta": cfg["rope_theta"],
                                "partial_rotary_factor": cfg["partial_rotary_factor"]}}
