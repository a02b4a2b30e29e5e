/* Causal attention of a cached forward on AVX-512 CPUs: each query row attends to its slot's
keys 0..pos, softmax(q k^T / sqrt(D)) v, in fp32 whatever the cache's dtype; where queries
and keys are bf16 and the CPU has AVX512-BF16, the scores sum the exact products of their
bf16 values by VDPBF16PS (half the instructions, no key converted: a 4-position verify's
attention ~1.5x faster on Qwen2-1.5B's and Qwen3.5-2B's shapes). Where it has AMX-BF16 as
well, the scores and the values both run on its tiles by TDPBF16PS (`scores_amx`,
`values_amx`: the probabilities then rounded to bf16, as torch's bf16 attention rounds
them). One thread, 512 keys, against VDPBF16PS scores and fp32 values: Qwen2-1.5B's 28
layers 4.20 -> 2.05 ms at 4 positions and 1.66 -> 1.41 at one, Qwen3.5-2B's 7 at 4
positions 1.41 -> 0.70; over 2,000 keys Qwen2-1.5B's 4 positions 15.6 -> 6.5 (the scores
alone on tiles: 4.30 -> 3.00, 1.64 -> 1.46, 17.6 -> 11.4).

Why: torch's bf16 batched matmul on the CPU copies the keys it reads (the cache is a strided
view) and is slow for these shapes: a decode step of Qwen2-1.5B's shapes spent more in
attention's copies than in its arithmetic. And the bits: a row's result here is computed
from its own query and the keys it may see, in one order (keys 0..pos, dot products over
D in fixed lanes), so neither the other rows of the call, nor the number of keys the call
reads (kv_len, a bucket), nor the thread that runs it changes a bit; the masked keys past a
row's position are never touched.

A sliding-window layer's cache may be a ring (cache/ring.py): the key of position t at entry
t mod ring. The kernel then reads the same keys in the same order (by position), so a ring
gives the bits a cache as long as the context gives.
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vecmath.h"

/* Query rows a tile: every query head of a kv head (grouped-query attention) and as many
   positions as fit, so that each key is converted once for all of them and each value once
   for up to six (score_block, value_block). 32: a 4-position verify of Qwen2-1.5B's shapes
   (6 query heads a kv head) in one tile, its keys and values read once rather than twice. */
#define MAX_TILE 32

/* Keys ahead of the one being read that are fetched: the next block of 16 into L1 while a
   block's keys are converted, and whole value rows into L2 while the first 64 lanes of the
   values are summed (later lanes then find them there). A block of keys is one 4 KB page
   at D = 128, where the hardware's prefetcher stops. On the Xeon (keys and values in L3 or
   in memory, Qwen2-1.5B's shapes): a decode step's attention 7-13% faster, and a 4-position
   verify's 10-11% with the tiles of 32. */
#define AHEAD 16

/* Fetch the key or value row of position t (entry t mod ring in a ring) into L1, or into L2
   where l2 != 0. */
static inline void fetch_row(const void *base, int64_t t, int64_t ring, int64_t D, int bf16,
                             int l2) {
    const int64_t size = bf16 ? 2 : 4;
    const char *row = (const char *)base + (ring ? t % ring : t) * D * size;
    for (int64_t c = 0; c < D * size; c += 64) {
        if (l2)
            _mm_prefetch(row + c, _MM_HINT_T1);
        else
            _mm_prefetch(row + c, _MM_HINT_T0);
    }
}

/* Lane u: the sum of a[u]'s 16 lanes, in _mm512_reduce_add_ps's order (halves, quarters,
   then lanes 0+2 and 1+3, then those two), for 16 vectors at once. */
static inline __m512 sum16(const __m512 *a) {
    __m512 b[8], c[4], d[2];
    for (int m = 0; m < 8; m++)  /* [a lo8 | a' lo8] + [a hi8 | a' hi8] */
        b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xee));
    for (int m = 0; m < 4; m++)  /* 128-bit quarters: each vector's low plus high */
        c[m] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * m], b[2 * m + 1], 0xdd));
    for (int m = 0; m < 2; m++)  /* within quarters: lanes 0 + 2, 1 + 3 */
        d[m] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * m], c[2 * m + 1], 0xee));
    const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88),
                                   _mm512_shuffle_ps(d[0], d[1], 0xdd));
    /* e's lane 4L + i holds vector 4i + L's sum */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14,
                                                   3, 7, 11, 15), e);
}

/* The rows of keys t0 .. t0 + 15 (entry t mod ring in a ring); past the last of them (nk),
   any key, whose scores are not stored. */
static inline void block_keys(const uint16_t *k, int64_t D, int64_t ring, int64_t t0,
                              int64_t nk, const uint16_t **key) {
    for (int u = 0; u < 16; u++) {
        const int64_t t = t0 + (u < nk ? u : 0);
        key[u] = k + (ring ? t % ring : t) * D;
    }
}

/* Row r's scores of the nk keys from t0 (sums, lane u: key t0 + u) that it sees, lo[r] ..
   n[r] - 1, into scores[r * stride + t - lo[r]]. */
