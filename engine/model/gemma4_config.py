"""Gemma 4's keys in config.json (`gemma4_text`, or the `gemma4` wrapper's `text_config`),
read into ModelConfig's fields and written back.

The keys a config.json leaves out default as transformers' Gemma4TextConfig has them. Its
full layers' head size and kv heads come from `global_head_dim` and
`num_global_key_value_heads` (the latter only with attention_k_eq_v), or from
`per_layer_config` as newer transformers write it; the mixture-of-experts variant is refused.
These functions take and give fields by name (config.py builds ModelConfig from them), so
that this module needs nothing of config.py's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.model.config_base import FULL, SLIDING, ConfigError

# What transformers' Gemma4TextConfig assumes of keys a config.json leaves out.
DEFAULTS: dict[str, Any] = {
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "sliding_window": 512, "eos_token_id": 1,
    "vocab_size_per_layer_input": 262144, "hidden_size_per_layer_input": 256,
    "rope_parameters": {SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
                        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                               "rope_theta": 1e6}}}


def with_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """The text config with transformers' defaults filled in, as model_type `gemma4`."""
    return {**DEFAULTS, **raw, "model_type": "gemma4"}


def read(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's Gemma 4 fields from a text config (defaults filled in)."""
    missing = [k for k in ("enable_moe_block", "num_experts", "top_k_experts") if raw.get(k)]
    if missing:
        raise ConfigError(f"Gemma 4's mixture-of-experts blocks ({', '.join(missing)}) are not "
                          "supported: ahead runs the dense Gemma 4 text models (it has no "
                          "router or experts)")
    if raw.get("use_bidirectional_attention") == "all":
        raise ConfigError("bidirectional attention (use_bidirectional_attention 'all') is "
                          "not supported")
    layers = int(raw["num_hidden_layers"])
    kinds = list(raw.get("layer_types") or [FULL if (i + 1) % 6 == 0 else SLIDING
                                            for i in range(layers)])
    kinds[-1] = FULL  # as transformers forces it
    rope = raw["rope_parameters"]
    local, full = rope.get(SLIDING) or {}, rope.get(FULL) or {}
    if local.get("rope_type", "default") != "default":
        raise ConfigError(f"sliding layers' rope {local['rope_type']!r} is not supported")
    scaling = {k: v for k, v in full.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if scaling.get("rope_type", "default") == "default":
        scaling = {}
    k_eq_v = bool(raw.get("attention_k_eq_v", False))
    head_dim, kv_heads = _full_layers(raw, kinds, k_eq_v)
    return {"layer_types": tuple(kinds), "hidden_act": raw["hidden_activation"],
            "sliding_window": int(raw["sliding_window"]),
            "local_rope_theta": float(local.get("rope_theta") or 10000.0),
            "rope_theta": float(full.get("rope_theta") or 10000.0),
            "rope_scaling": scaling or None,
            "partial_rotary_factor": float(full.get("partial_rotary_factor") or 1.0),
            "global_head_dim": head_dim, "num_global_kv_heads": kv_heads,
            "attention_k_eq_v": k_eq_v,
            "num_kv_shared_layers": int(raw.get("num_kv_shared_layers") or 0),
            "hidden_size_per_layer_input": int(raw["hidden_size_per_layer_input"] or 0),
            "vocab_size_per_layer_input": int(raw["vocab_size_per_layer_input"] or 0),
            "double_wide_mlp": bool(raw.get("use_double_wide_mlp", False)),
            "final_logit_softcapping": float(raw.get("final_logit_softcapping") or 0.0)}


def _full_layers(raw: dict[str, Any], kinds: list[str], k_eq_v: bool) -> tuple[int, int]:
    """The full layers' (head_dim, kv heads; 0: num_key_value_heads)."""
    per_layer = raw.get("per_layer_config")
    if per_layer is None:
        kv = raw.get("num_global_key_value_heads") if k_eq_v else None
        return int(raw.get("global_head_dim") or 512), int(kv or 0)
    overrides = {int(i): dict(v) for i, v in per_layer.items()}
    unknown = {k for v in overrides.values() for k in v} - {"head_dim", "num_key_value_heads"}
    if unknown:
        raise ConfigError(f"per_layer_config overrides {sorted(unknown)}: not supported")
    full = [overrides.get(i, {}) for i, kind in enumerate(kinds) if kind == FULL]
    if any(overrides.get(i) for i, kind in enumerate(kinds) if kind != FULL) or \
            any(o != full[0] for o in full):
        raise ConfigError("per_layer_config must give every full-attention layer the same "
                          "settings and sliding layers none")
    return int(full[0].get("head_dim") or 0), int(full[0].get("num_key_value_heads") or 0)


def to_hf(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's Gemma 4 keys from ModelConfig's fields (`ModelConfig.as_dict()`)."""
    full = {"rope_type": "default", **(cfg["rope_scaling"] or {}),
            "rope_theta": cfg["rope_theta"], "partial_rotary_factor": cfg["partial_rotary_factor"]}
    return {"model_type": "gemma4_text", "layer_types": list(cfg["layer_types"]),
            "hidden_activation": cfg["hidden_act"], "sliding_window": cfg["sliding_window"],
            "rope_parameters": {SLIDING: {"rope_type": "default",
                                          "rope_theta": cfg["local_rope_theta"]},
                                FULL: full},
            "global_head_dim": cfg["global_head_dim"] or cfg["head_dim"],
            "num_global_key_value_heads": cfg["num_global_kv_heads"] or None,
            "attention_k_eq_v": cfg["attention_k_eq_v"],
            "num_kv_shared_layers": cfg["num_kv_shared_layers"],
            "hidden_size_per_layer_input": cfg["hidden_size_per_layer_input"],
            "vocab_size_per_layer_input": cfg["vocab_size_per_layer_input"],
            "use_double_wide_mlp": cfg["double_wide_mlp"],
            "final_logit_softcapping": cfg["final_logit_softcapping"] or None}
