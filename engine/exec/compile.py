"""The step compiled by torch.compile: Inductor fuses the norms, rotary, residual and
activation kernels between the matmuls, and on the CPU takes the per-kernel cost of the
many small ones out of the step.

Three ways, by what the engine promises and the model's depth:
- Fixed-shape steps (CUDA, and engines that keep speculative output bit-identical) of a
  shallow model (at most WHOLE_BLOCKS blocks, modules included): the step's two functions
  compile whole. They run one shape: the widest verify, every slot (padding rows in the
  spare slot), attention over the whole cache. What still varies, the number of drafts, is
  the number of calls of `draft_one`, whose draft index is a tensor: so the step compiles
  once per kind of batch (greedy or sampled, drafting or not) and never again as K, prompt
  lengths and the number of live slots change.
- Fixed-shape steps of a deeper model: Inductor's time grows with the graph, and a whole
  real-shape step did not finish compiling in 76 s (Qwen2-1.5B's 28 blocks) or 107 s
  (Qwen3.5-2B) on an H100. There each kind of block (full attention; Gated DeltaNet on CUDA,
  where no CPU kernel of ours runs it) compiles once, in fixed shapes, and serves every
  layer and module of its kind inside the step; embedding, head, acceptance and drafting
  glue run eager between them (captured all the same in CUDA graphs). Prefill keeps the
  eager blocks: its lengths vary.
- Eager-shaped steps (fp32 on the CPU by default): the step keeps the narrowest shapes, which
  on a CPU cost far less than a fixed one (every row and key computed), and each
  full-attention block runs as one compiled function of the block, with dynamic shapes: one
  compiled copy serves every layer and the MTP modules, and it compiles a handful of
  variants (one row or several, one position or several), in about a minute on 2 cores
  where the whole step takes ten.
Inductor keeps what it compiled on disk ($XDG_CACHE_HOME/ahead/inductor), so a daemon that
restarts compiles little.
Each engine compiles its own copies of these functions: Dynamo keeps compiled variants on a
function's code object, and with shared code every engine a daemon reloads would add its
variants to the last one's until the limit, past which steps run eager.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engine import native
from engine.decode.draft import draft_one
from engine.decode.step import EAGER, StepFns, verify_window
from engine.model.block import run_block
from engine.model.gemma4 import Gemma4Model
from engine.model.transformer import Transformer
from engine.native import layer, mtp, trunk

BLOCK_VARIANTS = 32  # compiled variants of the block allowed (8 are used: see the tests)
WHOLE_BLOCKS = 12  # a fixed-shape step of a model of at most this many blocks compiles whole


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ahead" / "inductor"


def own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own, so what Dynamo compiles for it is kept apart."""
    assert isinstance(fn, types.FunctionType)
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    return copy


def step_fns(model: Transformer, compiled: bool, static: bool) -> StepFns:
    """The functions a step runs: eager, compiled whole, or with compiled blocks (a deep
    model's fixed-shape step, or a compiled eager-shaped one); the model's block runners are
    `run_block` again when `compiled` is False (on a CPU where our kernels run, layer.py's,
    which runs each full-attention and Gated DeltaNet block our kernels take in one call,
    and trunk.py's, a trunk of them in one, and mtp.py's, each greedy draft and the
    drafts a module chains on itself; `AHEAD_BLOCKS=0` keeps the Python forward, to
    compare)."""
    model.block_runner = model.linear_runner = run_block
    model.draft_runner = model.chain_runner = model.trunk_runner = None
    if not compiled:
        if native.available() and next(model.parameters()).device.type == "cpu" \
                and os.environ.get("AHEAD_BLOCKS", "1") != "0":
            model.block_runner = layer.run_block  # its blocks in one call where it can
            model.linear_runner = layer.run_linear_block  # and its Gated DeltaNet blocks
            model.trunk_runner = trunk.run_blocks  # (all its blocks in one, where it can)
            model.draft_runner = mtp.draft  # and its greedy drafts
            model.chain_runner = mtp.chain  # (a chain's after its first in one call)
        return EAGER
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir()))
    if static and not by_blocks(model):
        return StepFns(torch.compile(own_copy(verify_window), fullgraph=True, dynamic=False),
                       torch.compile(own_copy(draft_one), fullgraph=True, dynamic=False))
    if static:
        return block_step(model)
    # Not fullgraph: a block that cannot compile whole (an op Dynamo does not know, variants
    # past the limit) runs partly eager rather than failing a request.
    model.block_runner = with_variants(own_copy(run_block), BLOCK_VARIANTS, dynamic=True)
    return EAGER


def with_variants(fn: Callable[..., Any], limit: int, **kw: Any) -> Callable[..., Any]:
    """torch.compile(fn) keeping up to `limit` compiled variants: its own limit where
    torch.compile takes one (2.13, our CPU pin), else Dynamo's global one raised to it (the
    GPU image's torch 2.11 refused `recompile_limit`)."""
    try:
        return torch.compile(fn, recompile_limit=limit, **kw)  # type: ignore[call-overload]
    except TypeError:
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, limit)
        return torch.compile(fn, **kw)


def by_blocks(model: Transformer) -> bool:
    """Whether a fixed-shape step compiles block by block rather than whole: a deep model
    (Gemma 4's trunk runs its own blocks, with the KV they share: it compiles whole)."""
    return not isinstance(model.model, Gemma4Model) \
        and len(model.model.layers) + model.num_mtp > WHOLE_BLOCKS


def block_step(model: Transformer) -> StepFns:
    """The step's functions run eager, their blocks compiled in fixed shapes (one copy for
    the full-attention blocks, one for the Gated DeltaNet blocks on CUDA)."""
    blocks = torch.compile(own_copy(run_block), dynamic=False)
    cuda = model.model.embed_tokens.weight.device.type == "cuda"
    linear = torch.compile(own_copy(run_block), dynamic=False) \
        if cuda or not native.available() else run_block  # our CPU kernels run them
    return StepFns(InStep(verify_window, blocks, linear), InStep(draft_one, blocks, linear))


class InStep:
    """`fn` with the compiled block runners in the model while it runs, and `run_block`
    after: prefill's varied lengths compile nothing."""

    def __init__(self, fn: Callable[..., Any], blocks: Callable[..., Tensor],
                 linear: Callable[..., Tensor]) -> None:
        self.fn, self.blocks, self.linear = fn, blocks, linear

    def __call__(self, model: Transformer, *args: Any, **kwargs: Any) -> Any:
        model.block_runner, model.linear_runner = self.blocks, self.linear
        try:
            return self.fn(model, *args, **kwargs)
        finally:
            model.block_runner = model.linear_runner = run_block