static inline void store_scores(__m512 sums, int r, int64_t t0, int64_t nk, const int64_t *lo,
                                const int64_t *n, float *scores, int64_t stride) {
    const int64_t a = lo[r] > t0 ? lo[r] - t0 : 0, b = n[r] - t0 < nk ? n[r] - t0 : nk;
    const __mmask16 m = (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
    _mm512_mask_storeu_ps(scores + r * stride + t0 - lo[r], m, sums);
}

/* The scores of `rows` query rows against keys first..longest-1 by bf16 dot products
   (VDPBF16PS, fp32 sums of pairs of exact bf16 products): qb holds each row's query as the
   model made it (bf16, not yet scaled), k the cache's bf16 keys. 16 keys at a time, a row's
   16 sums summed by sum16 and then scaled: a score's arithmetic is its own row's and key's
   whatever else the tile holds. Half the instructions of the fp32 path's scores, and no key
   converted to fp32. The keys are fetched ahead, a block into L1 and the next into L2 (the
   keys from memory, Qwen2-1.5B's shapes over 2,000 keys, one thread on the EPYC Zen 4: one
   position 0.78x the time without, four 0.92x; a decode step of those shapes at 2,000
   tokens of context 0.98-0.99x; fetching further ahead did worse, and so did fetching the
   values here for their pass). Row r's score of key lo[r] + i goes to
   scores[r * stride + i]. */
__attribute__((target("avx512bf16"))) static void scores_bf16(
        const uint16_t *qb, const int64_t *lo, const int64_t *n, int rows, const uint16_t *k,
        int64_t D, int64_t ring, float scale, float *scores, int64_t stride, int64_t first,
        int64_t longest) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = first; t0 < longest; t0 += 16) {
        const int64_t nk = longest - t0 < 16 ? longest - t0 : 16;
        const uint16_t *key[16];
        block_keys(k, D, ring, t0, nk, key);
        /* the next block's keys into L1 and the one after it into L2 */
        for (int64_t t = t0 + AHEAD; t < t0 + 3 * AHEAD && t < longest; t++)
            fetch_row(k, t, ring, D, 1, t >= t0 + 2 * AHEAD);
        for (int r = 0; r < rows; r++) {
            if (t0 + 15 < lo[r] || t0 >= n[r]) continue;  /* none of the row's keys */
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t j = 0; j < D; j += 32) {
                const __m512bh qj = (__m512bh)_mm512_loadu_si512(qb + r * D + j);
                for (int u = 0; u < 16; u++)
                    acc[u] = _mm512_dpbf16_ps(acc[u], qj,
                                              (__m512bh)_mm512_loadu_si512(key[u] + j));
            }
            store_scores(_mm512_mul_ps(sum16(acc), sc), r, t0, nk, lo, n, scores, stride);
        }
    }
}

/* Row r's probabilities of keys t_start .. t_end - 1 (first rounded down to a multiple of
   32, longest rounded up to one), rounded to bf16 (as torch's bf16 attention rounds them)
   into pa + r * aw, zero outside the row's keys lo[r]..n[r]-1: what the values' bf16 dot
   products multiply (values_bf16, values_amx). Returns t_start. */
__attribute__((target("avx512bf16"))) static int64_t bf16_probabilities(
        float *const *p, const int64_t *lo, const int64_t *n, int rows, int64_t first,
        int64_t longest, uint16_t *pa, int64_t aw) {
    const int64_t t_start = first & ~(int64_t)31, t_end = (longest + 31) & ~(int64_t)31;
    for (int r = 0; r < rows; r++) {
        uint16_t *a = pa + r * aw;
        for (int64_t t = t_start; t < t_end; t += 16) {
            const int64_t from = lo[r] > t ? lo[r] - t : 0, to = n[r] - t < 16 ? n[r] - t : 16;
            __mmask16 m = 0;
            if (to > from) m = (__mmask16)(((1u << to) - 1) & ~((1u << from) - 1));
            const __m512 x = _mm512_maskz_loadu_ps(m, p[r] + t);
            _mm256_storeu_si256((__m256i *)(a + (t - t_start)),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_mov_ps(m, x)));
        }
    }
    return t_start;
}

/* Columns 0..15 (half 0) or 16..31 (half 1) of 32 in order, from the two sums of a pair of
   keys' values interleaved by unpacklo/unpackhi (lane 4L + i: column 8L + i of `lo`, column
   8L + 4 + i of `hi`). */
static inline __m512 put_back(__m512 lo, __m512 hi, int half) {
    const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21,
                                              22, 23);
    const __m512i second16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15,
                                               28, 29, 30, 31);
    return _mm512_permutex2var_ps(lo, half ? second16 : first16, hi);
}

#ifdef AMX_INTRINSICS
/* Dword i of each of x[0..15] into lane u of out[i]: a 16 x 16 transpose of dwords (pairs
   of bf16) by unpacks of dwords, of qwords, then of 128-bit lanes. */
