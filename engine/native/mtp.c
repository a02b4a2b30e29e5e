/* One greedy draft of an MTP module in one call (mtp.py): the chain's hidden state (the last
module's output, normed where the chain passes normed states), the module's input (the
next token's embedding and that state, each RMSNormed, side by side), its projection, its
decoder block (layer.c), its final norm and the draft's pick over the drafts' head (the
reduced head's coarse pass and candidates: wq.c `wq_draft_pick`; else the head's logits with
their argmax and log-sum-exp: `wq_linear_top`); and, where asked, the draft chain's rule
after it (`chain_step`).

Each part is the kernel the Python path calls (model/mtp.py, transformer.py `mtp_greedy`,
decode/draft_vocab.py), with the same arguments in the same order, so the draft, its logit
and the module's output (with the cache entries its block writes) are that path's bits. What
goes is the ~25 calls of Python and torch a draft made around them: on the 2-core EPYC ~0.4
ms a draft, a fifth of a Qwen2-1.5B draft's time and most of the bundled model's.
`mtp_chain` makes the drafts a module chains on itself one after another in one call. */
#include <stdint.h>
#include <stdlib.h>

#include "layer.h"

int wq_linear(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G, const float *bias,
              const void *x, void *y, int64_t M, int bf16, int threads);
int wq_linear_top(const uint8_t *w, int bits, int64_t N, int64_t K, int64_t G,
                  const float *bias, const void *x, void *y, int64_t M, int bf16, int threads,
                  int64_t *index, float *lse, float *value);
int wq_draft_pick(const uint8_t *w2, const uint8_t *w4, int64_t N, int64_t K, int64_t G,
                  const void *x, int64_t M, int bf16, int64_t C, int threads, int64_t *index,
                  float *top, float *lse);
void exp_difference(const float *a, const float *b, int64_t n, float *out);
void rms_norm(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
              uint16_t *h_out, int64_t rows, int64_t dim, const uint16_t *w, float offset,
              float eps, int upcast, uint16_t *out);

/* What a module's draft keeps between calls (mtp.py `_MtpPlan`, a ctypes copy of this). Its
   norms share the block's eps, offset and upcast. */
typedef struct {
    Plan block;
    Product eh_proj;            /* [hidden, 2 hidden] */
    const uint16_t *embed;      /* the token embedding [vocab, hidden] */
    const uint16_t *enorm, *hnorm, *norm;
    const uint16_t *chain_norm; /* the norm of the module the chain comes from, where the
                                   chain passes normed states; else NULL */
    int64_t vocab, hidden_first;
    Product head;               /* the drafts' head: the reduced head's int4 rows, or the
                                   whole head */
    const uint8_t *coarse;      /* the reduced head's 2-bit layout, or NULL */
    int64_t candidates;
    const int64_t *ids;         /* the reduced head's token ids, or NULL */
} MtpPlan;

/* The draft chain's state for B rows (decode/draft.py `Chain`) and the slots' buffers its
   drafts go to (decode/state.py `DecodeState`), where the rule runs here: the chain's
   stopping rule after draft j (policy/chain.py), as draft.py's `draft_one` and `chain_rule`
   run it, in the same float32 operations. */
typedef struct {
    const int64_t *j;           /* the draft's number, 1 .. (read where the step keeps it: no
                                   value of it comes back to the host) */
    int64_t *tokens;            /* [rows, tokens_stride]: the pending token, then the drafts */
    int64_t tokens_stride, rows;
    float *confidence;          /* [rows, conf_stride], each draft's probability; NULL:
                                   none computed (no row adapts) */
    int64_t conf_stride;
    const float *accept;        /* [positions, bins]: acceptance by position and bin */
    const float *limit;         /* [positions + 1]: break-even survival per number of drafts */
    int64_t positions, bins;
    const int64_t *k_limit, *floor;  /* [B] */
    const uint8_t *adaptive;    /* [B] bool */
    int64_t *count;             /* [B] drafts kept so far */
    uint8_t *alive;             /* [B] bool: whether the row's next draft is kept */
    float *survival;            /* [B] the chance that all its drafts so far are accepted */
} Chain;

/* Draft j's tokens (and probabilities) into the slots' buffers and the chain's rule after
   it; the rows still drafting. The probability is rows.c's `exp_difference` of top and lse,
   as the Python path's (rows.py `probability`). */
