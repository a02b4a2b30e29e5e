/* The small row-wise operators of a bf16 step between its products, on AVX-512 CPUs: RMSNorm
(after the residual add where one comes first), the SwiGLU gate, rotary embeddings, and the
argmax and log-sum-exp of a row of logits.

Why: as tensor operations a layer's norms, gate and rotary are some thirty operators a step,
each costing more in dispatch than in arithmetic, and those over several rows (a verify
window) cost more again; the logits' argmax and log-sum-exp were five passes over a
152k-entry row, each converting or writing it anew.

Each row is computed alone, element by element in a fixed order, so a row's bits never
depend on the rows beside it. Where torch rounds after every operator, so do these: the
rotary embedding gives torch's bits exactly (x cos + roll(x) sin, each product and the sum
rounded to bf16); the norm and the gate round where torch does, but their sums and exp are
our own, so their last bit may differ from torch's (never between two calls of ours).
*/
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vecmath.h"

/* RMSNorm of rows of `dim` bf16 values, row r at x + r * x_stride: h = x (+ res, rounded:
   the residual add, written to h_out, row r at r * dim), then with r = 1 / sqrt(mean(h^2) +
   eps), by the bf16 weight w: when `upcast`, round(h r (w + offset)) (Qwen3.5, Gemma 4, the
   offset added in fp32); else round(w round(h r)) (Llama, Qwen2/3). out: row r at r * dim. */
void rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
              uint16_t *h_out, int64_t rows, int64_t dim, const uint16_t *w, float offset,
              float eps, int upcast, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * x_stride;
        if (res) {  /* the residual add first, rounded as torch's bf16 add */
            uint16_t *hr = h_out + r * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                const __mmask16 m = tail(dim - i);
                const __m512 v = _mm512_add_ps(load16_masked(xr, i, m, 1),
                                               load16_masked(res + r * res_stride, i, m, 1));
                store16(hr, i, v, m, 1);
            }
            xr = hr;
        }
        __m512 ss = _mm512_setzero_ps();
        for (int64_t i = 0; i < dim; i += 16) {
            const __m512 v = load16_masked(xr, i, tail(dim - i), 1);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        const float scale = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) * (1.0f / (float)dim) + eps);
        const __m512 s = _mm512_set1_ps(scale);
        for (int64_t i = 0; i < dim; i += 16) {
            const __mmask16 m = tail(dim - i);
            const __m512 t = _mm512_mul_ps(load16_masked(xr, i, m, 1), s);
            const __m512 wv = load16_masked(w, i, m, 1);
            const __m512 y = upcast ? _mm512_mul_ps(t, _mm512_add_ps(wv, _mm512_set1_ps(offset)))
                                    : _mm512_mul_ps(wv, round_bf16(t));
            store16(out, r * dim + i, y, m, 1);
        }
    }
}

/* SwiGLU's gate: out = round(round(silu(g)) u) for rows of gu = [g (width) | u (width)],
   row r at gu + r * stride; out row r at r * width. */
void silu_mul(const uint16_t *gu, int64_t stride, int64_t rows, int64_t width, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *g = gu + r * stride, *u = g + width;
        for (int64_t i = 0; i < width; i += 16) {
            const __mmask16 m = tail(width - i);
            const __m512 s = round_bf16(silu16(load16_masked(g, i, m, 1)));
            store16(out, r * width + i, _mm512_mul_ps(s, load16_masked(u, i, m, 1)), m, 1);
        }
    }
}

/* An attention's output gate (Qwen3.5): out = round(y round(sigmoid(g))) for y [rows,
   heads * dim] (row r at y + r * y_stride) and the gate's logits, head h of row r at
   g + r * g_row + h * g_head (QKV's rows, where each head's query is followed by its gate's
   logits); out: [rows, heads * dim]. torch's bf16 sigmoid and product round the same way; its
   sigmoid's last bit may differ from ours (never between two calls of ours). */
void sigmoid_mul(const uint16_t *y, int64_t y_stride, const uint16_t *g, int64_t g_row,
                 int64_t g_head, int64_t rows, int64_t heads, int64_t dim, uint16_t *out) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *yh = y + r * y_stride + h * dim, *gh = g + r * g_row + h * g_head;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int64_t i = 0; i < dim; i += 16) {
                const __mmask16 m = tail(dim - i);
                const __m512 s = round_bf16(sigmoid16(load16_masked(gh, i, m, 1)));
                store16(o, i, _mm512_mul_ps(load16_masked(yh, i, m, 1), s), m, 1);
            }
        }
}

/* Rotary embedding of x [rows, heads, dim] (element (r, h, d) at r * row_stride +
   h * head_stride + d) by cos and sin [rows, rot] (bf16; sin's first half negated):
   out[.., i] = round(round(x_i cos_i) + round(x_j sin_i)), j = i + rot/2 for the first half
   and i - rot/2 for the second; dims past rot copied. out: [rows, heads, dim]. */
