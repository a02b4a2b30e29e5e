"""Training objective: next-token loss plus weighted MTP losses (DeepSeek-V3, depth 1 each)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from engine.model.transformer import Transformer


def lm_losses(model: Transformer, tokens: Tensor, mtp_weight: float = 0.3,
              ignore_index: int = -100) -> tuple[Tensor, Tensor, list[Tensor]]:
    """(total, trunk loss, per-module MTP losses) for a batch of token ids [B, S].

    Trunk row t predicts x_{t+1}; MTP row t (from h_t and x_{t+1}) predicts x_{t+2}.
    """
    logits, mtp_logits = model(tokens)
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab).float(),
                           tokens[:, 1:].reshape(-1), ignore_index=ignore_index)
    extra = [F.cross_entropy(ml[:, :-1].reshape(-1, vocab).float(), tokens[:, 2:].reshape(-1),
                             ignore_index=ignore_index) for ml in mtp_logits]
    total = main + mtp_weight * sum(extra) / max(len(extra), 1) if extra else main
    return total, main, extra
