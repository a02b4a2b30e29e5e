"""Model configuration: one dataclass for the decoder family, read from HF `config.json`.

Qwen3.5 (`qwen3_5_text`, or the multimodal `qwen3_5` wrapper's `text_config`) is a hybrid:
`layer_types` mixes full attention (gated, partial rotary) with Gated DeltaNet layers
(`linear_*`), and its norms scale by (1 + w). Its keys are read and written in qwen35_config.py.

Gemma 4 (`gemma4_text`, or the multimodal `gemma4` wrapper's `text_config`) mixes
sliding-window layers with full-attention layers that have their own head size, kv heads and
rope (`for_kind`); its last `num_kv_shared_layers` layers read an earlier layer's cache
(`kv_sources`). Its keys are read and written in gemma4_config.py; its mixture-of-experts
variant is refused."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.model import gemma4_config, qwen35_config
from engine.model.config_base import FULL, LINEAR, SLIDING, ConfigError

# model_type -> how the family differs from plain Llama.
_FAMILIES: dict[str, dict[str, bool | None]] = {
    "llama": {"qkv_bias": None, "qk_norm": False},  # None: read attention_bias
    "mistral": {"qkv_bias": False, "qk_norm": False},
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "mimo": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": None, "qk_norm": True},
    "qwen3_5": {"qkv_bias": None, "qk_norm": True},
    "gemma4": {"qkv_bias": None, "qk_norm": True},
}
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# rope type -> the settings it cannot do without
_ROPE_REQUIRES: dict[str, tuple[str, ...]] = {
    "default": (), "linear": ("factor",), "yarn": ("factor",), "proportional": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}
MTP_NAMINGS = ("deepseek", "mimo", "mtp")


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    family: str = "llama"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    num_mtp_modules: int = 0
    mtp_layers_per_module: int = 1
    mtp_naming: str = "deepseek"  # which checkpoint naming the MTP modules follow (see weights.py)
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Hybrid models (Qwen3.5): each layer's kind (empty: all full attention), the Gated
    # DeltaNet layers' shapes, and the traits of their full-attention layers.
    layer_types: tuple[str, ...] = ()
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 4
    partial_rotary_factor: float = 1.0  # rotate the first head_dim * this dims of q and k
    attn_output_gate: bool = False  # q_proj also makes a sigmoid gate on the output
    norm_offset: bool = False  # RMSNorms scale by (1 + w), w starting at 0
    hidden_act: str = "silu"  # the MLP's gate: silu, or gelu's tanh form (Gemma)
    # Gemma 4. rope_theta, rope_scaling and partial_rotary_factor are its full layers'; its
    # sliding layers rotate all head_dim dims at local_rope_theta. 0: as the other layers.
    sliding_window: int = 0  # keys a sliding layer's query sees, its own included
    local_rope_theta: float = 10000.0
    global_head_dim: int = 0  # full layers' head size
    num_global_kv_heads: int = 0  # full layers' kv heads
    attention_k_eq_v: bool = False  # full layers' keys double as their values
    num_kv_shared_layers: int = 0  # the last layers, reading an earlier layer's cache
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings (E2B/E4B)
    vocab_size_per_layer_input: int = 0
    double_wide_mlp: bool = False  # KV-shared layers' MLPs twice as wide
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // max(self.num_heads, 1)
        self.layer_types = tuple(self.layer_types) or (FULL,) * self.num_layers
        self._check_hybrid()
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings", "mtp_layers_per_module")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ConfigError(f"the rotary dims (head_dim {self.head_dim} * partial_rotary_factor "
                              f"{self.partial_rotary_factor}) must be even and positive")
        if self.num_mtp_modules < 0:
            raise ConfigError(f"number of MTP modules must be >= 0, got {self.num_mtp_modules}")
        if self.mtp_naming not in MTP_NAMINGS:
            raise ConfigError(f"unknown MTP naming {self.mtp_naming!r}")
        if self.mtp_naming == "mtp" and self.num_mtp_modules > 1:
            raise ConfigError("the `mtp.*` naming holds one MTP module (of several layers)")
        if self.mtp_naming != "mtp" and self.mtp_layers_per_module > 1:
            raise ConfigError(f"the {self.mtp_naming!r} naming holds one block per MTP module; "
                              "several need the `mtp.*` naming")
        self._check_rope()
        self._check_gemma4()

    @property
    def rotary_dim(self) -> int:
        """The dims rope tables cover (proportional rope: all of them, the unrotated at
        frequency 0)."""
        if (self.rope_scaling or {}).get("rope_type") == "proportional":
            return self.head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    def for_kind(self, kind: str) -> ModelConfig:
        """The config as one attention layer of this kind sees it (Gemma 4's sliding and
        full layers differ in head size, kv heads and rope); others see it as it is."""
        if self.family != "gemma4":
            return self
        if kind == SLIDING:
            return replace(self, rope_theta=self.local_rope_theta, rope_scaling=None,
                           partial_rotary_factor=1.0, global_head_dim=0, num_global_kv_heads=0)
        return replace(self, head_dim=self.global_head_dim or self.head_dim,
                       num_kv_heads=self.num_global_kv_heads or self.num_kv_heads,
                       global_head_dim=0, num_global_kv_heads=0)

    @property
    def kv_sources(self) -> tuple[int, ...]:
        """Per layer, the layer whose KV cache it attends over: itself, or for the last
        num_kv_shared_layers the last earlier unshared layer of its kind."""
        first = self.num_layers - self.num_kv_shared_layers
        kinds = self.layer_types[:first]
        return tuple(i if i < first else first - 1 - kinds[::-1].index(kind)
                     for i, kind in enumerate(self.layer_types))

    @property
    def hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (Gated DeltaNet) instead of a KV cache."""
        return LINEAR in self.layer_types

    def _check_hybrid(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for "
                              f"{self.num_layers} layers")
        unknown = set(self.layer_types) - {FULL, LINEAR, SLIDING}
        if unknown:
            raise ConfigError(f"unknown layer types {sorted(unknown)}; supported: {FULL}, "
                              f"{LINEAR}, {SLIDING}")
        if SLIDING in self.layer_types and self.sliding_window <= 0:
            raise ConfigError(f"sliding-window layers need a positive sliding_window, got "
                              f"{self.sliding_window}")
        if not self.hybrid:
            return
        dims = ("linear_num_k_heads", "linear_num_v_heads", "linear_k_head_dim",
                "linear_v_head_dim", "linear_conv_kernel")
        for name in dims:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive for linear-attention layers, "
                                  f"got {getattr(self, name)}")
        if self.linear_num_v_heads % self.linear_num_k_heads:
            raise ConfigError(f"linear_num_value_heads ({self.linear_num_v_heads}) must be a "
                              f"multiple of linear_num_key_heads ({self.linear_num_k_heads})")

    def _check_gemma4(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"hidden activation {self.hidden_act!r} is not supported; "
                              f"supported: {', '.join(ACTIVATIONS)}")
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ConfigError(f"num_kv_shared_layers must be in [0, {self.num_layers}), got "
                              f"{self.num_kv_shared_layers}")
        first = self.num_layers - self.num_kv_shared_layers
        lacking = set(self.layer_types[first:]) - set(self.layer_types[:first])
        if lacking:
            raise ConfigError(f"KV-shared layers of kind {sorted(lacking)} have no earlier "
                              "layer of their kind to share a cache with")
        if self.hidden_size_per_layer_input < 0 or (self.hidden_size_per_layer_input and
                                                    self.vocab_size_per_layer_input <= 0):
            raise ConfigError("per-layer inputs need a positive hidden_size_per_layer_input "
                              "and vocab_size_per_layer_input")
        if self.num_global_kv_heads < 0 or self.num_heads % (self.num_global_kv_heads or 1):
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_global_key_value_heads ({self.num_global_kv_heads})")
        if self.final_logit_softcapping < 0:
            raise ConfigError("final_logit_softcapping must be positive (0: none)")

    def _check_rope(self) -> None:
        scaling = self.rope_scaling or {}
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in _ROPE_REQUIRES:
            raise ConfigError(f"rope scaling {rope_type!r} is not supported; supported: "
                              f"{', '.join(_ROPE_REQUIRES)}")
        for key in _ROPE_REQUIRES[rope_type]:
            value = scaling.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(f"rope scaling {rope_type!r} needs a positive number for "
                                  f"{key!r}, got {value!r}")

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config dict (transformers 4.x or 5.x layout)."""
        raw = _text_part(raw)
        model_type = raw.get("model_type")
        if not isinstance(model_type, str) or model_type not in _FAMILIES:
            raise ConfigError(f"model_type {model_type!r} is not supported; supported: "
                              f"{', '.join(sorted(_FAMILIES))}")
        if raw.get("hidden_act", "silu") != "silu" and model_type != "gemma4":
            raise ConfigError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("mtp_use_dedicated_embeddings"):
            raise ConfigError("MTP modules with their own embeddings are not supported")
        if raw.get("use_sliding_window") or (model_type == "mistral" and raw.get("sliding_window")):
            raise ConfigError("sliding-window attention is not supported")
        traits = _FAMILIES[model_type]
        try:
            partial = float(raw.get("partial_rotary_factor") or
                            (raw.get("rope_parameters") or {}).get("partial_rotary_factor") or 1)
            if partial != 1.0 and model_type != "qwen3_5":
                raise ConfigError("partial rotary embeddings (partial_rotary_factor) are not "
                                  "supported")
            heads = int(raw["num_attention_heads"])
            bias = bool(raw.get("attention_bias", False))
            eos = raw.get("eos_token_id")
            fields: dict[str, Any] = dict(
                family=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or 0),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=_rope_theta(raw),
                rope_scaling=_rope_scaling(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
                qkv_bias=bias if traits["qkv_bias"] is None else bool(traits["qkv_bias"]),
                o_bias=bias and traits["qkv_bias"] is None,  # llama, qwen3: o_proj too
                mlp_bias=bool(raw.get("mlp_bias", False)) and model_type == "llama",
                qk_norm=bool(traits["qk_norm"]),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                num_mtp_modules=_num_mtp(raw),
                mtp_naming="mtp" if raw.get("mtp_num_hidden_layers") else
                           "mimo" if model_type == "mimo" else "deepseek",
                mtp_layers_per_module=int(raw.get("mtp_num_hidden_layers") or 1),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
                partial_rotary_factor=partial,
            )
            fields.update(qwen35_config.read(raw) if model_type == "qwen3_5" else
                          gemma4_config.read(raw) if model_type == "gemma4" else {})
            return cls(**fields)
        except KeyError as e:
            raise ConfigError(f"missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError, AttributeError, ArithmeticError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"bad value: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not readable JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        try:
            return cls.from_hf(raw)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A config.json dict that both ahead and transformers read back."""
        raw: dict[str, Any] = {
            "architectures": [_ARCH[self.family]],
            "model_type": self.family,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        }
        if self.eos_token_ids:
            raw["eos_token_id"] = list(self.eos_token_ids)
        if self.family == "qwen3_5":
            raw.update(qwen35_config.to_hf(self.as_dict()))
            del raw["rope_theta"], raw["rope_scaling"]
        if self.family == "gemma4":
            raw.update(gemma4_config.to_hf(self.as_dict()))
            del raw["rope_theta"], raw["rope_scaling"], raw["hidden_act"], raw["mlp_bias"]
        if self.num_mtp_modules and self.mtp_naming == "mtp":
            raw["mtp_num_hidden_layers"] = self.mtp_layers_per_module
        elif self.num_mtp_modules:
            raw["num_nextn_predict_layers"] = self.num_mtp_modules
        return raw

    def with_(self, **changes: Any) -> ModelConfig:
        return replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "mimo": "MiMoForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen3_5": "Qwen3_5ForCausalLM", "gemma4": "Gemma4ForCausalLM"}


