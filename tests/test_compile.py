"""The step contract on the CPU: the step compiles whole (fullgraph) and, once warm, never
recompiles as K, prompt lengths and the number of live slots change; its tokens are those
of plain decoding in the same engine."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from daemon.backends.local import step_mode
from engine import Engine, GenParams
from engine.model.block import run_block
from tests.conftest import CHAIN_VOCAB, load_exact
from training.synthetic import write_assistant, write_checkpoint


@pytest.mark.slow
def test_the_compiled_step_never_recompiles(trained_dir: Path) -> None:
    torch._dynamo.reset()
    engine = load_exact(trained_dir, max_seq_len=256, slots=3, compile=True)
    assert engine.static and engine.early_exit is False and step_mode(engine) == "compiled"
    rng = random.Random(0)
    steps, batches = 0, 0
    with torch._dynamo.config.patch(error_on_recompile=True):
        while steps < 50:
            live = rng.randint(1, 3)
            prompts = [[rng.choice(CHAIN_VOCAB) for _ in range(rng.randint(2, 60))]
                       for _ in range(live)]
            ks = [rng.choice([0, 1, 3, 5, 8, None]) for _ in range(live)]
            gens = [engine.start(p, GenParams(12, k=k), slot=i)
                    for i, (p, k) in enumerate(zip(prompts, ks, strict=True))]
            while running := [g for g in gens if g.finish_reason is None]:
                engine.step(running)
                steps += 1
            batches += 1
            for g, p in zip(gens, prompts, strict=True):
                plain = engine.generate(p, GenParams(12, speculative=False), slot="plain")
                assert g.tokens == plain.tokens
    assert batches >= 5


@pytest.mark.slow
def test_compiled_blocks_keep_eager_shapes_and_compile_a_handful_of_variants(
        trained_dir: Path, random_dir: Path) -> None:
    """fp32 on the CPU (no bit-identity promise): compile=True compiles each full-attention
    block, one compiled copy for every layer and module, and the step keeps its eager shapes.
    Over 50 steps that vary K, prompt lengths and live slots it compiles no more than a
    handful of variants, never falls back, and gives the eager engine's tokens."""
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    eager = Engine.load(trained_dir, max_seq_len=256, slots=3)
    engine = Engine.load(trained_dir, max_seq_len=256, slots=3, compile=True)
    assert engine.compiled and not engine.static and engine.early_exit
    assert engine.model.block_runner is not run_block and not eager.compiled
    assert (step_mode(engine), step_mode(eager)) == ("compiled blocks", "eager")  # ahead status
    rng = random.Random(1)
    steps = 0
    while steps < 50:
        live = rng.randint(1, 3)
        prompts = [[rng.choice(CHAIN_VOCAB) for _ in range(rng.randint(2, 60))]
                   for _ in range(live)]
        ks = [rng.choice([0, 1, 3, 5, 8, None]) for _ in range(live)]
        slots = rng.sample(range(3), live)  # not always in order: a batch may not be a span
        runs = []
        for e in (engine, eager):
            gens = [e.start(p, GenParams(12, k=k), slot=s)
                    for p, k, s in zip(prompts, ks, slots, strict=True)]
            while running := [g for g in gens if g.finish_reason is None]:
                e.step(running)
                steps += e is engine
            runs.append([g.tokens for g in gens])
        assert runs[0] == runs[1]
    assert 0 < counters["stats"]["unique_graphs"] <= 12  # far from the limit (BLOCK_VARIANTS)
    assert not counters["graph_break"]
    # An engine loaded next (a daemon's reload, here to another model) compiles its own
    # variants: they do not add to this one's towards the limit.
    variants = compiled_variants(engine)
    reloaded = Engine.load(random_dir, max_seq_len=256, slots=3, compile=True)
    reloaded.generate(prompts[0], GenParams(12))
    assert compiled_variants(reloaded) > 0 and compiled_variants(engine) == variants


