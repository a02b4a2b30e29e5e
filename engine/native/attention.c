/* Causal attention of a cached forward on AVX-512 CPUs: each query row attends to its slot's
keys 0..pos, softmax(q k^T / sqrt(D)) v, in fp32 whatever the cache's dtype; where queries
and keys are bf16 and the CPU has AVX512-BF16, the scores sum the exact products of their
bf16 values by VDPBF16PS (half the instructions, no key converted: a 4-position verify's
attention ~1.5x faster on Qwen2-1.5B's and Qwen3.5-2B's shapes).

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
   positions as fit, so that each key and value is loaded and converted once for all of
   them; each row's dot product and each of its 16 output lanes keeps one accumulator in a
   register. */
#define MAX_TILE 16

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

/* The scores of `rows` query rows against keys first..longest-1 by bf16 dot products
   (VDPBF16PS, fp32 sums of pairs of exact bf16 products): qb holds each row's query as the
   model made it (bf16, not yet scaled), k the cache's bf16 keys. 16 keys at a time, a row's
   16 sums summed by sum16 and then scaled: a score's arithmetic is its own row's and key's
   whatever else the tile holds. Half the instructions of the fp32 path's scores, and no key
   converted to fp32. Row r's score of key lo[r] + i goes to scores[r * stride + i]. */
__attribute__((target("avx512bf16"))) static void scores_bf16(
        const uint16_t *qb, const int64_t *lo, const int64_t *n, int rows, const uint16_t *k,
        int64_t D, int64_t ring, float scale, float *scores, int64_t stride, int64_t first,
        int64_t longest) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t t0 = first; t0 < longest; t0 += 16) {
        const int64_t nk = longest - t0 < 16 ? longest - t0 : 16;
        const uint16_t *key[16];
        for (int u = 0; u < 16; u++) {
            const int64_t t = t0 + (u < nk ? u : 0);  /* past the end: any key, not stored */
            key[u] = k + (ring ? t % ring : t) * D;
        }
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
            const __m512 sums = _mm512_mul_ps(sum16(acc), sc);
            const int64_t a = lo[r] > t0 ? lo[r] - t0 : 0, b = n[r] - t0 < nk ? n[r] - t0 : nk;
            const __mmask16 m = (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
            _mm512_mask_storeu_ps(scores + r * stride + t0 - lo[r], m, sums);
        }
    }
}

