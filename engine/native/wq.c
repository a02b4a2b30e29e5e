/* Products by int4 and int8 weights on AVX-512 VNNI CPUs: y = x W^T (+ b).

Activations are quantized to int8 per group of G inputs (one scale a group and row, as
llama.cpp's Q8_0 does per 32), and each group's products summed in int32 by VPDPBUSD
(unsigned weight bytes times signed activation bytes); a group's sum becomes float once:
with w = q s + m and a = qa sa, sum_k w a = sa (s sum q qa + m sum qa).

Why not torch's weight-only kernels: they run one row at a time and reread the weights for
every row. Here the weights stream once per call, a tile of 16 outputs at a time (int4 calls
of fewer than 8 rows: two tiles at a time, `pair_rows`), and every row of the call is
multiplied by the tile while it is in registers: on a memory-bound machine a call of a few
rows (a speculative verify) costs about what one row costs.

A row's result depends on that row alone: its int8 codes and scales come from its own
values, int32 sums are exact in any order, and the float sums over groups run in the same
order whatever the number of rows or which thread runs the tile. Batch size and position
never change a bit.

Layout (made by layout.py `pack` and encode.c `wq_encode`), one block per (tile of 16
outputs, group of G inputs), tiles outer, int4 tiles by pairs (where each block's bytes are:
tiles.h `tile_at`):
  int4: G/8 vectors of 64 bytes; lane c (output t*16+c), byte b of vector j holds
        q[k = g*G + 8j + b] in its low nibble and q[k + 4] in its high nibble;
  int8: G/4 vectors of 64 bytes; lane c, byte b of vector j holds q[k = g*G + 4j + b];
  2-bit (a draft head's coarse pass, made from its int4 layout by encode.c
        `wq_coarse_from_int4`): G/16 vectors of 64 bytes; bits 2i..2i+1 of byte b, lane c,
        vector j hold q[k = g*G + 16j + 4i + b];
  then 16 fp16 scales s and 16 fp16 offsets m: w = q s + m.
*/
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tiles.h"
#include "vecmath.h"

typedef int32_t __attribute__((may_alias)) quad; /* 4 activation codes */

#define MAX_ROWS 8
/* Rows of a pair of int4 tiles at a time: their accumulators fill the registers. */
#define PAIR_ROWS 4
/* Prefetch distances in bytes ahead of the tile being multiplied: into L1 (the hardware
   prefetcher alone left one thread at 9.7 GB/s on Qwen2-1.5B's int4 weights where a copy
   reads 12.8) and, further on, into L2, so that memory keeps streaming while a call of
   several rows computes. A trunk's worth of int4 products by turns on the 2-core EPYC:
   2 KB into L1 alone gave 4 rows at 1.16-1.32x one row's time; 4 KB into L1 and 16 KB into
   L2, 1.03-1.06x, and one row ~10% faster on one thread. A pair of int4 tiles is one
   stream (tiles.h), fetched into L1 alone (`pair_rows`). int8 tiles fetch into L1 alone:
   on the EPYC (Zen 5) the L2 fetches besides made 1 and 4 rows 10-15% slower (Qwen2-1.5B's
   and Qwen3.5-2B's shapes, interleaved medians, DRAM-bound). */
#define PREFETCH_L1 4096
#define PREFETCH_L2 16384

/* acc + the dot products of w's unsigned bytes with the 4 signed bytes at a, broadcast: one
   instruction with the broadcast in its memory operand (the intrinsics gave a broadcast load
   and register copies besides, which a 4-row tile pays for in every vector of weights). */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const quad *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*a));
    return acc;
}

/* acc + the dot products of w's unsigned bytes with b's signed ones, acc written in place.
   GCC compiled the intrinsic (`_mm512_dpbusd_epi32`) in `pair_rows`' one-row loop into a
   copy of each accumulator before its instruction and another after, on the loop's chain of
   dependent instructions; with this, one row's int4 products ran 12-13% faster on the 2-core
   EPYC Zen 4 (Qwen3.5-2B's MLP and attention shapes from DRAM, one thread, by turns) and a
   plain decode step of Qwen3.5-2B 9% faster. A call of four rows, eight chains, ran 2-3%
   slower with it, so it keeps the intrinsic; two and three rows are the same either way. */
static inline __m512i dpbusd(__m512i acc, __m512i w, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(b));
    return acc;
}

/* Row r of x (fp32, or bf16 when bf16 != 0) as int8 codes per group, the group's scale
   and the scale times the sum of its codes. Vectors of 16: the largest magnitude and the
   int32 sum come out the same in any order. */
static void quantize_row(const void *x, int bf16, int64_t r, int64_t K, int64_t G,
                         int8_t *qa, float *sa, float *ssum) {
    for (int64_t g = 0; g < K / G; g++) {
        const int64_t k0 = r * K + g * G;
        __m512 vmax = _mm512_setzero_ps();
        for (int64_t i = 0; i < G; i += 16)
            vmax = _mm512_max_ps(_mm512_abs_ps(load16(x, k0 + i, bf16)), vmax);  /* NaN: skipped */
        const float amax = _mm512_reduce_max_ps(vmax);
        const float scale = amax / 127.0f;
        const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < G; i += 16) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x, k0 + i, bf16), inv));
            sum = _mm512_add_epi32(sum, q);
            _mm_storeu_si128((__m128i *)(qa + k0 + i), _mm512_cvtsepi32_epi8(q));
        }
        sa[r * (K / G) + g] = scale;
        ssum[r * (K / G) + g] = scale * (float)_mm512_reduce_add_epi32(sum);
    }
}