def compiled_variants(of: Engine | object) -> int:
    """How many variants Dynamo keeps of an engine's compiled block runner, or a runner."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    runner = of.model.block_runner if isinstance(of, Engine) else of
    code = runner._torchdynamo_orig_callable.__code__  # type: ignore[attr-defined]
    return len(_debug_get_cache_entry_list(code))


@pytest.mark.slow
def test_compiled_blocks_in_a_hybrid_model(tmp_path: Path) -> None:
    """Qwen3.5's full-attention blocks (output gate, offset norms, partial rotary) run
    compiled and its Gated DeltaNet blocks eager: the tokens are the eager engine's."""
    from training.synthetic import write_checkpoint

    write_checkpoint(tmp_path, "tiny-qwen3.5", train_steps=20, seed=0, mtp_naming="mtp")
    engines = [Engine.load(tmp_path, max_seq_len=256, k_max=4, slots=2, compile=c)
               for c in (True, False)]
    assert engines[0].compiled and not engines[0].static
    gen = torch.Generator().manual_seed(7)
    for n, k in ((9, None), (70, 0), (23, 4)):
        prompt = torch.randint(300, 396, (n,), generator=gen).tolist()
        runs = [e.generate(prompt, GenParams(16, k=k, speculative=k != 0)) for e in engines]
        assert runs[0].tokens == runs[1].tokens
        # the compiled blocks ran a verify's rows; how many drafts a 20-step model gets
        # accepted depends on the CPU it was trained on (CI's took none at adaptive K)
        assert runs[0].stats.drafted or k == 0


