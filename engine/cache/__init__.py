"""What a sequence leaves on the device between steps: KV caches, hidden states, slots."""

from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor


def zeros(*shape: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """torch.zeros, but on the CPU in pages the OS gives zeroed when first touched (an
    anonymous mapping), as calloc does: a cache's parts never written take no memory and
    cost nothing to allocate. Qwen3.5-2B's caches (4 slots, k_max 8) are 1.6 GB; zeroing
    them took 2-5 s of every load. A slot pays for its pages when it first writes them
    instead (k_max 3, a prefill of 512 tokens: 176 MB, 0.4-0.9 s of faults on a VM whose
    page cache was full), and a slot never used pays nothing. Freed with the tensor."""
    if device.type != "cpu":
        return torch.zeros(shape, device=device, dtype=dtype)
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=dtype).view(shape)
