/* The gated delta rule one position at a time (Gated DeltaNet's decode steps and verify
windows) on AVX-512 CPUs, reading and writing the recurrent states in the cache's ring:

    S_t = a_t S_{t-1} + k_t d_t^T,   d_t = b_t (v_t - (a_t S_{t-1})^T k_t),   o_t = S_t^T q_t

Why: written with tensor operations each position passes over every head's state (Dk x Dv
floats) about ten times and copies it twice more (gathered from the ring, stacked, scattered
back). Here a window of S positions takes S + 1 passes over a head's state: the first sums
S^T k_0; each next one writes S_t into its ring entry while it sums o_t and the next
position's S_t^T k_{t+1} from the same values, still in registers. The decay multiplies
those sums, a_t (S^T k), not each element of S (a multiply less an element, which a window of
four positions ran 8-10% faster for, Qwen3.5-2B's heads on the EPYC); a position's bits are
the same whether a window or a step computes it. The ring
entries are written with streaming stores (no read of the lines they replace, which a plain
store makes first) while a copy in scratch memory, which stays in cache, is what the next
position reads. Columns are independent, so a head runs in chunks of 128 (else 64, else 16)
columns (a window's positions 64 at a time, `window`). Sums run over Dk in order, lanes over
Dv: a row's result depends on its own state and inputs only, whatever else shares the call
or the thread, and whatever S is.
*/
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#define INLINE static inline __attribute__((always_inline))

/* acc = S^T k over nb blocks of 16 columns of the state at s (rows ps apart); the decay
   multiplies the sums after (`chunk`), not each element. */
INLINE void dot(const float *s, int64_t ps, const float *k, int64_t Dk, __m512 *acc,
                const int nb) {
    for (int j = 0; j < nb; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < Dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int j = 0; j < nb; j++)
            acc[j] = _mm512_fmadd_ps(ki, _mm512_loadu_ps(s + i * ps + 16 * j), acc[j]);
    }
}

/* One position over nb blocks of 16 columns: S' = a S + k d^T from the state at prev (rows
   ps apart) into next (rows Dv apart; streamed when `stream`; not kept unless `keep`),
   out = S'^T q, and when `more`, S' into cur (rows 16 nb apart) and the next position's
   S'^T kn into acc, summed as `dot` sums it. */
INLINE void update(const float *prev, int64_t ps, float *next, int64_t Dv, float *cur,
                   const float *k, const float *q, float a, const __m512 *d, __m512 *out,
                   const float *kn, __m512 *acc, int64_t Dk, const int nb, const int more,
                   const int stream, const int keep) {
    const __m512 at = _mm512_set1_ps(a);
    for (int j = 0; j < nb; j++) {
        out[j] = _mm512_setzero_ps();
        acc[j] = _mm512_setzero_ps();
    }
    for (int64_t i = 0; i < Dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]), qi = _mm512_set1_ps(q[i]);
        const __m512 kni = more ? _mm512_set1_ps(kn[i]) : ki;
        for (int j = 0; j < nb; j++) {
            const __m512 s = _mm512_fmadd_ps(ki, d[j], _mm512_mul_ps(
                                 at, _mm512_loadu_ps(prev + i * ps + 16 * j)));
            if (keep && stream)
                _mm512_stream_ps(next + i * Dv + 16 * j, s);
            else if (keep)
                _mm512_storeu_ps(next + i * Dv + 16 * j, s);
            out[j] = _mm512_fmadd_ps(qi, s, out[j]);
            if (more) {
                _mm512_storeu_ps(cur + i * 16 * nb + 16 * j, s);
                acc[j] = _mm512_fmadd_ps(kni, s, acc[j]);
            }
        }
    }
}

/* The committed state from an earlier window's (`Pending`): its first state s0 (rows Dv
   apart) after c more positions of that window, S = a_t S + k_t d_t^T element by element as
   `delta_settle` makes it (the same bits), into the committed entry `to` (streamed when
   aligned) and into cur (rows 16 nb apart), with acc = S^T k summed as `dot` sums it. */