/* x's M rows as int8 codes per group (`quantize_row`), in memory of their own. */
typedef struct {
    int8_t *qa;
    float *sa, *ssum;
} Coded;

static int code_rows(const void *x, int bf16, int64_t M, int64_t K, int64_t G, Coded *c) {
    c->qa = aligned_alloc(64, (size_t)((M * K + 63) / 64 * 64));
    c->sa = malloc(sizeof(float) * (size_t)(M * (K / G)) * 2);
    if (!c->qa || !c->sa) {
        free(c->qa);
        free(c->sa);
        return -1;
    }
    c->ssum = c->sa + M * (K / G);
    for (int64_t r = 0; r < M; r++) quantize_row(x, bf16, r, K, G, c->qa, c->sa, c->ssum);
    return 0;
}

static void coded_free(Coded *c) {
    free(c->qa);
    free(c->sa);
}

/* A group's int32 sums of rows r0 .. r0 + mr - 1 into their float accumulators, by the
   block's fp16 scales s and offsets m at sm: facc += sum (s sa) + m ssum. i0: the group's
   index for row r0 into sa and ssum. */
static inline __attribute__((always_inline)) void fold_group(
        __m512 *facc, const __m512i *sum, const int mr, const uint8_t *sm, const float *sa,
        const float *ssum, int64_t i0, int64_t ng) {
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sm));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sm + 32)));
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r * ng;
        facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[r]),
                                  _mm512_mul_ps(s, _mm512_set1_ps(sa[i])), facc[r]);
        facc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ssum[i]), facc[r]);
    }
}

/* One row's running argmax and log-sum-exp over the outputs one thread stores, in the
   order it stores them (`wq_linear_top`): per lane the largest value and the first index of
   it, and the sum of e^(v - ref), ref the largest value so far (the sums are rescaled when
   it grows, which after a row's first tiles is rare). */
typedef struct {
    __m512 best, sum;
    __m512i at;
    float ref;
    int64_t nan;  /* the first NaN's index, or -1 */
} __attribute__((aligned(64))) Top;

static void top_start(Top *t) {
    t->best = _mm512_set1_ps(-INFINITY);
    t->sum = _mm512_setzero_ps();
    t->at = _mm512_set1_epi32(0x7fffffff);
    t->ref = -INFINITY;
    t->nan = -1;
}

/* The lanes in m of v, outputs n0 .. n0 + 15 as stored, into t. */
static inline void top_add(Top *t, __m512 v, __mmask16 m, int64_t n0) {
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    if (nan && t->nan < 0) t->nan = n0 + __builtin_ctz(nan);
    const __mmask16 more = _mm512_mask_cmp_ps_mask(m, v, t->best, _CMP_GT_OQ);
    t->best = _mm512_mask_mov_ps(t->best, more, v);
    t->at = _mm512_mask_mov_epi32(t->at, more, _mm512_add_epi32(
        _mm512_set1_epi32((int)n0), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                       12, 13, 14, 15)));
    const __mmask16 ok = m & ~nan;
    if (_mm512_mask_cmp_ps_mask(ok, v, _mm512_set1_ps(t->ref), _CMP_GT_OQ)) {
        const float top = _mm512_mask_reduce_max_ps(ok, v);
        t->sum = _mm512_mul_ps(t->sum, exp_nonpositive(_mm512_set1_ps(t->ref - top)));
        t->ref = top;
    }
    if (t->ref != -INFINITY)
        t->sum = _mm512_add_ps(t->sum, _mm512_maskz_mov_ps(
            ok, exp_nonpositive(_mm512_sub_ps(v, _mm512_set1_ps(t->ref)))));
}

/* Rows r0 .. r0 + mr - 1 of the tile of outputs from n0: facc + bias, into y (and, with
   top, each row's value as stored into its running argmax and log-sum-exp). */
