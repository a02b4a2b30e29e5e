"""The int4 and int8 weights' layout that wq.c multiplies (tiles of 16 outputs, groups of
inputs), made from engine.model.quant's codes, and what the kernel computes from them in
float64 (the tests' reference)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

TILE = 16  # outputs a tile (wq.c's TILE)
# The version of `pack`'s layout, which a quant cache of packed weights names (see
# engine.model.quant.QuantCache): a change to the layout or to what wq.c reads from it gives
# a new one. 2: int4 tiles by pairs, one stream (tiles.h).
LAYOUT = 2
GROUPS = (128, 64, 32)  # inputs an activation group: the largest that divides the width


def group_for(in_features: int) -> int | None:
    """Inputs an activation group for a layer this wide, or None (not a multiple of 32)."""
    return next((g for g in GROUPS if in_features % g == 0), None)


def pack(mode: str, codes: Tensor, scales: Tensor, group: int) -> Tensor:
    """wq.c's layout from engine.model.quant's codes: int4 codes [N, K / 2] (two a byte, low
    nibble first) with scales [N, K / group, 2] (scale, value of code 8); int8 codes [N, K]
    with one scale a row. Returns uint8 [tiles, K / group, block], a block per tile and
    group: its codes (`body` bytes), then its 16 outputs' fp16 scales and offsets; int4
    tiles by pairs, their vectors by turns (tiles.h). Written into the result in place, a
    pass over the codes or two (a first load packs every weight: Qwen3.5-2B's 1.9 GB of int8
    codes took 13 s in five passes; a warm one maps the cache's layout)."""
    n = codes.shape[0]
    pad = -n % TILE
    tiles = (n + pad) // TILE
    k = codes.shape[1] * (2 if mode == "int4" else 1)  # inputs
    groups, body = k // group, group * (8 if mode == "int4" else 16)  # bytes of a group's codes
    out = torch.empty(tiles, groups, body + 4 * TILE, dtype=torch.uint8, device=codes.device)
    if mode == "int4":
        q = torch.stack([codes & 15, codes >> 4], dim=-1).view(n, k)  # inputs in order
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
        q = q.view(tiles, TILE, groups, group // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
        # [T, groups, j, lane, byte, nibble]: byte i of lane l, group row j, holds inputs
        # 8j + i (low nibble) and 8j + 4 + i (high)
        vectors = q[..., 0] | q[..., 1] << 4  # [T, groups, j, lane, byte]
        s, m = scales[..., 0], scales[..., 1] - 8 * scales[..., 0]  # w = q s + m
    else:
        u = codes.view(torch.uint8) ^ 0x80  # code + 128: w = (u - 128) s
        if pad:
            u = F.pad(u, (0, 0, 0, pad))
        vectors = u.view(tiles, TILE, groups, group // 4, 4).permute(0, 2, 3, 1, 4)
        s = scales.float()[:, None].expand(n, groups)
        m = -128 * s
    sm = F.pad(torch.stack([s, m], dim=-1), (0, 0, 0, 0, 0, pad))  # [N', groups, 2]
    sm = sm.view(tiles, TILE, groups, 2).permute(0, 2, 3, 1).to(torch.float16)
    width = 2 if mode == "int4" else 1  # tiles a stream (tiles.h)
    paired = tiles - tiles % width
    _by_streams(out[:paired], vectors[:paired], sm[:paired], width)
    _by_streams(out[paired:], vectors[paired:], sm[paired:], 1)  # a last odd int4 tile
    return out


def _by_streams(out: Tensor, vectors: Tensor, sm: Tensor, width: int) -> None:
    """Tiles' vectors [T, groups, j, lane, byte] and fp16 scales and offsets [T, groups, 2,
    lane] into out [T, groups, block], `width` tiles a stream: a stream's group holds its
    tiles' vectors by turns, then their scales (tiles.h)."""
    tiles, groups, j = vectors.shape[:3]
    if not tiles:
        return
    body = j * 64
    streams = out.view(tiles // width, groups, width * (body + 4 * TILE))
    streams[..., :width * body].view(-1, groups, j, width, TILE, 4).copy_(
        vectors.view(-1, width, groups, j, TILE, 4).permute(0, 2, 3, 1, 4, 5))
    streams[..., width * body:].view(torch.float16).view(-1, groups, width, 2, TILE).copy_(
        sm.view(-1, width, groups, 2, TILE).transpose(1, 2))


def reference(mode: str, codes: Tensor, scales: Tensor, group: int, x: Tensor,
              bias: Tensor | None = None) -> Tensor:
    """What the kernel computes, in float64 from the same quantities (tests): activations
    coded per group as wq.c codes them, weights as `pack` stores them (fp16 scales)."""
    n = codes.shape[0]
    if mode == "int4":
        s = scales[..., 0].half().double()
        m = (scales[..., 1] - 8 * scales[..., 0]).half().double()
        q = torch.stack([codes & 15, codes >> 4], dim=-1).view(n, -1, group).double()
        w = (q * s[..., None] + m[..., None]).view(n, -1)
    else:
        w = codes.double() * scales.half().double()[:, None]
    rows = x.reshape(-1, x.shape[-1]).float().view(-1, x.shape[-1] // group, group)
    amax = rows.abs().amax(-1, keepdim=True)
    qa = torch.round(rows * torch.where(amax > 0, 127 / amax, 0))
    a = (qa.double() * (amax / 127).double()).view(rows.shape[0], -1)
    y = a @ w.T + (0 if bias is None else bias.double())
    return y.view(*x.shape[:-1], n)
