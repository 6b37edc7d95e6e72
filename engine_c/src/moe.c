/*
 * moe.c - the mixture-of-experts FFN (qwen3moe, qwen3vlmoe): routing and the
 * expert matmuls.
 *
 * For each token row x (the normed input of the FFN, s->xb):
 *   router     r = W_gate_inp . x                      [n_expert] (es_matmul)
 *   softmax    p_e = exp(r_e - max r) / sum_e' exp(r_e' - max r)
 *              (exp_cephes; the sum over e in index order)
 *   top-k      the k = n_expert_used largest p_e, in rank order: a larger
 *              p first; equal p: the lower expert index first (the tie rule)
 *   weights    w_j = p_(j) / (p_(0) + p_(1) + ... + p_(k-1))  (Qwen3's
 *              norm_topk_prob, as transformers and llama.cpp apply it for
 *              these architectures; the sum in rank order)
 *   experts    y_j = W_down_e . (silu(W_gate_e . x) * (W_up_e . x)), e = expert j
 *   output     out = ((0 + w_0 y_0) + w_1 y_1) + ... + w_(k-1) y_(k-1)
 *
 * Rows are grouped by expert: the rows that chose expert e are gathered
 * into a contiguous run of "slots" (experts in index order, rows ascending
 * within one), so that each chosen expert's weights are read once per call
 * for all its rows, and one dispatch (es_matmul_grouped) runs the gate and up
 * matrices of every chosen expert, a second one the down matrices, with the
 * work shared out by (expert, block of output rows).
 *
 * Determinism: a row's router logits, softmax, choice and weights depend on
 * the row alone; each expert matmul computes an output element of a slot
 * from that slot's row and the expert's weights alone (es_matmul's
 * contract, whatever the rows of the expert); the combination runs over j
 * in rank order. So a row's output is bitwise the same whatever N, the
 * other rows, the batch and the thread count.
 *
 * Calls longer than ES_MOE_CHUNK rows are run in chunks of rows, which
 * bounds the scratch (moe_* buffers of the session: ES_MOE_CHUNK *
 * n_expert_used slots).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "quant.h"
#include "rowops.h"

/* p[0..n) = softmax(r[0..n)) in place (exp_cephes, the sum in index order). */
static void softmax_row(float *p, int n) {
    float m = p[0];
    for (int e = 1; e < n; e++) m = p[e] > m ? p[e] : m;
    float sum = 0.0f;
    for (int e = 0; e < n; e++) {
        p[e] = exp_cephes(p[e] - m);
        sum += p[e];
    }
    float inv = 1.0f / sum;
    for (int e = 0; e < n; e++) p[e] = p[e] * inv;
}

/* The k largest of p[0..n) in rank order (a larger value first; equal
 * values: the lower index first; NaN ranks below every number) into
 * sel[0..k), and their renormalised weights into w[0..k). */
static void top_k(const float *p, int n, int k, int32_t *sel, float *w) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int e = 0; e < n; e++) {
            int taken = 0;
            for (int i = 0; i < j && !taken; i++) taken = sel[i] == e;
            if (taken) continue;
            if (best < 0 || p[e] > p[best] || (p[best] != p[best] && p[e] == p[e])) best = e;
        }
        sel[j] = best;
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += p[sel[j]];
    for (int j = 0; j < k; j++) w[j] = p[sel[j]] / sum;
}

/* Gate and up output of slot rows, then SwiGLU in place into g (a dispatch
 * of its own: rows shared out in turn). */
typedef struct {
    float *g;
    const float *u;
    int64_t n_ff;
    int n;
    _Atomic int next;
} glu_task;

