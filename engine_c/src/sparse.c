/*
 * sparse.c - block-sparse attention for decode at long context (opt-in:
 * es_session_params sparse_topk K > 0; Quest's query-aware block choice).
 *
 * What a step attends. Per global layer and KV head g the session keeps,
 * for every KV block b (ES_KV_BLOCK positions), the element-wise min and
 * max of the keys of its valid positions (kv_bound, F16: the keys are F16,
 * so their min and max are exact). For any key k of the block and query q,
 *   q . k = sum_d q_d k_d <= sum_d max(q_d * min_d, q_d * max_d) = U_b(q),
 * so U_b bounds every score of the block. A key-split call (n <= KS_MAX_TOKENS
 * tokens: decode and verify) at positions [n_past, n_past + n), last =
 * (n_past + n - 1) / B, attends in every global layer, per KV head:
 *   block 0 (the sink), blocks last - 1 and last (the recent ones, which
 *   hold every query of the call: n <= B), and
 *   the K other blocks of the largest score S_b = sum over g's query heads
 *   h, in order, of U_b(q of the call's last token, head h); ties to the
 *   lower block index, a NaN score below every other one,
 * folded in ascending block order (the dense order restricted to them).
 * Only when the context has more blocks than that (last + 1 > K + 3);
 * otherwise, on sliding-window layers (their window already bounds a step)
 * and for longer calls (prefill) the attention is dense, bitwise the
 * attention of a session without sparse_topk.
 *
 * Why heads share a choice per KV head: the heads of a GQA group read the
 * same K and V blocks, so one choice per KV head costs one read of the
 * chosen blocks for all of them (per query head choices would read the
 * union), and summing their bounds keeps the blocks any of them weighs
 * heavily. Why once per call, from the last query: every query of the call
 * then reads the same blocks (one work unit shape for all, as in the dense
 * key split), and the last query's blocks contain every earlier query's
 * position. A query of an n-token call thus depends on the call's other
 * tokens, so a query computed in a 5-token verify is not bitwise the query
 * of a 1-token step: speculation is not exact under sparse attention, and
 * the services refuse it (the coordinator's gating).
 *
 * With a Q8_0 cache (kv_type) the keys are q * d, exact float32s that F16
 * may not hold: a bound is the min (max) rounded down (up) to F16, so U_b
 * still bounds every score of the block.
 *
 * Determinism: the bounds are min / max (exact) of the cache's keys,
 * recomputed from the block's valid positions whenever a call writes into
 * the block (so a rollback leaves nothing stale behind: the next call
 * writes from n_past, into the block that held the removed positions);
 * the scores are scalar float sums in a fixed order (no fma: the engine is
 * built with -ffp-contract=off), on the calling thread; the order is total.
 * So the choice depends only on the cache and the last query, never on the
 * thread count or the SIMD path, and the attention over the chosen blocks
 * follows the contract of attention.c.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "internal.h"

typedef struct {
    float key;      /* S_b, a NaN as -inf */
    int32_t b;
} rank_item;

/* Block b's bounds of KV head g in layer l: min [hd], then max [hd]. */
static uint16_t *bound_at(const es_session *seq, int l, int g, int32_t b) {
    const es_kv *kv = &seq->kv;
    size_t blk = ((size_t)l * (size_t)kv->n_head_kv + (size_t)g) * (size_t)kv->n_blk + (size_t)b;
    return seq->kv_bound + blk * 2 * (size_t)kv->head_dim;
}

/* The F16 nearest to x on its side: at most x (down) or at least x (up). */
static uint16_t fp16_directed(float x, int up) {
    uint16_t h = es_fp32_to_fp16(x);
    float y = es_fp16_to_fp32(h);
    if (x != x || y == x || (up ? y > x : y < x)) return h;
    /* one step of the F16 grid toward x: magnitude down for a positive y
     * rounded up (or negative rounded down), else up; -0 steps to -min */
    int neg = (h & 0x8000) != 0, toward_zero = up ? neg : !neg;
    if ((h & 0x7fff) == 0) return up ? (uint16_t)0x0001 : (uint16_t)0x8001;
    return (uint16_t)(toward_zero ? h - 1 : h + 1);
}

/* Block b's bounds of a Q8_0 cache: the keys q * d (exact float32), their
 * min and max rounded outward to F16. */
