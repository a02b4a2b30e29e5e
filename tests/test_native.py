"""Our int4/int8 CPU kernels (engine/native): what they compute, that a row's bits are its
own whatever the batch and threads, and what runs where they cannot."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import native
from engine.model.codes import Packed, encode
from engine.native import encode as to_layout
from engine.native import rows as row_ops

needs_vnni = pytest.mark.skipif(native.status() != "vnni",
                                reason=f"the kernels do not run here: {native.status()}")
MODES = ["int4", "int8"]


def _layer(mode: str, n: int, k: int, seed: int = 0) -> tuple[Packed, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen)
    codes, scales, group = encode(w, mode)
    return Packed(mode, codes, scales, bias, group), bias


@needs_vnni
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(200, 64), (50, 96), (33, 384), (16, 32)])
@pytest.mark.parametrize("rows", [1, 7, 19])
def test_the_kernel_computes_what_its_reference_says(mode: str, shape: tuple[int, int],
                                                     rows: int) -> None:
    layer, bias = _layer(mode, *shape)
    assert layer.native
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1))
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    want = native.reference(mode, layer.codes, layer.raw_scales, layer.native_group, x, bias)
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, shape[0])
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    got16 = layer(x.bfloat16())
    want16 = native.reference(mode, layer.codes, layer.raw_scales, layer.native_group,
                              x.bfloat16(), bias)
    assert got16.dtype == torch.bfloat16
    assert torch.allclose(got16.double(), want16, rtol=1e-2, atol=1e-2)


@needs_vnni
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 64), (16, 96), (300, 2048), (5, 256)])
def test_the_layout_made_from_a_weights_values_is_packs_of_its_codes(
        mode: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    """encode.c's layout, bit for bit the one `pack` makes of `encode`'s codes: rows of
    every scale, a constant group (no spread: the smallest scale), one of zeros, a huge
    value, and outputs that leave the last tile part empty."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(*shape, generator=gen) * torch.rand(shape[0], 1, generator=gen) * 3
    w[0, :32], w[1, :32], w[2, 5] = 0.5, 0.0, 1e4
    w = w.to(dtype)
    codes, scales, _ = encode(w, mode)
    group = native.group_for(shape[1])
    assert group is not None
    layout, got_group = to_layout.laid_out(w, mode)
    assert got_group == group
    assert torch.equal(layout, native.pack(mode, codes, scales, group))