INLINE void catch_up(const float *s0, const float *pk, const float *pd, const float *pa,
                     int64_t c, float *to, float *cur, const float *k, int64_t Dk,
                     int64_t Dv, int64_t j0, __m512 *acc, const int nb) {
    const int stream = ((uintptr_t)(to + j0) & 63) == 0;
    for (int j = 0; j < nb; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < Dk; i++) {
        const __m512 ki = _mm512_set1_ps(k[i]);
        for (int j = 0; j < nb; j++) {
            __m512 s = _mm512_loadu_ps(s0 + i * Dv + j0 + 16 * j);
            for (int64_t t = 0; t < c; t++)
                s = _mm512_fmadd_ps(_mm512_set1_ps(pk[t * Dk + i]),
                                    _mm512_loadu_ps(pd + t * Dv + j0 + 16 * j),
                                    _mm512_mul_ps(_mm512_set1_ps(pa[t]), s));
            if (stream)
                _mm512_stream_ps(to + i * Dv + j0 + 16 * j, s);
            else
                _mm512_storeu_ps(to + i * Dv + j0 + 16 * j, s);
            _mm512_storeu_ps(cur + i * 16 * nb + 16 * j, s);
            acc[j] = _mm512_fmadd_ps(ki, s, acc[j]);
        }
    }
}

/* A row's pending positions (`delta_rule`'s p*): the state its pass reads is s0 after the
   first c positions of an earlier window with factors pk [P, Dk], pd [P, Dv], pa [P]. */
typedef struct {
    const float *s0, *pk, *pd, *pa;
    int64_t c;
} Pending;

/* Positions 0 .. S-1 of columns j0 .. j0 + 16 nb - 1 of one head of one row, from prev
   (the state the first position reads, rows ps apart) and acc (its S^T k_0). dst[t]: where
   the state after position t goes (never the committed one). q, k [S, Dk], v, o [S, Dv],
   a, b [S] (the head's decay and write strength per position); cur: Dk x 16 nb floats of
   scratch, which each position after the first reads. */
INLINE void positions(const float *q, const float *k, const float *v, const float *a,
                      const float *b, float *const *dst, int64_t S, int64_t Dk, int64_t Dv,
                      int64_t j0, float *o, float *cur, float *dout, const float *prev,
                      int64_t ps, __m512 *acc, const int nb) {
    __m512 d[8], out[8];
    for (int64_t t = 0; t < S; t++) {
        const __m512 bt = _mm512_set1_ps(b[t]), at = _mm512_set1_ps(a[t]);
        for (int j = 0; j < nb; j++)  /* d = b (v - a (S^T k)) */
            d[j] = _mm512_mul_ps(_mm512_fnmadd_ps(at, acc[j], _mm512_loadu_ps(
                                     v + t * Dv + j0 + 16 * j)), bt);
        if (dout)  /* the factor the state's update multiplies: rebuilt from it later */
            for (int j = 0; j < nb; j++) _mm512_storeu_ps(dout + t * Dv + j0 + 16 * j, d[j]);
        float *next = dst[t] + j0;
        const int stream = ((uintptr_t)next & 63) == 0;
        const float *kt = k + t * Dk, *qt = q + t * Dk;
        if (t + 1 < S && dout)  /* no state of a window with factors is kept */
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt + Dk, acc, Dk, nb, 1, 0,
                   0);
        else if (dout)
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt, acc, Dk, nb, 0, 0, 0);
        else if (t + 1 < S && stream)
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt + Dk, acc, Dk, nb, 1, 1,
                   1);
        else if (t + 1 < S)
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt + Dk, acc, Dk, nb, 1, 0,
                   1);
        else if (stream)
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt, acc, Dk, nb, 0, 1, 1);
        else
            update(prev, ps, next, Dv, cur, kt, qt, a[t], d, out, kt, acc, Dk, nb, 0, 0, 1);
        for (int j = 0; j < nb; j++) _mm512_storeu_ps(o + t * Dv + j0 + 16 * j, out[j]);
        prev = cur;  /* cur is read, then written, element by element */
        ps = 16 * nb;
    }
}

/* Columns j0 .. j0 + 16 nb - 1 of one head over S positions (positions' arguments; state:
   the committed state, read, and where `pend` has positions written from them first). */
INLINE void chunk(const float *q, const float *k, const float *v, const float *a,
                  const float *b, float *state, float *const *dst, int64_t S,
                  int64_t Dk, int64_t Dv, int64_t j0, float *o, float *cur, float *dout,
                  const Pending *pend, const int nb) {
    __m512 acc[8];
    if (pend->c) {
        catch_up(pend->s0, pend->pk, pend->pd, pend->pa, pend->c, state, cur, k, Dk, Dv, j0,
                 acc, nb);
        positions(q, k, v, a, b, dst, S, Dk, Dv, j0, o, cur, dout, cur, 16 * nb, acc, nb);
    } else {
        dot(state + j0, Dv, k, Dk, acc, nb);
        positions(q, k, v, a, b, dst, S, Dk, Dv, j0, o, cur, dout, state + j0, Dv, acc, nb);
    }
}

