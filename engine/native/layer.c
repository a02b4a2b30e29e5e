/* A whole pre-norm decoder block of a cached forward in one call (layer.py): RMSNorm, the
fused QKV product, q/k norms, rotary embeddings, the KV cache write, attention, its output
gate (Qwen3.5), the output product, the residual add and the norm after it, the fused gate
and up product, SwiGLU's gate, the down product and the last residual add.

Each part is the kernel the block's Python forward calls (model/block.py, attention.py,
layers.py: rows.c, wq.c, attention.c), called here with the same arguments in the same order,
so a row's bits are the ones that path gives: what this saves is the path between them. A
decode step of Qwen2-1.5B's shapes made ~35 calls of Python and torch a layer around its ~12
kernels; on the 2-core EPYC those took 4-5 ms of a 37 ms step on one thread (docs/benchmarks.md).

Rows are M = B * S tokens of bf16, x [M, hidden] contiguous. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "layer.h"
#include "vecmath.h"

int wq_linear(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G, const float *bias,
              const void *x, void *y, int64_t M, int bf16, int threads);
void rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
              uint16_t *h_out, int64_t rows, int64_t dim, const uint16_t *w, float offset,
              float eps, int upcast, uint16_t *out);
void silu_mul(const uint16_t *gu, int64_t stride, int64_t rows, int64_t width, uint16_t *out);
void sigmoid_mul(const uint16_t *y, int64_t y_stride, const uint16_t *g, int64_t g_row,
                 int64_t g_head, int64_t rows, int64_t heads, int64_t dim, uint16_t *out);
void rope(const uint16_t *x, int64_t row_stride, int64_t head_stride, int64_t rows,
          int64_t heads, int64_t dim, const uint16_t *cos, const uint16_t *sin, int64_t rot,
          uint16_t *out);
int causal_attention(const void *q, int64_t B, int64_t H, int64_t S, int64_t D,
                     int64_t qsb, int64_t qsh, int64_t qss, int64_t osb, int64_t osh,
                     int64_t oss, int qbf16,
                     const void *k, const void *v, int64_t Hkv, int64_t sb, int64_t sh,
                     int64_t kv_len, const int64_t *pos, void *out, int bf16, float scale,
                     int64_t window, int64_t ring, int threads, int bf16_dot);
int kv_write(const void *k, const void *v, int64_t B, int64_t H, int64_t S, int64_t D,
             int64_t ksb, int64_t ksh, int64_t kss, int64_t vsb, int64_t vsh, int64_t vss,
             void *ck, void *cv, int64_t csb, int64_t csh, const int64_t *slots,
             const int64_t *at, int64_t num_slots, int64_t length, int64_t size);

static int product(const Product *p, int64_t K, const uint16_t *x, uint16_t *y, int64_t M,
                   int threads) {
    return wq_linear(p->w, (int)p->bits, p->n, K, p->group, p->bias, x, y, M, 1, threads);
}

/* out [M, hidden] = the block of x [M, hidden]: rows of B slots (slots[b], their caches'
   entries first_slot + b: consecutive slots, as `CacheBatch.span` says) at positions pos
   [B, S]; cos and sin [M, rot] (rows.c `rope`); the layer's caches ck, cv [num_slots,
   kv_heads, length, head_dim] bf16, their first kv_len entries attended. Returns 0; -1
   where scratch memory could not be had; -2 where a slot or position is outside the cache
   (nothing written); -3 where the plan's shapes do not fit together (nothing written). */
