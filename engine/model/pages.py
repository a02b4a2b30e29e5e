"""Quantized weights in 2 MB pages on Linux CPUs (transparent huge pages).

A decode step streams every weight once (Qwen2-1.5B in int4: 820 MB) from wherever the
allocator put it: 4 KB pages, each a TLB miss with a page walk, and the end of each page
the end of what the hardware's prefetcher fetches ahead. Linux backs a private anonymous
mapping with 2 MB pages where it is advised so (MADV_HUGEPAGE) before its first touch, and
/sys/kernel/mm/transparent_hugepage/enabled is "madvise" (most distributions' default) or
"always"; a mapping made by `mmap.mmap(-1, n)` alone is shared memory, which those pages
do not serve. On the EPYC Zen 4, one thread: an int4 product of 8960 x 1536 from memory
0.58-0.73x the time in them for one row and 0.76-0.82x for four; Qwen2-1.5B's plain step
0.94x, its K=3 step 0.96x (by turns in one engine).

So as the weights are quantized (model/quant.py), `place_weights` copies our kernels'
layouts side by side into one such mapping (each on a 4 KB boundary, the first on a 2 MB
one); each old copy is freed as its new one is made, so at most one layout more is held at
a time. The same bytes, read in the same order: the same bits. Where the mapping cannot be
had (not Linux, no memory) the weights stay where they are, and where the kernel grants no
large pages (`enabled` "never") they run as before from the copy. AHEAD_HUGE_PAGES=0
leaves them where they are.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable

import torch
from torch import Tensor

from engine.model.codes import Packed

PMD = 2 << 20  # a large page
ALIGN = 4096


def huge_mapping(nbytes: int) -> Tensor | None:
    """uint8 [nbytes] in a private anonymous mapping advised into large pages, starting on a
    2 MB boundary (untouched, so the pages come as it is written); None where one cannot be
    had. Freed with the last tensor that views it."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes <= 0:
        return None
    try:
        mm = mmap.mmap(-1, nbytes + PMD, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mm.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # holds the mapping
    start = -whole.data_ptr() % PMD
    return whole[start:start + nbytes]


def movable(weights: Iterable[Packed]) -> list[Packed]:
    """Those of `weights` whose layout `place_weights` moves (our kernels', on the CPU), each
    once."""
    return list({id(p): p for p in weights if p.native and p.packed.device.type == "cpu"
                 and p.packed.is_contiguous()}.values())


def place_weights(weights: Iterable[Packed]) -> int:
    """Every `movable` layout among `weights` moved into one `huge_mapping`; returns the
    bytes moved (0: none, or the mapping could not be had)."""
    if os.environ.get("AHEAD_HUGE_PAGES", "1") == "0":
        return 0
    packed = movable(weights)
    sizes = [-(-p.packed.nbytes // ALIGN) * ALIGN for p in packed]
    arena = huge_mapping(sum(sizes))
    if arena is None:
        return 0
    offset = 0
    for p, size in zip(packed, sizes, strict=True):
        old = p.packed
        new = arena[offset:offset + old.nbytes].view(old.dtype).view(old.shape)
        new.copy_(old)
        p.packed = new
        offset += size
    return offset


def huge_bytes(t: Tensor) -> int | None:
    """How many bytes of the mapping that holds t's first byte the kernel backs with large
    pages (/proc/self/smaps' AnonHugePages); None where that cannot be read."""
    address = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= address < hi
                elif inside and head == "AnonHugePages:":
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