/* A window of S > 1 positions over a head of Dv a multiple of 128: the first state (the
   committed one, or the one its pending positions make) is read 128 columns at a time, rows
   of 512 contiguous bytes, and the positions then run 64 columns at a time, so that the
   scratch each one writes and the next reads (Dk x 64 floats, 32 KB at Dk = 128) stays in
   L1, where 128 columns' (64 KB) went to L2 and back at every position. Qwen3.5-2B's 18
   layers, windows of 4, one thread on the AMX Xeon, medians of 40 by turns (the kernels'
   flags): 3.42 -> 3.11 ms with no pending positions, 4.54-4.61 -> 4.33-4.40 with 1-3.
   Reading the first state 64 columns at a time as well was slower (rows of 256 bytes).
   The columns' arithmetic is chunk's, so the bits are. */
INLINE void window(const float *q, const float *k, const float *v, const float *a,
                   const float *b, float *state, float *const *dst, int64_t S, int64_t Dk,
                   int64_t Dv, float *o, float *cur, float *dout, const Pending *pend) {
    float *narrow = cur + Dk * 128;
    for (int64_t j0 = 0; j0 < Dv; j0 += 128) {
        __m512 acc[8];
        const float *prev = state + j0;
        int64_t ps = Dv;
        if (pend->c) {
            catch_up(pend->s0, pend->pk, pend->pd, pend->pa, pend->c, state, cur, k, Dk, Dv,
                     j0, acc, 8);
            prev = cur;
            ps = 128;
        } else {
            dot(state + j0, Dv, k, Dk, acc, 8);
        }
        for (int j = 0; j < 2; j++)
            positions(q, k, v, a, b, dst, S, Dk, Dv, j0 + 64 * j, o, narrow, dout,
                      prev + 64 * j, ps, acc + 4 * j, 4);
    }
}

/* One head of one row over S positions (chunk's arguments), in the widest chunks that
   divide Dv; windows by `window`. */
static void head(const float *q, const float *k, const float *v, const float *a,
                 const float *b, float *state, float *const *dst, int64_t S,
                 int64_t Dk, int64_t Dv, float *o, float *cur, float *dout,
                 const Pending *pend) {
    if (S > 1 && Dv % 128 == 0)
        window(q, k, v, a, b, state, dst, S, Dk, Dv, o, cur, dout, pend);
    else if (Dv % 128 == 0)
        for (int64_t j0 = 0; j0 < Dv; j0 += 128)
            chunk(q, k, v, a, b, state, dst, S, Dk, Dv, j0, o, cur, dout, pend, 8);
    else if (Dv % 64 == 0)
        for (int64_t j0 = 0; j0 < Dv; j0 += 64)
            chunk(q, k, v, a, b, state, dst, S, Dk, Dv, j0, o, cur, dout, pend, 4);
    else
        for (int64_t j0 = 0; j0 < Dv; j0 += 16)
            chunk(q, k, v, a, b, state, dst, S, Dk, Dv, j0, o, cur, dout, pend, 1);
    _mm_sfence();  /* the streamed states are seen by whoever reads them next */
}

/* q, k [B, H, S, Dk], v [B, H, S, Dv], a, b [B, H, S] (fp32, contiguous); states: the ring
   of states, a head's [Dk, Dv] at offset src[row] + h*Dk*Dv for the committed one of row
   `row` and dst[row*S + t] + h*Dk*Dv for the one after its position t. o [B, H, S, Dv].
   With d (else NULL), [B, H, S, Dv]: no state after a position is written, only each
   position's d_t into d, from which `delta_settle`, or the next pass as its pending
   positions, makes the state after whichever one a commit keeps (a verify window writes
   no state where it wrote S: Qwen3.5-2B's 18 layers write 18 MB a state, by streaming
   stores that one thread made at ~8 GB/s on the AMX Xeon: 18 windows of 4 positions with
   two pending, 5.3 -> 3.7 ms when the last state was no longer written).
   With pn (else NULL): the committed states of rows with pn[row] > 0 are not written yet
   (a commit deferred its settle, see cache/state.py): such a row's pass reads the state at
   offset base[row] and first applies positions 0 .. pn[row] - 1 of the earlier window's
   factors pk [B, H, P, Dk], pd [B, H, P, Dv], pa [B, H, P], writing the committed state it
   makes (`delta_settle`'s bits) into its entry src[row] as it goes on to the window: one
   read of a state where a settle and then the pass read two.
   Returns 0, -1 for shapes this kernel does not take, or -2 when scratch memory could not
   be had. */
