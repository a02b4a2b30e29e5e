"""The decoding contract in bf16: a slot's tokens are the bits of its plain decoding, for
every K and whatever else shares the batch. The bundled model on real code, on the CPU
(the GPU's counterpart is in test_gpu.py)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.exec.invariance import Invariance
from tests.conftest import require_exact

# (file, line): cursor positions where the previous engine's speculative output left plain
# decoding in bf16 (fp32 top-2 gaps of a few thousandths), and two more.
CURSORS = (("struct.py", 6), ("pstats.py", 328), ("textwrap.py", 120), ("fractions.py", 400))


def code_prompts(engine: Engine, count: int = len(CURSORS)) -> list[list[int]]:
    """The 1,200 characters before each cursor, as `ahead generate` prompts them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name, line in CURSORS[:count]:
        text = (root / name).read_text(encoding="utf-8")
        cut = sum(map(len, text.splitlines(keepends=True)[:line]))
        out.append(engine.text_prompt(text[max(0, cut - 1200):cut]).ids)
    return out


@pytest.fixture(scope="module")
def bf16_engine(model_dir: Path) -> Engine:
    return require_exact(Engine.load(model_dir, dtype=torch.bfloat16, max_seq_len=1024, slots=3))


@pytest.mark.slow
def test_bf16_speculative_equals_plain_decoding_for_every_k(bf16_engine: Engine) -> None:
    engine = bf16_engine
    for prompt in code_prompts(engine):
        plain = engine.generate(prompt, GenParams(64, speculative=False)).tokens
        for k in [*range(1, engine.k_max + 1), None]:
            got = engine.generate(prompt, GenParams(64, k=k)).tokens
            assert got == plain, f"k={k}"


def run_batched(engine: Engine, prompts: list[list[int]], params: list[GenParams]) -> list:
    gens = [engine.start(p, pa, slot=("batch", i))
            for i, (p, pa) in enumerate(zip(prompts, params, strict=True))]
    while live := [g for g in gens if g.finish_reason is None]:
        engine.step(live)
    return [g.tokens for g in gens]


@pytest.mark.slow
@pytest.mark.parametrize("padded", [False, True])
def test_bf16_three_slots_equal_each_ones_plain_decoding(bf16_engine: Engine,
                                                         padded: bool) -> None:
    """Three slots decoding together (different K, one of them plain, ending at different
    times) give each the tokens its plain decoding gives alone; `padded` runs every step
    at the full batch, as the engine does where the batch size would change the bits."""
    engine = bf16_engine
    measured = engine.invariance
    if padded:
        engine.invariance = Invariance(measured.min_width, batch_invariant=False,
                                       key_invariant=measured.key_invariant)
    try:
        prompts = code_prompts(engine, 3)
        alone = [engine.generate(p, GenParams(n, speculative=False), slot="alone").tokens
                 for p, n in zip(prompts, (40, 25, 33), strict=True)]
        for ks in ((1, 8, None), (None, 3, 5)):
            params = [GenParams(n, k=k, speculative=k != 5)
                      for n, k in zip((40, 25, 33), ks, strict=True)]
            assert run_batched(engine, prompts, params) == alone, ks
    finally:
        engine.invariance = measured
