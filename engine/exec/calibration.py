"""`Engine.calibrate`: the step shapes that keep rows exact (exec/invariance.py) and the step
cost of every K (decode/costs.py), measured at load or read from disk; and what follows when
the device keeps no shape exact or a compiled step fails.

Measuring takes seconds on a small model and minutes on a 2B one on a CPU (hundreds of
steps), so a daemon restarted on the same model would pay for it each time. An entry is
named by everything the figures depend on: the checkpoint (its files' names, sizes and
modification times, or a preset's shapes), the device (the CPU's model name and flags, or
the GPU's name), torch's version, the dtype, the quantization, the threads, the slots, k_max,
the context and whether exactness was asked for. Anything else measures afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import time
from collections.abc import Hashable
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

import torch

from engine import native
from engine.decode.costs import Curves, Stepper, measure_costs, row_buckets
from engine.decode.policy import KPolicy
from engine.exec.invariance import Invariance, probe, promised
from engine.generation import GenParams
from engine.model.transformer import Transformer
from engine.paths import checkpoint_identity, write_replacing

log = logging.getLogger("ahead.engine")

VERSION = 3  # of what is measured and how: a change makes every entry stale


def device_identity(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    cpu = platform.processor()
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln for ln in info if ln.startswith("model name")), cpu) + \
            next((ln for ln in info if ln.startswith("flags")), "")
    except OSError:
        pass
    return f"cpu:{cpu}"


class CalibrationStore:
    def __init__(self, root: Path, **identity: object) -> None:
        """`identity`: what the figures depend on (see the module's docstring)."""
        self.root, self.identity = root, {**identity, "torch": torch.__version__,
                                          "version": VERSION}

    def path(self, step: str) -> Path:
        """The entry for steps run this way ("eager", "compiled", "graphs", ...)."""
        text = json.dumps({**self.identity, "step": step}, sort_keys=True, default=str)
        return self.root / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"

    @classmethod
    def of_checkpoint(cls, root: Path, model_dir: Path, model: Transformer,
                      **settings: object) -> CalibrationStore:
        """The entry of a checkpoint loaded with these engine settings on this machine, with
        this build of our kernels (a new one steps at other costs)."""
        weight = model.model.embed_tokens.weight
        return cls(root, model=checkpoint_identity(model_dir),
                   device=device_identity(weight.device), dtype=weight.dtype,
                   threads=torch.get_num_threads(), kernels=native.flavour(),
                   kernels_build=native.build(), **settings)

    def read(self, step: str) -> tuple[Invariance, tuple[Curves, Curves]] | None:
        try:
            entry = json.loads(self.path(step).read_text())
            costs, verify = ({int(r): [float(c) for c in curve] for r, curve in entry[key].items()}
                             for key in ("costs", "verify"))
            return Invariance(**entry["invariance"]), (costs, verify)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None  # absent or unreadable: measured again, and written anew

    def write(self, step: str, invariance: Invariance, costs: tuple[Curves, Curves]) -> None:
        text = json.dumps({"invariance": asdict(invariance),
                           "costs": {str(r): c for r, c in costs[0].items()},
                           "verify": {str(r): c for r, c in costs[1].items()}})
        write_replacing(self.path(step), lambda tmp: tmp.write_text(text))


class Calibrating(Stepper, Protocol):
    """What calibrating needs of an `Engine`."""

    model: Transformer
    calibration: CalibrationStore | None
    policy: KPolicy
    device: torch.device
    width: int
    max_slots: int
    invariance: Invariance
    exact: bool
    exact_asked: bool | None
    exactness: str
    load_seconds: dict[str, float]
    compiled: bool
    graphs: bool
    static: bool

    def reshape_step(self, *, compiled: bool, static: bool) -> None: ...
    def generate(self, prompt: list[int], params: GenParams | None = None, *,
                 slot: Hashable = None) -> object: ...


def calibrate(engine: Calibrating) -> None:
    """See `Engine.calibrate`. Fixed-shape steps (compiled, captured) read from disk are
    compiled and captured by the warm-up's generations instead of by measuring every K (on
    the H200 the bundled model's cold load spent 30 s compiling, capturing and measuring, and
    a warm `ahead serve` took 17 s to its first suggestion); where that fails they run eager
    and are measured. Compiled steps in eager shapes (the CPU's
    opt-in compiled blocks) compile variants as shapes come, so they are measured each time:
    measuring is their warm-up."""
    kept = engine.calibration if engine.static or not engine.compiled else None
    stored = kept.read(step_kind(engine)) if kept else None
    t0 = time.perf_counter()
    found = stored[0] if stored else probe(engine.model, engine.width, engine.max_slots) \
        if engine.exact else Invariance.unconstrained()
    engine.invariance = found
    if not found.exact:
        _without_exactness(engine, found.reason or "")
    t1 = time.perf_counter()
    costs = stored[1] if stored else _measure(engine)
    engine.policy.set_costs(*costs)
    t2 = time.perf_counter()
    if engine.static and not warm_up(engine):  # failed: now eager, and measured
        stored, costs = None, _measure(engine)
        engine.policy.set_costs(*costs)
    if kept and not stored:
        kept.write(step_kind(engine), found, costs)
    # "costs" holds the compiling and capturing of the steps it measures (their warm-up)
    engine.load_seconds |= {"probe": t1 - t0, "costs": t2 - t1, "warm-up": time.perf_counter() - t2}


def step_kind(engine: Calibrating) -> str:
    """How the step runs, for the calibration's entry: its costs depend on it."""
    return "+".join(name for name, on in (("compiled", engine.compiled),
                                          ("graphs", engine.graphs),
                                          ("fixed", engine.static)) if on) or "eager"


def warm_up(engine: Calibrating) -> bool:
    """Compile or capture the fixed-shape step's greedy kinds (a plain step, a step of each
    K: adaptive rows take the policy's K there; a verify of given drafts is a plain step's
    shape) before any request; sampled ones compile on their first use. False where the
    compiled or captured step failed, the engine then running eager steps."""
    ks = range(max(engine.policy.k_max, 1), 0, -1)  # K drafts after the prefill, then a step
    try:
        with engine.policy.aside():  # what these steps accept and cost is not serving's
            for params in (GenParams(max_new_tokens=8),
                           *(GenParams(max_new_tokens=2 * k + 2, k=k) for k in ks),
                           GenParams(max_new_tokens=4, speculative=False)):
                engine.generate([1, 2, 3], params, slot=("ahead", "warm"))
                engine.clear_cache(("ahead", "warm"))
        return True
    except Exception as e:  # a compiler or capture failure (toolchain, unsupported op)
        if not (engine.compiled or engine.graphs):
            raise
        engine.clear_cache(("ahead", "warm"))
        _run_eager(engine, e)
        return False


def _without_exactness(engine: Calibrating, reason: str) -> None:
    """No step shape keeps rows bit-identical to plain decoding: refuse if that was asked for,
    else run without the promise (in the cheapest shapes) and say so once."""
    engine.exactness = promised(engine.exact_asked, True, reason)
    engine.exact, engine.invariance = False, Invariance.unconstrained()
    log.warning("exact: %s; output may differ from plain decoding at near-ties",
                engine.exactness)
    engine.reshape_step(compiled=engine.compiled, static=_keeps_shape(engine))


def _measure(engine: Calibrating) -> tuple[Curves, Curves]:
    """The step cost curves; a compiled or captured step that fails here falls back to eager
    steps."""
    vocab, rows = engine.model.cfg.vocab_size, row_buckets(engine.max_slots)
    try:
        return measure_costs(engine, vocab, rows, warmup=engine.static or engine.compiled)
    except Exception as e:  # a compiler or capture failure (toolchain, unsupported op)
        if not (engine.static or engine.compiled):
            raise
        _run_eager(engine, e)
        return measure_costs(engine, vocab, rows, warmup=False)


def _run_eager(engine: Calibrating, error: Exception) -> None:
    """After a compiled or captured step failed: say so, and run eager steps."""
    log.warning("compiled or captured steps failed (%s: %s); running eager",
                type(error).__name__, error)
    engine.reshape_step(compiled=False, static=_keeps_shape(engine))


def _keeps_shape(engine: Calibrating) -> bool:
    """Whether a fixed-shape step stays in its shape after a fallback: on a GPU it does (the
    kernels a library picks move with the rows and keys of a call, so the probe's finding
    holds for that shape alone); on the CPU it ran in one shape only for exactness."""
    return engine.static and engine.device.type != "cpu"