static void glu_worker(void *ctx, int ith, int nth) {
    glu_task *t = ctx;
    (void)ith;
    (void)nth;
    for (int i; (i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n;)
        swiglu_row(t->g + (size_t)i * (size_t)t->n_ff, t->u + (size_t)i * (size_t)t->n_ff, (size_t)t->n_ff);
}

/* Rows [r0, r0 + n) of s->xb through the experts of layer l, into the same
 * rows of s->out. */
static void moe_chunk(es_session *s, int l, int r0, int n) {
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    const int NE = in->n_expert, K = in->n_expert_used;
    const size_t E = (size_t)in->n_embd, FF = (size_t)in->n_ff_exp;
    const float *xb = s->xb + (size_t)r0 * E;

    /* router, softmax, top-k */
    es_matmul(s->pool, L->gate_inp, xb, n, s->moe_logits, NE, s->mm_scratch);
    for (int i = 0; i < n; i++) {
        float *p = s->moe_logits + (size_t)i * NE;
        softmax_row(p, NE);
        top_k(p, NE, K, s->moe_sel + (size_t)i * K, s->moe_w + (size_t)i * K);
    }

    /* slots: experts in index order, each expert's rows ascending */
    int32_t *start = s->moe_start;
    memset(start, 0, (size_t)(NE + 1) * sizeof *start);
    for (int i = 0; i < n * K; i++) start[s->moe_sel[i] + 1]++;
    for (int e = 0; e < NE; e++) start[e + 1] += start[e];
    int32_t *fill = s->moe_fill;
    memcpy(fill, start, (size_t)NE * sizeof *fill);
    for (int i = 0; i < n; i++)
        for (int j = 0; j < K; j++) {
            int e = s->moe_sel[(size_t)i * K + j];
            int slot = fill[e]++;
            s->moe_slot[(size_t)i * K + j] = slot;
            memcpy(s->moe_x + (size_t)slot * E, xb + (size_t)i * E, E * sizeof(float));
        }
    int slots = n * K;

    /* gate and up of every chosen expert in one dispatch, SwiGLU, down in one dispatch */
    es_mm_group gu[2 * ES_MAX_EXPERT], dn[ES_MAX_EXPERT];
    int ngu = 0, ndn = 0;
    for (int e = 0; e < NE; e++) {
        int ne = start[e + 1] - start[e];
        if (ne == 0) continue;
        size_t o = (size_t)start[e];
        gu[ngu++] = (es_mm_group){&L->exp_gate[e], s->moe_x + o * E, ne, s->moe_g + o * FF, (int64_t)FF};
        gu[ngu++] = (es_mm_group){&L->exp_up[e], s->moe_x + o * E, ne, s->moe_u + o * FF, (int64_t)FF};
        dn[ndn++] = (es_mm_group){&L->exp_down[e], s->moe_g + o * FF, ne, s->moe_d + o * E, (int64_t)E};
    }
    s->moe_experts_read += ndn;
    es_matmul_grouped(s->pool, ngu, gu, s->moe_q8);
    glu_task gt = {s->moe_g, s->moe_u, (int64_t)FF, slots, 0};
    if (slots > 1) es_pool_run(s->pool, glu_worker, &gt);
    else glu_worker(&gt, 0, 1);
    es_matmul_grouped(s->pool, ndn, dn, s->moe_q8);

    /* each row: its experts' outputs weighted, in rank order */
    for (int i = 0; i < n; i++) {
        float *o = s->out + (size_t)(r0 + i) * E;
        for (size_t d = 0; d < E; d++) o[d] = 0.0f;
        for (int j = 0; j < K; j++) {
            float w = s->moe_w[(size_t)i * K + j];
            const float *y = s->moe_d + (size_t)s->moe_slot[(size_t)i * K + j] * E;
            for (size_t d = 0; d < E; d++) o[d] = o[d] + w * y[d];
        }
    }
}

void es_moe_ffn(es_session *s, int l, int n) {
    for (int r0 = 0; r0 < n; r0 += ES_MOE_CHUNK)
        moe_chunk(s, l, r0, n - r0 < ES_MOE_CHUNK ? n - r0 : ES_MOE_CHUNK);
}

void es_moe_scratch_free(es_session *s) {
    free(s->moe_logits); free(s->moe_sel); free(s->moe_w); free(s->moe_slot); free(s->moe_start);
    free(s->moe_fill); free(s->moe_x); free(s->moe_g); free(s->moe_u); free(s->moe_d); free(s->moe_q8);
    s->moe_logits = s->moe_w = s->moe_x = s->moe_g = s->moe_u = s->moe_d = NULL;
    s->moe_sel = s->moe_slot = s->moe_start = s->moe_fill = NULL;
    s->moe_q8 = NULL;
    s->moe_cap = 0;
}

es_status es_moe_scratch(es_session *s, int32_t n) {
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    int32_t rows = n < ES_MOE_CHUNK ? n : ES_MOE_CHUNK;
    if (in->n_expert == 0 || rows <= s->moe_cap) return ES_OK;
    size_t R = (size_t)rows, K = (size_t)in->n_expert_used, S = R * K, E = (size_t)in->n_embd,
           FF = (size_t)in->n_ff_exp;
    const es_layer *L = &m->layers[0];
    /* es_matmul_grouped_scratch of the gate and up groups (the rows of each expert once, or twice
       when gate and up take different activation formats), or of the down groups */
    (void)L;
    size_t re = es_matmul_scratch_bytes(ES_TYPE_Q8_0, (int64_t)E, 1), rf = es_matmul_scratch_bytes(ES_TYPE_Q8_0, (int64_t)FF, 1);
    size_t q8 = 2 * S * (re > rf ? re : rf) + 2 * 64 * (size_t)in->n_expert;
    es_session o = *s;   /* the old buffers, freed once the new ones are all there */
    s->moe_logits = malloc(R * (size_t)in->n_expert * sizeof(float));
    s->moe_sel = malloc(S * sizeof(int32_t));
    s->moe_w = malloc(S * sizeof(float));
    s->moe_slot = malloc(S * sizeof(int32_t));
    s->moe_start = malloc(((size_t)in->n_expert + 1) * sizeof(int32_t));
    s->moe_fill = malloc((size_t)in->n_expert * sizeof(int32_t));
    s->moe_x = malloc(S * E * sizeof(float));
    s->moe_g = malloc(S * FF * sizeof(float));
    s->moe_u = malloc(S * FF * sizeof(float));
    s->moe_d = malloc(S * E * sizeof(float));
    s->moe_q8 = aligned_alloc(64, q8 ? q8 : 64);
    if (!s->moe_logits || !s->moe_sel || !s->moe_w || !s->moe_slot || !s->moe_start || !s->moe_fill ||
        !s->moe_x || !s->moe_g || !s->moe_u || !s->moe_d || !s->moe_q8) {
        es_moe_scratch_free(s);
        s->moe_logits = o.moe_logits; s->moe_sel = o.moe_sel; s->moe_w = o.moe_w; s->moe_slot = o.moe_slot;
        s->moe_start = o.moe_start; s->moe_fill = o.moe_fill; s->moe_x = o.moe_x; s->moe_g = o.moe_g;
        s->moe_u = o.moe_u; s->moe_d = o.moe_d; s->moe_q8 = o.moe_q8;
        s->moe_cap = o.moe_cap;
        es_set_err(s->err, sizeof s->err, "out of memory for the expert scratch of %d rows", (int)rows);
        return ES_ERR_NOMEM;
    }
    es_moe_scratch_free(&o);
    s->moe_cap = rows;
    return ES_OK;
}
