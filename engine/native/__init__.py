"""Our own CPU kernels for AVX-512 VNNI CPUs: products by int4 and int8 weights (wq.c, in the
layout layout.py makes; encode.c makes it from a weight's values), the attention of a cached
forward and its cache writes (attention.c), Gated DeltaNet's delta rule a position at a time
(deltanet.c) and the rest of its step (gdn.c), the small row-wise operators of a bf16
step: norms, the SwiGLU gate, rotary embeddings, the logits' argmax (rows.c, rows.py), a
full-attention or Gated DeltaNet decoder block made of them in one call (layer.c, layer.py),
and a greedy MTP draft, its module's block and the draft head's pick included, in one call
(mtp.c, mtp.py).

The source ships with the package and is compiled on first use (build.py) by the system's
C compiler (`$CC`, else `cc`) into the cache ($XDG_CACHE_HOME/ahead/native, named by the
source, the flags and the compiler), then loaded with ctypes: no build step at install,
under a second to compile, and a machine without a compiler or without VNNI runs torch's
kernels instead (`status()` says which and why). `AHEAD_NATIVE=0` turns them off. Where the
CPU also has AVX512-BF16, attention scores bf16 queries and keys by bf16 dot products
(`bf16_dot`); where it has AMX-INT8, products of many rows run on its tiles (`amx`, wq.c),
and with AMX-BF16 as well, a bf16 attention's scores and values (`amx_bf16`, attention.c;
`AHEAD_AMX=0`: neither).
Threads: the kernel's OpenMP loop runs on the libgomp torch already loaded (the same
soname), as many threads as `torch.get_num_threads()`.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch
from torch import Tensor

from engine.native.build import FLAGS as FLAGS
from engine.native.build import SOURCES as SOURCES
from engine.native.build import NativeUnavailable as NativeUnavailable
from engine.native.build import compile_library, cpu_field, cpu_flags, missing_cpu_flags

# The weights' layout (layout.py), as callers know it: native.pack, native.GROUPS, ...
from engine.native.layout import GROUPS as GROUPS
from engine.native.layout import LAYOUT as LAYOUT
from engine.native.layout import TILE as TILE
from engine.native.layout import group_for as group_for
from engine.native.layout import pack as pack
from engine.native.layout import reference as reference

# A deferred settle as deltanet.c's delta_rule takes it: per row the offset of the state an
# earlier window read [B]; that window's k [B, H, P, Dk], factors [B, H, P, Dv] and decay
# [B, H, P] (fp32, contiguous); how many of its positions the row's committed state has [B]
# (int64; 0: none, the committed state is written).
Pending = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]

class Kernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib  # (rows.py declares its own functions)
        self.build = ""  # the library's name: a hash of the sources, flags and compiler
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn = lib.wq_linear
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, ctypes.c_int, i64, i64, i64, ptr, ptr, ptr, i64, *[ctypes.c_int] * 2]
        self._linear = fn
        self._linear_top = lib.wq_linear_top
        self._linear_top.restype = ctypes.c_int
        self._linear_top.argtypes = [*fn.argtypes, *[ctypes.c_void_p] * 3]
        att = lib.causal_attention
        att.restype = ctypes.c_int
        att.argtypes = [ptr, *[i64] * 10, ctypes.c_int, ptr, ptr, *[i64] * 4, ptr, ptr,
                        ctypes.c_int, ctypes.c_float, i64, i64, ctypes.c_int, ctypes.c_int]
        self._attention = att
        kv = lib.kv_write
        kv.restype = ctypes.c_int
        kv.argtypes = [ptr, ptr, *[i64] * 10, ptr, ptr, i64, i64, ptr, ptr, *[i64] * 3]
        self._kv_write = kv
        # attention's scores of bf16 queries and keys by bf16 dot products (attention.c), and
        # on AMD's CPUs its values (values_bf16): VDPBF16PS issues as often as an FMA there,
        # half as often on the Intel Xeons, where fp32 values were faster (docs/benchmarks.md)
        flags = cpu_flags() or frozenset()
        self.bf16_dot = "avx512_bf16" in flags
        self.bf16_values = self.bf16_dot and cpu_field("vendor_id") == "AuthenticAMD"
        self.amx = "amx_int8" in flags and os.environ.get("AHEAD_AMX", "1") != "0" \
            and lib.wq_amx_enable() == 1  # Linux grants the tile state
        # a bf16 attention on AMX tiles (attention.c scores_amx, values_amx) where bf16_dot runs
        self.amx_bf16 = self.amx and "amx_bf16" in flags
        delta = lib.delta_rule
        delta.restype = ctypes.c_int
        delta.argtypes = [ptr] * 8 + [i64] * 5 + [ptr, ctypes.c_int, ptr]
        delta.argtypes = [*delta.argtypes, *[ptr] * 5, i64]  # a deferred settle (Pending)
        self._delta = delta
        self._settle = lib.delta_settle
        self._settle.restype = None
        self._settle.argtypes = [ptr] * 7 + [i64] * 5 + [ctypes.c_int]
        gdn = lib.gdn_prepare
        gdn.restype = ctypes.c_int
        gdn.argtypes = [ptr] + [i64] * 10 + [ptr, i64, i64] + [ptr] * 10 + [ctypes.c_int] * 2
        self._gdn = gdn
        norm = lib.gdn_gated_norm
        norm.restype = ctypes.c_int
        norm.argtypes = [ptr] + [i64] * 4 + [ptr, i64, i64, ptr, ctypes.c_float, ptr, ctypes.c_int]
        self._gdn_norm = norm

    def run_delta_rule(self, q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor,
                       states: Tensor, src: Tensor, dst: Tensor, d: Tensor | None = None,
                       pending: Pending | None = None) -> Tensor:
        bsz, heads, seqlen, dk = q.shape
        q, k, v, decay, beta = (t.float().contiguous() for t in (q, k, v, decay, beta))
        src, dst = src.to(torch.int64).contiguous(), dst.to(torch.int64).contiguous()
        out = v.new_empty(v.shape)
        p = (None,) * 5 + (0,) if pending is None else \
            (*(t.data_ptr() for t in pending), pending[1].shape[2])
        done = self._delta(q.data_ptr(), k.data_ptr(), v.data_ptr(), decay.data_ptr(),
                           beta.data_ptr(), states.data_ptr(), src.data_ptr(), dst.data_ptr(),
                           bsz, heads, seqlen, dk, v.shape[-1], out.data_ptr(),
                           torch.get_num_threads(), None if d is None else d.data_ptr(), *p)
        if done == -2:
            raise MemoryError("delta rule: no scratch memory for a head's state")
        if done != 0:
            raise ValueError(f"delta rule: shapes the kernel does not take {tuple(v.shape)}")
        return out

    def run_delta_settle(self, k: Tensor, factors: Tensor, decay: Tensor, states: Tensor,
                         src: Tensor, dst: Tensor, n: Tensor) -> None:  # n: int64, contiguous
        self._settle(k.data_ptr(), factors.data_ptr(), decay.data_ptr(), states.data_ptr(),
                     src.data_ptr(), dst.data_ptr(), n.data_ptr(), *k.shape, factors.shape[-1],
                     torch.get_num_threads())

    def run_attention(self, q: Tensor, k: Tensor, v: Tensor, pos: Tensor,
                      scale: float | None = None, window: int = 0, ring: int = 0) -> Tensor:
        bsz, heads, seqlen, dim = q.shape
        if ring and not 0 < window <= ring <= k.shape[2]:
            raise ValueError(f"a ring of {ring} keys needs a window in (0, {ring}] and a "
                             f"cache of at least {ring} entries, got {window} and {k.shape[2]}")
        # q read, and the output written, in q's layout and dtype: no copy either way
        qf = q if q.dtype in (torch.float32, torch.bfloat16) and q.stride(-1) == 1 \
            else q.float().contiguous()
        positions, out = pos.to(torch.int64).contiguous(), torch.empty_like(qf)
        if self._attention(qf.data_ptr(), bsz, heads, seqlen, dim, *qf.stride()[:3],
                           *out.stride()[:3], int(qf.dtype == torch.bfloat16),
                           k.data_ptr(), v.data_ptr(), k.shape[1], k.stride(0), k.stride(1),
                           k.shape[2], positions.data_ptr(), out.data_ptr(),
                           int(k.dtype == torch.bfloat16), dim ** -0.5 if scale is None else scale,
                           window, ring, torch.get_num_threads(),
                           self.attention_dot(q.dtype)) != 0:
            raise MemoryError("the attention kernel could not allocate its scratch memory")
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def attention_dot(self, dtype: torch.dtype) -> int:
        """How attention takes queries of `dtype`: 0 as fp32; bf16 ones by AVX512-BF16 dot
        products its scores (1), or its scores and values (3); on AMX-BF16 tiles both (2)."""
        if not (self.bf16_dot and dtype == torch.bfloat16):
            return 0
        return 2 if self.amx_bf16 else 3 if self.bf16_values else 1

    def run_kv_write(self, cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor,
                     slots: Tensor, at: Tensor) -> bool:
        bsz, heads, seqlen, dim = k.shape
        slots, at = slots.to(torch.int64).contiguous(), at.to(torch.int64).contiguous()
        return self._kv_write(k.data_ptr(), v.data_ptr(), bsz, heads, seqlen, dim,
                              *k.stride()[:3], *v.stride()[:3], cache_k.data_ptr(),
                              cache_v.data_ptr(), *cache_k.stride()[:2], slots.data_ptr(),
                              at.data_ptr(),
                              cache_k.shape[0], cache_k.shape[2], k.element_size()) == 0

    def run_gdn_prepare(self, proj: Tensor, shape: GdnShape, conv: Tensor, index: Tensor,
                        slots: Tensor, weight: Tensor, a_log: Tensor,
                        dt_bias: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        bsz, seqlen, width = proj.shape
        hk, hv, dk, dv, kernel = shape
        c = 2 * hk * dk + hv * dv
        q, k = (proj.new_empty(bsz, hv, seqlen, dk, dtype=torch.float32) for _ in range(2))
        v = proj.new_empty(bsz, hv, seqlen, dv, dtype=torch.float32)
        decay, beta = (proj.new_empty(bsz, hv, seqlen, dtype=torch.float32) for _ in range(2))
        slots = slots.to(torch.int64).contiguous()
        done = self._gdn(proj.data_ptr(), width, c + hv * dv, c + hv * dv + hv, bsz, seqlen, hk,
                         hv, dk, dv, kernel, conv.data_ptr(), conv.shape[1], conv.shape[0],
                         slots.data_ptr(), index.data_ptr(), weight.data_ptr(),
                         a_log.data_ptr(), dt_bias.data_ptr(), q.data_ptr(), k.data_ptr(),
                         v.data_ptr(), decay.data_ptr(), beta.data_ptr(),
                         int(proj.dtype == torch.bfloat16), torch.get_num_threads())
        if done == -2:
            raise IndexError(f"Gated DeltaNet inputs: a slot or its state outside the state "
                             f"cache: slots {slots.tolist()}, of {conv.shape[0]}; ring "
                             f"{conv.shape[1]}")
        if done != 0:
            raise ValueError(f"Gated DeltaNet inputs: shapes the kernel does not take {shape}")
        return q, k, v, decay, beta

    def run_gdn_gated_norm(self, o: Tensor, proj: Tensor, z_off: int, weight: Tensor,
                           eps: float) -> Tensor:
        bsz, hv, seqlen, dv = o.shape
        out = proj.new_empty(bsz, seqlen, hv, dv)
        if self._gdn_norm(o.data_ptr(), bsz, seqlen, hv, dv, proj.data_ptr(), proj.shape[-1],
                          z_off, weight.data_ptr(), eps, out.data_ptr(),
                          int(proj.dtype == torch.bfloat16)) != 0:
            raise ValueError(f"gated norm: shapes the kernel does not take {tuple(o.shape)}")
        return out

    def run_linear(self, x: Tensor, w: Tensor, bias: Tensor | None, bits: int, n: int,
                   group: int, top: tuple[Tensor, ...] = ()) -> Tensor:
        """(`top`: index, lse and value tensors of y's rows for `wq_linear_top` to fill.)"""
        dtype, k = x.dtype, x.shape[-1]
        # x itself, the usual case: no view made
        rows = (x if dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()
        y = rows.new_empty(*x.shape[:-1], n)
        args = (w.data_ptr(), bits, n, k, group, None if bias is None else bias.data_ptr(),
                rows.data_ptr(), y.data_ptr(), rows.numel() // max(k, 1),
                int(rows.dtype == torch.bfloat16), torch.get_num_threads())
        if (self._linear_top(*args, *(t.data_ptr() for t in top)) if top
                else self._linear(*args)) != 0:
            raise MemoryError("the int8/int4 kernel could not allocate its scratch memory")
        return y if y.dtype == dtype else y.to(dtype)  # (a conversion to itself costs ~4 us)


@functools.cache
def _load() -> Kernels | str:
    if os.environ.get("AHEAD_NATIVE", "1") == "0":
        return "off (AHEAD_NATIVE=0)"
    if missing := missing_cpu_flags():
        return f"this CPU lacks {', '.join(missing)}"
    try:
        path = compile_library()
        got = Kernels(ctypes.CDLL(str(path)))
        got.build = path.stem
        return got
    except NativeUnavailable as e:
        return str(e)
    except OSError as e:
        return f"the compiled kernels do not load: {e}"


def kernels() -> Kernels:
    """The kernels, compiled and loaded once a process; raises NativeUnavailable."""
    got = _load()
    if isinstance(got, str):
        raise NativeUnavailable(got)
    return got


def status() -> str:
    """"vnni" when the kernels run here, else why not."""
    got = _load()
    return "vnni" if isinstance(got, Kernels) else got


def build() -> str:
    """Which build of the kernels runs (a hash of their sources, flags and compiler), else
    `status()`: what a step cost measured with them depends on (exec/calibration.py)."""
    got = _load()
    return got.build if isinstance(got, Kernels) else got


def flavour() -> str:
    """`status()`, "vnni+amx" where AMX tiles multiply calls of many rows (wq.c)."""
    got = _load()
    return "vnni+amx" if isinstance(got, Kernels) and got.amx else status()


_available: bool | None = None


def available() -> bool:
    """Whether the kernels run here: after the first call a module global, which a compiled
    graph reads as a constant (`torch.compiler.assume_constant_result` on this function would
    import torch._dynamo with this module: 1.9 s of every start)."""
    global _available
    if _available is None:
        _available = status() == "vnni"
    return _available


def linear(x: Tensor, w: Tensor, bias: Tensor | None, bits: int, n: int, group: int) -> Tensor:
    """x [..., K] (fp32 or bf16) times the weight `pack` made, plus `bias` (fp32)."""
    if torch.compiler.is_compiling():
        return torch.ops.ahead.wq_linear(x, w, bias, bits, n, group)
    return kernels().run_linear(x, w, bias, bits, n, group)


def attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float | None = None,
              window: int = 0, ring: int = 0) -> Tensor | None:
    """softmax(q k^T / sqrt(D)) v (or times `scale`) for q [B, H, S, D], each row (b, s)
    over keys 0..pos[b, s] of k, v [B, Hkv, kv_len, D] (views of a cache: rows of D
    contiguous), as `masked_attention` with the mask keys <= pos (a row past the keys sees
    them all), and with a `window` only the last that many of them; with a `ring`, the key of
    position t is entry t mod ring (cache/ring.py). None where the kernel does not take these
    tensors (then the caller's path runs)."""
    if not (k.dtype == v.dtype and k.dtype in (torch.float32, torch.bfloat16)
            and k.stride() == v.stride() and k.stride(-1) == 1
            and k.stride(-2) == k.shape[-1] and k.shape[-1] % 16 == 0
            and k.shape[-1] <= 512):
        return None
    if torch.compiler.is_compiling():
        return torch.ops.ahead.causal_attention(q, k, v, pos, scale, window, ring)
    return kernels().run_attention(q, k, v, pos, scale, window, ring)


def kv_write(cache_k: Tensor, cache_v: Tensor, k: Tensor, v: Tensor, slots: Tensor,
             at: Tensor) -> bool:
    """k, v [B, Hkv, S, D] into the caches [slots, Hkv, length, D] at row b's slot slots[b]
    and entries at[b] [S], as `cache_k[slots[:, None], :, at] = k.transpose(1, 2)` (v
    alike) writes them. False, writing nothing, where these tensors are not ones it takes
    (then the caller's indexed assignment runs, and raises what it raises)."""
    if not (available() and k.device.type == "cpu" and not torch.compiler.is_compiling()
            and not k.requires_grad and not v.requires_grad
            and k.dtype == v.dtype == cache_k.dtype == cache_v.dtype
            and k.dtype in (torch.float32, torch.bfloat16)
            and k.shape == v.shape and k.stride(-1) == 1 and v.stride(-1) == 1
            and cache_k.shape == cache_v.shape and cache_k.is_contiguous()
            and cache_v.is_contiguous() and cache_k.shape[1] == k.shape[1]
            and cache_k.shape[3] == k.shape[3] and at.shape == k.shape[::2]):
        return False
    return kernels().run_kv_write(cache_k, cache_v, k, v, slots, at)


def delta_rule(q: Tensor, k: Tensor, v: Tensor, decay: Tensor, beta: Tensor, states: Tensor,
               src: Tensor, dst: Tensor, d: Tensor | None = None,
               pending: Pending | None = None) -> Tensor | None:
    """`deltanet.recurrent` over q, k [B, H, S, Dk], v [B, H, S, Dv], decay (a_t, not its
    log), beta [B, H, S], each row's state at element offset src [B] of `states` (fp32,
    contiguous: the cache's ring), the state after each position to dst [B, S] (with d, eager
    only: none, and each position's factor into d [B, H, S, Dv]; with `pending`, eager
    only: committed states made first from an earlier window's factors: deltanet.c). Returns
    o [B, H, S, Dv]; None for shapes it does not take."""
    if not (states.dtype == torch.float32 and states.is_contiguous() and v.shape[-1] % 16 == 0
            and v.shape[-1] <= 256 and q.shape[2] <= 64):
        return None
    if torch.compiler.is_compiling():  # (never with d: see StateCache.delta_rule_window)
        return torch.ops.ahead.delta_rule(q, k, v, decay, beta, states, src, dst)
    return kernels().run_delta_rule(q, k, v, decay, beta, states, src, dst, d, pending)


GdnShape = tuple[int, int, int, int, int]  # key heads, value heads, Dk, Dv, conv kernel


def gdn_prepare(proj: Tensor, shape: GdnShape, conv: Tensor, index: Tensor, slots: Tensor,
                weight: Tensor, a_log: Tensor, dt_bias: Tensor
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None:
    """A Gated DeltaNet layer's delta-rule inputs for the positions of a step (gdn.c): from
    its fused input projections proj [B, S, W] (q, k, v's pre-convolution inputs, z, beta,
    alpha), the conv states in the cache's ring conv [slots, R, C, K-1] at each row's
    committed entry `index[slots]` (the state after each position written after it), and
    the fp32 weight by tap [K, C], A_log and dt_bias [Hv]: q, k [B, Hv, S, Dk]
    (L2-normalised, q by 1/sqrt(Dk)), v [B, Hv, S, Dv], decay and beta [B, Hv, S], fp32.
    None where the kernel does not take these tensors (head sizes not multiples of 16, or
    wider values than the delta rule's kernel takes, key heads wider than 512, windows of
    more than 64 positions)."""
    _, _, dk, dv, kernel = shape
    if torch.compiler.is_compiling() or proj.dtype not in (torch.float32, torch.bfloat16) \
            or conv.dtype != proj.dtype or not (proj.is_contiguous() and conv.is_contiguous()) \
            or dk % 16 or dv % 16 or dv > 256 or dk > 512 or proj.shape[1] > 64 \
            or not 2 <= kernel <= 8:
        return None
    return kernels().run_gdn_prepare(proj, shape, conv, index, slots, weight, a_log, dt_bias)


def gdn_gated_norm(o: Tensor, proj: Tensor, z_off: int, weight: Tensor, eps: float) -> Tensor:
    """GatedRMSNorm (model/deltanet.py) of the delta rule's output o [B, Hv, S, Dv] (fp32,
    contiguous) gated by the z at element z_off of each row of proj (`gdn_prepare`'s), the
    weight fp32 [Dv]: [B, S, Hv, Dv] in proj's dtype. For the shapes `gdn_prepare` takes."""
    return kernels().run_gdn_gated_norm(o, proj, z_off, weight, eps)


from engine.native import ops  # noqa: E402

ops.register(kernels)  # torch.ops.ahead.*, for compiled graphs
