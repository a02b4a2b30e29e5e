/* What layer.c's decoder block and mtp.c's draft share: a quantized product's layout and a
block's plan (layer.py `_Plan`, a ctypes copy of it). */
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

int layer_forward(const Plan *p, const uint16_t *x, int64_t B, int64_t S, const uint16_t *cos,
                  const uint16_t *sin, int64_t rot, const int64_t *slots, const int64_t *pos,
                  int64_t first_slot, int64_t kv_len, uint16_t *ck, uint16_t *cv,
                  int64_t num_slots, int64_t length, int threads, uint16_t *out);

#endif
