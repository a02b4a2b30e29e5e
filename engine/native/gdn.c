/* What a Gated DeltaNet layer computes between its input projection and the delta rule, for
the positions of a decode step or verify window (Qwen3.5's linear-attention layers), on
AVX-512 CPUs: the causal depthwise convolution over the conv state in the cache's ring and
the new q, k, v inputs, its silu, rounded to the model's dtype; q and k L2-normalised per key
head (q also by 1/sqrt(Dk)) and repeated for their value heads; the gates a_t = exp(-exp(A)
softplus(alpha_t + dt_bias)) and b_t = sigmoid(beta_t); and the conv state after each
position, written into the ring entries after the committed one.

Why: as tensor operations this is some sixty small operators a layer and position, each
costing more in dispatch than in arithmetic (Qwen3.5-2B's plain step spent a third of its
time between the matmuls, and a second thread does not shorten that). Each position's
values come from its own inputs and the state before it, channel by channel in a fixed
order, so a row's result does not depend on what else shares the call. The convolution
runs 16 channels at a time over all of a row's positions (threads take blocks of channels),
then the norms and gates a key head at a time (threads take heads).
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vecmath.h"

/* x / sqrt(sum x^2 + 1e-6) * scale over D floats (a multiple of 16), in place. */
static void l2norm(float *x, int64_t D, float scale) {
    __m512 ss = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
        const __m512 v = _mm512_loadu_ps(x + d);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) + 1e-6f));
    for (int64_t d = 0; d < D; d += 16) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + d), inv);
        if (scale != 1.0f) v = _mm512_mul_ps(v, _mm512_set1_ps(scale));
        _mm512_storeu_ps(x + d, v);
    }
}

/* A block's conv state, 16 channels of `keep` taps each, stored channel by channel: element
   i * keep + j is channel i's tap j. Where the state is bf16 and keep <= 4 (the 16 * keep
   values fill at most two vectors) it moves between that layout and a vector a tap by
   permutes; else element by element (gathers and scatters were slower on the Zen 5, and
   so was one function for both ways). The same values either way. */
typedef struct {
    __m512i read[4];   /* tap j's lanes i <- element i * keep + j (of lo | hi) */
    __m512i lo, hi;    /* element e <- tap j lane i (of taps 0,1 | taps 2,3) */
    __mmask32 lo_mask, hi_mask;  /* the 16 * keep elements: of the first vector, the second */
    int64_t keep;
    int fast;          /* the permutes apply (bf16, keep <= 4) */
} StateMoves;

static void state_moves(StateMoves *m, int64_t keep, int bf16) {
    m->keep = keep;
    m->fast = bf16 && keep <= 4;
    if (!m->fast) return;
    const int64_t n = 16 * keep;
    m->lo_mask = n >= 32 ? 0xffffffffu : (__mmask32)((1ull << n) - 1);
    m->hi_mask = n > 32 ? (__mmask32)((1ull << (n - 32)) - 1) : 0;
    uint16_t lo[32], hi[32];
    for (int64_t e = 0; e < 64; e++) {  /* element e = i * keep + j, tap j's lane i */
        const uint16_t src = e < n ? (uint16_t)((e % keep) * 16 + e / keep) : 0;
        if (e < 32) lo[e] = src; else hi[e - 32] = src;
    }
    m->lo = _mm512_loadu_si512(lo);
    m->hi = _mm512_loadu_si512(hi);
    for (int64_t j = 0; j < keep; j++) {
        uint16_t r[32];
        for (int64_t i = 0; i < 32; i++) r[i] = i < 16 ? (uint16_t)(i * keep + j) : 0;
        m->read[j] = _mm512_loadu_si512(r);
    }
}

/* The block's bf16 state at element `at` of conv into win[0 .. keep-1] (16 lanes a tap). */
static inline void state_read(const StateMoves *m, const void *conv, int64_t at,
                              float win[][16]) {
    const uint16_t *src = (const uint16_t *)conv + at;
    const __m512i a = _mm512_maskz_loadu_epi16(m->lo_mask, src);
    const __m512i b = _mm512_maskz_loadu_epi16(m->hi_mask, src + 32);
    for (int64_t j = 0; j < m->keep; j++) {
        const __m512i t = _mm512_permutex2var_epi16(a, m->read[j], b);
        _mm512_storeu_ps(win[j], _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm512_castsi512_si256(t)), 16)));
    }
}

/* win[0 .. keep-1] (bf16 values) as the block's bf16 state at element `at`. */
static inline void state_write(const StateMoves *m, void *conv, int64_t at, float win[][16]) {
    const int64_t keep = m->keep;
    __m256i t[4];
    for (int64_t j = 0; j < 4; j++)  /* exact: the values are bf16's */
        t[j] = j < keep ? _mm512_cvtepi32_epi16(_mm512_srli_epi32(
                   _mm512_castps_si512(_mm512_loadu_ps(win[j])), 16))
                        : _mm256_setzero_si256();
    const __m512i a = _mm512_inserti64x4(_mm512_castsi256_si512(t[0]), t[1], 1);
    const __m512i b = _mm512_inserti64x4(_mm512_castsi256_si512(t[2]), t[3], 1);
    uint16_t *dst = (uint16_t *)conv + at;
    _mm512_mask_storeu_epi16(dst, m->lo_mask, _mm512_permutex2var_epi16(a, m->lo, b));
    if (m->hi_mask)
        _mm512_mask_storeu_epi16(dst + 32, m->hi_mask, _mm512_permutex2var_epi16(a, m->hi, b));
}

