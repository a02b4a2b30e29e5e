"""Sampling and the speculative acceptance rule, free of host synchronisation.

Sampling uses the exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) picks i with
probability p_i / sum(p), on device, for any unnormalised p.
"""

from __future__ import annotations

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


def accept_greedy(drafts: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification.

    drafts [..., K]; logits [..., K+1, V] of the verify pass, row i predicting the token after
    draft i (row 0: after the last committed token). Returns tokens [..., K+1], whose first
    n are the accepted drafts and whose n-th is the target's own next token, and n [...].
    """
    target = logits.argmax(dim=-1)  # [..., K+1]
    k = drafts.shape[-1]
    n = (drafts == target[..., :k]).int().cumprod(-1).sum(-1)
    return target, n  # where drafts agree, target equals them


def accept_sampled(drafts: Tensor, p: Tensor, q: Tensor,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al., Chen et al.): lossless for any draft q.

    drafts [..., K] were sampled from q [..., K, V]; p [..., K+1, V] are the target's
    distributions. Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first
    rejection the token is drawn from norm(max(0, p_i - q_i)); if all K are kept a bonus token
    is drawn from p_K. Returns tokens [..., K+1] (first n accepted, then the drawn one) and n.
    """
    k = drafts.shape[-1]
    idx = drafts.unsqueeze(-1)
    p_d = p[..., :k, :].gather(-1, idx).squeeze(-1)  # p_i(d_i)  [..., K]
    q_d = q.gather(-1, idx).squeeze(-1)  # q_i(d_i)
    u = torch.rand(p_d.shape, generator=generator, device=p.device)
    n = (u * q_d < p_d).int().cumprod(-1).sum(-1)  # [...]
    residual = (p[..., :k, :] - q).clamp_min(0)
    # A residual with no mass cannot be reached (rejection needs p(d) < q(d)); guard anyway.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p[..., :k, :], residual)
    rows = torch.cat([residual, p[..., k:, :]], dim=-2)  # [..., K+1, V]
    pick = n[..., None, None].expand(*n.shape, 1, rows.shape[-1])
    drawn = sample(rows.gather(-2, pick).squeeze(-2), generator)  # [...]
    drawn = drawn.unsqueeze(-1)
    return torch.cat([drafts, drawn], dim=-1).scatter(-1, n.unsqueeze(-1), drawn), n
