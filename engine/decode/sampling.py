"""Sampling, free of host synchronisation: temperature, top-p, and each row's own generator.

Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i / sum(p), on device, for any unnormalised p.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def probs_from_logits(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Softmax at `temperature`, restricted to the smallest set with mass >= top_p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # Keep a token while the mass before it is < top_p; the top token is always kept.
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    sorted_p = sorted_p * keep
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """One index per row of `probs` [..., V] (need not be normalised)."""
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax(dim=-1)


class Sampler:
    """Greedy (temperature 0) or temperature/top-p sampling with its own generator."""

    def __init__(self, temperature: float, top_p: float, seed: int | None,
                 device: torch.device) -> None:
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, "
                             f"got {temperature}, {top_p}")
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed if seed is not None else torch.seed())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def pick(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """Token [...] and, when sampling, the distribution it was drawn from [..., V]."""
        if self.greedy:
            return logits.argmax(-1), None
        probs = probs_from_logits(logits, self.temperature, self.top_p)
        return sample(probs, self.generator), probs


def pick_rows(samplers: Sequence[Sampler], logits: Tensor, confident: bool = False,
              ) -> tuple[Tensor, list[Tensor | None], Tensor | None]:
    """One token per row of logits [B, V] with each row's sampler; what it was drawn from;
    and, when `confident`, each token's probability [B] under its row's distribution (for
    greedy rows the softmax's top, one op more than an argmax: a draft chain asks for it at
    every draft)."""
    if all(s.greedy for s in samplers):
        if confident:
            top, tok = torch.softmax(logits.float(), -1).max(-1)
            return tok, [None] * len(samplers), top
        return logits.argmax(-1), [None] * len(samplers), None
    picks = [s.pick(row) for s, row in zip(samplers, logits, strict=True)]
    tok = torch.stack([t for t, _ in picks])
    qs = [q for _, q in picks]
    if not confident:
        return tok, qs, None
    return tok, qs, torch.stack([q[t] if q is not None else torch.softmax(row.float(), -1)[t]
                                 for q, t, row in zip(qs, tok, logits, strict=True)])
