/* A weight's int4 or int8 codes in wq.c's layout, straight from its fp32 or bf16 values:
what engine/model/codes.py `_encode` followed by engine/native/layout.py `pack` make, bit for
bit, in one pass over the weight instead of a dozen (a 2B model's first load spent 19 s in
those two, one thread per operator at a time).

The same arithmetic as the torch operators, in fp32 and in the same order, each rounding as
theirs rounds (IEEE division, round half to even, fp16 by round to nearest even):
  int4, per output row and group of G inputs: low, high = min, max; s = max((high - low) /
       15, 1e-12); q = clamp(round((w - low) / s), 0, 15); zero = low + 8 s; stored: s and
       m = zero - 8 s, as fp16;
  int8, per output row: s = max(max |w|, 1e-12) / 127; q = clamp(round(w / s), -127, 127);
       stored: q + 128 as a byte, s and m = -128 s as fp16.
Outputs past the last row of the weight (the last tile's padding) are zero codes, scales and
offsets. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "tiles.h"

static inline __m512 load16(const void *w, int64_t i, int bf16) {
    if (!bf16)
        return _mm512_loadu_ps((const float *)w + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#define NEAREST (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

/* Row n's group of G inputs from k0 as int4 codes q[G]; its scale and offset. */
static void int4_group(const void *w, int bf16, int64_t at, int64_t G, uint8_t *q,
                       float *s_out, float *m_out) {
    __m512 lo = load16(w, at, bf16), hi = lo;
    for (int64_t i = 16; i < G; i += 16) {
        __m512 v = load16(w, at + i, bf16);
        lo = _mm512_min_ps(lo, v);
        hi = _mm512_max_ps(hi, v);
    }
    const float low = _mm512_reduce_min_ps(lo), high = _mm512_reduce_max_ps(hi);
    float s = (high - low) / 15.0f;
    s = s < 1e-12f ? 1e-12f : s;
    const __m512 vlow = _mm512_set1_ps(low), vs = _mm512_set1_ps(s);
    const __m512 zero = _mm512_setzero_ps(), top = _mm512_set1_ps(15.0f);
    for (int64_t i = 0; i < G; i += 16) {
        __m512 v = _mm512_div_ps(_mm512_sub_ps(load16(w, at + i, bf16), vlow), vs);
        v = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, NEAREST), zero), top);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
    }
    const float z = low + 8.0f * s;
    *s_out = s;
    *m_out = z - 8.0f * s;
}

/* Row n's int8 scale: max(max |w|, 1e-12) / 127 over its K inputs. */
static float int8_scale(const void *w, int bf16, int64_t at, int64_t K) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t i = 0; i < K; i += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(load16(w, at + i, bf16)));
    float a = _mm512_reduce_max_ps(amax);
    return (a < 1e-12f ? 1e-12f : a) / 127.0f;
}

/* Row n's group of G inputs from `at` as int8 codes plus 128. */
static void int8_group(const void *w, int bf16, int64_t at, int64_t G, float s, uint8_t *q) {
    const __m512 vs = _mm512_set1_ps(s);
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i bias = _mm512_set1_epi32(128);
    for (int64_t i = 0; i < G; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(w, at + i, bf16), vs), NEAREST);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(v), bias);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtepi32_epi8(u));
    }
}

static inline uint16_t half(float x) {
    return (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_set_ss(x), NEAREST), 0);
}

/* w [N, K] (fp32, or bf16 when bf16 != 0, rows contiguous) as `bits` (4 or 8) codes with
   activation groups of G inputs (G a multiple of 32 dividing K) into out [ceil(N / 16),
   K / G, block] (block = G * 8 (int4) or G * 16 (int8) bytes of codes, then 16 fp16 scales
   and 16 fp16 offsets; int4 tiles by pairs: tiles.h). Returns 0, or -1 for arguments it
   does not take. */