static int64_t chain_step(const Chain *c, int64_t B, const int64_t *slots, const int64_t *tok,
                          const float *top, const float *lse) {
    int64_t live = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t s = slots[b], j = *c->j;
        c->tokens[s * c->tokens_stride + j] = tok[b];
        c->count[b] += c->alive[b] != 0;
        int go = j < c->k_limit[b];
        if (c->confidence) {
            float conf;
            exp_difference(top + b, lse + b, 1, &conf);
            const float v = conf * (float)c->bins;
            int64_t bin = v >= 0 ? (int64_t)v : 0;  /* (NaN: 0, as torch's clamp gives) */
            if (bin > c->bins - 1) bin = c->bins - 1;
            c->confidence[s * c->conf_stride + j - 1] = conf;
            c->survival[b] *= c->accept[(j - 1) * c->bins + bin];
            go = go && (j < c->floor[b] || c->survival[b] > c->limit[j] || !c->adaptive[b]);
        }
        c->alive[b] = c->alive[b] && go;
        live += c->alive[b];
    }
    return live;
}

/* B rows' drafts. forward != 0: the module runs first, on the previous module's outputs prev
   [B, hidden] and the previous drafts tokens [B] at positions pos (its block's rope rows,
   slots and cache as layer.c's `layer_forward` takes them), its outputs into out [B, hidden];
   forward == 0: prev is already the module's output (a chain's first draft). Then tok [B],
   the draft; top [B], its logit; lse [B] (where not NULL), the log-sum-exp of the drafts'
   logits (the coarse pass's outside the candidates). With `chain` (its probabilities need
   lse), the drafts and their probabilities go into the slots' buffers and the chain's rule
   runs after them (`chain_step`; slots [B] then given for a first draft too). Returns 0, or
   with `chain` the rows still drafting; -1 where scratch memory could not be had; -2 where
   a slot or position is outside the cache or the buffers, -4 where a token is
   outside the vocabulary (nothing written); -3 where the plan's shapes do not fit. */
int mtp_draft(const MtpPlan *p, int forward, const uint16_t *prev, const int64_t *tokens,
              int64_t B, const uint16_t *cos, const uint16_t *sin, int64_t rot,
              const int64_t *slots, const int64_t *pos, int64_t first_slot, int64_t kv_len,
              uint16_t *ck, uint16_t *cv, int64_t num_slots, int64_t length, int threads,
              uint16_t *out, int64_t *tok, float *top, float *lse, const Chain *chain) {
    const int64_t H = p->block.hidden, N = p->head.n;
    const float eps = p->block.eps, offset = p->block.offset;
    const int upcast = (int)p->block.upcast;
    if (p->eh_proj.n != H || N < 1 || (p->coarse && !p->ids)
        || (chain && (*chain->j < 1 || *chain->j > chain->positions || chain->bins < 1
                      || *chain->j >= chain->tokens_stride || (chain->confidence
                      && (!lse || *chain->j > chain->conf_stride)))))
        return -3;
    if (chain)
        for (int64_t b = 0; b < B; b++)
            if (slots[b] < 0 || slots[b] >= chain->rows) return -2;
    if (forward)
        for (int64_t b = 0; b < B; b++)
            if (tokens[b] < 0 || tokens[b] >= p->vocab) return -4;
    /* scratch, in bf16 elements: the chain's normed states, the module's input, its
       projection, the final norm's rows; the head's logits where it runs whole */
    const int64_t sizes[] = {B * H, 2 * B * H, B * H, B * H, p->coarse ? 0 : B * N};
    int64_t total = 0;
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) total += sizes[i] + 32;
    uint16_t *scratch = malloc(sizeof(uint16_t) * (size_t)total);
    int64_t *index = malloc(sizeof(int64_t) * (size_t)B);
    float *sums = lse ? NULL : malloc(sizeof(float) * (size_t)B);  /* (linear_top's lse) */
    if (!scratch || !index || (!lse && !sums)) {
        free(scratch); free(index); free(sums);
        return -1;
    }
    uint16_t *parts[5], *at = scratch;
    for (size_t i = 0; i < 5; i++) {
        parts[i] = at;
        at += sizes[i] + 32;
    }
    uint16_t *hs = parts[0], *in = parts[1], *x = parts[2], *xn = parts[3], *logits = parts[4];
    int rc = -1;
    const uint16_t *src = prev;
    if (forward) {
        const uint16_t *h = prev;
        if (p->chain_norm) {
            rms_norm(prev, H, NULL, 0, NULL, B, H, p->chain_norm, offset, eps, upcast, hs);
            h = hs;
        }
        /* [enorm(e); hnorm(h)] (MiMo: [hnorm(h); enorm(e)]) a row at a time */
        const int64_t e_at = p->hidden_first ? H : 0, h_at = p->hidden_first ? 0 : H;
        for (int64_t b = 0; b < B; b++) {
            rms_norm(p->embed + tokens[b] * H, H, NULL, 0, NULL, 1, H, p->enorm, offset, eps,
                     upcast, in + b * 2 * H + e_at);
            rms_norm(h + b * H, H, NULL, 0, NULL, 1, H, p->hnorm, offset, eps, upcast,
                     in + b * 2 * H + h_at);
        }
        if (wq_linear(p->eh_proj.w, (int)p->eh_proj.bits, H, 2 * H, p->eh_proj.group,
                      p->eh_proj.bias, in, x, B, 1, threads) != 0)
            goto done;
        rc = layer_forward(&p->block, x, B, 1, cos, sin, rot, slots, pos, first_slot, kv_len,
                           ck, cv, num_slots, length, threads, out);
        if (rc != 0) goto done;
        rc = -1;
        src = out;
    }
    rms_norm(src, H, NULL, 0, NULL, B, H, p->norm, offset, eps, upcast, xn);
    if (p->coarse) {
        if (wq_draft_pick(p->coarse, p->head.w, N, H, p->head.group, xn, B, 1, p->candidates,
                          threads, index, top, lse) != 0)
            goto done;
    } else if (wq_linear_top(p->head.w, (int)p->head.bits, N, H, p->head.group, p->head.bias,
                             xn, logits, B, 1, threads, index, lse ? lse : sums, top) != 0) {
        goto done;
    }
    for (int64_t b = 0; b < B; b++) tok[b] = p->ids ? p->ids[index[b]] : index[b];
    rc = chain ? (int)chain_step(chain, B, slots, tok, top, lse) : 0;