static void bounds_q8(const es_kv *kv, const uint8_t *kb, int32_t end, uint16_t *bd) {
    int hd = kv->head_dim;
    const int8_t *kq = (const int8_t *)kb;
    const uint16_t *ks = (const uint16_t *)(const void *)(kb + (size_t)hd * ES_KV_BLOCK);
    for (int d = 0; d < hd; d++) {
        const int8_t *row = kq + (size_t)d * ES_KV_BLOCK;
        const uint16_t *sr = ks + (size_t)(d / 32) * ES_KV_BLOCK;
        float flo = (float)row[0] * es_fp16_to_fp32(sr[0]), fhi = flo;
        for (int32_t t = 1; t < end; t++) {
            float x = (float)row[t] * es_fp16_to_fp32(sr[t]);
            flo = x < flo ? x : flo;
            fhi = x > fhi ? x : fhi;
        }
        bd[d] = fp16_directed(flo, 0);
        bd[hd + d] = fp16_directed(fhi, 1);
    }
}

/* Recompute the bounds of layer l's blocks holding positions [p0, p1) from
 * the keys of each block's positions before p1. */
static void update_bounds(es_session *seq, int l, int32_t p0, int32_t p1) {
    const es_kv *kv = &seq->kv;
    int hd = kv->head_dim;
    for (int32_t b = p0 / ES_KV_BLOCK; b <= (p1 - 1) / ES_KV_BLOCK; b++) {
        int32_t end = p1 < (b + 1) * ES_KV_BLOCK ? p1 - b * ES_KV_BLOCK : ES_KV_BLOCK;
        for (int g = 0; g < kv->n_head_kv; g++) {
            uint16_t *bd = bound_at(seq, l, g, b);
            if (kv->type == ES_KV_Q8_0) {
                bounds_q8(kv, es_kv_k_block(kv, l, g, b), end, bd);
                continue;
            }
            const uint16_t *kb = (const uint16_t *)(const void *)es_kv_k_block(kv, l, g, b);   /* [hd][B] */
            for (int d = 0; d < hd; d++) {
                const uint16_t *row = kb + (size_t)d * ES_KV_BLOCK;
                uint16_t lo = row[0], hi = row[0];
                float flo = es_fp16_to_fp32(lo), fhi = flo;
                for (int32_t t = 1; t < end; t++) {
                    float x = es_fp16_to_fp32(row[t]);
                    if (x < flo) { flo = x; lo = row[t]; }
                    if (x > fhi) { fhi = x; hi = row[t]; }
                }
                bd[d] = lo;
                bd[hd + d] = hi;
            }
        }
    }
}

/* S_b: the bound of block b summed over the query heads [h0, h1) of q (the
 * call's last token, [n_head][hd]), heads then dimensions in order. */
static float block_score(const es_session *seq, int l, int g, int32_t b, const float *q, int h0, int h1) {
    int hd = seq->kv.head_dim;
    const uint16_t *bd = bound_at(seq, l, g, b);
    float lo[ES_MAX_HEAD_DIM], hi[ES_MAX_HEAD_DIM];   /* the F16 bounds as float32: exact, once a block */
    for (int d = 0; d < hd; d++) {
        lo[d] = es_fp16_to_fp32(bd[d]);
        hi[d] = es_fp16_to_fp32(bd[hd + d]);
    }
    float sum = 0.0f;
    for (int h = h0; h < h1; h++) {
        const float *qh = q + (size_t)h * hd;
        for (int d = 0; d < hd; d++) {
            float a = qh[d] * lo[d], c = qh[d] * hi[d];
            sum += a > c ? a : c;
        }
    }
    return sum;
}

/* Larger key first, then the lower block: a total order. */
static int rank_cmp(const void *x, const void *y) {
    const rank_item *a = x, *b = y;
    if (a->key != b->key) return a->key > b->key ? -1 : 1;
    return (a->b > b->b) - (a->b < b->b);
}

