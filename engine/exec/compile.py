"""The step's two functions compiled by torch.compile (Inductor fuses the norms, rotary,
residual and activation kernels between the matmuls).

Compiled steps run one shape: the widest verify, every slot (padding rows in the spare
slot), attention over the whole cache. What still varies, the number of drafts, is the
number of calls of `draft_one`, whose draft index is a tensor: so the step compiles once per
kind of batch (greedy or sampled, drafting or not) and never again as K, prompt lengths and
the number of live slots change. Inductor keeps what it compiled on disk
($XDG_CACHE_HOME/ahead/inductor), so a daemon that restarts compiles little.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from engine.decode.draft import draft_one
from engine.decode.step import StepFns, verify_window


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ahead" / "inductor"


def compiled_fns() -> StepFns:
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
    return StepFns(torch.compile(verify_window, fullgraph=True, dynamic=False),
                   torch.compile(draft_one, fullgraph=True, dynamic=False))
