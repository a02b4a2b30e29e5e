"""ahead's engine as a library: load a checkpoint, build prompts, generate.

    from engine import Engine, GenParams
    engine = Engine.load("path/to/model", device="cpu", dtype=torch.float32)
    gen = engine.generate(engine.text_prompt("def fib(n):").ids, GenParams(max_new_tokens=64))
    gen.tokens, gen.text, gen.stats

The names below are the public API; the modules behind them may move. They are imported on
first use, so that `engine.bundled` (a path) and the rest of a light client do not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "engine.engine",
    "ExactnessUnavailable": "engine.exec.invariance",
    "GenParams": "engine.generation",
    "Generation": "engine.generation",
    "Step": "engine.generation",
    "Stats": "engine.generation",
    "Prompt": "engine.prompt",
    "ContextOverflow": "engine.cache.slots",
    "CheckpointError": "engine.model.weights",
    "ConfigError": "engine.model.config",
    "TokenizerError": "engine.tokenizer",
    "bundled_model_dir": "engine.bundled",
}
__all__ = [
    "CheckpointError",
    "ConfigError",
    "ContextOverflow",
    "Engine",
    "ExactnessUnavailable",
    "GenParams",
    "Generation",
    "Prompt",
    "Stats",
    "Step",
    "TokenizerError",
    "bundled_model_dir",
]

if TYPE_CHECKING:  # what the lazy imports below give, for type checkers
    from engine.bundled import bundled_model_dir
    from engine.cache.slots import ContextOverflow
    from engine.engine import Engine
    from engine.exec.invariance import ExactnessUnavailable
    from engine.generation import Generation, GenParams, Stats, Step
    from engine.model.config import ConfigError
    from engine.model.weights import CheckpointError
    from engine.prompt import Prompt
    from engine.tokenizer import TokenizerError


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
