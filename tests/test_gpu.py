"""The CUDA paths (run them all with `python -m pytest -m gpu` on a machine with a GPU):
graph replay gives the bits of the same step run eagerly; speculative output equals plain
decoding in bf16 with three slots; replaying does not grow memory; graphs off still works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from tests.conftest import require_exact
from tests.test_identity import code_prompts, run_batched

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytestmark = [pytest.mark.gpu, pytest.mark.skip(reason="needs a CUDA device")]


def load(model_dir: Path, **kw: object) -> Engine:
    return require_exact(Engine.load(model_dir, device="cuda", dtype=torch.bfloat16,
                                     max_seq_len=1024, slots=3, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def graphed(model_dir: Path) -> Engine:
    return load(model_dir, graphs=True, compile=False)


def trace(engine: Engine, prompts: list[list[int]], ks: tuple[int | None, ...]) -> list:
    """Every step's committed tokens and waiting drafts, for three slots decoding together."""
    gens = [engine.start(p, GenParams(32, k=k), slot=("trace", i))
            for i, (p, k) in enumerate(zip(prompts, ks, strict=True))]
    seen = []
    while live := [g for g in gens if g.finish_reason is None]:
        engine.step(live)
        seen.append([(list(g.tokens), engine.drafts(g.slot)) for g in gens])
    return seen


def test_graph_replay_equals_the_eager_step(graphed: Engine, model_dir: Path) -> None:
    """Fixed K on every row: an adaptive row's K comes from each engine's own measured step
    costs (a replayed step costs a tenth of an eager one), so the two would draft differently
    by design (on the H100: two drafts against none). Adaptive rows are checked
    against plain decoding below."""
    eager = load(model_dir, graphs=False, compile=False, fixed_shapes=True)
    prompts = code_prompts(graphed, 3)
    for ks in ((1, 8, 3), (5, 2, 4)):
        assert trace(graphed, prompts, ks) == trace(eager, prompts, ks)
    assert graphed.graphs and graphed.captured > 0


def test_bf16_three_slots_equal_plain_decoding(graphed: Engine) -> None:
    prompts = code_prompts(graphed, 3)
    alone = [graphed.generate(p, GenParams(n, speculative=False), slot="alone").tokens
             for p, n in zip(prompts, (40, 25, 33), strict=True)]
    for ks in ((1, 8, None), (None, 3, 5)):
        params = [GenParams(n, k=k) for n, k in zip((40, 25, 33), ks, strict=True)]
        assert run_batched(graphed, prompts, params) == alone


def test_replaying_does_not_grow_memory(graphed: Engine) -> None:
    prompt = code_prompts(graphed, 1)[0]
    graphed.generate(prompt, GenParams(64), slot="mem")  # warm: every graph captured
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    steps = 0
    while steps < 1000:
        gen = graphed.start(prompt, GenParams(200), slot="mem")
        for _ in gen:
            steps += 1
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + (1 << 20)


def test_synthetic_acceptance_reaches_steps_captured_before_it(graphed: Engine) -> None:
    """The bench sets its synthetic acceptance on an engine whose steps were captured at
    load: rates of one keep every draft, zero none, then the model's own rule again (on the
    H200 the captured steps ignored the rates: every K kept nothing)."""
    prompt = code_prompts(graphed, 1)[0]
    params = GenParams(40, k=3, stop_loops=False)
    own = graphed.generate(prompt, params, slot="synth")
    kept = {}
    try:
        for rate in (1.0, 0.0):
            graphed.state.synthetic = torch.full((graphed.k_max,), rate, device="cuda")
            gen = graphed.generate(prompt, params, slot="synth")
            kept[rate] = (gen.stats.accepted, gen.stats.drafted)
    finally:
        graphed.state.synthetic = None
    assert kept[1.0][0] == kept[1.0][1] > 0 and kept[0.0][0] == 0 < kept[0.0][1]
    assert graphed.generate(prompt, params, slot="synth").tokens == own.tokens


def test_the_bench_captures_every_step_before_it_times(graphed: Engine) -> None:
    """With synthetic acceptance, `bench engine` captures each step shape before its timed
    runs, not in them (on the H200 they did: adaptive K on Qwen2-1.5B's shapes ran at half
    plain decoding's speed). Graphs captured, read as the bench says what it does next."""
    from clients.bench.steps import bench_steps

    seen: dict[str, int] = {}
    try:
        bench_steps(graphed, context=64, new_tokens=24, ks=[1, 3], rounds=1,
                    synthetic=[0.9, 0.8, 0.7],
                    progress=lambda msg: seen.setdefault(msg.split()[0], graphed.captured))
    finally:
        graphed.state.synthetic = None
    assert seen["compiling"] < seen["plain"] == seen["kernels"]


