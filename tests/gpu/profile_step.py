"""Where a plain decoding step's time goes on a GPU: host time, device time, and the top
kernels and host operators, for the bundled model and a real-shape preset.

    python3 tests/gpu/profile_step.py [--preset qwen2-1.5b] [--steps 32]

A step whose device time is far below its wall time is bound by the host (Python, launches,
the one sync); one whose device time is near its wall time is bound by its kernels, and the
kernel table says which.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from clients.bench.steps import preset_engine
from engine import Engine, GenParams
from engine.bundled import bundled_model_dir


def profile_engine(name: str, engine: Engine, steps: int) -> None:
    vocab = engine.model.cfg.vocab_size
    prompt = torch.randint(min(vocab, 4000), (500,), generator=torch.Generator().manual_seed(0))
    engine.clear_cache("p")
    gen = engine.start(prompt.tolist(), GenParams(3 * steps + 8, speculative=False,
                                                  stop_loops=False), slot="p")
    engine.step([gen])
    for _ in range(4):
        engine.step([gen])
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step([gen])
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step([gen])
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.device_time for e in kernels) / steps
    print(f"\n##### {name}: wall {statistics.median(walls) * 1e3:.3f} ms/step (median, "
          f"unprofiled); device busy {device_us / 1e3:.3f} ms/step; "
          f"{len(kernels) / steps:.0f} kernels/step")
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=70))
    print(table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen2-1.5b")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                   help="torch.compile the preset's step (auto: as the engine decides)")
    args = p.parse_args()
    bundled = bundled_model_dir()
    assert bundled is not None
    engine = Engine.load(bundled, device=args.device, dtype=torch.bfloat16,
                         max_seq_len=2048)
    profile_engine("bundled", engine, args.steps)
    del engine
    engine = preset_engine(args.preset, device=args.device, dtype=torch.bfloat16, max_seq_len=4096,
                           k_max=4, slots=1,
                           compile={"auto": None, "on": True, "off": False}[args.compile])
    profile_engine(args.preset, engine, args.steps)


if __name__ == "__main__":
    main()