void rope(const uint16_t *x, int64_t row_stride, int64_t head_stride, int64_t rows,
          int64_t heads, int64_t dim, const uint16_t *cos, const uint16_t *sin, int64_t rot,
          uint16_t *out) {
    const int64_t half = rot / 2;
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *c = cos + r * rot, *s = sin + r * rot;
        for (int64_t h = 0; h < heads; h++) {
            const uint16_t *xh = x + r * row_stride + h * head_stride;
            uint16_t *o = out + (r * heads + h) * dim;
            for (int part = 0; part < 2; part++) {
                const int64_t base = part * half, other = part ? 0 : half;
                for (int64_t i = 0; i < half; i += 16) {
                    const __mmask16 m = tail(half - i);
                    const __m512 a = round_bf16(_mm512_mul_ps(
                        load16_masked(xh + base, i, m, 1), load16_masked(c + base, i, m, 1)));
                    const __m512 b = round_bf16(_mm512_mul_ps(
                        load16_masked(xh + other, i, m, 1), load16_masked(s + base, i, m, 1)));
                    store16(o, base + i, _mm512_add_ps(a, b), m, 1);
                }
            }
            for (int64_t i = rot; i < dim; i++) o[i] = xh[i];
        }
    }
}

/* Per row of `v` values (row r at x + r * stride; fp32, or bf16 when bf16 != 0): the index
   of its first maximum (a NaN counting as the maximum, its first one, as torch's argmax),
   log sum exp and, where `value` is not NULL, the maximum itself (a draft's probability is
   exp(value - lse): no gather of it after). Four vectors of 16 a turn, each with its own
   running maximum and sum (one chain of dependent operations would wait on each compare
   and add), the last turn masked; a lane keeps the first index of its maximum, and the
   answer is the least index of the lanes that hold the row's maximum. */
void argmax_lse(const void *x, int64_t stride, int64_t rows, int64_t v, int bf16,
                int64_t *index, float *lse, float *value, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const char *row = (const char *)x + r * stride * (bf16 ? 2 : 4);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                14, 15);
        __m512 best[4];
        __m512i at[4];
        for (int u = 0; u < 4; u++) {
            best[u] = _mm512_set1_ps(-INFINITY);
            at[u] = _mm512_set1_epi32(0x7fffffff);
        }
        __mmask16 nan = 0;
        for (int64_t i = 0; i < v; i += 64)
            for (int u = 0; u < 4; u++) {
                const int64_t at_i = i + 16 * u;
                const __mmask16 m = at_i < v ? tail(v - at_i) : 0;
                const __m512 e = load16_masked(row, at_i, m, bf16);
                nan |= _mm512_mask_cmp_ps_mask(m, e, e, _CMP_UNORD_Q);
                const __mmask16 more = _mm512_mask_cmp_ps_mask(m, e, best[u], _CMP_GT_OQ);
                best[u] = _mm512_mask_mov_ps(best[u], more, e);
                at[u] = _mm512_mask_mov_epi32(at[u], more, _mm512_add_epi32(
                    _mm512_set1_epi32((int)at_i), lanes));
            }
        if (nan) {  /* torch's answer: the first NaN */
            int64_t i = 0;
            while (scalar(row, i, bf16) == scalar(row, i, bf16)) i++;
            index[r] = i;
            lse[r] = NAN;
            if (value) value[r] = NAN;
            continue;
        }
        const __m512 top4 = _mm512_max_ps(_mm512_max_ps(best[0], best[1]),
                                          _mm512_max_ps(best[2], best[3]));
        const float top = _mm512_reduce_max_ps(top4);
        if (top == -INFINITY) {  /* every logit -inf: the first, as torch's argmax */
            index[r] = 0;
            lse[r] = -INFINITY;
            if (value) value[r] = -INFINITY;
            continue;
        }
        const __m512 t = _mm512_set1_ps(top);
        __m512i first = _mm512_set1_epi32(0x7fffffff);
        for (int u = 0; u < 4; u++)
            first = _mm512_mask_min_epi32(first, _mm512_cmp_ps_mask(best[u], t, _CMP_EQ_OQ),
                                          first, at[u]);
        index[r] = _mm512_reduce_min_epi32(first);
        if (value) value[r] = top;
        __m512 sum[4];
        for (int u = 0; u < 4; u++) sum[u] = _mm512_setzero_ps();
        for (int64_t i = 0; i < v; i += 64)
            for (int u = 0; u < 4; u++) {
                const int64_t at_i = i + 16 * u;
                const __mmask16 m = at_i < v ? tail(v - at_i) : 0;
                const __m512 e = load16_masked(row, at_i, m, bf16);
                sum[u] = _mm512_add_ps(sum[u], _mm512_maskz_mov_ps(
                    m, exp_nonpositive(_mm512_sub_ps(e, t))));
            }
        const __m512 total = _mm512_add_ps(_mm512_add_ps(sum[0], sum[1]),
                                           _mm512_add_ps(sum[2], sum[3]));
        lse[r] = top + logf(_mm512_reduce_add_ps(total));
    }
}

/* out[i] = expf(a[i] - b[i]) for n floats: a draft's probability from its logit and the
   log-sum-exp of its logits (rows.py `probability`; mtp.c's chain rule reads it so too), one
   function for both so that their bits agree (torch's exp differs from libm's expf in about
   one value of a hundred, by an ulp). */
void exp_difference(const float *a, const float *b, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = expf(a[i] - b[i]);
}