static int int_cmp(const void *x, const void *y) {
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

void es_sparse_prepare(const es_session *s, attn_task *t) {
    es_session *seq = t->seq;
    const es_kv *kv = &seq->kv;
    int l = t->layer;
    if (seq->sparse_topk <= 0 || s->model->layers[l].swa) return;
    update_bounds(seq, l, kv->n_past, kv->n_past + t->n);
    int32_t K = seq->sparse_topk, last = (kv->n_past + t->n - 1) / ES_KV_BLOCK;
    seq->sparse_nsel[l] = 0;
    if (t->n > KS_MAX_TOKENS || (int64_t)last + 1 <= (int64_t)K + 3) return;
    const es_model_info *in = &s->model->info;
    int grp = in->n_head / in->n_head_kv;
    const float *q = s->q + (size_t)(t->row0 + t->n - 1) * (size_t)in->n_head * (size_t)in->head_dim;
    rank_item *rk = seq->sparse_rank;
    int32_t *sel = seq->sparse_sel + (size_t)l * (size_t)kv->n_head_kv * (size_t)kv->n_blk;
    for (int g = 0; g < kv->n_head_kv; g++) {
        int32_t nc = 0;
        for (int32_t b = 1; b < last - 1; b++) {   /* the candidates: neither sink nor recent */
            float sc = block_score(seq, l, g, b, q, g * grp, (g + 1) * grp);
            rk[nc++] = (rank_item){isnan(sc) ? -INFINITY : sc, b};
        }
        qsort(rk, (size_t)nc, sizeof *rk, rank_cmp);
        int32_t *sg = sel + (size_t)g * (size_t)kv->n_blk;
        sg[0] = 0;
        for (int32_t k = 0; k < K; k++) sg[1 + k] = rk[k].b;
        sg[K + 1] = last - 1;
        sg[K + 2] = last;
        qsort(sg, (size_t)K + 3, sizeof *sg, int_cmp);
    }
    seq->sparse_nsel[l] = K + 3;
    t->sel = sel;
    t->sel_ld = kv->n_blk;
    t->nvb = K + 3;
}

es_status es_sparse_alloc(es_session *s, int32_t topk, char *err, size_t err_len) {
    const es_kv *kv = &s->kv;
    size_t nb = (size_t)kv->n_blk, nl = (size_t)kv->n_layer, ng = (size_t)kv->n_head_kv;
    s->sparse_topk = topk;
    s->kv_bound = calloc(nl * ng * nb * 2 * (size_t)kv->head_dim, sizeof(uint16_t));
    s->sparse_sel = calloc(nl * ng * nb, sizeof(int32_t));
    s->sparse_nsel = calloc(nl, sizeof(int32_t));
    s->sparse_rank = calloc(nb, sizeof(rank_item));
    if (!s->kv_bound || !s->sparse_sel || !s->sparse_nsel || !s->sparse_rank) {
        es_set_err(err, err_len, "out of memory for the sparse attention's block bounds (%d blocks)", (int)nb);
        return ES_ERR_NOMEM;
    }
    return ES_OK;
}

void es_sparse_free(es_session *s) {
    free(s->kv_bound);
    free(s->sparse_sel);
    free(s->sparse_nsel);
    free(s->sparse_rank);
    s->kv_bound = NULL;
    s->sparse_sel = s->sparse_nsel = NULL;
    s->sparse_rank = NULL;
}

es_status es_session_sparse_blocks(es_session *s, int32_t layer, int32_t kv_head, int32_t *blocks,
                                   int32_t cap, int32_t *n_out) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (n_out) *n_out = 0;
    if (!n_out || (cap > 0 && !blocks) || cap < 0) {
        es_set_err(s->err, sizeof s->err, "es_session_sparse_blocks: n_out must not be NULL, blocks not NULL "
                   "when cap > 0, cap >= 0 (cap %d)", (int)cap);
        return ES_ERR_INVALID_ARG;
    }
    const es_model_info *in = &s->model->info;
    if (layer < 0 || layer >= in->n_layer || kv_head < 0 || kv_head >= in->n_head_kv) {
        es_set_err(s->err, sizeof s->err, "es_session_sparse_blocks: layer %d or kv_head %d out of range "
                   "([0, %d), [0, %d))", (int)layer, (int)kv_head, (int)in->n_layer, (int)in->n_head_kv);
        return ES_ERR_INVALID_ARG;
    }
    int32_t n = s->sparse_nsel ? s->sparse_nsel[layer] : 0;
    if (n > cap) {
        es_set_err(s->err, sizeof s->err, "es_session_sparse_blocks: %d blocks do not fit in cap %d", (int)n,
                   (int)cap);
        return ES_ERR_INVALID_ARG;
    }
    const int32_t *sel = s->sparse_sel + ((size_t)layer * (size_t)in->n_head_kv + (size_t)kv_head) * (size_t)s->kv.n_blk;
    if (n > 0) memcpy(blocks, sel, (size_t)n * sizeof *blocks);
    *n_out = n;
    s->err[0] = '\0';
    return ES_OK;
}
