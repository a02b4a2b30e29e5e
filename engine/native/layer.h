/* What layer.c's decoder blocks and mtp.c's draft share: a quantized product's layout and a
block's plan (layer.py `_Plan` and `_GdnPlan`, ctypes copies of them). */
#ifndef AHEAD_LAYER_H
#define AHEAD_LAYER_H
#include <stdint.h>

/* A quantized product's layout (wq.c): codes, bits, outputs, group, fp32 bias or NULL. */
typedef struct {
    const uint8_t *w;
    int64_t bits, n, group;
    const float *bias;
} Product;

/* What a block keeps between calls (layer.py `Plan`, a ctypes copy of this). */
typedef struct {
    Product qkv, o, gate_up, down;
    const uint16_t *input_norm, *post_norm, *q_norm, *k_norm;  /* q/k norms: NULL if none */
    float eps, offset, scale;
    int64_t upcast, hidden, heads, kv_heads, head_dim, inter, bf16_dot;
    int64_t gated;  /* an output gate (Qwen3.5): each head's query followed by its logits */
} Plan;

/* A Gated DeltaNet block's (Qwen3.5's linear-attention layers: layer.py `_GdnPlan`): its
   fused input projections (q, k, v's pre-convolution inputs, z, beta, alpha), out_proj, the
   MLP's products and the block's norms; the layer's shapes and its fp32 parameters (the
   convolution's weights by tap [kernel, C], A_log, dt_bias, the gated norm's weight). */
typedef struct {
    Product in, out, gate_up, down;
    const uint16_t *input_norm, *post_norm;
    float eps, offset;
    int64_t upcast, hidden, inter;
    int64_t k_heads, v_heads, k_dim, v_dim, kernel;
    const float *conv_weight, *a_log, *dt_bias, *norm_weight;
    float norm_eps;
} GdnPlan;

int layer_forward(const Plan *p, const uint16_t *x, int64_t B, int64_t S, const uint16_t *cos,
                  const uint16_t *sin, int64_t rot, const int64_t *slots, const int64_t *pos,
                  int64_t first_slot, int64_t kv_len, uint16_t *ck, uint16_t *cv,
                  int64_t num_slots, int64_t length, int threads, uint16_t *out);
int gdn_block_forward(const GdnPlan *p, const uint16_t *x, int64_t B, int64_t S, void *conv,
                      int64_t ring, int64_t num_slots, const int64_t *slots,
                      const int64_t *index, float *states,
                      const int64_t *src, const int64_t *dst, float *k, float *decay, float *d,
                      const int64_t *base, const float *pk, const float *pd, const float *pa,
                      const int64_t *pn, int64_t P, int threads, uint16_t *out);

/* A trunk's block (layer.c `trunk_forward`; trunk.py `_TrunkLayer`): a full-attention one
   (plan, its KV cache ck and cv) or a Gated DeltaNet one (gdn, its state cache and the rest
   of `gdn_block_forward`'s arguments for the call), the other's fields unused. */
typedef struct {
    const Plan *plan;
    const GdnPlan *gdn;
    uint16_t *ck, *cv;
    void *conv;
    int64_t ring, conv_slots;
    const int64_t *index;
    float *states;
    const int64_t *src, *dst;
    float *k, *decay, *d;
    const int64_t *base;
    const float *pk, *pd, *pa;
    const int64_t *pn;
    int64_t P;
} TrunkLayer;

int trunk_forward(const TrunkLayer *layers, int64_t n, const uint16_t *x, int64_t B,
                  int64_t S, const uint16_t *cos, const uint16_t *sin, int64_t rot,
                  const int64_t *slots, const int64_t *pos, int64_t first_slot,
                  int64_t kv_len, int64_t num_slots, int64_t length, int threads,
                  uint16_t *out);

#endif
