"""The model that ships inside the package: the default wherever a model is needed."""

from __future__ import annotations

import shutil
from pathlib import Path

BUNDLED_DIR = Path(__file__).parent / "model_data"
# What a shipped model directory holds; the weights are bf16 to stay small.
SHIPPED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "corpus-manifest.jsonl", "training.json")


def bundled_model_dir() -> Path | None:
    return BUNDLED_DIR if (BUNDLED_DIR / "config.json").is_file() else None


def install_bundled(model_dir: Path) -> Path:
    """Copy a trained model directory into the package (what `ahead train --install` does)."""
    missing = [f for f in SHIPPED_FILES if not (model_dir / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{model_dir} lacks {', '.join(missing)}")
    BUNDLED_DIR.mkdir(exist_ok=True)
    for name in SHIPPED_FILES:
        shutil.copy2(model_dir / name, BUNDLED_DIR / name)
    return BUNDLED_DIR
