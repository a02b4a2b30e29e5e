"""A preset's shapes (engine.model.presets.PRESETS) as files llama.cpp runs: a checkpoint with
random bf16 weights and the bundled tokenizer (the config's vocabulary is larger: the
converter pads it), converted to an f16 GGUF by llama.cpp's own converter, then quantized by
its `llama-quantize`. Qwen3.5's MTP module is kept (llama.cpp drafts with it:
`--spec-type draft-mtp`); the other families' are dropped (llama.cpp has none for them).

    python -m tests.peers.preset_gguf qwen2-1.5b /tmp/presets --types Q4_0,Q8_0

writes /tmp/presets/qwen2-1.5b/{checkpoint/, f16.gguf, Q4_0.gguf, Q8_0.gguf} (a file already
there is kept) and prints the GGUF paths, for `ahead bench engine --preset qwen2-1.5b
--peer .peers/llama/llama-server --peer-model .../Q4_0.gguf`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from engine.bundled import bundled_model_dir
from engine.model.presets import PRESETS
from engine.model.transformer import Transformer
from engine.model.weights import save_model
from tests.peers.llama import _CONVERT, LLAMA_DIR, installed

KEEPS_MTP = ("qwen3_5",)  # families whose MTP module llama.cpp runs


def write_checkpoint(name: str, out: Path, seed: int = 0) -> Path:
    cfg = PRESETS[name]
    if cfg.family not in KEEPS_MTP:
        cfg = cfg.with_(num_mtp_modules=0)
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = Transformer(cfg).eval()
    finally:
        torch.set_default_dtype(default)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tmp)
    bundled = bundled_model_dir()
    assert bundled is not None, "the bundled tokenizer is missing from this install"
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(bundled / file, tmp / file)
    tmp.rename(out)
    return out


def convert(checkpoint: Path, out: Path) -> Path:
    """`checkpoint` as an f16 GGUF (MTP module included where the checkpoint has one)."""
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_DIR / "convert"),
                        str(checkpoint), "--outfile", str(tmp), "--outtype", "f16"],
                       check=True, capture_output=True, timeout=3600)
        tmp.rename(out)
    return out


def quantize(f16: Path, kind: str, threads: int = 2) -> Path:
    out = f16.with_name(f"{kind}.gguf")
    if not out.is_file():
        tmp = out.with_name(out.name + ".tmp")
        subprocess.run([str(LLAMA_DIR / "llama-quantize"), str(f16), str(tmp), kind,
                        str(threads)], check=True, capture_output=True, timeout=3600)
        tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path, help="directory for the preset's files")
    parser.add_argument("--types", default="Q4_0,Q8_0",
                        help="llama-quantize types, comma-separated (f16 is always written)")
    args = parser.parse_args(argv)
    if not installed():
        print(f"llama.cpp is not installed in {LLAMA_DIR}: run "
              "tests/peers/install_llama_server.sh", file=sys.stderr)
        return 2
    root = args.out / args.preset
    root.mkdir(parents=True, exist_ok=True)
    print(f"writing {args.preset} (random weights) ...", file=sys.stderr, flush=True)
    checkpoint = write_checkpoint(args.preset, root / "checkpoint")
    config = json.loads((checkpoint / "config.json").read_text())
    print(f"converting ({config.get('model_type')}) to f16 GGUF ...", file=sys.stderr,
          flush=True)
    paths = [convert(checkpoint, root / "f16.gguf")]
    for kind in filter(None, args.types.split(",")):
        print(f"quantizing to {kind} ...", file=sys.stderr, flush=True)
        paths.append(quantize(paths[0], kind))
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
