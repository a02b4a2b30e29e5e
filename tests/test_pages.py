"""Quantized weights in 2 MB pages (engine/model/pages.py): the same bytes and products
wherever they live, the old copies freed, and large pages granted where the kernel grants
them (measured here: /sys/kernel/mm/transparent_hugepage/enabled)."""

from __future__ import annotations

import gc
import itertools
import weakref
from pathlib import Path

import pytest
import torch

from engine import Engine, GenParams
from engine.model.pages import PMD, huge_bytes, huge_mapping, place_weights
from engine.model.quant import packed_weights
from tests.test_native import _layer, needs_vnni
from tests.test_quant import hybrid_dir  # noqa: F401  (a fixture)


def _thp() -> str:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), or ""."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


granted = pytest.mark.skipif(_thp() not in ("always", "madvise"),
                             reason=f"no transparent huge pages here ({_thp() or 'no THP'})")


def test_a_mapping_starts_on_a_large_page_and_is_zeroed_writable_memory() -> None:
    m = huge_mapping(3 * PMD + 5)
    if m is None:
        pytest.skip("no MADV_HUGEPAGE mapping on this OS")
    assert m.numel() == 3 * PMD + 5 and m.data_ptr() % PMD == 0
    assert int(m.sum()) == 0
    m.fill_(7)
    assert int(m[-1]) == 7 and huge_mapping(0) is None


@granted
def test_the_kernel_backs_a_written_mapping_with_large_pages() -> None:
    m = huge_mapping(4 * PMD)
    assert m is not None
    m.fill_(1)  # first touch: the pages come now
    assert (huge_bytes(m) or 0) >= 2 * PMD


@needs_vnni
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_placed_layouts_keep_their_bytes_and_products_and_free_the_old_copies(
        mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    layers = [_layer(mode, n, k, seed)[0] for seed, (n, k) in
              enumerate([(200, 64), (512, 384), (48, 96)])]
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, k, generator=gen).bfloat16() for k in (64, 384, 96)]
    before = [layer(xi) for layer, xi in zip(layers, xs, strict=True)]
    copies = [layer.packed.clone() for layer in layers]
    old = [weakref.ref(layer.packed) for layer in layers]

    monkeypatch.setenv("AHEAD_HUGE_PAGES", "0")
    assert place_weights(layers) == 0 and all(r() is layer.packed
                                              for r, layer in zip(old, layers, strict=True))
    monkeypatch.delenv("AHEAD_HUGE_PAGES")
    moved = place_weights([*layers, layers[0]])  # named twice: moved once
    if moved == 0:
        pytest.skip("no MADV_HUGEPAGE mapping on this OS")
    assert moved == sum(-(-c.nbytes // 4096) * 4096 for c in copies)
    gc.collect()
    assert all(r() is None for r in old)  # nothing else held them
    for layer, copy, xi, ref in zip(layers, copies, xs, before, strict=True):
        assert layer.packed.data_ptr() % 4096 == 0 and torch.equal(layer.packed, copy)
        assert torch.equal(layer(xi), ref)  # the same bits


@needs_vnni
def test_a_quantized_engine_decodes_the_same_tokens_from_large_pages(
        hybrid_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    kw = {"quant": "int4", "quant_cache": tmp_path, "max_seq_len": 128, "draft_vocab": 64,
          "dtype": torch.bfloat16}
    prompt = torch.randint(300, 396, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    monkeypatch.setenv("AHEAD_HUGE_PAGES", "0")
    where = Engine.load(hybrid_dir, **kw)  # type: ignore[arg-type]
    monkeypatch.delenv("AHEAD_HUGE_PAGES")
    placed = Engine.load(hybrid_dir, **kw)  # type: ignore[arg-type]
    a, b = (list(packed_weights(e.model).values()) for e in (where, placed))
    assert len(a) == len(b) and all(torch.equal(p.packed, q.packed)
                                    for p, q in zip(a, b, strict=True))
    if huge_mapping(1) is not None:  # (where a mapping can be had)
        spans = sorted((p.packed.data_ptr(), -(-p.packed.nbytes // 4096) * 4096) for p in b)
        assert all(start + size == after for (start, size), (after, _) in
                   itertools.pairwise(spans))  # side by side in one mapping
    for params in (GenParams(16, speculative=False, stop_loops=False),
                   GenParams(16, k=3, stop_loops=False)):
        assert placed.generate(prompt, params).tokens == where.generate(prompt, params).tokens
