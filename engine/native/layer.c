/* A whole pre-norm decoder block of a cached forward in one call (layer.py): RMSNorm, the
fused QKV product, q/k norms, rotary embeddings, the KV cache write, attention, its output
gate (Qwen3.5), the output product, the residual add and the norm after it, the fused gate
and up product, SwiGLU's gate, the down product and the last residual add.

Each part is the kernel the block's Python forward calls (model/block.py, attention.py,
layers.py: rows.c, wq.c, attention.c), called here with the same arguments in the same order,
so a row's bits are the ones that path gives: what this saves is the path between them. A
decode step of Qwen2-1.5B's shapes made ~35 calls of Python and torch a layer around its ~12
kernels; on the 2-core EPYC those took 4-5 ms of a 37 ms step on one thread (docs/benchmarks.md).
`gdn_block_forward` does the same for a Gated DeltaNet block (Qwen3.5's linear-attention
layers), whose mixer is gdn.c's and deltanet.c's kernels between its two products.

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

int gdn_prepare(const void *x, int64_t x_stride, int64_t b_off, int64_t a_off, int64_t B,
                int64_t S, int64_t Hk, int64_t Hv, int64_t Dk, int64_t Dv, int64_t Kc,
                void *conv, int64_t R, int64_t num_slots, const int64_t *slots,
                const int64_t *index, const float *w, const float *a_log, const float *dt_bias,
                float *q, float *k, float *v, float *decay, float *beta, int bf16,
                int threads);
int delta_rule(const float *q, const float *k, const float *v, const float *a,
               const float *b, float *states, const int64_t *src, const int64_t *dst,
               int64_t B, int64_t H, int64_t S, int64_t Dk, int64_t Dv, float *o,
               int threads, float *d, const int64_t *base, const float *pk, const float *pd,
               const float *pa, const int64_t *pn, int64_t P);
int gdn_gated_norm(const float *o, int64_t B, int64_t S, int64_t Hv, int64_t Dv,
                   const void *x, int64_t x_stride, int64_t z_off, const float *weight,
                   float eps, void *out, int bf16);

static int product(const Product *p, int64_t K, const uint16_t *x, uint16_t *y, int64_t M,
                   int threads) {
    return wq_linear(p->w, (int)p->bits, p->n, K, p->group, p->bias, x, y, M, 1, threads);
}

/* Scratch of `count` parts, sizes[i] bf16 elements each (32 more apiece), into parts; the
   block to free, or NULL. */
static uint16_t *scratch_parts(const int64_t *sizes, int count, uint16_t **parts) {
    int64_t total = 0;
    for (int i = 0; i < count; i++) total += sizes[i] + 32;
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)total), *at = scratch;
    for (int i = 0; scratch && i < count; i++) {
        parts[i] = at;
        at += sizes[i] + 32;
    }
    return scratch;
}

/* A block's second half: h = x + mixed and its norm (into xn), the fused gate and up
   product, SwiGLU's gate, the down product, out = h + down (rounded as torch's bf16 add).
   gu, act: scratch of M * 2 * inter and M * inter; down may be mixed's memory. */
static int mlp_half(const Product *gate_up, const Product *down_p, const uint16_t *norm,
                    float offset, float eps, int upcast, const uint16_t *x,
                    const uint16_t *mixed, int64_t M, int64_t H, int64_t I, uint16_t *xn,
                    uint16_t *h, uint16_t *gu, uint16_t *act, uint16_t *down, int threads,
                    uint16_t *out) {
    rms_norm(x, H, mixed, H, h, M, H, norm, offset, eps, upcast, xn);
    if (product(gate_up, H, xn, gu, M, threads) != 0) return -1;
    silu_mul(gu, 2 * I, M, I, act);
    if (product(down_p, I, act, down, M, threads) != 0) return -1;
    for (int64_t m = 0; m < M; m++)
        for (int64_t i = 0; i < H; i += 16) {
            const __mmask16 k = tail(H - i);
            store16(out, m * H + i, _mm512_add_ps(load16_masked(h, m * H + i, k, 1),
                                                  load16_masked(down, m * H + i, k, 1)), k, 1);
        }
    return 0;
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
    uint16_t *parts[9];
    uint16_t *scratch = scratch_parts(sizes, 9, parts);
    if (!scratch) return -1;
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
    /* the MLP half (the down product into the output product's rows, free again) */
    if (mlp_half(&p->gate_up, &p->down, p->post_norm, p->offset, p->eps, (int)p->upcast, x, o,
                 M, H, I, xn, h, gu, act, o, threads, out) != 0)
        goto done;
    rc = 0;
done:
    free(scratch);
    return rc;
}

