"""KV caches: one attention layer's keys and values for one slot, allocated once at the full
context and written in place by position; and a batch's view of several slots' caches.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerKV:
    """One attention layer's cache, allocated once at full length and written in place."""

    __slots__ = ("k", "v")

    def __init__(self, bsz: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        shape = (bsz, num_kv_heads, max_seq_len, head_dim)  # [B, Hkv, T, D]
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


class RowsKV:
    """One layer's caches for a batch of sequences, one `LayerKV` per row, each with its own
    positions [B, S] and attention mask [S, kv_len_b] (lengths differ between rows)."""

    __slots__ = ("masks", "rows")

    def __init__(self, rows: list[LayerKV], masks: list[Tensor]) -> None:
        self.rows, self.masks = rows, masks