int layer_forward(const Plan *p, const uint16_t *x, int64_t B, int64_t S, const uint16_t *cos,
                  const uint16_t *sin, int64_t rot, const int64_t *slots, const int64_t *pos,
                  int64_t first_slot, int64_t kv_len, uint16_t *ck, uint16_t *cv,
                  int64_t num_slots, int64_t length, int threads, uint16_t *out) {
    const int64_t M = B * S, H = p->hidden, hq = p->heads, hkv = p->kv_heads, D = p->head_dim;
    const int64_t nq = hq * D, nkv = hkv * D, nqkv = p->qkv.n, I = p->inter;
    /* QKV's rows: the queries (each head's followed by its gate's logits where gated), k, v */
    const int64_t qw = p->gated ? 2 * nq : nq, qstep = p->gated ? 2 * D : D;
    if (nqkv != qw + 2 * nkv || p->gate_up.n != 2 * I || p->o.n != H || p->down.n != H
        || D % 16 != 0 || D > 512 || hq % hkv != 0 || rot % 2 != 0 || rot > D)
        return -3;
    /* scratch, in bf16 elements: the normed rows (later the post-attention norm's), QKV,
       normed q and k, rotated q and k, attention's output (and gated), the output product
       (later the down product's), the residual stream after attention, gate and up,
       SwiGLU's gate */
    const int64_t sizes[] = {M * H, M * nqkv, p->q_norm ? M * (nq + nkv) : 0, M * (nq + nkv),
                             (p->gated ? 2 : 1) * M * nq, M * H, M * H, M * 2 * I, M * I};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i] + 32;
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)total);
    if (!scratch) return -1;
    uint16_t *parts[9], *at = scratch;
    for (size_t i = 0; i < 9; i++) {
        parts[i] = at;
        at += sizes[i] + 32;
    }
    uint16_t *xn = parts[0], *qkv = parts[1], *normed = parts[2], *qk = parts[3],
             *att = parts[4], *o = parts[5], *h = parts[6], *gu = parts[7], *act = parts[8];
    int rc = -1;

    rms_norm(x, H, NULL, 0, NULL, M, H, p->input_norm, p->offset, p->eps, (int)p->upcast, xn);
    if (product(&p->qkv, H, xn, qkv, M, threads) != 0) goto done;
    /* q [M, hq, D] and k [M, hkv, D]: in QKV's rows, or normed into rows of their own */
    const uint16_t *q_src = qkv, *k_src = qkv + qw;
    int64_t q_stride = nqkv, q_head = qstep, k_stride = nqkv;
    if (p->q_norm) {
        for (int64_t m = 0; m < M; m++) {
            rms_norm(qkv + m * nqkv, qstep, NULL, 0, NULL, hq, D, p->q_norm, p->offset,
                     p->eps, (int)p->upcast, normed + m * nq);
            rms_norm(qkv + m * nqkv + qw, D, NULL, 0, NULL, hkv, D, p->k_norm, p->offset,
                     p->eps, (int)p->upcast, normed + M * nq + m * nkv);
        }
        q_src = normed;
        k_src = normed + M * nq;
        q_stride = nq;
        q_head = D;
        k_stride = nkv;
    }
    uint16_t *qr = qk, *kr = qk + M * nq;
    rope(q_src, q_stride, q_head, M, hq, D, cos, sin, rot, qr);
    rope(k_src, k_stride, D, M, hkv, D, cos, sin, rot, kr);
    /* k [B, hkv, S, D] as the rotated rows' transposed view; v as QKV's */
    if (kv_write(kr, qkv + qw + nkv, B, hkv, S, D, S * nkv, D, nkv, S * nqkv, D, nqkv, ck, cv,
                 hkv * length * D, length * D, slots, pos, num_slots, length, 2) != 0) {
        rc = -2;
        goto done;
    }
    const int64_t first = first_slot * hkv * length * D;
    if (causal_attention(qr, B, hq, S, D, S * nq, D, nq, S * nq, D, nq, 1, ck + first,
                         cv + first, hkv, hkv * length * D, length * D, kv_len, pos, att, 1,
                         p->scale, 0, 0, threads, (int)p->bf16_dot) != 0)
        goto done;
    if (p->gated) {  /* att times sigmoid of each head's gate logits */
        sigmoid_mul(att, nq, qkv + D, nqkv, 2 * D, M, hq, D, att + M * nq);
        att += M * nq;
    }
    if (product(&p->o, nq, att, o, M, threads) != 0) goto done;
    /* h = x + o, its norm into xn */
    rms_norm(x, H, o, H, h, M, H, p->post_norm, p->offset, p->eps, (int)p->upcast, xn);
    if (product(&p->gate_up, H, xn, gu, M, threads) != 0) goto done;
    silu_mul(gu, 2 * I, M, I, act);
    uint16_t *down = o;  /* the output product's rows are free again */
    if (product(&p->down, I, act, down, M, threads) != 0) goto done;
    for (int64_t m = 0; m < M; m++)  /* h + down, rounded as torch's bf16 add */
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 k = tail(H - i);
            store16(out, m * H + i, _mm512_add_ps(load16_masked(h, m * H + i, k, 1),
                                                  load16_masked(down, m * H + i, k, 1)), k, 1);
        }
    rc = 0;
done:
    free(scratch);
    return rc;
}
