"""The step contract on the CPU: the step compiles whole (fullgraph) and, once warm, never
recompiles as K, prompt lengths and the number of live slots change; its tokens are those
of plain decoding in the same engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from tests.conftest import CHAIN_VOCAB


@pytest.mark.slow
def test_the_compiled_step_never_recompiles(trained_dir: Path) -> None:
    torch._dynamo.reset()
    engine = Engine.load(trained_dir, max_seq_len=256, slots=3, compile=True)
    assert engine.static and engine.early_exit is False
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