int wq_encode(const void *w, int bf16, int64_t N, int64_t K, int bits, int64_t G,
              uint8_t *out, int threads) {
    if ((bits != 4 && bits != 8) || G <= 0 || G % 32 || K % G || G > 256 || N <= 0)
        return -1;
    const int64_t groups = K / G, tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
    for (int64_t t = 0; t < tiles; t++) {
        const Tile tl = tile_at(out, bits, tiles, groups, G, t);
        uint8_t q[256];
        float row_scale[TILE];
        for (int c = 0; c < TILE; c++) {
            const int64_t n = t * TILE + c;
            row_scale[c] = bits == 8 && n < N ? int8_scale(w, bf16, n * K, K) : 0.0f;
        }
        for (int64_t g = 0; g < groups; g++) {
            uint8_t *dst = (uint8_t *)tl.p + g * tl.gs;  /* vector j at dst + j * tl.vs */
            uint16_t *sm = (uint16_t *)(dst + tl.so);
            for (int c = 0; c < TILE; c++) {
                const int64_t n = t * TILE + c;
                if (n >= N) {  /* padding: zero codes, scales and offsets */
                    for (int64_t j = 0; j < G / (bits == 4 ? 8 : 4); j++)
                        memset(dst + j * tl.vs + c * 4, 0, 4);
                    sm[c] = sm[TILE + c] = 0;
                    continue;
                }
                const int64_t at = n * K + g * G;
                float s, m;
                if (bits == 4) {
                    int4_group(w, bf16, at, G, q, &s, &m);
                    /* vector j, lane c, byte b: inputs 8j + b (low nibble), 8j + 4 + b */
                    for (int64_t j = 0; j < G / 8; j++)
                        for (int b = 0; b < 4; b++)
                            dst[j * tl.vs + c * 4 + b] =
                                (uint8_t)(q[8 * j + b] | q[8 * j + 4 + b] << 4);
                } else {
                    s = row_scale[c];
                    m = -128.0f * s;
                    int8_group(w, bf16, at, G, s, q);
                    /* vector j, lane c, byte b: input 4j + b */
                    for (int64_t j = 0; j < G / 4; j++)
                        memcpy(dst + j * tl.vs + c * 4, q + 4 * j, 4);
                }
                sm[c] = half(s);
                sm[TILE + c] = half(m);
            }
        }
    }
    return 0;
}

/* A draft head's coarse 2-bit layout (wq.c; tile by tile, where int4 tiles are by pairs:
   tiles.h) from its int4 one, `tiles` x `groups` blocks of G inputs: each int4 code q
   becomes round(q / 5) (levels 0, 5, 10, 15 of the int4 code: the group's range in four
   steps) and each scale s, 5 s (as fp16); the offsets stay. The drafts' coarse pass finds
   candidates by it, which the int4 layout then scores exactly. */
void wq_coarse_from_int4(const uint8_t *w4, int64_t tiles, int64_t groups, int64_t G,
                         uint8_t *w2, int threads) {
    static const uint8_t level[16] = {0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 3};
    const int64_t body2 = G * TILE / 4, sm = 4 * TILE;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t blk = 0; blk < tiles * groups; blk++) {
        const Tile tl = tile_at(w4, 4, tiles, groups, G, blk / groups);
        const uint8_t *in = tl.p + blk % groups * tl.gs;  /* vector j at in + j * tl.vs */
        uint8_t *out = w2 + blk * (body2 + sm);
        for (int64_t j = 0; j < G / 16; j++)
            for (int c = 0; c < TILE; c++)
                for (int b = 0; b < 4; b++) {
                    uint8_t byte = 0;
                    for (int i = 0; i < 4; i++) {  /* input 16j + 4i + b: int4 vector 2j + i / 2 */
                        const uint8_t q = in[tl.vs * (2 * j + i / 2) + 4 * c + b];
                        byte |= (uint8_t)(level[i % 2 ? q >> 4 : q & 15] << (2 * i));
                    }
                    out[64 * j + 4 * c + b] = byte;
                }
        const uint16_t *s4 = (const uint16_t *)(in + tl.so);
        uint16_t *s2 = (uint16_t *)(out + body2);
        for (int c = 0; c < TILE; c++) {
            s2[c] = _cvtss_sh(5.0f * _cvtsh_ss(s4[c]), 0);
            s2[TILE + c] = s4[TILE + c];
        }
    }
}
