"""Sampling on the device, per row: temperature and top-p as tensors, draws from the
counter-based generator (`random.py`), no host synchronisation.

Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i / sum(p), for any unnormalised p.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.decode.random import exponential


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a generation picks tokens: greedy (temperature 0) or temperature/top-p, seeded."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        t, p = self.temperature, self.top_p
        # NaN fails every comparison, so it is refused along with the out-of-range values.
        if not (t == 0 or 1e-3 <= t <= 100) or not 0 < p <= 1:
            raise ValueError(f"need temperature 0 (greedy) or in [0.001, 100] and "
                             f"0 < top_p <= 1, got {t}, {p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: Tensor, temperature: float | Tensor,
                      top_p: float | Tensor = 1.0) -> Tensor:
    """Softmax at `temperature`, restricted to the smallest set with mass >= top_p. Both
    may be floats or tensors broadcasting against logits[..., :1] (one per row)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if isinstance(top_p, float) and top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is < top_p; the top token is always kept.
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    sorted_p = sorted_p * keep
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: Tensor, seed: Tensor, pos: Tensor, purpose: int) -> Tensor:
    """One index per row of `probs` [..., V] (need not be normalised), drawn with the
    row's seed at its position: seed and pos broadcast to probs[..., 0]."""
    seed, pos = torch.broadcast_tensors(seed, pos)
    return (probs / exponential(seed, pos, purpose, probs.shape[-1])).argmax(dim=-1)


@dataclass(slots=True)
class RowSampling:
    """A batch's sampling settings on the device, one entry per row; `sampled` and
    `nucleus` say (on the host) whether any row samples and whether any cuts the tail."""

    temperature: Tensor  # [B] float, 0 for greedy rows
    top_p: Tensor  # [B] float
    seed: Tensor  # [B] long
    sampled: bool
    nucleus: bool

    def probs(self, logits: Tensor) -> Tensor:
        """Each row's distribution [B, ..., V] (greedy rows: at temperature 1, unused)."""
        shape = (-1,) + (1,) * (logits.dim() - 1)
        t = torch.where(self.temperature > 0, self.temperature, 1.0).view(shape)
        return probs_from_logits(logits, t, self.top_p.view(shape) if self.nucleus else 1.0)

    def pick(self, logits: Tensor, pos: Tensor, purpose: int,
             ) -> tuple[Tensor, Tensor | None]:
        """A token per row of logits [B, S, V] (pos [B, S]: where each is drawn), and the
        distributions sampled rows drew from (None when every row is greedy)."""
        greedy = logits.float().argmax(-1)  # fp32: see accept_greedy
        if not self.sampled:
            return greedy, None
        probs = self.probs(logits)
        drawn = sample(probs, self.seed[:, None], pos, purpose)
        return torch.where(self.temperature[:, None] > 0, drawn, greedy), probs
