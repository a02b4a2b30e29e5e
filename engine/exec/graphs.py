"""The step as CUDA graphs: captured once per step shape, replayed every step.

A replay launches the whole step (every layer's kernels, the acceptance, the draft chain)
at once, so the host's per-kernel launch cost leaves the step. Every input is read from
fixed buffers (the caches, `DecodeState`, and this object's slot index tensor), which the
host fills before the replay; the output is the graph's own tensor, read once. Graphs are
captured on first use of a shape, all in one memory pool. Capturing runs the step twice
first (to warm up lazy initialisation and compiled code), on the spare slot alone: real
slots are not touched until a replay names them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from engine.decode.state import DecodeState
from engine.decode.step import Shape

Step = Callable[[Tensor, Shape], Tensor]  # (slot index tensor, shape) -> result


class StepGraphs:
    def __init__(self, step: Step, state: DecodeState, rows: int, spare: int) -> None:
        self._step, self._state, self._spare = step, state, spare
        self.slots = torch.zeros(rows, dtype=torch.long, device=state.device)
        self._graphs: dict[tuple[Shape, int | None], tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self._host = torch.zeros(rows, dtype=torch.long).pin_memory()

    def __len__(self) -> int:
        return len(self._graphs)

    def __call__(self, index: list[int], shape: Shape) -> Tensor:
        """Run the step for the slots in `index` (exactly `rows` of them)."""
        # A benchmark's synthetic acceptance (DecodeState.synthetic) is a branch of the step
        # and a tensor it reads: steps captured without it, or with another, keep ignoring it
        # (on the H200, every K then kept no draft: 1 token a step).
        synthetic = self._state.synthetic
        key = shape, None if synthetic is None else synthetic.data_ptr()
        if key not in self._graphs:
            self._graphs[key] = self._capture(shape)
        self._host.copy_(torch.tensor(index))
        self.slots.copy_(self._host, non_blocking=True)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, shape: Shape) -> tuple[torch.cuda.CUDAGraph, Tensor]:
        self.slots.fill_(self._spare)
        self._state.set_rows([self._spare], lengths=[0], num_drafts=[0], plan=[[0, 0, 0]])
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(self.slots, shape)
                self._state.lengths[self._spare] = 0
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._step(self.slots, shape)
        return graph, out
