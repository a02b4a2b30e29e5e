"""`ahead models [DIR ...]`: the checkpoints ahead could run, and how it would run them.

Looks at the bundled model, every snapshot in the Hugging Face cache and the given
directories (a model directory, or a directory of them), and for each checks what loading
checks before it reads a tensor: the config (a supported family), the safetensors headers
and every tensor's name, and a tokenizer. A loadable one gets a line with its family, its
parameters, its MTP modules (its own, or heads trained by `ahead train --heads-only`), the
device, dtype and quantization it would run in (the flags and config given, as `ahead
serve` decides) and the memory that takes: weights, and the KV cache at the configured
context and slots. One that cannot load gets the reason. Nothing is read beyond headers.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from clients.common import engine_options
from engine.model.hub import hf_hub_cache

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(slots=True)
class Found:
    name: str  # a hub name (org/name, @commit for a snapshot that main does not point at)
    path: str
    loadable: bool
    reason: str = ""  # why not, when it cannot load
    family: str = ""
    parameters: int = 0
    mtp: str = ""  # "1 module", "2 heads (ahead train --heads-only)", "none"
    device: str = ""
    dtype: str = ""
    quant: str = ""
    weights_bytes: int = 0
    cache_bytes: int = 0


def candidates(dirs: list[Path]) -> list[tuple[str, Path]]:
    """(name, directory) of the bundled model, the hub cache's snapshots and `dirs`."""
    from engine.bundled import bundled_model_dir

    out: list[tuple[str, Path]] = []
    bundled = bundled_model_dir()
    if bundled is not None:
        out.append(("bundled", bundled))
    cache = hf_hub_cache()
    for repo in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        name = repo.name.removeprefix("models--").replace("--", "/", 1)
        main = repo / "refs" / "main"
        head = main.read_text(encoding="utf-8").strip() if main.is_file() else ""
        for snap in sorted((repo / "snapshots").glob("*")):
            if snap.is_dir():
                out.append((name if snap.name == head else f"{name}@{snap.name[:12]}", snap))
    for d in dirs:
        if (d / "config.json").is_file() or not d.is_dir():
            out.append((str(d), d))
        else:
            out += [(str(sub), sub) for sub in sorted(d.iterdir())
                    if sub.is_dir() and (sub / "config.json").is_file()]
    return out


def inspect(name: str, path: Path, options: dict[str, Any]) -> Found:
    """What loading `path` with `options` (Engine.load's) would give, without its tensors."""
    from engine.model.config import FULL, ConfigError
    from engine.model.weights import HEADS_FILE, CheckpointError, check_checkpoint

    found = Found(name, str(path), False)
    if not path.is_dir():
        found.reason = "not a directory"
        return found
    try:
        model, _, _ = check_checkpoint(path)
    except (ConfigError, CheckpointError) as e:
        found.reason = str(e).replace(f"{path}/", "").replace(str(path), ".")
        return found
    if not (path / "tokenizer.json").is_file():
        found.reason = "no tokenizer.json"
        return found
    cfg = model.cfg
    found.loadable, found.family = True, cfg.family
    found.parameters = sum(p.numel() for p in model.parameters())
    n = cfg.num_mtp_modules
    heads = (path / HEADS_FILE).is_file()
    found.mtp = "none" if not n else f"{n} module{'s' * (n > 1)}" + (
        " (heads from ahead train --heads-only)" if heads else "")
    from engine.model.quant import resolve, run_dtype

    device = options["device"]
    kind = str(device).partition(":")[0]
    found.quant = resolve(model, options["quant"], kind)  # the engine's rules
    dtype = options["dtype"] or run_dtype(kind, found.quant)
    found.device, found.dtype = device, str(dtype).removeprefix("torch.")
    size = DTYPE_BYTES.get(found.dtype, 4)
    per = {"int8": 1.0, "int4": 0.5}.get(found.quant, size)
    found.weights_bytes = int(found.parameters * per)
    attention = sum(1 for kind in cfg.layer_types if kind == FULL) \
        + n * cfg.mtp_layers_per_module
    found.cache_bytes = (2 * attention * cfg.num_kv_heads * cfg.head_dim * options["max_seq_len"]
                         * (options["slots"] + 1) * size)
    return found


def command(args: argparse.Namespace) -> int:
    options = engine_options(args)
    found = [inspect(name, path, options) for name, path in candidates(
        [Path(d).expanduser() for d in args.dirs])]
    if args.json:
        print(json.dumps([asdict(f) for f in found], indent=2))
        return 0
    if not found:
        print(f"no models: nothing in {hf_hub_cache()} and no directory given")
    for f in found:
        print(line(f))
    return 0


def line(f: Found) -> str:
    if not f.loadable:
        return f"{f.name}  cannot load: {f.reason}"
    return (f"{f.name}  {f.family}, {_count(f.parameters)} parameters, MTP: {f.mtp}; "
            f"{f.device} {f.dtype}{'' if f.quant == 'none' else ' ' + f.quant}: "
            f"weights {_size(f.weights_bytes)} + KV cache {_size(f.cache_bytes)}")


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
