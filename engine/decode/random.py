"""Counter-based random numbers: a pure function of (seed, position, purpose, index).

A row's draws depend on nothing but its own seed and the positions it samples at, so a
seeded row gives the same output whatever shares its batch, on any device, inside a CUDA
graph, with no generator state to carry between steps. Each decision at a position uses its
own purpose; a draw whose outcome was discarded (a draft past the first rejection) may be
drawn again at a later step, which is sound: nothing committed depended on it.

The hash is Chris Wellons' `lowbias32`, on int64 tensors holding 32-bit values (products
split in 16-bit halves so that nothing overflows).
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK32 = 0xFFFFFFFF
TARGET, ACCEPT, DRAFT = 1, 2, 3  # purposes: the target's own token, a draft's test, a draft


def _mul32(x: Tensor, m: int) -> Tensor:
    lo, hi = m & 0xFFFF, m >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def hash32(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed: Tensor, pos: Tensor, purpose: int, size: int | None = None) -> Tensor:
    """Uniforms in (0, 1), float32: one per element of `pos` (seed broadcast against it),
    or, with `size`, `size` of them per element along a new last dimension."""
    x = hash32((seed & MASK32) ^ hash32((pos * 8 + purpose) & MASK32))
    if size is not None:
        x = hash32(x[..., None] ^ torch.arange(size, device=x.device))
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def exponential(seed: Tensor, pos: Tensor, purpose: int, size: int) -> Tensor:
    """Exp(1) draws [..., size] for the exponential race: argmax p_i / E_i picks i with
    probability p_i / sum(p)."""
    return -torch.log(uniform(seed, pos, purpose, size))
