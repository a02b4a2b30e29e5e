"""What a sequence leaves on the device between steps: KV caches, hidden states, slots."""

from __future__ import annotations

import mmap

import torch
from torch import Tensor


def zeros(*shape: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """torch.zeros, but on the CPU in pages the OS gives zeroed when first touched (an
    anonymous mapping), as calloc does: a cache's parts never written take no memory and
    cost nothing to allocate. Qwen3.5-2B's caches (4 slots, k_max 8) are 1.6 GB, of which a
    step touches a small part; zeroing them took 2-5 s of every load. Freed with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    numel = 1
    for n in shape:
        numel *= n
    size = numel * torch.empty(0, dtype=dtype).element_size()
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)