/* out [M, hidden] = the Gated DeltaNet block of x [M, hidden] (model/block.py with
   model/deltanet.py's `_step_native`): RMSNorm, the fused input projections, gdn.c's
   convolution and gates (the conv states after each position written into the ring conv
   [slots, ring, C, kernel - 1] after each row's committed entry index[slot]), deltanet.c's
   delta rule (each row's state at element src[b] of `states`; the states after its
   positions to dst [B, S], or with d none of them and each position's factor into d
   [B, Hv, S, Dv]; base .. P: the committed states an earlier window left to this pass, as
   `delta_rule` takes them), the gated norm, out_proj, then the MLP half. Rows are B slots of
   S positions. k [B, Hv, S, k_dim] and decay [B, Hv, S] are the caller's (fp32): what a
   window keeps for the commit's write. The same kernels with the same arguments in the same
   order as that Python path: its bits. Returns 0; -1 where scratch memory could not be had;
   -2 where a row's slot is outside the ring's num_slots or its committed entry outside the
   ring, and -3 where the plan's shapes do not fit together (nothing written to the cache
   either way); -4 where gdn.c or deltanet.c did not take the call (layer.py checks what
   they take first). */
int gdn_block_forward(const GdnPlan *p, const uint16_t *x, int64_t B, int64_t S, void *conv,
                      int64_t ring, int64_t num_slots, const int64_t *slots,
                      const int64_t *index, float *states,
                      const int64_t *src, const int64_t *dst, float *k, float *decay, float *d,
                      const int64_t *base, const float *pk, const float *pd, const float *pa,
                      const int64_t *pn, int64_t P, int threads, uint16_t *out) {
    const int64_t M = B * S, H = p->hidden, I = p->inter, hk = p->k_heads, hv = p->v_heads;
    const int64_t dk = p->k_dim, dv = p->v_dim, c = 2 * hk * dk + hv * dv, W = p->in.n;
    if (W != c + hv * dv + 2 * hv || p->out.n != H || p->gate_up.n != 2 * I
        || p->down.n != H || hv % hk != 0)
        return -3;
    /* scratch, in bf16 elements: the normed rows (later the post-attention norm's), the
       projections, the gated norm's output, out_proj's (later the down product's), the
       residual stream after the mixer, gate and up, SwiGLU's gate; then fp32 q, v, beta and
       the delta rule's output, as bf16 pairs */
    const int64_t f32 = 2, sizes[] = {M * H, M * W, M * hv * dv, M * H, M * H, M * 2 * I,
                                      M * I, f32 * M * hv * dk, f32 * M * hv * dv,
                                      f32 * M * hv, f32 * M * hv * dv};
    uint16_t *parts[11];
    uint16_t *scratch = scratch_parts(sizes, 11, parts);
    if (!scratch) return -1;
    uint16_t *xn = parts[0], *proj = parts[1], *y = parts[2], *mixed = parts[3],
             *h = parts[4], *gu = parts[5], *act = parts[6];
    float *q = (float *)parts[7], *v = (float *)parts[8], *beta = (float *)parts[9],
          *o = (float *)parts[10];
    int rc = -1;

    rms_norm(x, H, NULL, 0, NULL, M, H, p->input_norm, p->offset, p->eps, (int)p->upcast, xn);
    if (product(&p->in, H, xn, proj, M, threads) != 0) goto done;
    const int prepared = gdn_prepare(proj, W, c + hv * dv, c + hv * dv + hv, B, S, hk, hv,
                                     dk, dv, p->kernel, conv, ring, num_slots, slots, index,
                                     p->conv_weight, p->a_log, p->dt_bias, q, k, v, decay,
                                     beta, 1, threads);
    if (prepared != 0) {
        rc = prepared == -2 ? -2 : -4;
        goto done;
    }
    const int got = delta_rule(q, k, v, decay, beta, states, src, dst, B, hv, S, dk, dv, o,
                               threads, d, base, pk, pd, pa, pn, P);
    if (got != 0) {  /* -2: no scratch memory for a head's state */
        rc = got == -2 ? -1 : -4;
        goto done;
    }
    if (gdn_gated_norm(o, B, S, hv, dv, proj, W, c, p->norm_weight, p->norm_eps, y, 1) != 0) {
        rc = -4;
        goto done;
    }
    if (product(&p->out, hv * dv, y, mixed, M, threads) != 0) goto done;
    if (mlp_half(&p->gate_up, &p->down, p->post_norm, p->offset, p->eps, (int)p->upcast, x,
                 mixed, M, H, I, xn, h, gu, act, mixed, threads, out) != 0)
        goto done;
    rc = 0;
done:
    free(scratch);
    return rc;
}

