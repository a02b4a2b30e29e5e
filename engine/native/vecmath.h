/* Vector maths shared by the kernels (AVX-512). */
#ifndef AHEAD_VECMATH_H
#define AHEAD_VECMATH_H

#include <immintrin.h>
#include <stdint.h>

/* 16 floats from element i of p: fp32, or bf16 when bf16 != 0. */
static inline __m512 load16(const void *p, int64_t i, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i))),
            16));
    return _mm512_loadu_ps((const float *)p + i);
}

/* Lanes 0..left-1 of 16 (all of them from 16 on). */
static inline __mmask16 tail(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
}

/* `load16` of the lanes in m alone (the others 0, nothing read past them). */
static inline __m512 load16_masked(const void *p, int64_t i, __mmask16 m, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* Element i of p (fp32, or bf16 when bf16 != 0) as a float. */
static inline float scalar(const void *p, int64_t i, int bf16) {
    if (bf16) {
        union { uint32_t u; float f; } v = {.u = (uint32_t)((const uint16_t *)p)[i] << 16};
        return v.f;
    }
    return ((const float *)p)[i];
}

/* The bf16 value nearest each lane (ties to even, as torch's conversion), as fp32. */
static inline __m512 round_bf16(__m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

/* The lanes in m of v at element i of p: fp32, or rounded to bf16 (round_bf16) when
   bf16 != 0. */
static inline void store16(void *p, int64_t i, __m512 v, __mmask16 m, int bf16) {
    if (bf16)
        _mm256_mask_storeu_epi16((uint16_t *)p + i, m, _mm512_cvtepi32_epi16(
            _mm512_srli_epi32(_mm512_castps_si512(round_bf16(v)), 16)));
    else
        _mm512_mask_storeu_ps((float *)p + i, m, v);
}

/* e^x for x <= 0 (x - max of a softmax, -|x| for a sigmoid): Cody-Waite reduction
   x = n ln2 + r, |r| <= ln2/2, then a degree-6 polynomial for e^r (relative error about
   2e-7); below -87 it is 0. */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512 e = _mm512_scalef_ps(p, n);
    return _mm512_maskz_mov_ps(~tiny, e);
}

/* Compilers with the AMX intrinsics (wq.c's int8 products, attention.c's bf16 tiles): AMX
   then, and LDTILECFG's 64-byte configuration (palette 1). */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define AMX_INTRINSICS 1
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileConfig;
#endif

/* sigmoid(x), with e^-|x| from the vector exp. */
static inline __m512 sigmoid16(__m512 x) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(),
                                                   _mm512_abs_ps(x)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 num = _mm512_mask_mov_ps(one, neg, e);  /* x < 0: e/(1+e), else 1/(1+e) */
    return _mm512_div_ps(num, _mm512_add_ps(one, e));
}

/* silu(x) = x sigmoid(x). */
static inline __m512 silu16(__m512 x) {
    return _mm512_mul_ps(x, sigmoid16(x));
}

#endif