static inline __attribute__((always_inline)) void store_tile(
        void *y, const __m512 *facc, const int mr, int64_t r0, int64_t N, int64_t n0,
        const float *bias, int bf16, Top *top) {
    const __mmask16 mask = tail(N - n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : _mm512_setzero_ps();
    for (int r = 0; r < mr; r++) {
        const __m512 v = _mm512_add_ps(facc[r], b);
        store16(y, (r0 + r) * N + n0, v, mask, bf16);
        if (top) top_add(top + r0 + r, bf16 ? round_bf16(v) : v, mask, n0);
    }
}

/* One tile of 16 outputs for `mr` rows (a constant in each inlined copy). */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *w, int bits, int64_t K, int64_t G, const int8_t *qa, const float *sa,
        const float *ssum, int64_t r0, const int mr, const float *bias, void *y, int bf16,
        int64_t N, int64_t t, Top *top) {
    const int64_t ng = K / G;
    const Tile tl = tile_at(w, bits, (N + TILE - 1) / TILE, ng, G, t);
    /* int4 vectors are 64 or 128 bytes apart (a tile alone or in a pair: tiles.h); int8 and
       2-bit ones 64, a constant in their loops (the variable made four int8 rows 13% slower
       on the Zen 4) */
    const int64_t vs = tl.vs;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 facc[MAX_ROWS];
    for (int r = 0; r < mr; r++) facc[r] = _mm512_setzero_ps();
    const uint8_t *p = tl.p;
    for (int64_t g = 0; g < ng; g++, p += tl.gs) {
        __m512i acc[MAX_ROWS], acc2[MAX_ROWS];  /* two chains: half the latency a group */
        for (int r = 0; r < mr; r++) acc[r] = acc2[r] = _mm512_setzero_si512();
        const int8_t *a0 = qa + r0 * K + g * G;
        if (bits == 4) {
            for (int64_t j = 0; j < G / 8; j++) {
                _mm_prefetch((const char *)p + vs * j + PREFETCH_L1, _MM_HINT_T0);
                _mm_prefetch((const char *)p + vs * j + PREFETCH_L2, _MM_HINT_T1);
                __m512i v = _mm512_loadu_si512(p + vs * j);
                __m512i lo = _mm512_and_si512(v, low);
                __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < mr; r++) {
                    const quad *a = (const quad *)(a0 + r * K + 8 * j);
                    acc[r] = dpbusd_bcast(acc[r], lo, a);
                    acc2[r] = dpbusd_bcast(acc2[r], hi, a + 1);
                }
            }
        } else if (bits == 2) {  /* four chains: a vector's four dot products each its own */
            const __m512i two = _mm512_set1_epi8(0x03);
            __m512i acc3[MAX_ROWS], acc4[MAX_ROWS];
            for (int r = 0; r < mr; r++) acc3[r] = acc4[r] = _mm512_setzero_si512();
            for (int64_t j = 0; j < G / 16; j++) {
                _mm_prefetch((const char *)p + 64 * j + PREFETCH_L1, _MM_HINT_T0);
                _mm_prefetch((const char *)p + 64 * j + PREFETCH_L2, _MM_HINT_T1);
                const __m512i v = _mm512_loadu_si512(p + 64 * j);
                const __m512i c0 = _mm512_and_si512(v, two);
                const __m512i c1 = _mm512_and_si512(_mm512_srli_epi16(v, 2), two);
                const __m512i c2 = _mm512_and_si512(_mm512_srli_epi16(v, 4), two);
                const __m512i c3 = _mm512_and_si512(_mm512_srli_epi16(v, 6), two);
                for (int r = 0; r < mr; r++) {
                    const quad *a = (const quad *)(a0 + r * K + 16 * j);
                    acc[r] = dpbusd_bcast(acc[r], c0, a);
                    acc2[r] = dpbusd_bcast(acc2[r], c1, a + 1);
                    acc3[r] = dpbusd_bcast(acc3[r], c2, a + 2);
                    acc4[r] = dpbusd_bcast(acc4[r], c3, a + 3);
                }
            }
            for (int r = 0; r < mr; r++) acc2[r] = _mm512_add_epi32(acc2[r], _mm512_add_epi32(
                acc3[r], acc4[r]));
        } else {
            for (int64_t j = 0; j < G / 4; j += 2) {
                _mm_prefetch((const char *)p + 64 * j + PREFETCH_L1, _MM_HINT_T0);
                _mm_prefetch((const char *)p + 64 * j + 64 + PREFETCH_L1, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512(p + 64 * j);
                __m512i v2 = _mm512_loadu_si512(p + 64 * j + 64);
                for (int r = 0; r < mr; r++) {
                    const quad *a = (const quad *)(a0 + r * K + 4 * j);
                    acc[r] = dpbusd_bcast(acc[r], v, a);
                    acc2[r] = dpbusd_bcast(acc2[r], v2, a + 1);
                }
            }
        }
        for (int r = 0; r < mr; r++) acc[r] = _mm512_add_epi32(acc[r], acc2[r]);
        fold_group(facc, acc, mr, p + tl.so, sa, ssum, r0 * ng + g, ng);
    }
    store_tile(y, facc, mr, r0, N, t * TILE, bias, bf16, top);
}

/* Two tiles of int4 weights (32 outputs) for `mr` rows (up to 4): each row's activation
   quads are broadcast into a register once and serve both tiles, and one accumulator a tile
   and row takes the low and the high nibbles (two tiles give the independent chains that
   two accumulators gave one tile). On the 2-core Xeon (Cascade Lake) one thread ran
   Qwen2-1.5B's MLP and attention products 7-10% faster for 1, 2 and 4 rows than by single
   tiles with broadcasts in the instructions' operands (interleaved, medians of 25), bits
   unchanged: the same int32 sums, and the float sums over groups in the same order.
   The pair is one stream of bytes in the order they are read (tiles.h), fetched into L1
   PREFETCH_L1 ahead (past the pair's end, the next pair: the next this thread reads; after
   the last, bytes past the weights, a fetch the CPU drops without a fault). The pair was two
   streams a tile apart, each fetching its own bytes ahead (which on the 2-core EPYC Zen 5
   made one row 0-20% faster and four rows 10-30% than one fetch distance for both). As one
   stream, on the 2-core EPYC Zen 4 (Qwen3.5-2B's MLP and attention shapes, 321 MB from
   DRAM, the two layouts by turns in one process, medians of 21): one thread, one row
   0.90-0.93x the time and four rows 0.88-0.90x; two threads, 0.95x and 0.96x. Without the
   software fetches one row gained a little more there (0.84-0.90x) and four rows lost (1.3x
   slower than with them), so the fetches stay for every call. Calls of three and four rows
   (a verify of two and three drafts), whose loops VPDPBUSD bounds more than memory does, also
   fetch PREFETCH_L2 ahead into L2: on the Zen 4, Qwen3.5-2B's K=2 and K=3 steps by turns in
   one process ran 0.92-0.93x the time on one thread and 0.94-0.96x on two. One and two rows
   do not: there the L2 fetches made one row's products 4% slower and two rows' 20% (the K=1
   step 1.13x). 32 KB ahead was the same as 16; 8 KB worse. */