def _text_part(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: the multimodal Qwen3.5 and Gemma 4 wrappers keep it in
    `text_config` (the head's tying at the top level); the text configs name themselves
    `qwen3_5_text` and `gemma4_text`. Gemma 4's keys default as transformers' do."""
    if raw.get("model_type") in ("qwen3_5", "gemma4") and isinstance(raw.get("text_config"),
                                                                     dict):
        text = dict(raw["text_config"])
        if "tie_word_embeddings" in raw:
            text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        raw = text
    if raw.get("model_type") == "qwen3_5_text":
        raw = {**raw, "model_type": "qwen3_5"}
    if raw.get("model_type") in ("gemma4", "gemma4_text"):  # the text config's defaults
        raw = gemma4_config.with_defaults(raw)
    return raw


def _rope_theta(raw: dict[str, Any]) -> float:
    params = raw.get("rope_parameters") or {}
    return float(params.get("rope_theta") or raw.get("rope_theta") or 10000.0)


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 folds scaling into `rope_parameters`; 4.x used `rope_scaling`."""
    scaling = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved"):
        scaling.pop(key, None)  # Qwen3.5's M-RoPE: text positions are the same on every axis
    rope_type = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn"):
        # As transformers reads it: a top-level original length (Phi-3 style) wins, the default
        # is max_position_embeddings, and a null yarn factor means the ratio of the two lengths.
        max_len = raw.get("max_position_embeddings", 4096)
        if raw.get("original_max_position_embeddings") is not None:
            scaling["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        if scaling.get("original_max_position_embeddings") is None:
            scaling["original_max_position_embeddings"] = max_len
        if rope_type == "yarn" and scaling.get("factor") is None:
            scaling["factor"] = max_len / scaling["original_max_position_embeddings"]
    return scaling


def _num_mtp(raw: dict[str, Any]) -> int:
    if raw.get("num_nextn_predict_layers"):
        return int(raw["num_nextn_predict_layers"])
    return 1 if raw.get("mtp_num_hidden_layers") else 0