/* The convolution of channels c0 .. c0+15 of row b over its S positions: silu of the sum
   over the Kc taps (in order) into mixed, rounded to bf16 when bf16 != 0, and the conv
   state after each position into its ring entry. w: the weights [Kc, C]. */
static inline __attribute__((always_inline)) void conv_block(
        const StateMoves *m, const void *x, int64_t x_stride, int64_t b, int64_t S, int64_t C,
        int64_t c0, int64_t Kc, void *conv, const float *w, int64_t state,
        const int64_t *after, float *mixed, int bf16, int fast) {
    const int64_t keep = Kc - 1;
    float win[64 + 8][16];  /* the window's inputs: the committed state's, then the new */
    __m512 taps[8];
    for (int64_t j = 0; j < Kc; j++) taps[j] = _mm512_loadu_ps(w + j * C + c0);
    if (fast)
        state_read(m, conv, state + c0 * keep, win);
    else
        for (int64_t j = 0; j < keep; j++)
            for (int64_t i = 0; i < 16; i++)
                win[j][i] = scalar(conv, state + (c0 + i) * keep + j, bf16);
    for (int64_t s = 0; s < S; s++)
        _mm512_storeu_ps(win[keep + s], load16(x, (b * S + s) * x_stride + c0, bf16));
    for (int64_t s = 0; s < S; s++) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < Kc; j++)
            sum = _mm512_add_ps(sum, _mm512_mul_ps(_mm512_loadu_ps(win[s + j]), taps[j]));
        __m512 out = silu16(sum);
        if (bf16) out = round_bf16(out);
        _mm512_storeu_ps(mixed + (b * S + s) * C + c0, out);
        /* the conv state after position s: inputs s+1 .. s+Kc-1 of the window */
        const int64_t dst = after[s] + c0 * keep;
        if (fast) {
            state_write(m, conv, dst, win + s + 1);
        } else if (bf16) {
            uint16_t *o = (uint16_t *)conv + dst;
            for (int64_t i = 0; i < 16; i++)
                for (int64_t j = 0; j < keep; j++) {
                    union { float f; uint32_t u; } bits = {.f = win[s + 1 + j][i]};
                    o[i * keep + j] = (uint16_t)(bits.u >> 16);
                }
        } else {
            float *o = (float *)conv + dst;
            for (int64_t i = 0; i < 16; i++)
                for (int64_t j = 0; j < keep; j++) o[i * keep + j] = win[s + 1 + j][i];
        }
    }
}

/* Rows b of S positions. x: the layer's fused input projections, row (b, s) at
   (b*S + s) * x_stride elements: q, k, v's C = 2 Hk Dk + Hv Dv pre-convolution inputs first,
   beta's Hv at b_off, alpha's Hv at a_off. conv: the ring [slots, R, C, Kc-1] (the model's
   dtype, as x), slot slots[b]'s committed entry index[slots[b]]; the state after position
   s goes to entry (index + 1 + s) mod R. w: the convolution's weights by tap [Kc, C];
   a_log and dt_bias [Hv]; all fp32. Out (fp32): q, k [B, Hv, S, Dk], v [B, Hv, S, Dv],
   decay a_t and beta b_t [B, Hv, S]. bf16 != 0: x and conv are bf16, and the
   convolution's output is rounded to bf16 as the model's dtype would. Returns 0; -1 when the
   shapes are not ones this kernel takes or memory could not be had; -2, nothing written,
   where a slot is outside the ring's `num_slots` or its entry outside the ring. */