static inline __attribute__((always_inline)) void pair_rows(
        const uint8_t *w, int64_t K, int64_t G, const int8_t *qa, const float *sa,
        const float *ssum, int64_t r0, const int mr, const float *bias, void *y, int bf16,
        int64_t N, int64_t t, Top *top) {
    const int64_t ng = K / G;
    /* tile t's and t + 1's stream: their vectors by turns, 128 bytes a pair of them (a
       constant in the loop), then tile t's scales and t + 1's */
    const Tile tl = tile_at(w, 4, (N + TILE - 1) / TILE, ng, G, t);
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 facc[2][PAIR_ROWS];
    for (int r = 0; r < mr; r++) facc[0][r] = facc[1][r] = _mm512_setzero_ps();
    const uint8_t *p = tl.p;
    for (int64_t g = 0; g < ng; g++, p += tl.gs) {
        __m512i acc[2][PAIR_ROWS];
        for (int r = 0; r < mr; r++) acc[0][r] = acc[1][r] = _mm512_setzero_si512();
        const int8_t *a0 = qa + r0 * K + g * G;
        for (int64_t j = 0; j < G / 8; j++) {
            __m512i lo[2], hi[2];
            _mm_prefetch((const char *)p + 128 * j + PREFETCH_L1, _MM_HINT_T0);
            _mm_prefetch((const char *)p + 128 * j + 64 + PREFETCH_L1, _MM_HINT_T0);
            if (mr > 2) {  /* and into L2 further on: see above */
                _mm_prefetch((const char *)p + 128 * j + PREFETCH_L2, _MM_HINT_T1);
                _mm_prefetch((const char *)p + 128 * j + 64 + PREFETCH_L2, _MM_HINT_T1);
            }
            for (int u = 0; u < 2; u++) {
                const __m512i v = _mm512_loadu_si512(p + 128 * j + 64 * u);
                lo[u] = _mm512_and_si512(v, low);
                hi[u] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
            }
            for (int r = 0; r < mr; r++) {
                const quad *a = (const quad *)(a0 + r * K + 8 * j);
                const __m512i b1 = _mm512_set1_epi32(a[0]), b2 = _mm512_set1_epi32(a[1]);
                for (int u = 0; u < 2; u++) {
                    if (mr < PAIR_ROWS) {  /* (`dpbusd`: why each way) */
                        acc[u][r] = dpbusd(acc[u][r], lo[u], b1);
                        acc[u][r] = dpbusd(acc[u][r], hi[u], b2);
                    } else {
                        acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], lo[u], b1);
                        acc[u][r] = _mm512_dpbusd_epi32(acc[u][r], hi[u], b2);
                    }
                }
            }
        }
        for (int u = 0; u < 2; u++)
            fold_group(facc[u], acc[u], mr, p + tl.so + 64 * u, sa, ssum, r0 * ng + g, ng);
    }
    for (int u = 0; u < 2; u++)
        store_tile(y, facc[u], mr, r0, N, (t + u) * TILE, bias, bf16, top);
}

/* AMX (CPUs with AMX-INT8, where Linux grants the tile state: `wq_amx_enable`): a tile of
   16 outputs for up to 16 rows by TDPBSUD, which sums 16 x 16 x 64 products an instruction
   where VPDPBUSD sums 16 x 4. The layout's 64-byte vectors are already rows of the B tile:
   int8's as they are (16 make the tile of 64 inputs), int4's once their low and high nibbles
   are split into two (inputs 8j + b, then 8j + 4 + b). The int32 sums are exact in any order
   and the group's fold is `fold_group`'s, so a row's bits are those of the VNNI path,
   whichever path a call's number of rows takes. Prefills and int8 verifies gain; a verify of
   a few int4 rows stays on VPDPBUSD (AMX_MIN_ROWS). Two kernels: `amx_tiles` (four C tiles
   in flight, the int4 splits made ahead) and, for int8 calls of fewer than AMX_ROWS rows,
   `amx_chain`. Against one C tile for every call, 80 weights of 6144 x 2048 by turns, one
   thread: int4 16 rows 55.1 -> 52.7 ms, 64 rows 179.7 -> 164.9; int8 16 rows 102.9 -> 83.6,
   64 rows 201.4 -> 178.0. */
#ifdef AMX_INTRINSICS
#define WQ_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define AMX_ROWS 16
enum { AMX_CHAIN = 1, AMX_TILES = 2 };  /* `tile`'s amx: which kernel */
/* The fewest rows a call runs by AMX (fewer: VPDPBUSD). Measured on a 2-core Xeon with AMX,
   one thread, weights of 6144 x 2048 (1 GB of int4, 0.8 GB of int8: from memory), ms for
   them all, VNNI / AMX, two runs by turns: int4, 4 rows 55.3 / 62.4, 5 rows 66.4 / 63.0,
   6 rows 70.3 / 63.7 (a few rows' VPDPBUSD, which pair_rows keeps busy, cost less than
   splitting the nibbles); int8, 3 rows 54.7 / 55.6, 4 rows 60.2 / 55.6. */
#define AMX_MIN_ROWS(bits) ((bits) == 4 ? 5 : 3)

static int amx_on = 0;
static __thread int amx_set = 0;  /* rows << 8 | inputs a B tile: this thread's config */

/* Asks Linux for the AMX tile state (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); 1 when
   granted (the caller checked the CPU's amx_int8 flag), and `linear` uses AMX from then. */