done:
    free(scratch); free(index); free(sums);
    return rc;
}

/* Drafts j0 .. j1 of one module, each chained on the one before (`mtp_draft` with forward,
   then its chain's rule), in one call: from the module's output prev [B, hidden] and the
   draft tokens [B] of draft j0 - 1, draft j at positions base[b] + j + offset (the module's
   entries: decode/draft.py `_module_pos`), their rope rows from the tables cos and sin
   [table, rot]; chain->j for draft j at draft_index + j (the step's own numbers). With
   early_exit, the chain ends after a draft that leaves no row drafting (draft.py
   `draft_chain`). The last draft made leaves its module's output in last [B, hidden] and
   its tokens in last_tok [B], its number in *made (j0 - 1: none). Returns the rows still
   drafting after it; or the error code of the draft that did not run (`mtp_draft`'s; -2
   also for a position outside the tables), the drafts before it made. */
int mtp_chain(const MtpPlan *p, const uint16_t *prev, const int64_t *tokens, int64_t B,
              int64_t j0, int64_t j1, const int64_t *draft_index, const int64_t *base,
              int64_t offset, const uint16_t *cos, const uint16_t *sin, int64_t table,
              int64_t rot, const int64_t *slots, int64_t first_slot, int64_t kv_len,
              uint16_t *ck, uint16_t *cv, int64_t num_slots, int64_t length, int threads,
              int early_exit, const Chain *chain, uint16_t *last, int64_t *last_tok,
              int64_t *made) {
    const int64_t H = p->block.hidden;
    uint16_t *outs = malloc(sizeof(uint16_t) * (size_t)(2 * B * H + 64));
    uint16_t *rope = malloc(sizeof(uint16_t) * (size_t)(2 * B * rot + 64));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(2 * B));
    float *top = malloc(sizeof(float) * (size_t)(2 * B));
    *made = j0 - 1;
    if (!outs || !rope || !pos || !top) {
        free(outs); free(rope); free(pos); free(top);
        return -1;
    }
    int64_t *tok = pos + B;
    float *lse = chain->confidence ? top + B : NULL;
    uint16_t *bufs[2] = {outs, outs + B * H + 32};
    for (int64_t b = 0; b < B; b++) last_tok[b] = tokens[b];
    Chain c = *chain;
    int rc = 0;
    for (int64_t j = j0; j <= j1; j++) {
        uint16_t *out = bufs[j & 1];
        int outside = 0;
        for (int64_t b = 0; b < B; b++) {  /* this draft's positions and their rope rows */
            pos[b] = base[b] + j + offset;
            outside |= pos[b] < 0 || pos[b] >= table;
        }
        if (outside) {
            rc = -2;
            break;
        }
        for (int64_t b = 0; b < B; b++)
            for (int64_t r = 0; r < rot; r++) {
                rope[b * rot + r] = cos[pos[b] * rot + r];
                rope[(B + b) * rot + r] = sin[pos[b] * rot + r];
            }
        c.j = draft_index + j;
        rc = mtp_draft(p, 1, prev, last_tok, B, rope, rope + B * rot, rot, slots, pos,
                       first_slot, kv_len, ck, cv, num_slots, length, threads, out, tok, top,
                       lse, &c);
        if (rc < 0) break;
        prev = out;
        *made = j;
        for (int64_t b = 0; b < B; b++) last_tok[b] = tok[b];
        if (early_exit && rc == 0) break;
    }
    if (*made >= j0)
        for (int64_t i = 0; i < B * H; i++) last[i] = prev[i];
    free(outs); free(rope); free(pos); free(top);
    return rc;
}
