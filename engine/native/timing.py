"""Our kernels timed as a step runs them: `ahead bench engine`'s breakdown of a step."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine import native
from engine.native import layer, mtp, pick, rows, trunk

# The parts of a step our kernels are, by the functions that call them (`timed`).
KERNEL_PARTS = {"run_linear": "int8/int4 products", "run_attention": "attention",
                "run_delta_rule": "delta rule", "run_delta_settle": "delta rule",
                "run_gdn_prepare": "Gated DeltaNet inputs",
                "run_gdn_gated_norm": "Gated DeltaNet norm"}
ROW_PARTS = {"_rms_norm": "norms", "_silu_mul": "SwiGLU gate", "_rope": "rotary embeddings",
             "_argmax_lse": "argmax of the logits"}
PICK_PARTS = {"draft_pick": "greedy drafts' coarse pass and candidates"}
# A whole decoder block in one call (its products, attention or Gated DeltaNet mixer, norms
# and the rest inside it).
LAYER_PARTS = {"_forward": "decoder blocks in one call (layer.c)",
               "_gdn_forward": "decoder blocks in one call (layer.c)"}
TRUNK_PARTS = {"_trunk": "decoder blocks in one call (layer.c)"}  # a trunk's, in one
# A greedy MTP draft in one call (its module's block, projection, norms and pick inside it),
# and a chain of them.
MTP_PARTS = {"_draft": "MTP drafts in one call (mtp.c)",
             "_chain": "MTP drafts in one call (mtp.c)"}


@contextlib.contextmanager
def timed() -> Iterator[dict[str, list[float]]]:
    """While inside, each call of our kernels is timed: yields {part: [seconds, calls]},
    summed as they run (`ahead bench engine`'s breakdown of a step). Wall time from the call
    to its return, Python's conversions around the kernel included: the CPU kernels return
    when done. Nothing is timed where the kernels do not run here."""
    totals: dict[str, list[float]] = {}
    if not native.available():
        yield totals
        return
    lib = native.kernels()
    swapped: list[tuple[object, str, Callable[..., Any]]] = []

    def wrap(owner: object, name: str, part: str) -> None:
        fn = getattr(owner, name)
        slot = totals.setdefault(part, [0.0, 0])

        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                slot[0] += time.perf_counter() - t0
                slot[1] += 1

        swapped.append((owner, name, fn))
        setattr(owner, name, run)

    try:
        for name, part in KERNEL_PARTS.items():
            wrap(lib, name, part)
        for name, part in ROW_PARTS.items():
            wrap(rows, name, part)
        for name, part in PICK_PARTS.items():
            wrap(pick, name, part)
        for name, part in LAYER_PARTS.items():
            wrap(layer, name, part)
        for name, part in TRUNK_PARTS.items():
            wrap(trunk, name, part)
        for name, part in MTP_PARTS.items():
            wrap(mtp, name, part)
        yield totals
    finally:
        for owner, name, fn in reversed(swapped):
            if owner is lib:
                delattr(lib, name)  # the bound method again
            else:
                setattr(owner, name, fn)
