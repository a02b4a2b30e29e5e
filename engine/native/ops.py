"""Our kernels as torch custom operators (torch.ops.ahead.*), for compiled graphs: Dynamo
traces them as opaque calls with these shapes, and the eager wrappers in engine/native call
them while compiling."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def register(kernels: Callable[[], Any]) -> None:
    """Register the operators, each calling `kernels()` (engine/native's) when it runs."""

    @torch.library.custom_op("ahead::wq_linear", mutates_args=())
    def _wq_linear(x: Tensor, w: Tensor, bias: Tensor | None, bits: int, n: int,
                   group: int) -> Tensor:
        return kernels().run_linear(x, w, bias, bits, n, group)

    @_wq_linear.register_fake
    def _(x: Tensor, w: Tensor, bias: Tensor | None, bits: int, n: int, group: int) -> Tensor:
        return x.new_empty(*x.shape[:-1], n)

    @torch.library.custom_op("ahead::causal_attention", mutates_args=())
    def _causal_attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float | None,
                          window: int, ring: int) -> Tensor:  # contiguous, as the fake says
        return kernels().run_attention(q, k, v, pos, scale, window, ring).contiguous()

    @_causal_attention.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float | None,
          window: int, ring: int) -> Tensor:
        return q.new_empty(q.shape)

    @torch.library.custom_op("ahead::delta_rule", mutates_args=("states",))
    def _delta_rule(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, states: Tensor,
                    src: Tensor, dst: Tensor) -> Tensor:
        return kernels().run_delta_rule(q, k, v, decay, beta, states, src, dst)

    @_delta_rule.register_fake
    def _(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, states: Tensor,
          src: Tensor, dst: Tensor) -> Tensor:
        return v.new_empty(v.shape, dtype=torch.float32)
