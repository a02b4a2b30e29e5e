"""What the commands share: errors, settings, the model, the engine."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


class CliError(Exception):
    """A failure to report as one line, without a traceback."""


def settings() -> Any:
    from daemon.config import load_settings

    return load_settings()


def model_dir(args: argparse.Namespace) -> Path:
    from engine.bundled import bundled_model_dir

    model = args.model or settings().model or bundled_model_dir()
    if not model:
        raise CliError("no model given and the bundled model is missing from this install: "
                       "pass --model DIR (a Hugging Face checkpoint directory with config.json, "
                       "tokenizer.json and safetensors), set AHEAD_MODEL, or set model in "
                       "the config file")
    from engine.model.hub import ModelNotFound, resolve_model

    try:  # a directory, or a hub name (org/name[@revision]) in the Hugging Face cache
        return resolve_model(model)
    except ModelNotFound as e:
        raise CliError(str(e)) from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine.load's keyword arguments from the flags, the config file and AHEAD_*."""
    import torch

    from daemon.config import SWITCHES, switch

    cfg = settings()  # flags win over the config file and AHEAD_* variables
    device = args.device or cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    named = args.dtype or cfg.dtype
    dtype = dtypes[named] if named else None  # the quantization's (engine/model/quant.py)
    draft_model = getattr(args, "draft_model", None) or cfg.draft_model
    return {"device": device, "dtype": dtype, "max_seq_len": args.max_seq_len or cfg.max_seq_len,
            "k_max": cfg.k_max if args.k_max is None else args.k_max,
            "slots": getattr(args, "slots", None) or cfg.slots,
            "quant": getattr(args, "quant", None) or cfg.quant,
            "draft_vocab": cfg.draft_vocab, "drafts": cfg.drafts,
            **{name: switch(getattr(args, name, None) or getattr(cfg, name))
               for name in SWITCHES},
            **({"draft_model": draft_model} if draft_model else {})}


def load_engine(args: argparse.Namespace, **overrides: Any) -> Any:
    """The engine the flags, the config file and AHEAD_* ask for; `overrides`: keyword
    arguments of Engine.load a command sets itself."""
    from engine import Engine

    return Engine.load(model_dir(args), **(engine_options(args) | overrides))


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory, or a Hugging Face name "
                   "(Qwen/Qwen3.5-2B[@revision]) found in the local HF cache (default: the "
                   "config file's, $AHEAD_MODEL, else the bundled model)")
    p.add_argument("--draft-model", help="a Gemma 4 -assistant drafter for the model: "
                   "checkpoint directory or Hugging Face name (default: the config's, else "
                   "<model>-assistant where it is beside the model in the HF cache)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="default: bf16 on CUDA, and on a CPU with AVX512-BF16 for int8 and "
                   "int4 weights; else fp32")
    p.add_argument("--max-seq-len", type=int, help="KV cache length in tokens (default 4096)")
    p.add_argument("--k-max", type=int, help="most drafts per step (default 8)")
    p.add_argument("--quant", choices=["auto", "none", "int8", "int4", "int8dyn"],
                   help="quantized weights for every matmul (int8, int4: our kernels on "
                   "AVX-512 VNNI CPUs, else torch's; int8dyn: torch's integer matmul; auto: "
                   "int8 for a model of 4M parameters or more where our kernels run, else "
                   "none); codes kept in ~/.cache/ahead/quant (default: the config's, else auto)")
    for name, what in (("graphs", "replay the decode step as CUDA graphs"),
                       ("compile", "torch.compile the decode step"),
                       ("exact", "keep output bit-identical to plain decoding even where "
                        "that costs speed (fp32 on the CPU)")):
        p.add_argument(f"--{name}", choices=["auto", "on", "off"],
                       help=f"{what} (default: the config's, else auto)")


def serve_args(args: argparse.Namespace) -> list[str]:
    """The model flags given, passed on to a daemon this command starts."""
    out = []
    for flag in ("model", "draft_model", "device", "dtype", "max_seq_len", "k_max", "quant",
                 "graphs", "compile", "exact"):
        value = getattr(args, flag, None)
        if value is not None:
            out += [f"--{flag.replace('_', '-')}", str(value)]
    return out
