"""Named presets (gpt-fast's idea): the bundled model's shape, real models' shapes for
`ahead bench engine --preset` (random weights, built in memory), and tiny ones for tests and
`ahead new-model`."""

from __future__ import annotations

from typing import Any

from engine.model.config import FULL, LINEAR, ModelConfig

_QWEN35_LAYERS = (LINEAR, LINEAR, LINEAR, FULL)
_QWEN35: dict[str, Any] = {"linear_num_k_heads": 16, "linear_num_v_heads": 16,
                           "linear_k_head_dim": 128, "linear_v_head_dim": 128,
                           "partial_rotary_factor": 0.25, "attn_output_gate": True,
                           "norm_offset": True}

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
}