def test_graphs_off_still_decodes_exactly(model_dir: Path) -> None:
    engine = load(model_dir, graphs=False, compile=False)
    for prompt in code_prompts(engine, 2):
        plain = engine.generate(prompt, GenParams(48, speculative=False)).tokens
        for k in (2, 8, None):
            assert engine.generate(prompt, GenParams(48, k=k)).tokens == plain


def test_context_drafts_in_replayed_steps_equal_plain_decoding(graphed: Engine) -> None:
    """Drafts the host writes between replays (the context's) are verified by the captured
    step as the modules' are: each row's tokens are its plain decoding's, and they are
    drafted and kept."""
    prompts = []
    for p in code_prompts(graphed, 3):  # the code, what the model writes after it, the code
        first = graphed.generate(p, GenParams(40, speculative=False), slot="seed").tokens
        prompts.append([*p, *first, *p[-16:]])
    alone = [graphed.generate(p, GenParams(40, speculative=False), slot="alone").tokens
             for p in prompts]
    for drafts in ("context", "both"):
        gens = [graphed.start(p, GenParams(40, drafts=drafts), slot=("ctx", i))
                for i, p in enumerate(prompts)]
        while live := [g for g in gens if g.finish_reason is None]:
            graphed.step(live)
        assert [g.tokens for g in gens] == alone, drafts
        assert sum(g.stats.by_source.get("context", [0, 0, 0])[2] for g in gens) > 0


def test_gemma4_with_its_assistant_replays_as_graphs(tmp_path: Path) -> None:
    """A tiny Gemma 4 (sliding-window rings, KV sharing, per-layer inputs) with its
    assistant drafting inside the captured step: replayed steps give the eager fixed-shape
    step's tokens and drafts, and speculative output equals plain decoding, past the rings'
    length."""
    from training.synthetic import write_assistant, write_checkpoint

    cfg = write_checkpoint(tmp_path / "g4", "tiny-gemma4", seed=0)
    write_assistant(tmp_path / "g4-assistant", "tiny-gemma4", cfg, seed=0)
    kw = {"draft_model": tmp_path / "g4-assistant", "compile": False}
    graphed = load(tmp_path / "g4", graphs=True, **kw)
    eager = load(tmp_path / "g4", graphs=False, fixed_shapes=True, **kw)
    ring = graphed.caches.ring
    assert graphed.model.assistant is not None and ring is not None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 400, (n,), generator=gen).tolist() for n in (90, 40, 120)]
    assert trace(graphed, prompts, (1, 4, 8)) == trace(eager, prompts, (1, 4, 8))
    assert graphed.captured > 0
    alone = [graphed.generate(p, GenParams(40, speculative=False), slot="alone").tokens
             for p in prompts]
    assert len(prompts[2]) + 40 > ring.size
    params = [GenParams(40, k=k) for k in (None, 3, 8)]
    assert run_batched(graphed, prompts, params) == alone


def test_int4_replayed_steps_equal_plain_decoding(model_dir: Path, tmp_path: Path) -> None:
    """tinygemm's int4 product (`aten._weight_int4pack_mm`) for every linear layer, the
    reduced draft head's rows included, inside captured steps: speculative output equals
    plain decoding of the same quantized model, alone and with three slots, and the codes
    kept on disk load back to the same tokens."""
    from engine.model.quant import describe

    def int4() -> Engine:
        return load(model_dir, graphs=True, compile=False, quant="int4",
                    quant_cache=tmp_path / "quant")

    engine = int4()
    assert describe(engine.model).startswith("int4"), describe(engine.model)
    prompts = code_prompts(engine, 3)
    alone = [engine.generate(p, GenParams(n, speculative=False), slot="alone").tokens
             for p, n in zip(prompts, (40, 25, 33), strict=True)]
    for k in (1, 3, None):
        assert engine.generate(prompts[0], GenParams(40, k=k)).tokens == alone[0]
    params = [GenParams(n, k=k) for n, k in zip((40, 25, 33), (2, None, 5), strict=True)]
    assert run_batched(engine, prompts, params) == alone
    assert engine.graphs and engine.captured > 0
    assert any((tmp_path / "quant").rglob("*")), "the int4 codes were not kept on disk"
    again = int4()
    assert [again.generate(p, GenParams(n, speculative=False), slot="alone").tokens
            for p, n in zip(prompts, (40, 25, 33), strict=True)] == alone
