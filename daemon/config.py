"""User configuration: `~/.config/ahead/config.toml`, overridden by environment variables.

    model = "/path/to/checkpoint"   # default: the bundled model
    draft_model = "google/gemma-4-e2b-it-assistant"  # a Gemma 4 model's -assistant drafter
                                     # (a directory or a name; default: <model>-assistant
                                     # where it is beside the model in the HF cache)
    device = "cuda"                  # default: cuda when available
    dtype = "bf16"                   # fp32 | bf16 | fp16 (default: bf16 on CUDA, and for
                                     # int8/int4 on a CPU with AVX512-BF16; else fp32)
    quant = "auto"                   # auto (int8 for a model of 4M+ parameters where our
                                     # CPU kernels run, else none) | none | int8 | int4 | int8dyn
    draft_vocab = 32768              # tokens a draft scores (the most frequent in code); 0: all
    idle_timeout = 1800              # seconds; 0 = never exit
    max_seq_len = 4096
    k_max = 8
    drafts = "both"                  # where drafts come from: the model's MTP modules (mtp),
                                     # the text so far (context), or both, chosen per step
    slots = 4                        # KV-cache slots (documents kept warm)
    threads = 0                      # CPU threads for the model; 0: all cores but one
    graphs = "auto"                  # CUDA graphs for the decode step: auto (on CUDA) | on | off
    compile = "auto"                 # torch.compile the step: auto (on CUDA) | on | off
    exact = "auto"                   # bit-identical to plain decoding even where it costs:
                                     # auto (all but fp32 on the CPU; given up, and said so
                                     # in ahead status, where the device cannot keep it) |
                                     # on (refuses to load there) | off

    # A remote serving engine instead of the local model (see daemon/backends/openai.py):
    backend = "openai"               # local (default) | openai
    url = "http://gpu-box:8000/v1"   # its OpenAI-compatible API
    api_key_env = "TEAM_LLM_KEY"     # the environment variable holding its API key
    served_model = "Qwen/Qwen2.5-Coder-7B"  # the model name it serves (default: its first)
    tokenizer = "/path/to/model"     # that model's tokenizer.json, to build its FIM prompts
                                     # (default: served_model's in the Hugging Face cache)
    fim_template = "qwen"            # else a named layout: qwen, deepseek, starcoder,
                                     # codellama; or "infill": llama-server's /infill
    timeout = 30                     # seconds the server may stay silent
    http = "127.0.0.1:8741"          # serve the HTTP endpoint here (default: off)
    log_max_bytes = 10485760         # daemon.log is rotated at this size (two old ones kept)

    # What is worth showing (engine/decode/quality.py): a suggestion whose confidence (the
    # geometric mean of its tokens' probabilities) is below the threshold is not shown or
    # written; 0 shows everything the loop and echo rules let through.
    min_confidence = 0.3             # inline completions (editors, `ahead complete`)
    docstring_min_confidence = 0.25  # the docstring hook (default: the model's own, chosen by
                                     # `ahead bench quality --save` and kept in quality.json
                                     # beside it, which may say that it writes none; else 0.25)

Every key may also come from `AHEAD_<KEY>` (e.g. AHEAD_MODEL); command-line flags win over
both. Unknown keys and wrong types are errors that name the file and the key.
"""

from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

SWITCHES = ("graphs", "compile", "exact")


def switch(value: str | None) -> bool | None:
    """auto -> None (the engine decides), on -> True, off -> False."""
    return None if value in (None, "auto") else value == "on"


BACKENDS = ("local", "openai")
QUANT_MODES = ("auto", "none", "int8", "int4", "int8dyn")  # engine.model.quant.MODES
# Chosen with `ahead bench quality` on held-out code (see docs/benchmarks.md).
MIN_CONFIDENCE, DOCSTRING_MIN_CONFIDENCE = 0.3, 0.25
FIM_TEMPLATES = ("qwen", "deepseek", "starcoder", "codellama", "infill")


class ConfigFileError(ValueError):
    """A config file or variable that cannot be used, naming the file and the key."""