/* Up to MAX_TILE query rows of one kv head (q: `rows` rows of D floats, already times the
   scale; D a multiple of 16, at most 512) against the keys of positions lo[r]..n[r]-1 (at
   entry t mod ring of k and v when ring > 0, else at entry t). A row's arithmetic is the
   same whatever rows share its tile: its dot products over D in fixed lanes, its sums over
   keys in position order. Row r's probability of key lo[r] + i is at scores[r * stride + i].
   `rows` is a constant in each inlined copy, so that the accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_rows(
        const float *q, const uint16_t *qb, float scale, const int64_t *lo, const int64_t *n,
        const int rows, const void *k, const void *v, int64_t D, int64_t ring, int bf16,
        float *scores, int64_t stride, float *const *out, float *kbuf) {
    const int64_t nd = D / 16;
    int64_t longest = 0, first = n[0], all_lo = 0, all_n = n[0];
    const float *p[MAX_TILE];  /* p[r][t]: row r's probability of key t */
    for (int r = 0; r < rows; r++) {
        longest = n[r] > longest ? n[r] : longest;
        first = lo[r] < first ? lo[r] : first;
        all_lo = lo[r] > all_lo ? lo[r] : all_lo;  /* keys every row sees: all_lo..all_n-1 */
        all_n = n[r] < all_n ? n[r] : all_n;
        p[r] = scores + r * stride - lo[r];
    }
    /* The scores. Each row's dot product accumulates in lanes d mod 16 and is summed across
       them in _mm512_reduce_add_ps's order, either way: a key at a time for all rows (few
       rows), or, for many rows, 16 keys at a time (converted once into kbuf) summed all at
       once by sum16, which spends fewer instructions a score. */
    if (qb) {
        scores_bf16(qb, lo, n, rows, (const uint16_t *)k, D, ring, scale, scores, stride, first,
                    longest);
    } else if (rows <= 8) {
        for (int64_t t = first; t < longest; t++) {
            const int64_t at = (ring ? t % ring : t) * D;
            __m512 acc[MAX_TILE];
            for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
            for (int64_t j = 0; j < nd; j++) {
                const __m512 kj = load16(k, at + 16 * j, bf16);
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * D + 16 * j), kj, acc[r]);
            }
            for (int r = 0; r < rows; r++)
                if (t >= lo[r] && t < n[r])
                    scores[r * stride + t - lo[r]] = _mm512_reduce_add_ps(acc[r]);
        }
    } else for (int64_t t0 = first; t0 < longest; t0 += 16) {
        const int64_t nk = longest - t0 < 16 ? longest - t0 : 16;
        for (int64_t u = 0; u < 16; u++) {
            const int64_t t = t0 + (u < nk ? u : 0);  /* past the end: any key, not stored */
            const int64_t at = (ring ? t % ring : t) * D;
            for (int64_t j = 0; j < nd; j++)
                _mm512_storeu_ps(kbuf + u * D + 16 * j, load16(k, at + 16 * j, bf16));
        }
        for (int r = 0; r < rows; r++) {
            if (t0 + 15 < lo[r] || t0 >= n[r]) continue;  /* none of the row's keys */
            __m512 acc[16];
            for (int u = 0; u < 16; u++) acc[u] = _mm512_setzero_ps();
            for (int64_t j = 0; j < nd; j++) {
                const __m512 qj = _mm512_loadu_ps(q + r * D + 16 * j);
                for (int u = 0; u < 16; u++)
                    acc[u] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(kbuf + u * D + 16 * j), acc[u]);
            }
            const __m512 sums = sum16(acc);
            /* keys t0 + u within lo[r]..n[r]-1 */
            const int64_t a = lo[r] > t0 ? lo[r] - t0 : 0, b = n[r] - t0 < nk ? n[r] - t0 : nk;
            const __mmask16 m = (__mmask16)(((1u << b) - 1) & ~((1u << a) - 1));
            _mm512_mask_storeu_ps(scores + r * stride + t0 - lo[r], m, sums);
        }
    }
    float inv[MAX_TILE];
    for (int r = 0; r < rows; r++) {  /* probabilities in lanes of 16: a fixed order */
        float *s = scores + r * stride, max = -INFINITY;
        const int64_t count = n[r] - lo[r];
        for (int64_t i = 0; i < count; i++) max = s[i] > max ? s[i] : max;
        __m512 sum16 = _mm512_setzero_ps();
        for (int64_t i = 0; i < count; i += 16) {
            const __mmask16 m = count - i >= 16 ? 0xffff : (__mmask16)((1u << (count - i)) - 1);
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i),
                                                     _mm512_set1_ps(max)));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(s + i, m, e);
            sum16 = _mm512_add_ps(sum16, e);
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum16);
    }
    for (int64_t j = 0; j < nd; j++) {  /* 16 output lanes at a time, keys in order */
        __m512 acc[MAX_TILE];
        for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t t = first; t < longest; t++) {
            const __m512 vj = load16(v, (ring ? t % ring : t) * D + 16 * j, bf16);
            if (t >= all_lo && t < all_n) {  /* every row sees it */
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][t]), vj, acc[r]);
            } else {
                for (int r = 0; r < rows; r++)
                    if (t >= lo[r] && t < n[r])
                        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(p[r][t]), vj, acc[r]);
            }
        }
        for (int r = 0; r < rows; r++)
            _mm512_storeu_ps(out[r] + 16 * j, _mm512_mul_ps(acc[r], _mm512_set1_ps(inv[r])));
    }
}

static void attend_tile(const float *q, const uint16_t *qb, float scale, const int64_t *lo,
                        const int64_t *n, int rows, const void *k, const void *v, int64_t D,
                        int64_t ring, int bf16, float *scores, int64_t stride,
                        float *const *out, float *kbuf) {
    switch (rows) {
#define ROWS(c) case c: attend_rows(q, qb, scale, lo, n, c, k, v, D, ring, bf16, scores, \
                                    stride, out, kbuf); break;
        ROWS(1) ROWS(2) ROWS(3) ROWS(4) ROWS(5) ROWS(6) ROWS(7) ROWS(8)
        ROWS(9) ROWS(10) ROWS(11) ROWS(12) ROWS(13) ROWS(14) ROWS(15) ROWS(16)
#undef ROWS
    }
}