static inline void transpose16(const __m512i *x, __m512i *out) {
    __m512i t[16], q[16];
    for (int k = 0; k < 8; k++) {
        t[2 * k] = _mm512_unpacklo_epi32(x[2 * k], x[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(x[2 * k], x[2 * k + 1]);
    }
    for (int k = 0; k < 4; k++) {  /* q[4k + j], lane L: rows 4k..4k+3 of column 4L + j */
        q[4 * k] = _mm512_unpacklo_epi64(t[4 * k], t[4 * k + 2]);
        q[4 * k + 1] = _mm512_unpackhi_epi64(t[4 * k], t[4 * k + 2]);
        q[4 * k + 2] = _mm512_unpacklo_epi64(t[4 * k + 1], t[4 * k + 3]);
        q[4 * k + 3] = _mm512_unpackhi_epi64(t[4 * k + 1], t[4 * k + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i a = _mm512_shuffle_i32x4(q[j], q[4 + j], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(q[8 + j], q[12 + j], 0x44);
        const __m512i c = _mm512_shuffle_i32x4(q[j], q[4 + j], 0xee);
        const __m512i d = _mm512_shuffle_i32x4(q[8 + j], q[12 + j], 0xee);
        out[j] = _mm512_shuffle_i32x4(a, b, 0x88);
        out[4 + j] = _mm512_shuffle_i32x4(a, b, 0xdd);
        out[8 + j] = _mm512_shuffle_i32x4(c, d, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(c, d, 0xdd);
    }
}

/* `scores_bf16` on AMX tiles (CPUs with AMX-BF16, where Linux grants the tile state): each
   block of 16 keys transposed once into B tiles of pairs of bf16 (32 of D a tile), and
   TDPBF16PS sums them against up to 16 query rows a C tile (two for the tile's 32), fp32
   sums of pairs of exact bf16 products over D in order. A score depends on its own query
   row and key alone, whatever else the tile holds or however many rows it has. kt: D * 32
   bytes of scratch. */
__attribute__((target("amx-tile,amx-bf16"))) static void scores_amx(
        const uint16_t *qb, const int64_t *lo, const int64_t *n, int rows, const uint16_t *k,
        int64_t D, int64_t ring, float scale, float *scores, int64_t stride, int64_t first,
        int64_t longest, uint8_t *kt) {
    TileConfig cfg = {0};
    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    cfg.palette = 1;
    cfg.rows[0] = cfg.rows[2] = (uint8_t)r0;  /* C and A of rows 0..15 */
    cfg.colsb[0] = cfg.colsb[2] = 64;
    if (r1) {
        cfg.rows[1] = cfg.rows[3] = (uint8_t)r1;  /* C and A of rows 16.. */
        cfg.colsb[1] = cfg.colsb[3] = 64;
    }
    cfg.rows[4] = 16;  /* B: 16 pairs of D x 16 keys */
    cfg.colsb[4] = 64;
    _tile_loadconfig(&cfg);
    float c[32 * 16] __attribute__((aligned(64)));
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = first; t0 < longest; t0 += 16) {
        const int64_t nk = longest - t0 < 16 ? longest - t0 : 16;
        const uint16_t *key[16];
        block_keys(k, D, ring, t0, nk, key);
        for (int64_t j = 0; j < D; j += 32) {
            __m512i x[16], y[16];
            for (int u = 0; u < 16; u++) x[u] = _mm512_loadu_si512(key[u] + j);
            transpose16(x, y);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(kt + 2 * j * 16 + 64 * i, y[i]);
        }
        _tile_zero(0);
        if (r1) _tile_zero(1);
        for (int64_t j = 0; j < D; j += 32) {
            _tile_loadd(4, kt + 2 * j * 16, 64);
            _tile_loadd(2, qb + j, D * 2);
            _tile_dpbf16ps(0, 2, 4);
            if (r1) {
                _tile_loadd(3, qb + 16 * D + j, D * 2);
                _tile_dpbf16ps(1, 3, 4);
            }
        }
        _tile_stored(0, c, 64);
        if (r1) _tile_stored(1, c + 16 * 16, 64);
        for (int r = 0; r < rows; r++) {
            if (t0 + 15 < lo[r] || t0 >= n[r]) continue;  /* none of the row's keys */
            store_scores(_mm512_mul_ps(_mm512_load_ps(c + 16 * r), sc), r, t0, nk, lo, n, scores,
                         stride);
        }
    }
    _tile_release();
}

/* The values of a tile on AMX-BF16 tiles (where `scores_amx` runs): out[r] = sum over keys
   of p[r][t] v[t] / sum p. Each row's probabilities rounded to bf16 (as torch's bf16
   attention rounds them) into A tiles of 32 keys, zero outside the row's keys lo..n-1;
   the values of each pair of keys interleaved once into B tiles (unpacklo/hi of 32 columns:
   a column's lane permuted within 128 bits, put back at the store); TDPBF16PS sums 32 keys
   an instruction for up to 16 rows. Blocks of keys start at multiples of 32 (of positions,
   in a ring too), so a row's sums run over the same pairs and blocks in the same order
   whatever rows share its tile (the other rows' keys enter it times 0). pa: scratch for
   MAX_TILE rows of `aw` bf16 probabilities; bt: 2 KB. */
__attribute__((target("amx-tile,amx-bf16,avx512bf16"))) static void values_amx(
        float *const *p, const float *inv, const int64_t *lo, const int64_t *n, int rows,
        const uint16_t *v, int64_t D, int64_t ring, void *const *out, int obf16,
        int64_t first, int64_t longest, uint16_t *pa, int64_t aw, uint8_t *bt) {
    const int64_t t_start = bf16_probabilities(p, lo, n, rows, first, longest, pa, aw);
    const int64_t t_end = (longest + 31) & ~(int64_t)31;
    TileConfig cfg = {0};
    const int r0 = rows < 16 ? rows : 16, r1 = rows - r0;
    cfg.palette = 1;
    for (int i = 0; i < 8; i++) cfg.colsb[i] = 64;
    cfg.rows[0] = cfg.rows[1] = cfg.rows[4] = (uint8_t)r0;  /* C low, C high, A: rows 0..15 */
    cfg.rows[2] = cfg.rows[3] = cfg.rows[5] = (uint8_t)r1;  /* the same for rows 16.. */
    if (!r1) cfg.colsb[2] = cfg.colsb[3] = cfg.colsb[5] = 0;
    cfg.rows[6] = cfg.rows[7] = 16;  /* B low, B high: 16 pairs of keys x 16 columns */
    _tile_loadconfig(&cfg);
    float c[4][16 * 16] __attribute__((aligned(64)));
    for (int64_t j0 = 0; j0 < D; j0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        if (r1) {
            _tile_zero(2);
            _tile_zero(3);
        }
        for (int64_t t0 = t_start; t0 < t_end; t0 += 32) {
            for (int i = 0; i < 16; i++) {
                const int64_t t = t0 + 2 * i;
                if (j0 == 0 && t + AHEAD + 1 < longest) {
                    fetch_row(v, t + AHEAD, ring, D, 1, 1);
                    fetch_row(v, t + AHEAD + 1, ring, D, 1, 1);
                }
                const __m512i x = t < longest ? _mm512_loadu_si512(
                    v + (ring ? t % ring : t) * D + j0) : _mm512_setzero_si512();
                const __m512i y = t + 1 < longest ? _mm512_loadu_si512(
                    v + (ring ? (t + 1) % ring : t + 1) * D + j0) : _mm512_setzero_si512();
                _mm512_storeu_si512(bt + 64 * i, _mm512_unpacklo_epi16(x, y));
                _mm512_storeu_si512(bt + 1024 + 64 * i, _mm512_unpackhi_epi16(x, y));
            }
            _tile_loadd(6, bt, 64);
            _tile_loadd(7, bt + 1024, 64);
            _tile_loadd(4, pa + (t0 - t_start), aw * 2);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (r1) {
                _tile_loadd(5, pa + 16 * aw + (t0 - t_start), aw * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, c[0], 64);
        _tile_stored(1, c[1], 64);
        if (r1) {
            _tile_stored(2, c[2], 64);
            _tile_stored(3, c[3], 64);
        }
        for (int r = 0; r < rows; r++) {
            const int g = r < 16 ? 0 : 2, i = r < 16 ? r : r - 16;
            const __m512 lo16 = _mm512_load_ps(c[g] + 16 * i);
            const __m512 hi16 = _mm512_load_ps(c[g + 1] + 16 * i);
            const __m512 scale = _mm512_set1_ps(inv[r]);
            store16(out[r], j0, _mm512_mul_ps(put_back(lo16, hi16, 0), scale), 0xffff, obf16);
            store16(out[r], j0 + 16, _mm512_mul_ps(put_back(lo16, hi16, 1), scale), 0xffff,
                    obf16);
        }
    }
    _tile_release();
}
#endif

/* Scores of RB query rows from r0 (q: rows of D floats, already times the scale) against
   the 16 keys from t0 in kbuf (fp32, converted once for every row of the tile), 16 / RB keys
   at a time: the RB x 16 / RB dot products accumulate side by side, each loaded query or key
   serving several of them (one FMA a load held a key at a time to one FMA a cycle here, on
   a CPU whose FMA takes two). Each dot product still accumulates in lanes d mod 16 over D in
   order and is summed across them by sum16, in _mm512_reduce_add_ps's order: the bits of a
   key at a time. Row r's score of key lo[r] + i goes to scores[r * stride + i]. */
static inline __attribute__((always_inline)) void score_block(
        const float *q, int64_t D, int r0, const int RB, const float *kbuf, int64_t t0,
        int64_t nk, const int64_t *lo, const int64_t *n, float *scores, int64_t stride) {
    const int UB = 16 / RB;
    for (int u0 = 0; u0 < nk; u0 += UB) {
        __m512 acc[16];
        for (int a = 0; a < 16; a++) acc[a] = _mm512_setzero_ps();
        for (int64_t j = 0; j < D; j += 16) {
            __m512 kv[16];
            for (int u = 0; u < UB; u++) kv[u] = _mm512_loadu_ps(kbuf + (u0 + u) * D + j);
            for (int i = 0; i < RB; i++) {
                const __m512 qv = _mm512_loadu_ps(q + (r0 + i) * D + j);
                for (int u = 0; u < UB; u++)
                    acc[i * UB + u] = _mm512_fmadd_ps(qv, kv[u], acc[i * UB + u]);
            }
        }
        const __m512 sums = sum16(acc);  /* lane i * UB + u: row r0 + i, key t0 + u0 + u */
        for (int i = 0; i < RB; i++) {
            const int r = r0 + i;
            const int64_t t = t0 + u0;  /* keys t .. t + UB - 1 of which lo[r]..n[r]-1 */
            const int64_t a = lo[r] > t ? lo[r] - t : 0;
            int64_t b = n[r] - t < UB ? n[r] - t : UB;
            b = b < nk - u0 ? b : nk - u0;
            if (a >= b) continue;
            const __mmask16 m = (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
            const __m512 row = _mm512_maskz_compress_ps((__mmask16)(m << (i * UB)), sums);
            _mm512_mask_storeu_ps(scores + r * stride + t + a - lo[r],
                                  (__mmask16)((1u << (b - a)) - 1), row);
        }
    }
}

/* out[r0 + i] lanes j0 .. j0 + 16 JB - 1 for RB rows from r0: the probabilities p[r][t]
   times the values, keys in position order, each value vector loaded and converted once for
   the block's RB rows and each probability broadcast once for its JB vectors. A row's sums
   are the same whatever rows or columns share its block. */
static inline __attribute__((always_inline)) void value_block(
        float *const *p, const float *inv, int r0, const int RB, int64_t j0, const int JB,
        const int64_t *lo, const int64_t *n, int64_t first, int64_t longest, int64_t all_lo,
        int64_t all_n, const void *v, int64_t D, int64_t ring, int bf16, void *const *out,
        int obf16) {
    __m512 acc[24];
    for (int a = 0; a < RB * JB; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t t = first; t < longest; t++) {
        const int64_t at = (ring ? t % ring : t) * D + j0;
        if (j0 == 0 && t + AHEAD < longest) fetch_row(v, t + AHEAD, ring, D, bf16, 1);
        __m512 vj[4];
        for (int c = 0; c < JB; c++) vj[c] = load16(v, at + 16 * c, bf16);
        const int every = t >= all_lo && t < all_n;  /* every row of the tile sees it */
        for (int i = 0; i < RB; i++) {
            const int r = r0 + i;
            if (!every && (t < lo[r] || t >= n[r])) continue;
            const __m512 pr = _mm512_set1_ps(p[r][t]);
            for (int c = 0; c < JB; c++)
                acc[i * JB + c] = _mm512_fmadd_ps(pr, vj[c], acc[i * JB + c]);
        }
    }
    for (int i = 0; i < RB; i++)
        for (int c = 0; c < JB; c++)
            store16(out[r0 + i], j0 + 16 * c,
                    _mm512_mul_ps(acc[i * JB + c], _mm512_set1_ps(inv[r0 + i])), 0xffff, obf16);
}

/* value_block over all of D for RB rows: 64 lanes at a time, then 32, then 16. */
static inline __attribute__((always_inline)) void value_rows(
        float *const *p, const float *inv, int r0, const int RB, const int64_t *lo,
        const int64_t *n, int64_t first, int64_t longest, int64_t all_lo, int64_t all_n,
        const void *v, int64_t D, int64_t ring, int bf16, void *const *out, int obf16) {
    int64_t j0 = 0;
    for (; j0 + 64 <= D; j0 += 64)
        value_block(p, inv, r0, RB, j0, 4, lo, n, first, longest, all_lo, all_n, v, D, ring,
                    bf16, out, obf16);
    for (; j0 + 32 <= D; j0 += 32)
        value_block(p, inv, r0, RB, j0, 2, lo, n, first, longest, all_lo, all_n, v, D, ring,
                    bf16, out, obf16);
    for (; j0 < D; j0 += 16)
        value_block(p, inv, r0, RB, j0, 1, lo, n, first, longest, all_lo, all_n, v, D, ring,
                    bf16, out, obf16);
}

/* out[r0 + i] lanes j0 .. j0 + 32 JB - 1 for RB rows from r0, the values summed by bf16 dot
   products (VDPBF16PS, where the scores were: values_bf16). Each pair of keys t, t + 1 (t
   even, by position; a key at or past `longest` enters as 0) is interleaved once for the
   block's rows (unpacklo/hi of 32 columns: `put_back` orders the lanes at the store), and a
   row's pair of bf16 probabilities is broadcast to the block's JB x 2 sums. A row sums the
   pairs that hold any of its keys lo..n-1, in position order (the pair's other key enters
   times 0): the same bits whatever rows or columns share its block. */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline))
void value_block_bf16(const uint16_t *pa, int64_t aw, int64_t t_start, const float *inv,
                      int r0, const int RB, int64_t j0, const int JB, const int64_t *lo,
                      const int64_t *n, int64_t first, int64_t longest, int64_t all_lo,
                      int64_t all_n, const uint16_t *v, int64_t D, int64_t ring,
                      void *const *out, int obf16) {
    __m512 acc[24];
    for (int a = 0; a < RB * JB * 2; a++) acc[a] = _mm512_setzero_ps();
    for (int64_t t = first & ~(int64_t)1; t < longest; t += 2) {
        if (j0 == 0 && t + AHEAD + 1 < longest) {
            fetch_row(v, t + AHEAD, ring, D, 1, 1);
            fetch_row(v, t + AHEAD + 1, ring, D, 1, 1);
        }
        const uint16_t *x = v + (ring ? t % ring : t) * D + j0;
        const uint16_t *y = t + 1 < longest ? v + (ring ? (t + 1) % ring : t + 1) * D + j0
                                            : NULL;
        __m512bh lo2[2], hi2[2];
        for (int c = 0; c < JB; c++) {
            const __m512i a = _mm512_loadu_si512(x + 32 * c);
            const __m512i b = y ? _mm512_loadu_si512(y + 32 * c) : _mm512_setzero_si512();
            lo2[c] = (__m512bh)_mm512_unpacklo_epi16(a, b);
            hi2[c] = (__m512bh)_mm512_unpackhi_epi16(a, b);
        }
        const int every = t + 1 >= all_lo && t < all_n;  /* every row of the block sees it */
        for (int i = 0; i < RB; i++) {
            const int r = r0 + i;
            if (!every && (t + 1 < lo[r] || t >= n[r])) continue;
            int32_t pair;
            memcpy(&pair, pa + r * aw + (t - t_start), sizeof(pair));
            const __m512bh pr = (__m512bh)_mm512_set1_epi32(pair);
            for (int c = 0; c < JB; c++) {
                acc[(i * JB + c) * 2] = _mm512_dpbf16_ps(acc[(i * JB + c) * 2], pr, lo2[c]);
                acc[(i * JB + c) * 2 + 1] = _mm512_dpbf16_ps(acc[(i * JB + c) * 2 + 1], pr,
                                                             hi2[c]);
            }
        }
    }
    for (int i = 0; i < RB; i++) {
        const __m512 scale = _mm512_set1_ps(inv[r0 + i]);
        for (int c = 0; c < JB; c++)
            for (int h = 0; h < 2; h++)
                store16(out[r0 + i], j0 + 32 * c + 16 * h,
                        _mm512_mul_ps(put_back(acc[(i * JB + c) * 2],
                                               acc[(i * JB + c) * 2 + 1], h), scale),
                        0xffff, obf16);
    }
}

/* value_block_bf16 over all of D for RB rows: 64 lanes at a time, then 32. */
__attribute__((target("avx512bf16"))) static inline __attribute__((always_inline))
void value_rows_bf16(const uint16_t *pa, int64_t aw, int64_t t_start, const float *inv,
                     int r0, const int RB, const int64_t *lo, const int64_t *n, int64_t first,
                     int64_t longest, int64_t all_lo, int64_t all_n, const uint16_t *v,
                     int64_t D, int64_t ring, void *const *out, int obf16) {
    int64_t j0 = 0;
    for (; j0 + 64 <= D; j0 += 64)
        value_block_bf16(pa, aw, t_start, inv, r0, RB, j0, 2, lo, n, first, longest, all_lo,
                         all_n, v, D, ring, out, obf16);
    for (; j0 < D; j0 += 32)
        value_block_bf16(pa, aw, t_start, inv, r0, RB, j0, 1, lo, n, first, longest, all_lo,
                         all_n, v, D, ring, out, obf16);
}

/* The values of a tile whose scores were bf16 dot products (scores_bf16: bf16 keys and
   values, D a multiple of 32), on AMD's CPUs (bf16_dot 3: see native/__init__.py; on the
   Intel Xeons value_rows was faster), by bf16 dot products as well: each row's probabilities
   rounded to bf16, as torch's bf16 attention and values_amx round them, and two keys an
   instruction for 16 columns, where value_rows converts each value to fp32 and multiplies
   one key an FMA. On the EPYC Zen 4, one thread, keys in cache, against value_rows by turns
   (medians of 100): Qwen2-1.5B's shapes (12 query heads, 2 kv heads, D = 128) over 512
   keys, one position 0.85x the time and four 0.81x, over 2,000 keys 0.82x and 0.80x;
   Qwen3.5-2B's (8, 2, 256) 0.84x, 0.77x, 0.82x, 0.77x. Qwen2-1.5B's K=3 step at 2,000
   tokens of context, int4: 0.95x. Rows by 6, 4, 2, 1; columns 64 at a time, then 32. */
__attribute__((target("avx512bf16"))) static void values_bf16(
        float *const *p, const float *inv, const int64_t *lo, const int64_t *n, int rows,
        const uint16_t *v, int64_t D, int64_t ring, void *const *out, int obf16,
        int64_t first, int64_t longest, int64_t all_lo, int64_t all_n, uint16_t *pa,
        int64_t aw) {
    const int64_t t_start = bf16_probabilities(p, lo, n, rows, first, longest, pa, aw);
    int r0 = 0;
    for (; r0 + 6 <= rows; r0 += 6)
        value_rows_bf16(pa, aw, t_start, inv, r0, 6, lo, n, first, longest, all_lo, all_n, v,
                        D, ring, out, obf16);
    for (; r0 + 4 <= rows; r0 += 4)
        value_rows_bf16(pa, aw, t_start, inv, r0, 4, lo, n, first, longest, all_lo, all_n, v,
                        D, ring, out, obf16);
    for (; r0 + 2 <= rows; r0 += 2)
        value_rows_bf16(pa, aw, t_start, inv, r0, 2, lo, n, first, longest, all_lo, all_n, v,
                        D, ring, out, obf16);
    for (; r0 < rows; r0++)
        value_rows_bf16(pa, aw, t_start, inv, r0, 1, lo, n, first, longest, all_lo, all_n, v,
                        D, ring, out, obf16);
}

/* Up to MAX_TILE query rows of one kv head (q: `rows` rows of D floats, already times the
   scale; D a multiple of 16, at most 512) against the keys of positions lo[r]..n[r]-1 (at
   entry t mod ring of k and v when ring > 0, else at entry t). A row's arithmetic is the
   same whatever rows share its tile: its dot products over D in fixed lanes, its sums over
   keys in position order. Row r's probability of key lo[r] + i is at scores[r * stride + i];
   its output goes to out[r] (fp32, or rounded to bf16 when obf16 != 0). */
static void attend_tile(const float *q, const uint16_t *qb, float scale, const int64_t *lo,
                        const int64_t *n, const int rows, const void *k, const void *v,
                        int64_t D, int64_t ring, int bf16, float *scores, int64_t stride,
                        void *const *out, int obf16, float *kbuf, int amx,
                        int dot_values, uint16_t *pa, int64_t aw) {
    int64_t longest = 0, first = n[0], all_lo = 0, all_n = n[0];
    float *p[MAX_TILE];  /* p[r][t]: row r's probability of key t */
    for (int r = 0; r < rows; r++) {
        longest = n[r] > longest ? n[r] : longest;
        first = lo[r] < first ? lo[r] : first;
        all_lo = lo[r] > all_lo ? lo[r] : all_lo;  /* keys every row sees: all_lo..all_n-1 */
        all_n = n[r] < all_n ? n[r] : all_n;
        p[r] = scores + r * stride - lo[r];
    }
#ifdef AMX_INTRINSICS
    if (qb && amx) {
        scores_amx(qb, lo, n, rows, (const uint16_t *)k, D, ring, scale, scores, stride, first,
                   longest, (uint8_t *)kbuf);
    } else
#endif
    if (qb) {
        scores_bf16(qb, lo, n, rows, (const uint16_t *)k, D, ring, scale, scores, stride, first,
                    longest);
    } else for (int64_t t0 = first; t0 < longest; t0 += 16) {
        const int64_t nk = longest - t0 < 16 ? longest - t0 : 16;
        for (int64_t u = 0; u < 16; u++) {  /* past the end: any key (its scores not kept) */
            const int64_t t = t0 + (u < nk ? u : 0), ahead = t0 + AHEAD + u;
            const int64_t at = (ring ? t % ring : t) * D;
            if (ahead < longest) fetch_row(k, ahead, ring, D, bf16, 0);
            for (int64_t j = 0; j < D; j += 16)
                _mm512_storeu_ps(kbuf + u * D + j, load16(k, at + j, bf16));
        }
        int r0 = 0;
        for (; r0 + 4 <= rows; r0 += 4)
            score_block(q, D, r0, 4, kbuf, t0, nk, lo, n, scores, stride);
        for (; r0 + 2 <= rows; r0 += 2)
            score_block(q, D, r0, 2, kbuf, t0, nk, lo, n, scores, stride);
        for (; r0 < rows; r0++)
            score_block(q, D, r0, 1, kbuf, t0, nk, lo, n, scores, stride);
    }
    float inv[MAX_TILE];
    for (int r = 0; r < rows; r++) {  /* probabilities in lanes of 16: a fixed order */
        float *s = scores + r * stride;
        const int64_t count = n[r] - lo[r];
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < count; i += 16)  /* the largest: the same in any order */
            vmax = _mm512_mask_max_ps(vmax, tail(count - i), _mm512_loadu_ps(s + i), vmax);
        const float max = _mm512_reduce_max_ps(vmax);
        __m512 sum16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < count; i += 16) {
            const __mmask16 m = tail(count - i);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i),
                                                     _mm512_set1_ps(max)));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(s + i, m, e);
            sum16 = _mm512_add_ps(sum16, e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum16);
    }
#ifdef AMX_INTRINSICS
    if (qb && amx) {
        values_amx(p, inv, lo, n, rows, (const uint16_t *)v, D, ring, out, obf16, first, longest,
                   pa, aw, (uint8_t *)kbuf);
        return;
    }
#endif
    if (qb && dot_values) {
        values_bf16(p, inv, lo, n, rows, (const uint16_t *)v, D, ring, out, obf16, first,
                    longest, all_lo, all_n, pa, aw);
        return;
    }
    int r0 = 0;
    for (; r0 + 6 <= rows; r0 += 6)
        value_rows(p, inv, r0, 6, lo, n, first, longest, all_lo, all_n, v, D, ring, bf16, out,
                   obf16);
    for (; r0 + 4 <= rows; r0 += 4)
        value_rows(p, inv, r0, 4, lo, n, first, longest, all_lo, all_n, v, D, ring, bf16, out,
                   obf16);
    for (; r0 + 2 <= rows; r0 += 2)
        value_rows(p, inv, r0, 2, lo, n, first, longest, all_lo, all_n, v, D, ring, bf16, out,
                   obf16);
    for (; r0 < rows; r0++)
        value_rows(p, inv, r0, 1, lo, n, first, longest, all_lo, all_n, v, D, ring, bf16, out,
                   obf16);
}

/* out [B, H, S, D] = attention of q [B, H, S, D] over the keys k, v; q and out fp32, or
   bf16 when qbf16 != 0 (out rounded as torch rounds), their element (b, h, s, d) at
   b*qsb + h*qsh + s*qss + d and b*osb + h*osh + s*oss + d (so that a [B, S, H, D]
   projection's transposed view is read, and written, as it is); k and v fp32, or bf16 when
   bf16 != 0, element (b, h, t, d) at b*sb + h*sh + t*D + d, of
   kv heads H / Hkv query heads share; row (b, s) sees keys 0..pos[b*S + s], all kv_len of
   them where its position is past them (a padding row parked at the cache's end), none (a
   row of zeros) where it is negative; with a window > 0, only the last `window` of those
   (a sliding-window layer). With ring > 0 (then 0 < window <= ring <= kv_len), k and v are
   a ring: position t's key at entry t mod ring, and every row sees the last `window` of
   keys 0..pos. bf16_dot != 0 (the CPU has AVX512-BF16, and q holds bf16 values): with bf16
   keys and D a multiple of 32, the scores by bf16 dot products (scores_bf16), and the values
   as well where bf16_dot is 3 (values_bf16) or on AMX tiles where it is 2. Returns 0, or
   -1 when scratch memory could not be had or the shapes are not ones this kernel takes. */
int causal_attention(const void *q, int64_t B, int64_t H, int64_t S, int64_t D,
                     int64_t qsb, int64_t qsh, int64_t qss, int64_t osb, int64_t osh,
                     int64_t oss, int qbf16,
                     const void *k, const void *v, int64_t Hkv, int64_t sb, int64_t sh,
                     int64_t kv_len, const int64_t *pos, void *out, int bf16, float scale,
                     int64_t window, int64_t ring, int threads, int bf16_dot) {
    if (D % 16 != 0 || D > 512 || H % Hkv != 0) return -1;
    const int dot = bf16_dot && bf16 && D % 32 == 0, amx = dot && bf16_dot == 2,
              dot_values = dot && bf16_dot == 3;
    if (ring && (window <= 0 || window > ring || ring > kv_len)) return -1;
    const int64_t group = H / Hkv, rows_all = group * S, osize = qbf16 ? 2 : 4;
    const int64_t tiles = (rows_all + MAX_TILE - 1) / MAX_TILE;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* a tile's scores, and its queries times the scale (or as they are, in bf16) */
        const int64_t aw = kv_len + 96;  /* a row's bf16 probabilities (values_amx) */
        float *scores = malloc(sizeof(float) * (size_t)((kv_len + 32 + D) * MAX_TILE + 16 * D)
                               + sizeof(uint16_t) * (size_t)(MAX_TILE * (D + aw)));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        float *scaled = scores ? scores + (kv_len + 32) * MAX_TILE : NULL;
        float *kbuf = scores ? scaled + D * MAX_TILE : NULL;  /* a block's keys, fp32 */
        uint16_t *qb = scores ? (uint16_t *)(kbuf + 16 * D) : NULL;  /* queries, bf16 */
        uint16_t *pa = qb ? qb + MAX_TILE * D : NULL;  /* probabilities, bf16 (values_amx) */
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t hk = 0; hk < Hkv; hk++)
                for (int64_t tile = 0; tile < tiles; tile++) {
                    if (!scores) continue;
                    const int64_t off = b * sb + hk * sh;
                    const void *kh = bf16 ? (const void *)((const uint16_t *)k + off)
                                          : (const void *)((const float *)k + off);
                    const void *vh = bf16 ? (const void *)((const uint16_t *)v + off)
                                          : (const void *)((const float *)v + off);
                    void *outs[MAX_TILE];
                    int64_t ns[MAX_TILE], los[MAX_TILE];
                    int rows = 0;
                    /* rows position-major, so a tile's rows see nearly the same keys */
                    for (int64_t i = tile * MAX_TILE; i < rows_all && i < (tile + 1) * MAX_TILE;
                         i++) {
                        const int64_t s = i / group, h = hk * group + i % group;
                        const int64_t p = pos[b * S + s];
                        const int64_t n = p < 0 ? 0 : ring || p < kv_len ? p + 1 : kv_len;
                        const int64_t qi = b * qsb + h * qsh + s * qss;
                        void *o = (char *)out + (b * osb + h * osh + s * oss) * osize;
                        if (n == 0) {
                            memset(o, 0, (size_t)(osize * D));
                            continue;
                        }
                        float *qr = scaled + rows * D;
                        for (int64_t j = 0; j < D; j += 16) {
                            const __m512 qj = load16(q, qi + j, qbf16);
                            if (dot)  /* bf16 values: their top halves */
                                _mm256_storeu_si256((__m256i *)(qb + rows * D + j),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                                        _mm512_castps_si512(qj), 16)));
                            else
                                _mm512_storeu_ps(qr + j, _mm512_mul_ps(qj, _mm512_set1_ps(scale)));
                        }
                        outs[rows] = o;
                        los[rows] = window > 0 && n > window ? n - window : 0;
                        ns[rows++] = n;
                    }
                    if (rows)
                        attend_tile(scaled, dot ? qb : NULL, scale, los, ns, rows, kh, vh, D,
                                    ring, bf16, scores, kv_len + 32, outs, qbf16, kbuf, amx,
                                    dot_values, pa, aw);
                }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* A cached forward's keys and values into its slots' caches: row (b, s)'s head h, D
   elements of `size` bytes at k + b*ksb + h*ksh + s*kss (v at v + b*vsb + h*vsh + s*vss),
   into entry at[b*S + s] of slot slots[b] (the cache's element (slot, h, entry, 0) at
   slot*csb + h*csh + entry*D, k and v caches alike). What torch's indexed assignment does
   (cache/kv.py), without the index tensors it builds for each layer: ~30 us a layer of a
   decode step there, a few here. Returns -1, writing nothing, where a slot or an entry is
   outside the cache (slots, length). */
int kv_write(const void *k, const void *v, int64_t B, int64_t H, int64_t S, int64_t D,
             int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb, int64_t vsh, int64_t vss,
             void *ck, void *cv, int64_t csb, int64_t csh, const int64_t *slots,
             const int64_t *at, int64_t num_slots, int64_t length, int64_t size) {
    for (int64_t b = 0; b < B; b++) {
        if (slots[b] < 0 || slots[b] >= num_slots) return -1;
        for (int64_t s = 0; s < S; s++)
            if (at[b * S + s] < 0 || at[b * S + s] >= length) return -1;
    }
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t dst = (slots[b] * csb + h * csh + at[b * S + s] * D) * size;
                memcpy((char *)ck + dst, (const char *)k + (b * ksb + h * ksh + s * kss) * size,
                       (size_t)(D * size));
                memcpy((char *)cv + dst, (const char *)v + (b * vsb + h * vsh + s * vss) * size,
                       (size_t)(D * size));
            }
    return 0;
}