int wq_amx_enable(void) {
#ifdef WQ_AMX
    amx_on = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#endif
    return amx_on;
}

#ifdef WQ_AMX
/* Tiles 0-3 (C: mr rows of 16 int32, a group's sums each), 4-5 (A: mr rows of kc
   activation codes), 6-7 (B: kc / 4 rows of 16 outputs x 4 weight codes); kc: 64 inputs,
   or a group of 32. */
__attribute__((target("amx-tile,amx-int8"))) static void amx_configure(int mr, int kc) {
    TileConfig cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) {
        cfg.colsb[i] = (uint16_t)(i == 4 || i == 5 ? kc : 64);
        cfg.rows[i] = (uint8_t)(i >= 6 ? kc / 4 : mr);
    }
    _tile_loadconfig(&cfg);
    amx_set = mr << 8 | kc;
}

__attribute__((target("amx-tile,amx-int8"))) static void amx_release(void) {
    if (amx_set) _tile_release();
    amx_set = 0;
}

/* `tile_rows` by AMX, mr <= AMX_ROWS rows, one group after another in one C tile: for int8
   calls of fewer than AMX_ROWS rows, which it ran 5-6% faster than `amx_tiles` (3 and 4
   rows, 60 weights of 6144 x 2048 by turns), the tile's products being few. */
__attribute__((target("amx-tile,amx-int8"))) static void amx_chain(
        const uint8_t *w, int bits, int64_t K, int64_t G, const int8_t *qa, const float *sa,
        const float *ssum, int64_t r0, int mr, const float *bias, void *y, int bf16,
        int64_t N, int64_t t, Top *top) {
    const int kc = G < 64 ? (int)G : 64;
    if (amx_set != (mr << 8 | kc)) amx_configure(mr, kc);
    const int64_t ng = K / G;
    const Tile tl = tile_at(w, bits, (N + TILE - 1) / TILE, ng, G, t);
    const __m512i low = _mm512_set1_epi8(0x0f);
    uint8_t split[1024] __attribute__((aligned(64)));
    int32_t sums[AMX_ROWS * TILE] __attribute__((aligned(64)));
    __m512 facc[AMX_ROWS];
    __m512i acc[AMX_ROWS];
    for (int r = 0; r < mr; r++) facc[r] = _mm512_setzero_ps();
    const uint8_t *p = tl.p;
    for (int64_t g = 0; g < ng; g++, p += tl.gs) {
        const int8_t *a0 = qa + r0 * K + g * G;
        _tile_zero(0);
        for (int64_t c = 0; c < G / kc; c++) {  /* kc inputs a B tile */
            if (bits == 4) {
                for (int j = 0; j < kc / 8; j++) {
                    const uint8_t *v8 = p + tl.vs * (kc / 8 * c + j);
                    _mm_prefetch((const char *)v8 + PREFETCH_L1, _MM_HINT_T0);
                    _mm_prefetch((const char *)v8 + PREFETCH_L2, _MM_HINT_T1);
                    const __m512i v = _mm512_loadu_si512(v8);
                    _mm512_store_si512(split + 128 * j, _mm512_and_si512(v, low));
                    _mm512_store_si512(split + 128 * j + 64,
                                       _mm512_and_si512(_mm512_srli_epi16(v, 4), low));
                }
                _tile_loadd(6, split, 64);
            } else {
                for (int j = 0; j < kc / 4; j++)
                    _mm_prefetch((const char *)p + 16 * kc * c + 64 * j + PREFETCH_L1,
                                 _MM_HINT_T0);
                _tile_loadd(6, p + 16 * kc * c, 64);
            }
            _tile_loadd(4, a0 + kc * c, K);
            _tile_dpbsud(0, 4, 6);  /* signed activations times unsigned weight codes */
        }
        _tile_stored(0, sums, 64);
        for (int r = 0; r < mr; r++) acc[r] = _mm512_load_si512(sums + TILE * r);
        fold_group(facc, acc, mr, p + tl.so, sa, ssum, r0 * ng + g, ng);
    }
    store_tile(y, facc, mr, r0, N, t * TILE, bias, bf16, top);
}

/* An int4 B tile: the 64-byte vectors of kc inputs at v, vs bytes apart, split into their
   low and high nibbles in buf, which then holds the tile's rows (inputs 8j + b, then
   8j + 4 + b). Each vector fetches into L1 the line PREFETCH_L1 ahead of it. */
static inline void amx_split(const uint8_t *v, int64_t vs, int kc, uint8_t *buf) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int j = 0; j < kc / 8; j++) {
        _mm_prefetch((const char *)v + vs * j + PREFETCH_L1, _MM_HINT_T0);
        const __m512i x = _mm512_loadu_si512(v + vs * j);
        _mm512_store_si512(buf + 128 * j, _mm512_and_si512(x, low));
        _mm512_store_si512(buf + 128 * j + 64, _mm512_and_si512(_mm512_srli_epi16(x, 4), low));
    }
}

/* Splits made this many B tiles ahead of the one loaded: a tile loaded right after the
   stores that wrote it waited for them (50 cycles a tile, where three or more ahead took
   15, on the 2-core Xeon). AMX_RING buffers hold them. */
#define AMX_AHEAD 4
#define AMX_RING 8

/* `tile_rows` by AMX for tiles t .. t + nt - 1 (nt: 1, or 2 as `pair_rows` takes them),
   mr <= AMX_ROWS rows: four C tiles in flight (per tile, four groups or two at a time), so
   that four chains of TDPBSUD run side by side (one accumulator made each product wait for
   the one before, then its sums' store and reload); the A tiles alternate, the B tiles by
   tile. Each tile's groups fold in their order. */