int gdn_prepare(const void *x, int64_t x_stride, int64_t b_off, int64_t a_off, int64_t B,
                int64_t S, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t Kc,
                void *conv, int64_t R, int64_t num_slots, const int64_t *slots,
                const int64_t *index,
                const float *w, const float *a_log, const float *dt_bias,
                float *q, float *k, float *v, float *decay, float *beta, int bf16,
                int threads) {
    const int64_t C = 2 * Hk * Dk + Hv * Dv, keep = Kc - 1, group = Hv / Hk;
    if (Dk % 16 || Dv % 16 || Hv % Hk || Dk > 512 || Kc < 2 || Kc > 8 || S > 64
            || S + 1 > R)
        return -1;
    for (int64_t b = 0; b < B; b++)
        if (slots[b] < 0 || slots[b] >= num_slots || index[slots[b]] < 0
            || index[slots[b]] >= R)
            return -2;
    float *mixed = malloc(sizeof(float) * (size_t)(B * S * C));  /* conv outputs [B, S, C] */
    int64_t *after = malloc(sizeof(int64_t) * (size_t)(B * (S + 1)));
    if (!mixed || !after) {
        free(mixed);
        free(after);
        return -1;
    }
    const int64_t entry = C * keep;  /* elements of one conv state */
    for (int64_t b = 0; b < B; b++) {  /* [committed, after position 0, 1, ...] */
        const int64_t slot = slots[b], at = index[slot];
        for (int64_t s = 0; s <= S; s++)
            after[b * (S + 1) + s] = (slot * R + (at + s) % R) * entry;
    }
    StateMoves moves;
    state_moves(&moves, keep, bf16);
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static) collapse(2)
        for (int64_t b = 0; b < B; b++)
            for (int64_t c0 = 0; c0 < C; c0 += 16)
                if (moves.fast)  /* a copy of the loop each way */
                    conv_block(&moves, x, x_stride, b, S, C, c0, Kc, conv, w,
                               after[b * (S + 1)], after + b * (S + 1) + 1, mixed, bf16, 1);
                else
                    conv_block(&moves, x, x_stride, b, S, C, c0, Kc, conv, w,
                               after[b * (S + 1)], after + b * (S + 1) + 1, mixed, bf16, 0);
#pragma omp for schedule(static) collapse(3)
        for (int64_t b = 0; b < B; b++)
            for (int64_t s = 0; s < S; s++)
                for (int64_t kh = 0; kh < Hk; kh++) {
                    const int64_t row = b * S + s;
                    float qn[512], kn[512];
                    const float *m = mixed + row * C;
                    for (int64_t d = 0; d < Dk; d++) {
                        qn[d] = m[kh * Dk + d];
                        kn[d] = m[(Hk + kh) * Dk + d];
                    }
                    l2norm(qn, Dk, 1.0f / sqrtf((float)Dk));
                    l2norm(kn, Dk, 1.0f);
                    for (int64_t h = kh * group; h < (kh + 1) * group; h++) {
                        const int64_t out = (b * Hv + h) * S + s;
                        for (int64_t d = 0; d < Dk; d++) {
                            q[out * Dk + d] = qn[d];
                            k[out * Dk + d] = kn[d];
                        }
                        for (int64_t d = 0; d < Dv; d++)
                            v[out * Dv + d] = m[2 * Hk * Dk + h * Dv + d];
                        const float bt = scalar(x, row * x_stride + b_off + h, bf16);
                        const float al = scalar(x, row * x_stride + a_off + h, bf16) + dt_bias[h];
                        const float soft = al > 20.0f ? al : log1pf(expf(al));
                        decay[out] = expf(-expf(a_log[h]) * soft);
                        beta[out] = 1.0f / (1.0f + expf(-bt));
                    }
                }
    }
    free(mixed);
    free(after);
    return 0;
}

/* The layer's output norm after the delta rule: RMSNorm(o) * weight * silu(z) per value head,
   in the order and dtype roundings of GatedRMSNorm (model/deltanet.py). o [B, Hv, S, Dv]
   fp32 (the delta rule's output); z: Hv * Dv values at element z_off of row (b*S + s) of x
   (the fused projections, x_stride elements a row); weight [Dv] fp32. Writes
   out [B, S, Hv, Dv] (bf16 when bf16 != 0, with x, else fp32). */
int gdn_gated_norm(const float *o, int64_t B, int64_t S, int64_t Hv, int64_t Dv,
                   const void *x, int64_t x_stride, int64_t z_off, const float *weight,
                   float eps, void *out, int bf16) {
    if (Dv % 16) return -1;
    for (int64_t b = 0; b < B; b++)
        for (int64_t s = 0; s < S; s++)
            for (int64_t h = 0; h < Hv; h++) {
                const float *src = o + ((b * Hv + h) * S + s) * Dv;
                const int64_t zrow = (b * S + s) * x_stride + z_off + h * Dv;
                const int64_t dst = ((b * S + s) * Hv + h) * Dv;
                __m512 ss = _mm512_setzero_ps();
                for (int64_t d = 0; d < Dv; d += 16) {
                    __m512 v = _mm512_loadu_ps(src + d);
                    if (bf16) v = round_bf16(v);
                    ss = _mm512_fmadd_ps(v, v, ss);
                }
                const __m512 r = _mm512_set1_ps(
                    1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)Dv + eps));
                for (int64_t d = 0; d < Dv; d += 16) {
                    __m512 v = _mm512_loadu_ps(src + d);
                    if (bf16) v = round_bf16(v);
                    v = _mm512_mul_ps(v, r);
                    if (bf16) v = round_bf16(v);
                    v = _mm512_mul_ps(_mm512_loadu_ps(weight + d), v);
                    if (bf16) v = round_bf16(v);
                    v = _mm512_mul_ps(v, silu16(load16(x, zrow + d, bf16)));
                    store16(out, dst + d, v, 0xffff, bf16);
                }
            }
    return 0;
}