@needs_vnni
@pytest.mark.parametrize("mode", MODES)
# activation groups of 128 (6 of them: four and two at a time on AMX), 64 and 32
@pytest.mark.parametrize("width", [256, 768, 64, 96])
@pytest.mark.parametrize("rows", [11, 4])
def test_a_rows_bits_are_its_own_in_any_batch_and_on_any_number_of_threads(
        mode: str, width: int, rows: int) -> None:
    """Also where the CPU has AMX: 22 rows (int8 and int4) and 8 (int8: one group at a
    time; int4) run on its tiles, one row on VPDPBUSD."""
    layer, _ = _layer(mode, 75, width)
    x = torch.randn(2, rows, width, generator=torch.Generator().manual_seed(2))
    together = layer(x)
    alone = torch.stack([torch.stack([layer(x[b, i:i + 1])[0] for i in range(rows)])
                         for b in range(2)])
    assert torch.equal(together, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(layer(x), together)
    finally:
        torch.set_num_threads(threads)


@needs_vnni
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1000, 37])  # many tiles a thread; a partial last tile
def test_the_products_argmax_and_log_sum_exp_are_those_of_what_it_stores(
        mode: str, threads: int, n: int) -> None:
    """`Packed.top` (wq.c `wq_linear_top`): the same outputs as the product, and per row the
    argmax, maximum and log-sum-exp rows.c gives of them, NaN and all -inf included: ties
    across tiles and threads go to the first index, as torch's argmax."""
    layer, _ = _layer(mode, n, 128, seed=3)
    assert layer.bias32 is not None
    # two outputs far above the rest, equal once rounded to bf16 (1000 + less than 4): a tie
    # in a tile of the first thread and one of the second, or of one thread's tiles
    layer.bias32[n // 2] = layer.bias32[n - 1] = 1000.0
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(4))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        for dtype in (torch.float32, torch.bfloat16):
            with torch.inference_mode():
                got = layer.top(x.to(dtype))
            assert got is not None
            out, index, top, lse = got
            assert torch.equal(out, layer(x.to(dtype)))
            want_index, want_lse = row_ops.argmax_lse(out)
            assert torch.equal(index, want_index)
            if dtype == torch.bfloat16:
                assert bool((index == n // 2).all())
            assert torch.equal(top, out.float().amax(-1))
            assert torch.allclose(lse, want_lse, rtol=1e-6, atol=1e-5)
        layer.bias32[:] = float("-inf")  # every output -inf: index 0, lse -inf
        with torch.inference_mode():
            got = layer.top(x)
        assert got is not None and bool((got[1] == 0).all()) and bool(torch.isinf(got[3]).all())
        layer.bias32[:] = 0.0
        layer.bias32[n - 2] = float("nan")  # a NaN: its index, lse NaN
        with torch.inference_mode():
            got = layer.top(x)
        assert got is not None and bool((got[1] == n - 2).all()) and bool(got[3].isnan().all())
    finally:
        torch.set_num_threads(before)


@needs_vnni
def test_the_kernel_runs_inside_a_compiled_graph() -> None:
    layer, _ = _layer("int4", 64, 128)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(lambda t: layer(t) * 2, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x) * 2)


def _status_in(env: dict[str, str]) -> list[str]:
    """native.status() and the kernels a quantized layer runs on, in a fresh process."""
    code = ("from engine import native; from engine.model.codes import Packed, encode;"
            "import torch; c, s, g = encode(torch.randn(32, 64), 'int8');"
            "p = Packed('int8', c, s, None, g); y = p(torch.randn(2, 64));"
            "print(native.status()); print(not p.native, tuple(y.shape))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_without_the_kernels_torch_runs_the_layer_and_status_says_why(tmp_path: Path) -> None:
    assert _status_in({"AHEAD_NATIVE": "0"}) == ["off (AHEAD_NATIVE=0)", "True (2, 32)"]
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'brokencc 1.0' && exit 0\n"
                      "echo 'brokencc: cannot compile' >&2; exit 1\n")
    broken.chmod(0o755)
    env = {"CC": str(broken), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    status, runs = _status_in(env)
    if native.status() == "vnni":  # else the CPU's own reason comes first
        assert status == f"the C compiler ({broken}) failed: brokencc: cannot compile"
    assert runs == "True (2, 32)"
    assert not list((tmp_path / "cache").rglob("*.so"))
    assert _status_in({"CC": str(tmp_path / "nocc"), "XDG_CACHE_HOME": str(tmp_path)})[1] \
        == "True (2, 32)"


@needs_vnni
def test_the_compiled_kernels_are_kept_and_reused(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert _status_in(env) == ["vnni", "False (2, 32)"]
    built = list((tmp_path / "ahead" / "native").glob("wq-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert _status_in(env)[0] == "vnni"
    assert built[0].stat().st_mtime_ns == stamp


@pytest.fixture(scope="module")
def amx_emulated(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """wq.c built with its AMX instructions carried out in C (tests/amx_emulated.c), its AMX
    kernels on from the start."""
    out = tmp_path_factory.mktemp("amx") / "wq_amx_emulated.so"
    rows_c = next(s for s in native.SOURCES if s.name == "rows.c")  # wq.c's argmax_lse
    done = subprocess.run([os.environ.get("CC") or "cc", *native.FLAGS, "-o", str(out),
                           str(Path(__file__).with_name("amx_emulated.c")), str(rows_c)],
                          capture_output=True, text=True, timeout=300)
    if "lacks the AMX intrinsics" in done.stderr:
        pytest.skip("this C compiler has no AMX intrinsics, so wq.c has no AMX kernels")
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    lib.wq_emulate_amx()
    lib.wq_linear.restype = ctypes.c_int
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int  # wq.c `wq_linear`'s
    lib.wq_linear.argtypes = [ptr, c_int, i64, i64, i64, ptr, ptr, ptr, i64, c_int, c_int]
    return lib


@needs_vnni
@pytest.mark.parametrize("mode", MODES)
# tiles 13 (an odd last one: int4 stores tiles by pairs), 5 and 3 (a partial last one), 1;
# activation groups of 128 (two, six: four and two at a time), 64 and 32
@pytest.mark.parametrize("shape", [(200, 256), (75, 768), (33, 64), (16, 96)])
@pytest.mark.parametrize("rows", [3, 5, 16, 19])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_amx_kernels_give_the_vnni_kernels_bits(amx_emulated: ctypes.CDLL, mode: str,
                                                     shape: tuple[int, int], rows: int,
                                                     threads: int) -> None:
    """wq.c's AMX kernels, their instructions emulated, on calls of as many rows as run on
    AMX tiles (int4 from 5, int8 from 3; int8 under 16 rows one group at a time): the bits
    of the kernels this CPU runs (VPDPBUSD, or AMX where it has it). Fewer rows stay on
    VPDPBUSD there too. So wherever the weights' layout changes, the AMX kernels are checked
    on any CPU, not only on one with AMX."""
    layer, _ = _layer(mode, *shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
    got = torch.empty(rows, shape[0], dtype=torch.bfloat16)
    assert amx_emulated.wq_linear(layer.packed.data_ptr(), 4 if mode == "int4" else 8,
                                  shape[0], shape[1], layer.native_group,
                                  layer.bias32.data_ptr(), x.data_ptr(), got.data_ptr(),
                                  rows, 1, threads) == 0
    assert torch.equal(got, layer(x))


def _attention_case(dtype: torch.dtype, seed: int = 0, dim: int = 128,
                    heads: tuple[int, int] = (6, 2)) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    cache_k = torch.randn(3, hkv, 96, dim, generator=gen).to(dtype)  # [slots, Hkv, len, D]
    cache_v = torch.randn(3, hkv, 96, dim, generator=gen).to(dtype)
    q = torch.randn(2, hq, 4, dim, generator=gen).to(dtype)  # [B, H, S, D]
    pos = torch.tensor([[0, 1, 2, 3], [40, 41, 42, 63]])
    return cache_k, cache_v, q, pos


@needs_vnni
@pytest.mark.parametrize(("dtype", "dot", "amx", "values"),
                         [(torch.float32, False, False, False),
                          (torch.bfloat16, False, False, False),
                          (torch.bfloat16, True, False, False),
                          (torch.bfloat16, True, False, True),
                          (torch.bfloat16, True, True, False)],
                         ids=["fp32", "bf16", "bf16-dot-products", "bf16-dot-values",
                              "bf16-amx-tiles"])
@pytest.mark.parametrize("dim", [128, 80])  # values 64 lanes at a time; 80: 64, then 16
@pytest.mark.parametrize("heads", [(6, 2), (12, 2), (12, 1)])
def test_attention_is_masked_attention_and_a_rows_bits_are_its_own(
        dtype: torch.dtype, dot: bool, amx: bool, values: bool, dim: int,
        heads: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The ways of scoring bf16 keys: converted to fp32, by bf16 dot products where the CPU
    has them (AVX512-BF16; the values too, as AMD's CPUs run them), and on AMX-BF16 tiles
    (the values too). A row alone (3, 6 or 12 query rows a kv head) and among 4 positions
    (12 rows, 24: AMX's tiles of 16 and 8, or 48: tiles of 32 and 16), scored 4, 2 and 1
    rows at a time, their values 6, 4, 2 and 1: the same bits.
    And q as a projection makes it ([B, S, H, D] seen as [B, H, S, D]): the same bits,
    written in that layout."""
    from engine.model.attention import masked_attention

    if dot and not native.kernels().bf16_dot:
        pytest.skip("this CPU has no AVX512-BF16 dot products")
    if amx and not native.kernels().amx_bf16:
        pytest.skip("this CPU has no AMX-BF16 tiles, or Linux did not grant them")
    monkeypatch.setattr(native.kernels(), "bf16_dot", dot)
    monkeypatch.setattr(native.kernels(), "bf16_values", values)
    monkeypatch.setattr(native.kernels(), "amx_bf16", amx)
    cache_k, cache_v, q, pos = _attention_case(dtype, dim=dim, heads=heads)
    kernel = native
    k, v = cache_k[1:3, :, :64], cache_v[1:3, :, :64]  # slots 1, 2; a bucket of 64 keys
    got = kernel.attention(q, k, v, pos)
    assert got is not None and got.dtype == dtype and got.shape == q.shape
    mask = (torch.arange(64)[None, None, :] <= pos[:, :, None])[:, None]
    want = masked_attention(q.float(), k.float(), v.float(), mask)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol)
    # all keys of the slots instead of a bucket; each row alone: the same bits
    assert torch.equal(kernel.attention(q, cache_k[1:3], cache_v[1:3], pos), got)
    for b in range(2):
        for s in range(4):
            alone = kernel.attention(q[b:b + 1, :, s:s + 1], k[b:b + 1], v[b:b + 1],
                                     pos[b:b + 1, s:s + 1])
            assert torch.equal(alone, got[b:b + 1, :, s:s + 1])
    projected = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] underneath
    seen = kernel.attention(projected, k, v, pos)
    assert seen is not None and seen.stride() == projected.stride()
    assert torch.equal(seen, got)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seqlen", [1, 4])
def test_kv_write_writes_what_indexed_assignment_writes(dtype: torch.dtype,
                                                         seqlen: int) -> None:
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(3, 2, 40, 32, generator=gen).to(dtype)  # [slots, Hkv, length, D]
    projected = torch.randn(2, seqlen, 2 * 2 * 32, generator=gen).to(dtype)  # [B, S, 2HD]
    k, v = (t.view(2, seqlen, 2, 32).transpose(1, 2) for t in projected.split(64, -1))
    k = k.transpose(1, 2).contiguous().transpose(1, 2)  # as rotated: other strides than v
    slots = torch.tensor([2, 0])
    at = torch.tensor([[5], [40 - seqlen]]) + torch.arange(seqlen)  # [B, S]: to the end
    want_k, want_v = cache.clone(), cache.clone()
    want_k[slots[:, None], :, at] = k.transpose(1, 2)
    want_v[slots[:, None], :, at] = v.transpose(1, 2)
    got_k, got_v = cache.clone(), cache.clone()
    assert native.kv_write(got_k, got_v, k, v, slots, at)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # Outside the cache: nothing written, and the caller's assignment runs (and raises).
    for bad_slots, bad_at in ((torch.tensor([3, 0]), at), (slots, at + 40), (slots, at - 50)):
        assert not native.kv_write(got_k, got_v, k, v, bad_slots, bad_at)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    # Tensors it does not take: another dtype than the cache's.
    assert not native.kv_write(got_k, got_v, k.half(), v.half(), slots, at)


@needs_vnni
def test_attention_rows_past_the_keys_see_them_all_and_other_tensors_are_declined() -> None:
    cache_k, cache_v, q, pos = _attention_case(torch.float32)
    kernel = native
    k, v = cache_k[1:3, :, :48], cache_v[1:3, :, :48]
    parked = pos.clone()
    parked[1] = 95  # padding rows of a prefill sit at the cache's last position
    last = pos.clone()
    last[1] = 47
    assert torch.equal(kernel.attention(q, k, v, parked), kernel.attention(q, k, v, last))
    assert kernel.attention(q.half(), cache_k[1:3].half(), cache_v[1:3].half(), pos) is None


@needs_vnni
@pytest.mark.parametrize("v_dim", [48, 64, 256])  # the kernel's chunks: 16, 64, 128 columns
def test_the_delta_rule_runs_in_the_cache_ring_as_the_recurrent_form_does(v_dim: int) -> None:
    from engine.cache.state import StateCache
    from engine.model.deltanet import recurrent

    gen = torch.Generator().manual_seed(4)
    heads, k_dim, ring = 4, 32, 5
    index = torch.tensor([1, 0, 4])  # each slot's committed ring entry (4: the next wraps)
    cache = StateCache(3, ring, 8, 4, heads, k_dim, v_dim, index, torch.float32)
    cache.state.normal_(generator=gen)
    slots = torch.tensor([2, 0])

    def case(n: int) -> tuple[torch.Tensor, ...]:
        q, k = (torch.randn(2, heads, n, k_dim, generator=gen) * 0.3 for _ in range(2))
        v = torch.randn(2, heads, n, v_dim, generator=gen)
        return q, k, v, -torch.rand(2, heads, n, generator=gen), torch.rand(2, heads, n,
                                                                             generator=gen)

    q, k, v, g, beta = case(3)
    committed = cache.read_state(slots).clone()
    want_o, want_states = recurrent(q, k, v, g, beta, committed)
    src, dst = cache.state_offsets(slots, 3)
    got = native.delta_rule(q, k, v, g.exp(), beta, cache.state, src, dst)
    assert got is not None
    assert torch.allclose(got, want_o, atol=1e-5)
    at = (index[slots, None] + torch.arange(1, 4)) % ring
    assert torch.allclose(cache.state[slots[:, None], at], want_states, atol=1e-5)
    assert torch.equal(cache.read_state(slots), committed)  # the committed entry is untouched
    # one slot alone, one position at a time: the same bits as the window of three
    window = got[1:].clone()
    after = cache.state[slots[1:, None], at[1:]].clone()
    for t in range(3):
        src, dst = cache.state_offsets(slots[1:], 1)
        one = native.delta_rule(*(x[1:, :, t:t + 1] for x in (q, k, v, g.exp(), beta)),
                                          cache.state, src, dst)
        assert one is not None and torch.equal(one, window[:, :, t:t + 1])
        assert torch.equal(cache.state[slots[1:], (index[slots[1:]] + 1) % ring], after[:, t])
        index[slots[1:]] = (index[slots[1:]] + 1) % ring  # commit the position


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("top", "rows"), [(52, [[49, 50, 51], [47, 48, 51]]),
                                           (5, [[2, 3, 4], [0, 1, 4]])],
                         ids=["wrapped", "near-the-start"])
def test_attention_over_a_ring_gives_the_bits_of_a_full_length_cache(
        dtype: torch.dtype, top: int, rows: list[list[int]]) -> None:
    """A sliding-window layer's ring (cache/ring.py) holds position t's key at entry
    t mod size: the kernel reads the keys the full-length cache holds, in the same order,
    and the ring's mask says what the torch path sees."""
    from engine.cache.ring import ring_mask
    from engine.model.attention import masked_attention

    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, window, size, length = 4, 2, 32, 7, 11, 60
    full_k = torch.randn(2, kv_heads, length, dim, generator=gen).to(dtype)
    full_v = torch.randn(2, kv_heads, length, dim, generator=gen).to(dtype)
    # The ring after writing positions 0..top-1 in order: entry e holds the last t with
    # t mod size == e; the others (and entry `size`, the scratch one) hold noise.
    ring_k = torch.randn(2, kv_heads, size + 1, dim, generator=gen).to(dtype)
    ring_v = torch.randn(2, kv_heads, size + 1, dim, generator=gen).to(dtype)
    for t in range(top):
        ring_k[:, :, t % size], ring_v[:, :, t % size] = full_k[:, :, t], full_v[:, :, t]
    q = torch.randn(2, heads, 3, dim, generator=gen).to(dtype)
    pos = torch.tensor(rows)
    want = native.attention(q, full_k, full_v, pos, None, window)
    got = native.attention(q, ring_k, ring_v, pos, None, window, size)
    assert got is not None and want is not None and torch.equal(got, want)
    masked = masked_attention(q.float(), ring_k.float(), ring_v.float(),
                              ring_mask(pos, window, size))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.float(), masked, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="ring of 11 keys needs a window"):
        native.attention(q, ring_k, ring_v, pos, None, size + 1, size)


@needs_vnni
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel", [2, 4, 5, 6])
def test_the_gated_deltanet_inputs_and_conv_states_are_the_layers_torch_path(
        dtype: torch.dtype, kernel: int) -> None:
    """gdn.c over a window of 3 positions for 2 rows of a 3-slot ring (one about to wrap):
    the convolution, norms and gates as model/deltanet.py computes them, and the conv state
    after each position in its ring entry, bit for bit (the window's own inputs). Kernels
    of 2-5 taps move bf16 states by permutes, 6 and fp32 element by element. A slot past the
    ring's, or an entry past the ring: an error, nothing written."""
    import torch.nn.functional as F

    from engine.model.deltanet import _prepare, causal_conv

    gen = torch.Generator().manual_seed(6)
    hk, hv, dk, dv, ring, seqlen = 2, 4, 32, 48, 5, 3
    c = 2 * hk * dk + hv * dv
    width = c + hv * dv + 2 * hv  # q, k, v's inputs, z, beta, alpha
    proj = torch.randn(2, seqlen, width, generator=gen).to(dtype)
    conv = torch.randn(3, ring, c, kernel - 1, generator=gen).to(dtype)
    index, slots = torch.tensor([1, 0, 4]), torch.tensor([2, 0])
    weight = torch.randn(c, kernel, generator=gen) * 0.3
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    committed = conv[slots, index[slots]].clone()  # [B, C, K-1]
    before = conv.clone()
    got = native.gdn_prepare(proj, (hk, hv, dk, dv, kernel), conv, index, slots,
                             weight.t().contiguous(), a_log, dt_bias)
    assert got is not None
    window = torch.cat([committed, proj[..., :c].transpose(1, 2)], dim=-1)  # [B, C, K-1+S]
    mixed = causal_conv(window, weight).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    want = _prepare(q.reshape(2, seqlen, hk, dk), k.reshape(2, seqlen, hk, dk),
                    v.reshape(2, seqlen, hv, dv), hv // hk)
    beta = torch.sigmoid(proj[..., c + hv * dv:c + hv * dv + hv].float()).transpose(1, 2)
    alpha = proj[..., c + hv * dv + hv:].float() + dt_bias
    decay = torch.exp(-a_log.exp() * F.softplus(alpha)).transpose(1, 2)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: silu's rounding may differ
    for name, a, b in zip(("q", "k", "v", "decay", "beta"), got, (*want, decay, beta),
                          strict=True):
        assert a.shape == b.shape and torch.allclose(a, b, atol=tol, rtol=tol), name
    for s in range(seqlen):  # the conv state after position s: inputs s+1 .. s+K-1
        at = (index[slots] + 1 + s) % ring
        assert torch.equal(conv[slots, at], window[:, :, s + 1:s + kernel]), s
    assert torch.equal(conv[slots, index[slots]], committed)
    written = torch.zeros(conv.shape[:2], dtype=torch.bool)
    for s in range(seqlen):
        written[slots, (index[slots] + 1 + s) % ring] = True
    assert torch.equal(conv[~written], before[~written])  # nothing else touched
    after = conv.clone()
    bad_index = index.clone()
    bad_index[2] = ring  # an entry past the ring
    for bad_slots, entries in ((torch.tensor([3, 0]), index), (torch.tensor([-1, 0]), index),
                               (slots, bad_index)):
        with pytest.raises(IndexError, match="outside the state cache"):
            native.gdn_prepare(proj, (hk, hv, dk, dv, kernel), conv, entries, bad_slots,
                               weight.t().contiguous(), a_log, dt_bias)
    assert torch.equal(conv, after)  # nothing written


@needs_vnni
def test_timed_counts_each_kernel_call_and_leaves_the_kernels_as_they_were() -> None:
    """`timing.timed` (the bench's breakdown of a step) times each call of our kernels by
    its part, and afterwards the calls go straight to the kernels again."""
    from engine.native import rows
    from engine.native.timing import timed

    norm, products = rows._rms_norm, type(native.kernels()).run_linear
    codes, scales, group = encode(torch.randn(48, 64), "int4")
    packed = Packed("int4", codes, scales, None, group)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    want = packed(x)
    with timed() as totals:
        assert torch.equal(packed(x), want)
        packed(x)
        rows.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 0.0, 1e-6, False)
    assert totals["int8/int4 products"][1] == 2 and totals["norms"][1] == 1
    assert totals["int8/int4 products"][0] > 0 and totals["attention"] == [0.0, 0]
    assert rows._rms_norm is norm and "run_linear" not in vars(native.kernels())
    assert type(native.kernels()).run_linear is products
    packed(x)
    assert totals["int8/int4 products"][1] == 2  # no longer counted


@needs_vnni
@pytest.mark.parametrize("v_dim", [48, 64, 256])  # the kernel's chunks: 16, 64, 128 columns
def test_a_window_that_writes_no_state_settles_the_kept_one_bit_for_bit(v_dim: int) -> None:
    """`StateCache.delta_rule_window` writes none of a window's states; the commit's `settle`
    rebuilds the one it keeps, the last included, from the committed state and the window's
    factors: the bits `delta_rule` writes for that position, the outputs the same, nothing
    else of the ring touched."""
    from engine.cache.state import StateCache

    gen = torch.Generator().manual_seed(5)
    heads, k_dim, width, ring = 4, 32, 4, 6
    index = torch.tensor([1, 0, 4])
    slots = torch.tensor([2, 0])
    q, k = (torch.randn(2, heads, width, k_dim, generator=gen) * 0.3 for _ in range(2))
    v = torch.randn(2, heads, width, v_dim, generator=gen)
    decay, beta = torch.rand(2, heads, width, generator=gen), torch.rand(2, heads, width,
                                                                          generator=gen)
    cache = StateCache(3, ring, 8, 4, heads, k_dim, v_dim, index, torch.float32)
    cache.state.normal_(generator=gen)
    start = cache.state.clone()
    src, dst = cache.state_offsets(slots, width)
    every = start.clone()
    want = native.delta_rule(q, k, v, decay, beta, every, src, dst)
    assert want is not None
    entries = (index[slots, None] + torch.arange(1, width + 1)) % ring  # [rows, positions]
    for kept in ([0, 2], [1, 3], [3, 0], [2, 1], [3, 3]):
        cache.state.copy_(start)
        out = cache.delta_rule_window(q, k, v, decay, beta, slots)
        assert out is not None and torch.equal(out, want) and cache.unsettled is not None
        assert torch.equal(cache.state, start)  # the pass wrote no state
        cache.settle(slots[[1, 0]], torch.tensor(kept[::-1]))  # rows matched by slot
        assert cache.unsettled is None
        for row, n in enumerate(kept):
            slot, entry = slots[row], entries[row, n]
            assert torch.equal(cache.state[slot, entry], every[slot, entry]), (kept, row)
            untouched = [e for e in range(ring) if e != int(entry)]
            assert torch.equal(cache.state[slot, untouched], start[slot, untouched])
        assert torch.equal(cache.state[1], start[1])  # a slot not in the window


@needs_vnni
@pytest.mark.parametrize("v_dim", [48, 64, 256])
@pytest.mark.parametrize("width", [4, 1])  # the next pass: a verify window, a plain step
def test_a_deferred_settle_made_by_the_next_pass_gives_the_settles_bits(
        v_dim: int, width: int) -> None:
    """A commit defers the write of the state it keeps (`StateCache.defer`); the next pass
    of the same rows makes it as it reads it: its outputs and the committed state it writes
    (and a plain step's state after its position) are the bits of a settle followed by the
    pass, for every kept position, the window's last included; a pass of other rows, or any
    other reader, has it settled first."""
    from engine.cache.state import StateCache, commit

    gen = torch.Generator().manual_seed(11)
    heads, k_dim, window, ring = 4, 32, 4, 6
    slots = torch.tensor([2, 0])

    def inputs(s: int) -> tuple[torch.Tensor, ...]:
        q, k = (torch.randn(2, heads, s, k_dim, generator=gen) * 0.3 for _ in range(2))
        return (q, k, torch.randn(2, heads, s, v_dim, generator=gen),
                torch.rand(2, heads, s, generator=gen), torch.rand(2, heads, s, generator=gen))

    first, second = inputs(window), inputs(width)
    start = torch.randn(3, ring, heads, k_dim, v_dim, generator=gen)

    def run(kept: list[int], deferred: bool) -> tuple[StateCache, torch.Tensor]:
        index = torch.tensor([1, 0, 4])
        cache = StateCache(3, ring, 8, 4, heads, k_dim, v_dim, index, torch.float32)
        cache.state.copy_(start)
        assert cache.delta_rule_window(*first, slots) is not None
        u, n = cache.unsettled, torch.tensor(kept)
        assert u is not None
        if deferred:
            cache.defer(u.kept(slots, n))
            assert cache.pending
        else:
            cache.settle(slots, n)
        commit(index, ring, slots, n)
        pending = cache.take(slots) if deferred else None
        assert not cache.pending
        if width > 1:
            out = cache.delta_rule_window(*second, slots, pending)
        else:
            src, dst = cache.state_offsets(slots, width)
            out = native.delta_rule(*second, cache.state, src, dst, pending=pending)
        assert out is not None
        return cache, out

    for kept in ([0, 2], [1, 3], [3, 3], [2, 0]):
        (want, want_out), (got, got_out) = run(kept, False), run(kept, True)
        assert torch.equal(got_out, want_out), kept
        assert torch.equal(got.state, want.state), kept  # committed, last and every other
        index = torch.tensor([1, 0, 4])  # and for any other reader, settled first
        other = StateCache(3, ring, 8, 4, heads, k_dim, v_dim, index, torch.float32)
        other.state.copy_(start)
        assert other.delta_rule_window(*first, slots) is not None and other.unsettled is not None
        other.defer(other.unsettled.kept(slots, torch.tensor(kept)))
        commit(index, ring, slots, torch.tensor(kept))
        settled = run(kept, False)[0]
        assert torch.equal(other.read_state(slots), settled.state[slots, index[slots]])
        assert not other.pending
    # rows stepping by turns each keep theirs: a pass of other rows leaves it, a reader of
    # any of its rows has it made
    cache = StateCache(3, ring, 8, 4, heads, k_dim, v_dim, torch.tensor([1, 0, 4]),
                       torch.float32)
    assert cache.delta_rule_window(*first, slots) is not None and cache.unsettled is not None
    cache.defer(cache.unsettled.kept(slots, torch.tensor([0, 1])))
    assert cache.take(torch.tensor([1])) is None and list(cache.pending) == [(2, 0)]
    cache.settle_pending(torch.tensor([1]))
    assert list(cache.pending) == [(2, 0)]
    cache.settle_pending(torch.tensor([0, 1]))
    assert not cache.pending