__attribute__((target("amx-tile,amx-int8"))) static void amx_tiles(
        const uint8_t *w, int bits, int64_t K, int64_t G, const int8_t *qa, const float *sa,
        const float *ssum, int64_t r0, int mr, const float *bias, void *y, int bf16,
        int64_t N, int64_t t, int nt, Top *top) {
    const int kc = G < 64 ? (int)G : 64;
    if (amx_set != (mr << 8 | kc)) amx_configure(mr, kc);
    const int64_t ng = K / G, tile_bytes = ng * (G * TILE * bits / 8 + 4 * TILE);
    const Tile tl[2] = {tile_at(w, bits, (N + TILE - 1) / TILE, ng, G, t),
                        tile_at(w, bits, (N + TILE - 1) / TILE, ng, G, t + 1)};
    /* a chunk of kc inputs: kc / 8 (int4) or kc / 4 (int8) vectors */
    const int64_t gs = tl[0].gs, chunk_bytes = kc * bits / 32 * tl[0].vs;
    /* B tiles in order q: group, then chunk of kc inputs in it (G / kc: 1 or 2), then
       stream (nt: 1 or 2) */
    const int cs = G > kc, ns = nt == 2, per = nt == 2 ? 2 : 4;  /* groups a pass */
    const int64_t Q = ng << (cs + ns);
    uint8_t ring[AMX_RING][1024] __attribute__((aligned(64)));
    int32_t sums[4][AMX_ROWS * TILE] __attribute__((aligned(64)));
    __m512 facc[2][AMX_ROWS];
    __m512i acc[AMX_ROWS];
    for (int u = 0; u < nt; u++)
        for (int r = 0; r < mr; r++) facc[u][r] = _mm512_setzero_ps();
    /* int8: two streams a tile apart (each fetches past its tile's end into the next pair's
       same stream); int4: a pair of tiles is one stream (tiles.h) */
#define OFFSET(q) (((q) >> (cs + ns)) * gs + (((q) >> ns) & cs) * chunk_bytes)
#define SKIP(off) (ns && (off) + PREFETCH_L1 >= tile_bytes ? tile_bytes : 0)
#define SPLIT(q) amx_split(tl[(q) & ns].p + OFFSET(q), tl[0].vs, kc, ring[(q) % AMX_RING])
    if (bits == 4)
        for (int64_t q = 0; q < AMX_AHEAD && q < Q; q++) SPLIT(q);
    const int8_t *a0 = qa + r0 * K;
    for (int64_t g = 0; g < ng; g += per) {
        const int n = ng - g < per ? (int)(ng - g) : per;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int i = 0; i < n; i++)
            for (int c = 0; c <= cs; c++) {
                const int8_t *a = a0 + (g + i) * G + kc * c;
                const int odd = (i * (cs + 1) + c) & 1;  /* the A tile: 4 or 5 */
                if (odd) _tile_loadd(5, a, K); else _tile_loadd(4, a, K);
                for (int u = 0; u < nt; u++) {
                    const int64_t q = (((g + i) << cs | c) << ns) | u;
                    const uint8_t *b;
                    if (bits == 4) {
                        if (q + AMX_AHEAD < Q) SPLIT(q + AMX_AHEAD);
                        b = ring[q % AMX_RING];
                    } else {
                        const int64_t off = OFFSET(q);
                        b = tl[u].p + off;
                        for (int j = 0; j < kc / 4; j++)
                            _mm_prefetch((const char *)b + 64 * j + PREFETCH_L1 + SKIP(off),
                                         _MM_HINT_T0);
                    }
#define DP(C, A, B) _tile_loadd(B, b, 64); _tile_dpbsud(C, A, B); break;
                    switch ((i * nt + u) << 1 | odd) {  /* tile numbers are constants */
                    case 0: DP(0, 4, 6) case 1: DP(0, 5, 6) case 2: DP(1, 4, 7)
                    case 3: DP(1, 5, 7) case 4: DP(2, 4, 6) case 5: DP(2, 5, 6)
                    case 6: DP(3, 4, 7) default: DP(3, 5, 7)
                    }
#undef DP
                }
            }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        for (int i = 0; i < n; i++)
            for (int u = 0; u < nt; u++) {
                for (int r = 0; r < mr; r++)
                    acc[r] = _mm512_load_si512(sums[i * nt + u] + TILE * r);
                fold_group(facc[u], acc, mr, tl[u].p + (g + i) * gs + tl[u].so, sa, ssum,
                           r0 * ng + g + i, ng);
            }
    }
#undef SPLIT
#undef SKIP
#undef OFFSET
    for (int u = 0; u < nt; u++)
        store_tile(y, facc[u], mr, r0, N, (t + u) * TILE, bias, bf16, top);
}
#endif