@dataclass(slots=True)
class Settings:
    model: str | None = None
    draft_model: str | None = None
    device: str | None = None
    dtype: str | None = None
    quant: str = "auto"
    draft_vocab: int = 32768
    idle_timeout: float = 1800.0
    max_seq_len: int = 4096
    k_max: int = 8
    drafts: str = "both"
    slots: int = 4
    threads: int = 0
    graphs: str = "auto"
    compile: str = "auto"
    exact: str = "auto"
    backend: str = "local"
    url: str | None = None
    api_key_env: str | None = None
    served_model: str | None = None
    tokenizer: str | None = None
    fim_template: str | None = None
    timeout: float = 30.0
    http: str | None = None
    log_max_bytes: int = 10 * 1024 * 1024
    min_confidence: float = MIN_CONFIDENCE
    docstring_min_confidence: float | None = None  # None: the model's (docstring_threshold)

    def __post_init__(self) -> None:
        for name in SWITCHES:
            if getattr(self, name) not in ("auto", "on", "off"):
                raise ConfigFileError(f"{name} must be auto, on or off, not "
                                      f"{getattr(self, name)!r}")
        if self.quant not in QUANT_MODES:
            raise ConfigFileError(f"quant must be {', '.join(QUANT_MODES)}, not {self.quant!r}")
        if self.dtype not in (None, "fp32", "bf16", "fp16"):
            raise ConfigFileError(f"dtype must be fp32, bf16 or fp16, not {self.dtype!r}")
        if self.draft_vocab < 0:
            raise ConfigFileError("draft_vocab must not be negative")
        if self.drafts not in ("mtp", "context", "both"):
            raise ConfigFileError(f"drafts must be mtp, context or both, not {self.drafts!r}")
        for name in ("max_seq_len", "slots"):
            if getattr(self, name) < 1:
                raise ConfigFileError(f"{name} must be positive")
        if self.k_max < 0 or self.idle_timeout < 0 or self.threads < 0:
            raise ConfigFileError("k_max, idle_timeout and threads must not be negative")
        if self.backend not in BACKENDS:
            raise ConfigFileError(f"backend must be one of {', '.join(BACKENDS)}, "
                                  f"not {self.backend!r}")
        if self.fim_template not in (None, *FIM_TEMPLATES):
            raise ConfigFileError(f"fim_template must be one of {', '.join(FIM_TEMPLATES)}, "
                                  f"not {self.fim_template!r}")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigFileError(f"url must start with http:// or https://, not {self.url!r}")
        if self.timeout <= 0:
            raise ConfigFileError("timeout must be positive")
        if self.log_max_bytes < 1024:
            raise ConfigFileError("log_max_bytes must be at least 1024")
        for name in ("min_confidence", "docstring_min_confidence"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) < 1:
                raise ConfigFileError(f"{name} must be in [0, 1), not {getattr(self, name)!r}")


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(os.environ.get("AHEAD_CONFIG") or Path(base) / "ahead" / "config.toml")


def _coerce(name: str, value: Any, where: str) -> Any:
    kinds = {f.name: f.type for f in fields(Settings)}
    kind = str(kinds[name])
    try:
        if "float" in kind:
            return float(value)
        if isinstance(value, bool):  # `graphs = false` in TOML
            return "on" if value else "off"
        if "int" in kind:
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigFileError(f"{where}: {name} must be {kind}, not {value!r}") from None


def load_settings(path: Path | None = None, env: dict[str, str] | None = None) -> Settings:
    path = path or config_path()
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    if path.exists():
        try:
            raw = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigFileError(f"{path}: {e}") from None
        known = {f.name for f in fields(Settings)}
        for key, value in raw.items():
            if key not in known:
                raise ConfigFileError(f"{path}: unknown key {key!r}; known: "
                                      f"{', '.join(sorted(known))}")
            values[key] = _coerce(key, value, str(path))
    for f in fields(Settings):
        var = f"AHEAD_{f.name.upper()}"
        if env.get(var):
            values[f.name] = _coerce(f.name, env[var], var)
    try:
        return Settings(**values)
    except ConfigFileError as e:
        raise ConfigFileError(f"{path}: {e}") from None


QUALITY_FILE = "quality.json"  # in a model's directory: `ahead bench quality --save`


def docstring_threshold(settings: Settings, model_dir: Path) -> tuple[float | None, str]:
    """The docstring hook's threshold, and where it comes from: the config's, else the one
    `ahead bench quality --save` chose for this model (None: no threshold passed, the hook
    writes none with it), else DOCSTRING_MIN_CONFIDENCE."""
    if settings.docstring_min_confidence is not None:
        return settings.docstring_min_confidence, "the config"
    path = Path(model_dir) / QUALITY_FILE
    if not path.is_file():
        return DOCSTRING_MIN_CONFIDENCE, "the default"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigFileError(f"{path}: {e}") from None
    value = data.get("docstring_min_confidence") if isinstance(data, dict) else 0
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                              or not 0 <= value < 1):
        raise ConfigFileError(f"{path}: docstring_min_confidence must be a number in [0, 1) "
                              f"or null, not {value!r}")
    return value, str(path)


def save_model_quality(model_dir: Path, chosen: dict[str, Any], measured_on: list[str]) -> Path:
    """Keep `ahead bench quality`'s chosen thresholds beside the model (written atomically)."""
    from daemon.paths import write_atomic

    path = Path(model_dir) / QUALITY_FILE
    try:
        write_atomic(path, json.dumps({**chosen, "measured_on": measured_on}, indent=2) + "\n")
    except OSError as e:
        raise ConfigFileError(f"cannot write {path}: {e}") from None
    return path
