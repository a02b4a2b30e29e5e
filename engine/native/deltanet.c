/* The gated delta rule one position at a time (Gated DeltaNet's decode steps and verify
windows) on AVX-512 CPUs, reading and writing the recurrent states in the cache's ring:

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = b_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t

Why: written with tensor operations each position passes over every head's state (Dk x Dv
floats) about ten times and copies it twice more (gathered from the ring, stacked, scattered
back); here each position reads the previous state twice from cache and writes the next
once, into its ring entry. The ring entries are written with streaming stores (no read of
the lines they replace, which a plain store makes first: a third of the traffic) while a
copy in scratch memory, which stays in cache, is what the next position reads. Sums run
over Dk in order, lanes over Dv: a row's result depends on its own state and inputs only,
whatever else shares the call or the thread.
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

/* One head of one row over S positions. state: the committed state (read); dst[t]: where
   the state after position t goes (never the committed one). q, k [S, Dk], v, o [S, Dv],
   a, b [S] (a head's decay and write strength per position), Dv a multiple of 16 <= 256;
   cur: Dk x Dv floats of scratch. */
static void head(const float *q, const float *k, const float *v, const float *a,
                 const float *b, const float *state, float *const *dst, int64_t S,
                 int64_t Dk, int64_t Dv, float *o, float *cur) {
    const int64_t nv = Dv / 16;
    const float *prev = state;
    for (int64_t t = 0; t < S; t++) {
        const __m512 at = _mm512_set1_ps(a[t]);
        __m512 acc[16];
        for (int64_t j = 0; j < nv; j++) acc[j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < Dk; i++) {  /* (a S)^T k */
            const __m512 ki = _mm512_set1_ps(k[t * Dk + i]);
            for (int64_t j = 0; j < nv; j++)
                acc[j] = _mm512_fmadd_ps(ki, _mm512_mul_ps(at, _mm512_loadu_ps(
                                                  prev + i * Dv + 16 * j)), acc[j]);
        }
        const __m512 bt = _mm512_set1_ps(b[t]);
        for (int64_t j = 0; j < nv; j++)  /* d = b (v - (a S)^T k) */
            acc[j] = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(v + t * Dv + 16 * j), acc[j]),
                                   bt);
        __m512 out[16];
        for (int64_t j = 0; j < nv; j++) out[j] = _mm512_setzero_ps();
        float *next = dst[t];
        const int stream = ((uintptr_t)next & 63) == 0, more = t + 1 < S;
        for (int64_t i = 0; i < Dk; i++) {  /* S = a S + k d^T; o = S^T q */
            const __m512 ki = _mm512_set1_ps(k[t * Dk + i]);
            const __m512 qi = _mm512_set1_ps(q[t * Dk + i]);
            for (int64_t j = 0; j < nv; j++) {
                const int64_t e = i * Dv + 16 * j;  /* cur may be prev: read, then written */
                const __m512 s = _mm512_fmadd_ps(ki, acc[j],
                                                 _mm512_mul_ps(at, _mm512_loadu_ps(prev + e)));
                if (stream)
                    _mm512_stream_ps(next + e, s);
                else
                    _mm512_storeu_ps(next + e, s);
                if (more) _mm512_storeu_ps(cur + e, s);
                out[j] = _mm512_fmadd_ps(qi, s, out[j]);
            }
        }
        for (int64_t j = 0; j < nv; j++) _mm512_storeu_ps(o + t * Dv + 16 * j, out[j]);
        prev = cur;
    }
    _mm_sfence();  /* the streamed states are seen by whoever reads them next */
}

/* q, k [B, H, S, Dk], v [B, H, S, Dv], a, b [B, H, S] (fp32, contiguous); states: the ring
   of states, a head's [Dk, Dv] at offset src[row] + h*Dk*Dv for the committed one of row
   `row` and dst[row*S + t] + h*Dk*Dv for the one after its position t. o [B, H, S, Dv].
   Returns 0, -1 for shapes this kernel does not take, or -2 when scratch memory could not
   be had. */
int delta_rule(const float *q, const float *k, const float *v, const float *a,
               const float *b, float *states, const int64_t *src, const int64_t *dst,
               int64_t B, int64_t H, int64_t S, int64_t Dk, int64_t Dv, float *o,
               int threads) {
    if (Dv % 16 != 0 || Dv > 256 || S > 64) return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *cur = S > 1 ? aligned_alloc(64, (size_t)(Dk * Dv) * sizeof(float)) : NULL;
        if (S > 1 && !cur) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < B; r++)
            for (int64_t h = 0; h < H; h++) {
                if (S > 1 && !cur) continue;
                float *out[64];
                for (int64_t t = 0; t < S; t++) out[t] = states + dst[r * S + t] + h * Dk * Dv;
                const int64_t x = (r * H + h) * S;
                head(q + x * Dk, k + x * Dk, v + x * Dv, a + x, b + x,
                     states + src[r] + h * Dk * Dv, out, S, Dk, Dv, o + x * Dv, cur);
            }
        free(cur);
    }
    return failed ? -2 : 0;
}
