"""The speculative acceptance rule, on the device, for a batch of rows.

Notation: row b verified its pending token and drafts d_1..d_K (only its first nd[b] are
real; the rest pad the batch to one width). The drafts were drawn from the draft
distributions q_1..q_K (the MTP modules'); the verify pass gives the target's
distributions p_1..p_{K+1}, where p_i is the target's distribution for the position of d_i
and p_{nd+1} the one after the row's last draft.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.decode.random import ACCEPT, TARGET, uniform
from engine.decode.sampling import RowSampling, sample


def accept(drafts: Tensor, logits: Tensor, nd: Tensor, q: Tensor | None, sampling: RowSampling,
           pos: Tensor) -> tuple[Tensor, Tensor]:
    """The one rule every verify uses: tokens [B, K+1] and n [B], the drafts kept.

    drafts [B, K]; logits [B, K+1, V] (row i predicts the token after draft i, row 0 the
    token after the last committed one); nd [B]; q [B, K, V] the draft distributions of
    sampled rows; pos [B, K+1] the positions the tokens are for. The first n tokens are the
    kept drafts, token n the target's own. Greedy rows keep the longest prefix with
    d_i = argmax p_i; sampled rows use speculative sampling, lossless for any q."""
    tokens, n = accept_greedy(drafts, logits, nd)
    if not sampling.sampled:
        return tokens, n
    assert q is not None
    s_tokens, s_n = accept_sampled(drafts, sampling.probs(logits), q, nd, sampling.seed, pos)
    greedy = sampling.temperature == 0
    return torch.where(greedy[:, None], tokens, s_tokens), torch.where(greedy, n, s_n)


def accept_synthetic(drafts: Tensor, target: Tensor, nd: Tensor, rates: Tensor, seed: Tensor,
                     pos: Tensor) -> tuple[Tensor, Tensor]:
    """Benchmarks only, not lossless: draft i is kept with probability rates[i] whatever the
    target says (llama.cpp's --spec-synth-rates), so that speculative speed can be measured
    on random weights at a chosen acceptance. target [B, K+1] as `accept_greedy` gives it."""
    k = drafts.shape[-1]
    real = torch.arange(k, device=drafts.device) < nd[:, None]
    u = uniform(seed[:, None], pos[:, :k], ACCEPT)
    n = ((u < rates[:k]) & real).int().cumprod(-1).sum(-1)
    kept = torch.arange(k + 1, device=drafts.device) < n[:, None]
    return torch.where(kept, torch.cat([drafts, target[:, k:]], dim=-1), target), n


def accept_greedy(drafts: Tensor, logits: Tensor, nd: Tensor) -> tuple[Tensor, Tensor]:
    """Greedy verification: d_i is kept while it equals argmax p_i (and i <= nd)."""
    # fp32: the same maximum and first index, and ATen's bf16 argmax on the CPU is a scalar
    # loop (1 ms over a 152k vocabulary per row, 15x the cast and an fp32 argmax)
    return accept_target(drafts, logits.float().argmax(dim=-1), nd)


def accept_target(drafts: Tensor, target: Tensor, nd: Tensor) -> tuple[Tensor, Tensor]:
    """`accept_greedy` given the target's argmax [B, K+1]."""
    k = drafts.shape[-1]
    real = torch.arange(k, device=drafts.device) < nd[:, None]
    n = ((drafts == target[:, :k]) & real).int().cumprod(-1).sum(-1)
    return target, n  # where drafts agree, target equals them


def accept_sampled(drafts: Tensor, p: Tensor, q: Tensor, nd: Tensor, seed: Tensor,
                   pos: Tensor) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al., Chen et al.): lossless for any draft q.

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection the
    token is drawn from norm(max(0, p_i - q_i)); if all nd are kept a bonus token is drawn
    from p_{nd+1}. p [B, K+1, V], q [B, K, V]; pos [B, K+1]: the position each token is
    for, which with the row's seed keys its uniforms."""
    k = drafts.shape[-1]
    real = torch.arange(k, device=drafts.device) < nd[:, None]  # [B, K]
    q = q * real[..., None]  # padding drafts: no mass, so the row after the last real is p
    idx = drafts.unsqueeze(-1)
    p_d = p[:, :k].gather(-1, idx).squeeze(-1)  # p_i(d_i)  [B, K]
    q_d = q.gather(-1, idx).squeeze(-1)  # q_i(d_i)
    u = uniform(seed[:, None], pos[:, :k], ACCEPT)
    n = ((u * q_d < p_d) & real).int().cumprod(-1).sum(-1)  # [B]
    residual = (p[:, :k] - q).clamp_min(0)
    # A residual with no mass cannot be reached (rejection needs p(d) < q(d)); guard anyway.
    empty = residual.sum(-1, keepdim=True) <= 0
    residual = torch.where(empty, p[:, :k], residual)
    rows = torch.cat([residual, p[:, k:]], dim=-2)  # [B, K+1, V]
    at = n[:, None, None].expand(-1, 1, rows.shape[-1])
    drawn = sample(rows.gather(1, at).squeeze(1), seed, pos.gather(1, n[:, None]).squeeze(1),
                   TARGET)  # [B]
    tokens = torch.cat([drafts, drawn[:, None]], dim=-1).scatter(1, n[:, None], drawn[:, None])
    return tokens, n