@pytest.mark.slow
def test_a_deep_models_fixed_shape_step_compiles_block_by_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model deeper than WHOLE_BLOCKS (0 here; a real-shape model on CUDA) compiles each
    kind of block once in fixed shapes (full attention; Gated DeltaNet as on CUDA, our CPU
    kernels off) for every layer and module: a handful of graphs, none again once warm as K,
    prompt lengths and live slots change (prefill keeps its eager blocks), and the tokens of
    the eager fixed-shape step."""
    from engine import native
    from engine.exec import compile as compile_mod

    monkeypatch.setattr(compile_mod, "WHOLE_BLOCKS", 0)
    monkeypatch.setattr(native, "_load", lambda: "off (as on CUDA: no CPU kernel of ours)")
    monkeypatch.setattr(native, "_available", None)  # asked again of the `_load` above
    write_checkpoint(tmp_path, "tiny-qwen3.5", train_steps=10, seed=0, mtp_naming="mtp")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    kw = {"max_seq_len": 256, "k_max": 4, "slots": 2, "fixed_shapes": True, "exact": False}
    engine = Engine.load(tmp_path, compile=True, **kw)  # type: ignore[arg-type]
    eager = Engine.load(tmp_path, compile=False, **kw)  # type: ignore[arg-type]
    assert engine.static and engine.compiled and step_mode(engine) == "compiled"
    assert engine.model.block_runner is run_block  # between steps: prefill runs eager
    rng = random.Random(2)

    def batch() -> list[list[int]]:
        live = rng.randint(1, 2)
        prompts = [[rng.randrange(300, 396) for _ in range(rng.randint(3, 70))]
                   for _ in range(live)]
        ks = [rng.choice([0, 1, 3, None]) for _ in range(live)]
        runs = []
        for e in (engine, eager):
            gens = [e.start(p, GenParams(10, k=k), slot=i)
                    for i, (p, k) in enumerate(zip(prompts, ks, strict=True))]
            while running := [g for g in gens if g.finish_reason is None]:
                e.step(running)
            runs.append([g.tokens for g in gens])
        assert runs[0] == runs[1]
        return runs[0]

    for _ in range(3):
        batch()
    graphs = counters["stats"]["unique_graphs"]
    assert 0 < graphs <= 8, graphs  # both kinds of block, a few shapes: not a layer each
    runners = engine.fns.verify
    assert isinstance(runners, compile_mod.InStep)
    kinds = [layer.linear for layer in engine.model.model.layers]
    assert kinds.count(True) == 3 and kinds.count(False) == 1 and engine.model.num_mtp == 1
    # one variant serves the three Gated DeltaNet layers; the full-attention layer and the
    # module share the window's shape, and the module alone runs the drafts' one row
    assert compiled_variants(runners.linear) == 1 and compiled_variants(runners.blocks) == 2
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(4):
            batch()


class HostSyncs(TorchDispatchMode):
    """Records the ops that make the host wait for the device (a scalar read, a truth value,
    an output whose size depends on the data) and tensors made from host data, a lone
    scalar's included (`t[index] = 0` makes one and copies it to the device; a Python scalar
    passed to an op by value is fine): a CUDA graph cannot capture them."""

    SYNCS = frozenset({"aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero",
                       "aten::masked_select", "aten::_unique2", "aten::unique_consecutive",
                       "aten::equal", "aten::item"})

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func._schema.name
        if name in self.SYNCS or name == "aten::lift_fresh":
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_an_adaptive_row_in_a_fixed_shape_verifies_every_draft_it_made(
        trained_dir: Path) -> None:
    """A fixed-shape step makes every draft it is given room for (no early exit): an adaptive
    row there drafts the policy's K and the next step verifies all of them. They used to
    make k_max drafts and cut them by the chain rule, every step costing a K=k_max one (on
    the H200: adaptive K below plain decoding on Qwen2-1.5B's shapes)."""
    engine = load_exact(trained_dir, max_seq_len=256, compile=False, fixed_shapes=True)
    assert engine.static and not engine.early_exit
    engine.policy.set_costs([1.0 + k for k in range(engine.k_max + 1)])  # a draft: a step
    made: list[int] = []
    run = engine._run

    def counted(index: list[int], shape: Any) -> torch.Tensor:
        made.append(shape.drafts)
        return run(index, shape)

    engine._run = counted  # type: ignore[method-assign]
    gen = engine.start(list(CHAIN_VOCAB[:40]), GenParams(40, drafts="mtp", stop_loops=False))
    verified = [step.k for step in gen][1:]  # the prefill's step verifies nothing
    assert len(made) == len(verified) >= 5
    assert made[:-1] == verified[1:]  # the last step's drafts: the generation had ended
    assert 0 < max(made) < engine.k_max


@pytest.fixture(params=["tiny-qwen3", "tiny-qwen3.5", "tiny-gemma4"])
def any_family(request: pytest.FixtureRequest, trained_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dense checkpoint, a hybrid one (Gated DeltaNet layers, their state ring), and a
    Gemma 4 one with its assistant beside it at `<dir>-assistant` (sliding-window rings, KV
    sharing, the assistant drafting in the modules' place)."""
    if request.param == "tiny-qwen3":
        return trained_dir
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "tiny-gemma4":
        cfg = write_checkpoint(path, request.param, seed=0)
        write_assistant(path.with_name(path.name + "-assistant"), request.param, cfg, seed=0)
        return path
    write_checkpoint(path, request.param, train_steps=10, seed=0, mtp_naming="mtp")
    return path


def test_the_fixed_shape_step_never_waits_on_the_device(any_family: Path) -> None:
    """What CUDA graphs capture on a GPU (`Engine._call_step` in fixed shapes: verify,
    acceptance, draft chain) checked on the CPU: greedy, sampled and nucleus rows, fixed and
    adaptive K, plain steps and drafting ones, make no op that reads a value back to the host
    or copies one to the device (on the H100, `[slots] = 0` failed every capture)."""
    from engine.model.weights import load_assistant, load_model
    from engine.tokenizer import Tokenizer

    model = load_model(any_family)
    helper = any_family.with_name(any_family.name + "-assistant")
    if helper.is_dir():
        model.assistant = load_assistant(helper, model.cfg)
    engine = Engine(model, Tokenizer.from_dir(any_family), max_seq_len=256,
                    slots=3, compile=False, fixed_shapes=True)
    assert engine.mtp  # modules or the assistant draft in the step
    engine.calibrate()
    modes: list[HostSyncs] = []
    step = engine._call_step

    def traced(slots: torch.Tensor, shape: object) -> torch.Tensor:
        with HostSyncs() as mode:
            out = step(slots, shape)  # type: ignore[arg-type]
        modes.append(mode)
        return out

    engine._call_step = traced  # type: ignore[method-assign]
    params = [GenParams(24, k=None), GenParams(24, k=3, temperature=0.8, seed=1),
              GenParams(24, k=8, temperature=0.7, top_p=0.9, seed=2)]
    prompt = [5, 6, 7] * 30  # past the ring of a sliding window (Gemma 4)
    gens = [engine.start([*prompt, 8 + i], p, slot=i) for i, p in enumerate(params)]
    while running := [g for g in gens if g.finish_reason is None]:
        engine.step(running)
    engine.generate([5, 6, 7], GenParams(8, speculative=False))  # steps that draft nothing
    assert len(modes) >= 4 and all(not m.seen for m in modes), [m.seen for m in modes if m.seen]