/* out [B, H, S, D] (fp32) = attention of q [B, H, S, D] (fp32, contiguous) over the keys
   k, v (fp32, or bf16 when bf16 != 0; element (b, h, t, d) at b*sb + h*sh + t*D + d) of
   kv heads H / Hkv query heads share; row (b, s) sees keys 0..pos[b*S + s], all kv_len of
   them where its position is past them (a padding row parked at the cache's end), none (a
   row of zeros) where it is negative; with a window > 0, only the last `window` of those
   (a sliding-window layer). With ring > 0 (then 0 < window <= ring <= kv_len), k and v are
   a ring: position t's key at entry t mod ring, and every row sees the last `window` of
   keys 0..pos. bf16_dot != 0 (the CPU has AVX512-BF16, and q holds bf16 values): with bf16
   keys and D a multiple of 32, the scores by bf16 dot products (scores_bf16). Returns 0, or
   -1 when scratch memory could not be had or the shapes are not ones this kernel takes. */
int causal_attention(const float *q, int64_t B, int64_t H, int64_t S, int64_t D,
                     const void *k, const void *v, int64_t Hkv, int64_t sb, int64_t sh,
                     int64_t kv_len, const int64_t *pos, float *out, int bf16, float scale,
                     int64_t window, int64_t ring, int threads, int bf16_dot) {
    if (D % 16 != 0 || D > 512 || H % Hkv != 0) return -1;
    const int dot = bf16_dot && bf16 && D % 32 == 0;
    if (ring && (window <= 0 || window > ring || ring > kv_len)) return -1;
    const int64_t group = H / Hkv, rows_all = group * S;
    const int64_t tiles = (rows_all + MAX_TILE - 1) / MAX_TILE;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* a tile's scores, and its queries times the scale (or as they are, in bf16) */
        float *scores = malloc(sizeof(float) * (size_t)((kv_len + 32 + D) * MAX_TILE + 16 * D)
                               + sizeof(uint16_t) * (size_t)(MAX_TILE * D));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        float *scaled = scores ? scores + (kv_len + 32) * MAX_TILE : NULL;
        float *kbuf = scores ? scaled + D * MAX_TILE : NULL;  /* a block's keys, fp32 */
        uint16_t *qb = scores ? (uint16_t *)(kbuf + 16 * D) : NULL;  /* queries, bf16 */
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
                    float *outs[MAX_TILE];
                    int64_t ns[MAX_TILE], los[MAX_TILE];
                    int rows = 0;
                    /* rows position-major, so a tile's rows see nearly the same keys */
                    for (int64_t i = tile * MAX_TILE; i < rows_all && i < (tile + 1) * MAX_TILE;
                         i++) {
                        const int64_t s = i / group, h = hk * group + i % group;
                        const int64_t row = (b * H + h) * S + s, p = pos[b * S + s];
                        const int64_t n = p < 0 ? 0 : ring || p < kv_len ? p + 1 : kv_len;
                        if (n == 0) {
                            memset(out + row * D, 0, sizeof(float) * (size_t)D);
                            continue;
                        }
                        float *qr = scaled + rows * D;
                        for (int64_t j = 0; j < D; j += 16) {
                            const __m512 qj = _mm512_loadu_ps(q + row * D + j);
                            if (dot)  /* bf16 values: their top halves */
                                _mm256_storeu_si256((__m256i *)(qb + rows * D + j),
                                    _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                                        _mm512_castps_si512(qj), 16)));
                            else
                                _mm512_storeu_ps(qr + j, _mm512_mul_ps(qj, _mm512_set1_ps(scale)));
                        }
                        outs[rows] = out + row * D;
                        los[rows] = window > 0 && n > window ? n - window : 0;
                        ns[rows++] = n;
                    }
                    if (rows)
                        attend_tile(scaled, dot ? qb : NULL, scale, los, ns, rows, kh, vh, D,
                                    ring, bf16, scores, kv_len + 32, outs, kbuf);
                }
        free(scores);
    }
    return failed ? -1 : 0;
}