/* Blocks 0 .. n - 1 of a trunk, each on the one before's output, in one call (trunk.py
   `run_blocks`): layers[i].plan's full-attention block (`layer_forward`, with its KV cache
   ck, cv) or layers[i].gdn's Gated DeltaNet block (`gdn_block_forward`, with its state cache
   and what run_linear_block gives that call). The rows, rope rows, slots and positions are
   the same for every block (a step's); the full-attention blocks' caches share num_slots and
   length. x is the first block's input, out the last's output. Returns 0; -2 where a slot or
   position is outside the KV caches or a slot or its entry outside a state cache's ring,
   checked before any block runs (nothing written); else the first failing block's code
   (`layer_forward`'s or `gdn_block_forward`'s), the blocks before it run. */
int trunk_forward(const TrunkLayer *layers, int64_t n, const uint16_t *x, int64_t B,
                  int64_t S, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                  const int64_t *slots, const int64_t *pos, int64_t first_slot,
                  int64_t kv_len, int64_t num_slots, int64_t length, int threads,
                  uint16_t *out) {
    const int64_t M = B * S;
    int64_t H = 0, full = 0;
    for (int64_t i = 0; i < n; i++) {
        const TrunkLayer *l = &layers[i];
        if ((l->plan == NULL) == (l->gdn == NULL)) return -3;
        const int64_t h = l->plan ? l->plan->hidden : l->gdn->hidden;
        if (i && h != H) return -3;
        H = h;
        full |= l->plan != NULL;
    }
    for (int64_t b = 0; full && b < B; b++) {  /* what kv_write checks, before any block */
        if (slots[b] < 0 || slots[b] >= num_slots) return -2;
        for (int64_t s = 0; s < S; s++)
            if (pos[b * S + s] < 0 || pos[b * S + s] >= length) return -2;
    }
    for (int64_t i = 0; i < n; i++)  /* and what gdn_prepare checks */
        for (int64_t b = 0; layers[i].gdn && b < B; b++)
            if (slots[b] < 0 || slots[b] >= layers[i].conv_slots
                || layers[i].index[slots[b]] < 0 || layers[i].index[slots[b]] >= layers[i].ring)
                return -2;
    uint16_t *tmp = n > 1 ? malloc(sizeof(uint16_t) * (size_t)(2 * M * H + 64)) : NULL;
    if (n > 1 && !tmp) return -1;
    uint16_t *bufs[2] = {tmp, tmp ? tmp + M * H + 32 : NULL};
    const uint16_t *in = x;
    int rc = 0;
    for (int64_t i = 0; i < n && rc == 0; i++) {
        const TrunkLayer *l = &layers[i];
        uint16_t *dst = i == n - 1 ? out : bufs[i & 1];
        rc = l->plan ? layer_forward(l->plan, in, B, S, cos, sin, rot, slots, pos, first_slot,
                                     kv_len, l->ck, l->cv, num_slots, length, threads, dst)
                     : gdn_block_forward(l->gdn, in, B, S, l->conv, l->ring, l->conv_slots,
                                         slots, l->index, l->states, l->src, l->dst, l->k,
                                         l->decay, l->d, l->base, l->pk, l->pd, l->pa, l->pn,
                                         l->P, threads, dst);
        in = dst;
    }
    free(tmp);
    return rc;
}