int delta_rule(const float *q, const float *k, const float *v, const float *a,
               const float *b, float *states, const int64_t *src, const int64_t *dst,
               int64_t B, int64_t H, int64_t S, int64_t Dk, int64_t Dv, float *o,
               int threads, float *d, const int64_t *base, const float *pk, const float *pd,
               const float *pa, const int64_t *pn, int64_t P) {
    if (Dv % 16 != 0 || Dv > 256 || S > 64) return -1;
    int pending = 0;
    for (int64_t r = 0; pn && r < B; r++) {
        if (pn[r] < 0 || pn[r] > P) return -1;
        pending |= pn[r] > 0;
    }
    const int scratch = S > 1 || pending;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *cur = scratch ? aligned_alloc(64, (size_t)(Dk * 192) * sizeof(float)) : NULL;
        if (scratch && !cur) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < B; r++)
            for (int64_t h = 0; h < H; h++) {
                if (scratch && !cur) continue;
                float *out[64];
                for (int64_t t = 0; t < S; t++) out[t] = states + dst[r * S + t] + h * Dk * Dv;
                const int64_t x = (r * H + h) * S, y = (r * H + h) * P;
                Pending pend = {NULL, NULL, NULL, NULL, 0};
                if (pn && pn[r] > 0)
                    pend = (Pending){states + base[r] + h * Dk * Dv, pk + y * Dk, pd + y * Dv,
                                     pa + y, pn[r]};
                head(q + x * Dk, k + x * Dk, v + x * Dv, a + x, b + x,
                     states + src[r] + h * Dk * Dv, out, S, Dk, Dv, o + x * Dv, cur,
                     d ? d + x * Dv : NULL, &pend);
            }
        free(cur);
    }
    return failed ? -2 : 0;
}

/* After a pass with d (`delta_rule`): the state after position n[row] of each row where
   0 <= n[row] < S (the pass wrote none), rebuilt from the committed one at
   src[row] into dst[row*S + n[row]] (offsets as delta_rule's) by the pass's own factors:
   S_t = k_t d_t^T + a_t S_{t-1} element by element, the same operations in the same order as
   the pass made them, so the same bits. k [B, H, S, Dk], d [B, H, S, Dv] (Dv a multiple of
   16, as delta_rule takes), a [B, H, S]. */
void delta_settle(const float *k, const float *d, const float *a, float *states,
                  const int64_t *src, const int64_t *dst, const int64_t *n, int64_t B,
                  int64_t H, int64_t S, int64_t Dk, int64_t Dv, int threads) {
#pragma omp parallel for schedule(static) collapse(2) num_threads(threads) if (threads > 1)
    for (int64_t r = 0; r < B; r++)
        for (int64_t h = 0; h < H; h++) {
            const int64_t last = n[r];
            if (last < 0 || last >= S) continue;
            const int64_t x = (r * H + h) * S;
            const float *s0 = states + src[r] + h * Dk * Dv;
            float *out = states + dst[r * S + last] + h * Dk * Dv;
            const int stream = ((uintptr_t)out & 63) == 0;
            for (int64_t i = 0; i < Dk; i++)
                for (int64_t j = 0; j < Dv; j += 16) {
                    __m512 s = _mm512_loadu_ps(s0 + i * Dv + j);
                    for (int64_t t = 0; t <= last; t++)
                        s = _mm512_fmadd_ps(_mm512_set1_ps(k[(x + t) * Dk + i]),
                                            _mm512_loadu_ps(d + (x + t) * Dv + j),
                                            _mm512_mul_ps(_mm512_set1_ps(a[x + t]), s));
                    if (stream)
                        _mm512_stream_ps(out + i * Dv + j, s);
                    else
                        _mm512_storeu_ps(out + i * Dv + j, s);
                }
        }
    _mm_sfence();
}
