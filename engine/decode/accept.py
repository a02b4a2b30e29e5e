"""The speculative acceptance rule, on device: which drafts a verify pass keeps.

Notation: the drafts d_1..d_K were drawn from the draft distributions q_1..q_K (the MTP
modules'); the verify pass gives the target's distributions p_1..p_{K+1}, where p_i is the
target's distribution for the position of d_i and p_{K+1} the one after the last draft.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.decode.sampling import Sampler, probs_from_logits, sample


def accept(drafts: Tensor, logits: Tensor, q: Tensor | None,
           sampler: Sampler) -> tuple[Tensor, Tensor]:
    """The one rule every verify uses: tokens [K+1] and n, the number of drafts kept.

    drafts [K]; logits [K+1, V] of the verify pass (row i predicts the token after draft i,
    row 0 the token after the last committed one); q [K, V] the draft distributions (None
    when greedy). Greedy: keep the longest prefix with d_i = argmax p_i, then the target's
    own next token. Sampling: speculative sampling, lossless for any q."""
    if sampler.greedy:
        return accept_greedy(drafts, logits)
    p = probs_from_logits(logits, sampler.temperature, sampler.top_p)
    return accept_sampled(drafts, p, q if q is not None else p[:0], sampler.generator)


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
