"""Named presets (gpt-fast's idea): the bundled model's shape, real models' shapes for
`ahead bench engine --preset` (random weights, built in memory), and tiny ones for tests and
`ahead new-model`."""

from __future__ import annotations

from typing import Any

from engine.model.assistant import AssistantConfig
from engine.model.config import FULL, LINEAR, SLIDING, ModelConfig

_QWEN35_LAYERS = (LINEAR, LINEAR, LINEAR, FULL)
_QWEN35: dict[str, Any] = {"linear_num_k_heads": 16, "linear_num_v_heads": 16,
                           "linear_k_head_dim": 128, "linear_v_head_dim": 128,
                           "partial_rotary_factor": 0.25, "attn_output_gate": True,
                           "norm_offset": True}

# Gemma 4 E2B's text model, its kinds four sliding layers to one full, as in its config.json:
# 35 layers, the last 20 reading the caches of layers 13 (sliding) and 14 (full), their MLPs
# twice as wide; per-layer input embeddings of 256 per layer; 262144 tokens.
_E2B_LAYERS = (SLIDING,) * 4 + (FULL,)
_GEMMA4: dict[str, Any] = {"family": "gemma4", "qk_norm": True, "tie_word_embeddings": True,
                           "norm_offset": False, "hidden_act": "gelu_pytorch_tanh",
                           "local_rope_theta": 10000.0, "rope_theta": 1e6,
                           "rope_scaling": {"rope_type": "proportional"},
                           "partial_rotary_factor": 0.25, "final_logit_softcapping": 30.0}

PRESETS: dict[str, ModelConfig] = {
    # Deep and narrow with a small vocabulary, so one MTP module and the head cost a small
    # fraction of a verify step. ~8M parameters: 16 MB in bf16.
    "ahead-small": ModelConfig(family="qwen3", vocab_size=4096, hidden_size=256,
                               intermediate_size=768, num_layers=8, num_heads=4, num_kv_heads=2,
                               head_dim=64, qk_norm=True, tie_word_embeddings=True,
                               num_mtp_modules=1, rope_theta=10000.0,
                               max_position_embeddings=2048),
    # Qwen2-1.5B's shapes with one MTP module, for `ahead bench engine --preset` (random
    # weights, built in memory).
    "qwen2-1.5b": ModelConfig(family="qwen2", vocab_size=151936, hidden_size=1536,
                              intermediate_size=8960, num_layers=28, num_heads=12,
                              num_kv_heads=2, head_dim=128, qkv_bias=True,
                              tie_word_embeddings=True, num_mtp_modules=1, rope_theta=1e6,
                              max_position_embeddings=32768),
    # Qwen3.5-2B's shapes (three Gated DeltaNet layers to one gated-attention layer, its
    # one-layer MTP module), for `ahead bench engine --preset`.
    "qwen3.5-2b": ModelConfig(family="qwen3_5", vocab_size=248320, hidden_size=2048,
                              intermediate_size=6144, num_layers=24, num_heads=8,
                              num_kv_heads=2, head_dim=256, qk_norm=True,
                              tie_word_embeddings=True, num_mtp_modules=1, mtp_naming="mtp",
                              rope_theta=1e7, max_position_embeddings=262144,
                              layer_types=_QWEN35_LAYERS * 6, **_QWEN35),
    "tiny-qwen3.5": ModelConfig(family="qwen3_5", vocab_size=512, hidden_size=64,
                                intermediate_size=128, num_layers=4, num_heads=4,
                                num_kv_heads=2, head_dim=16, qk_norm=True, num_mtp_modules=1,
                                mtp_naming="mtp", max_position_embeddings=1024,
                                layer_types=_QWEN35_LAYERS,
                                **{**_QWEN35, "linear_num_k_heads": 2, "linear_num_v_heads": 4,
                                   "linear_k_head_dim": 16, "linear_v_head_dim": 16}),
    "tiny-llama": ModelConfig(family="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=2, num_heads=4, num_kv_heads=2, num_mtp_modules=1,
                              max_position_embeddings=1024),
    "tiny-qwen2": ModelConfig(family="qwen2", vocab_size=512, hidden_size=64, intermediate_size=160,
                              num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True,
                              num_mtp_modules=1, tie_word_embeddings=True,
                              max_position_embeddings=1024),
    "tiny-qwen3": ModelConfig(family="qwen3", vocab_size=512, hidden_size=64, intermediate_size=128,
                              num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32, qk_norm=True,
                              num_mtp_modules=2, max_position_embeddings=1024),
    # Gemma 4 E2B's text shapes: random weights, for `ahead bench engine --preset` (with
    # its assistant's shapes, ASSISTANTS below).
    "gemma4-e2b": ModelConfig(vocab_size=262144, hidden_size=1536, intermediate_size=6144,
                              num_layers=35, num_heads=8, num_kv_heads=1, head_dim=256,
                              global_head_dim=512, sliding_window=512,
                              max_position_embeddings=131072, layer_types=_E2B_LAYERS * 7,
                              num_kv_shared_layers=20, hidden_size_per_layer_input=256,
                              vocab_size_per_layer_input=262144, double_wide_mlp=True,
                              eos_token_ids=(1, 106), **_GEMMA4),
    # A tiny Gemma 4 of every part E2B has (kv sharing, per-layer inputs, double-wide MLPs),
    # a sliding window that prompts run past; with its assistant for `ahead new-model`.
    "tiny-gemma4": ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                               num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16,
                               global_head_dim=32, sliding_window=32,
                               max_position_embeddings=2048,
                               layer_types=(SLIDING, SLIDING, FULL) * 2,
                               num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                               vocab_size_per_layer_input=512, double_wide_mlp=True, **_GEMMA4),
}


def _assistant_text(target: ModelConfig, **shape: Any) -> ModelConfig:
    """An assistant's own layers: the target's rope and head sizes (its queries read the
    target's keys), no per-layer inputs, no kv sharing of its own."""
    return target.with_(num_kv_shared_layers=0, hidden_size_per_layer_input=0,
                        vocab_size_per_layer_input=0, double_wide_mlp=False,
                        final_logit_softcapping=0.0, **shape)


# The Gemma 4 presets' `-assistant` drafters (transformers' gemma4_assistant). E2B's: 4 layers
# 256 wide (three sliding, one full), 4 query heads, the clustered head of 2048 centroids
# scoring the top 32.
ASSISTANTS: dict[str, AssistantConfig] = {
    "gemma4-e2b": AssistantConfig(
        _assistant_text(PRESETS["gemma4-e2b"], hidden_size=256, intermediate_size=2048,
                        num_layers=4, num_heads=4, layer_types=(SLIDING,) * 3 + (FULL,)),
        backbone_hidden_size=1536, ordered=True, num_centroids=2048, top_k=32),
    "tiny-gemma4": AssistantConfig(
        _assistant_text(PRESETS["tiny-gemma4"], hidden_size=32, intermediate_size=64,
                        num_layers=2, num_heads=4, layer_types=(SLIDING, FULL)),
        backbone_hidden_size=64, ordered=True, num_centroids=8, top_k=2),
}