/* Tile t (int4: tiles t and t + 1 where `pair`) for all M rows (on AMX tiles where `amx`). */
static void tile(const uint8_t *w, int bits, int64_t K, int64_t G, const int8_t *qa,
                 const float *sa, const float *ssum, int64_t M, const float *bias, void *y,
                 int bf16, int64_t N, int64_t t, int pair, int amx, Top *top) {
#ifdef WQ_AMX
    if (amx == AMX_CHAIN) {
        amx_chain(w, bits, K, G, qa, sa, ssum, 0, (int)M, bias, y, bf16, N, t, top);
        return;
    }
    if (amx) {
        for (int64_t r0 = 0; r0 < M; r0 += AMX_ROWS)
            amx_tiles(w, bits, K, G, qa, sa, ssum, r0,
                      (int)(M - r0 < AMX_ROWS ? M - r0 : AMX_ROWS), bias, y, bf16, N, t,
                      pair ? 2 : 1, top);
        return;
    }
#endif
    if (pair) {
        for (int64_t r0 = 0; r0 < M; r0 += PAIR_ROWS) {
            const int64_t left = M - r0;
            switch (left >= PAIR_ROWS ? PAIR_ROWS : left) {
#define ROWS(n) case n: pair_rows(w, K, G, qa, sa, ssum, r0, n, bias, y, bf16, N, t, top); break;
                ROWS(1) ROWS(2) ROWS(3) ROWS(4)
#undef ROWS
            }
        }
        return;
    }
    for (int64_t r0 = 0; r0 < M; r0 += MAX_ROWS) {
        const int64_t left = M - r0;
        switch (left >= MAX_ROWS ? MAX_ROWS : left) {
#define ROWS(n) case n: \
    tile_rows(w, bits, K, G, qa, sa, ssum, r0, n, bias, y, bf16, N, t, top); break;
            ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
#undef ROWS
        }
    }
}

/* Each row's argmax and log-sum-exp from the threads' running ones, in the threads' order
   (which is the outputs' order: a static schedule gives thread i the i-th run of tiles): the
   first index of the largest value (a NaN counting as the largest, its first one, as torch's
   argmax; every value -inf: index 0), log sum exp (NaN with a NaN). */
static void top_finish(const Top *tops, int threads, int64_t M, int64_t *index, float *lse,
                       float *value) {
    for (int64_t r = 0; r < M; r++) {
        float best = -INFINITY, ref = -INFINITY;
        int64_t at = 0, nan = -1;
        for (int i = 0; i < threads; i++) {
            const Top *t = tops + (int64_t)i * M + r;
            if (t->nan >= 0 && nan < 0) nan = t->nan;
            const float v = _mm512_reduce_max_ps(t->best);
            if (v > best) {
                best = v;
                at = _mm512_mask_reduce_min_epi32(
                    _mm512_cmp_ps_mask(t->best, _mm512_set1_ps(v), _CMP_EQ_OQ), t->at);
            }
            if (t->ref > ref) ref = t->ref;
        }
        if (nan >= 0) {
            index[r] = nan;
            lse[r] = NAN;
            if (value) value[r] = NAN;
            continue;
        }
        index[r] = at;
        if (value) value[r] = best;
        if (ref == -INFINITY) {
            lse[r] = -INFINITY;
            continue;
        }
        float total = 0.0f;
        for (int i = 0; i < threads; i++) {
            const Top *t = tops + (int64_t)i * M + r;
            if (t->ref != -INFINITY) total += _mm512_reduce_add_ps(t->sum) * expf(t->ref - ref);
        }
        lse[r] = ref + logf(total);
    }
}

static int linear(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G,
                  const float *bias, const void *x, void *y, int64_t M, int bf16, int threads,
                  int64_t *index, float *lse, float *value) {
    Top *tops = index ? aligned_alloc(64, sizeof(Top) * (size_t)(threads * M)) : NULL;
    Coded c;
    if ((index && !tops) || code_rows(x, bf16, M, K, G, &c) != 0) {
        free(tops);
        return -1;
    }
    const int8_t *qa = c.qa;
    const float *sa = c.sa, *ssum = c.ssum;
    for (int64_t i = 0; tops && i < threads * M; i++) top_start(tops + i);
    const int64_t tiles = (N + TILE - 1) / TILE;
    /* int4 calls of a few rows (decode steps, verifies): tiles by pairs (an odd last one
       alone); of MAX_ROWS rows or more (a prefill), single tiles MAX_ROWS rows at a time,
       which the Xeon ran 2-10% faster (512 rows of Qwen2-1.5B's shapes, one thread) */
    const int amx = !amx_on || bits == 2 || M < AMX_MIN_ROWS(bits) ? 0
                    : bits == 8 && M < AMX_ROWS ? AMX_CHAIN : AMX_TILES;
    const int64_t step = amx == AMX_TILES || (bits == 4 && M < MAX_ROWS && !amx) ? 2 : 1;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        Top *top = tops ? tops + (int64_t)omp_get_thread_num() * M : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t += step)
            tile(w, bits, K, G, qa, sa, ssum, M, bias, y, bf16, N, t,
                 step == 2 && t + 1 < tiles, amx, top);
#ifdef WQ_AMX
        if (amx) amx_release();  /* no tile state kept between calls */
#endif
    }
    if (tops) top_finish(tops, threads, M, index, lse, value);
    coded_free(&c);
    free(tops);
    return 0;
}

/* y [M, N] = x [M, K] W^T + bias; x and y fp32, or bf16 when bf16 != 0; bias fp32 or NULL.
   Returns 0, or -1 when scratch memory could not be had. */
int wq_linear(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G, const float *bias,
              const void *x, void *y, int64_t M, int bf16, int threads) {
    return linear(w, bits, N, K, G, bias, x, y, M, bf16, threads, NULL, NULL, NULL);
}

