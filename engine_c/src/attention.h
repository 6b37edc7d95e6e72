/*
 * attention.h - the attention's entry points for the forward pass
 * (attention.c; the contract is above attend_unit there). Private to the
 * engine.
 *
 * A layer's attention over the sessions of a call: one attn_task per
 * session, es_attn_shape on each (its units follow the previous task's in
 * attn_batch.end), then es_pool_run(pool, es_attn_worker, &batch).
 */
#ifndef ES_ATTENTION_H
#define ES_ATTENTION_H

#include <stdatomic.h>

#include "internal.h"

typedef struct {
    es_session *s;      /* the call's scratch: q, att, att_ws, att_done, mm_scratch */
    es_session *seq;    /* the session these rows belong to: its KV cache, parts, grp_done */
    int row0;           /* its rows in the call's scratch: [row0, row0 + n) */
    int layer;
    int n;              /* its tokens in this call */
    int per, split;     /* query heads per unit, units per KV head group */
    int ts, nsl;        /* tokens per unit, token slices (query split) */
    int nch, bpc;       /* key split: chunks of blocks per head group (0: query split), blocks per chunk */
    int32_t nblk;       /* blocks attended by the call's last token: [0, nblk) holds every one */
    int32_t blo;        /* the first block of the call's first token's window (its window's, else
                           0; with eviction at least sb) */
    int32_t sb;         /* KV eviction: the sink blocks the call reaches (min(sink_blk, nblk)), else 0 */
    int32_t nvb;        /* the call's blocks: [0, sb), then [blo, nblk) (es_attn_vblock); with
                           sparse attention the nvb blocks of sel */
    const int32_t *sel; /* sparse attention (sparse.c): KV head g's blocks, ascending, at
                           sel[g * sel_ld + v] for v in [0, nvb); NULL: every block (dense) */
    int32_t sel_ld;
    size_t rs;          /* > 0: the unit that completes the call's (key split) or a token slice's
                           (query split) attention quantizes those att rows into mm_scratch for
                           W_o (rows rs bytes apart) */
} attn_task;

/* One attention dispatch over the sessions of a call: the units of t[k] are
 * [end[k - 1], end[k]) of one counter. */
typedef struct {
    es_session *s;
    const attn_task *t;
    int nt;
    int end[ES_MAX_BATCH];
    _Atomic int next;   /* next work unit to take */
} attn_batch;

/* The first position of the window the query at position pos attends in
 * layer l: 0, or on a sliding-window layer max(0, pos - n_swa + 1), or with
 * KV eviction max(0, pos - kv_window + 1) in every layer (which also attends
 * the sinks [0, kv->sinks) before it). Depends only on the query's own
 * position (the attention contract in attention.c). */
static inline int32_t es_attn_window_lo(const es_kv *kv, const es_model *m, int l, int32_t pos) {
    if (!kv->evict && !m->layers[l].swa) return 0;
    int32_t lo = pos - kv->n_swa + 1;
    return lo > 0 ? lo : 0;
}

/* A call's blocks in order (attn_task): index v in [0, t->nvb) is block
 * v of the sinks, then the blocks from t->blo, or with sparse attention KV
 * head g's v-th selected block; es_attn_vindex inverts the dense map. */
static inline int32_t es_attn_vblock(const attn_task *t, int g, int32_t v) {
    if (t->sel) return t->sel[(size_t)g * (size_t)t->sel_ld + (size_t)v];
    return v < t->sb ? v : t->blo + v - t->sb;
}
static inline int32_t es_attn_vindex(const attn_task *t, int32_t b) {
    return b < t->sb ? b : t->sb + b - t->blo;
}

/* Sparse attention (sparse.c), for t (seq, layer, n, row0 set; s->q holds
 * the call's queries, the KV cache its keys): when the session has
 * sparse_topk > 0 and the layer is global, bring the per-block key bounds of
 * the blocks the call wrote up to date; then, for a key-split call whose
 * context has more blocks than it keeps, choose each KV head's blocks and
 * set t->sel, t->sel_ld and t->nvb. Otherwise leaves t->sel NULL (dense). */
void es_sparse_prepare(const es_session *s, attn_task *t);

/* Shape t's work units (t->s, seq, row0, layer, n and rs set; the rest is
 * filled in) and reset the counters the workers use. Returns the number of
 * units. */
int es_attn_shape(const es_session *s, attn_task *t);
/* es_task_fn over an attn_batch: the units of every task, taken in turn
 * from ab->next (set to 0 before the run). */
void es_attn_worker(void *ctx, int ith, int nth);

#endif /* ES_ATTENTION_H */