/* `wq_linear`, and per row of y (as stored: bf16 when bf16 != 0) the index of its first
   maximum and its log-sum-exp into index [M] and lse [M] (rows.c `argmax_lse`'s answers;
   with value, not NULL, the maximum itself [M]),
   summed while the outputs are in registers: a head's logits (Qwen3.5-2B's 248k a row) are
   not read again from memory, where the weights streaming past have pushed them. The
   log-sum-exp's last bits depend on the number of threads (each sums its own outputs), never
   on the rows beside a row. */
int wq_linear_top(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G,
                  const float *bias, const void *x, void *y, int64_t M, int bf16, int threads,
                  int64_t *index, float *lse, float *value) {
    return linear(w, bits, N, K, G, bias, x, y, M, bf16, threads, index, lse, value);
}

/* Element i of p as store16 stored it: fp32, or bf16 when bf16 != 0. */
static inline float value_at(const void *p, int64_t i, int bf16) {
    if (!bf16) return ((const float *)p)[i];
    const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* The C best of a row's tile maxima [tiles] (padding at -inf), by a min-heap, into sel
   ascending. Ties keep the lower tile. */
static void best_tiles(const float *mx, int64_t tiles, int64_t C, int64_t *sel) {
    int64_t n = 0;
    for (int64_t t = 0; t < tiles; t++) {
        const float v = mx[t];
        if (n == C && !(v > mx[sel[0]])) continue;
        int64_t i;
        if (n < C) {  /* sift up */
            i = n++;
            while (i > 0 && mx[sel[(i - 1) / 2]] > v) {
                sel[i] = sel[(i - 1) / 2];
                i = (i - 1) / 2;
            }
        } else {  /* replace the root, sift down */
            i = 0;
            for (;;) {
                int64_t c = 2 * i + 1;
                if (c >= n) break;
                if (c + 1 < n && mx[sel[c + 1]] < mx[sel[c]]) c++;
                if (!(mx[sel[c]] < v)) break;
                sel[i] = sel[c];
                i = c;
            }
        }
        sel[i] = t;
    }
    for (int64_t i = 1; i < n; i++) {  /* ascending tile order (C is small) */
        const int64_t t = sel[i];
        int64_t j = i;
        for (; j > 0 && sel[j - 1] > t; j--) sel[j] = sel[j - 1];
        sel[j] = t;
    }
}

/* rows.c's: per row, the index of its first maximum and its log-sum-exp. */
void argmax_lse(const void *x, int64_t stride, int64_t rows, int64_t v, int bf16,
                int64_t *index, float *lse, float *value, int threads);

/* A greedy draft per row of x [M, K] from a draft head of N rows (engine/decode/draft_vocab.py
   `DraftHead.greedy`): the coarse pass over its 2-bit layout w2 gives each tile of 16 rows
   its largest logit; the C tiles with the largest are scored by the int4 layout w4, with the
   bits the int4 product stores for them (bf16 when bf16 != 0), and the row's draft is the
   first of their largest: index [M] and its logit top [M]; with lse (not NULL), the
   log-sum-exp of the exact logits of those tiles and the coarse ones of the rest [M]. A
   row's answers depend on that row alone. Returns 0, or -1 when scratch memory could not be
   had. */
int wq_draft_pick(const uint8_t *w2, const uint8_t *w4, int64_t N, int64_t K, int64_t G,
                  const void *x, int64_t M, int bf16, int64_t C, int threads, int64_t *index,
                  float *top, float *lse) {
    const int64_t tiles = (N + TILE - 1) / TILE, width = tiles * TILE;
    if (C > tiles) C = tiles;
    if (C < 1) return -1;
    float *rough = malloc(sizeof(float) * (size_t)(M * width));
    float *fine = malloc(sizeof(float) * (size_t)(M * width));
    float *mx = malloc(sizeof(float) * (size_t)(M * tiles));
    int64_t *sel = malloc(sizeof(int64_t) * (size_t)(M * (C + 1)));  /* + argmax_lse's index */
    Coded c;
    if (!rough || !fine || !mx || !sel || code_rows(x, bf16, M, K, G, &c) != 0) {
        free(rough); free(fine); free(mx); free(sel);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            tile(w2, 2, K, G, c.qa, c.sa, c.ssum, M, NULL, rough, 0, width, t, 0, 0, NULL);
            for (int64_t r = 0; r < M; r++)
                mx[r * tiles + t] = _mm512_mask_reduce_max_ps(
                    tail(N - t * TILE), _mm512_loadu_ps(rough + r * width + t * TILE));
        }
#pragma omp single
        for (int64_t r = 0; r < M; r++) best_tiles(mx + r * tiles, tiles, C, sel + r * C);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * C; i++)  /* a row's tiles in int4, its bits alone */
            tile_rows(w4, 4, K, G, c.qa, c.sa, c.ssum, i / C, 1, NULL, fine, bf16, width,
                      sel[i], NULL);
    }
    for (int64_t r = 0; r < M; r++) {
        float best = -INFINITY;
        int64_t at = sel[r * C] * TILE;
        for (int64_t i = 0; i < C; i++) {
            const int64_t n0 = sel[r * C + i] * TILE;
            for (int64_t k = 0; k < TILE && n0 + k < N; k++) {
                const float v = value_at(fine, r * width + n0 + k, bf16);
                if (v > best) {
                    best = v;
                    at = n0 + k;
                }
                rough[r * width + n0 + k] = v;  /* the exact logit over the coarse one */
            }
        }
        index[r] = at;
        top[r] = best;
    }
    if (lse) argmax_lse(rough, width, M, N, 0, sel + M * C, lse, NULL, 1);
    coded_free(&c);
    free(rough); free(fine); free(mx); free(sel);
    return 0;
}
