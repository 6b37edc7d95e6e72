/*
 * tree.c - token-tree verification: es_forward_tree (the checks, the
 * nodes' depths and positions, and their attention) and
 * es_session_keep_path.
 *
 * A tree call is es_forward over its nodes but for two stages: RoPE rotates
 * node i by n_past + depth(i) (es_forward_positions' tables), and the
 * attention (es_tree_attention) gives node i the keys of the last row of a
 * chain over its root-to-node path. Every other stage is per row, so those
 * two make node i's logits bitwise the chain's (the determinism contract,
 * internal.h).
 *
 * The nodes' K and V go to KV slots n_past + i (node i), as es_forward's
 * rows do, so a chain (parents[i] = i - 1) has every node at its own
 * position. Node i's chain attends positions [0, n_past + d], d = depth(i),
 * in blocks of ES_KV_BLOCK positions fixed by absolute position, and the
 * block result depends on which key sits at which position of the block
 * (attention.c's contract). So for each block b of [0, (n_past + d) /
 * ES_KV_BLOCK]:
 *   the block holds no new position (b * B + B <= n_past), or every
 *   ancestor of i sits in its own slot (ancestor at depth j in slot
 *   n_past + j): the cache's block as it is;
 *   else: the cache's block copied into the thread's scratch, and position
 *   n_past + j of it (j <= d, in the block) given the key and value of the
 *   ancestor at depth j (slot n_past + anc[j]). F16 copies are exact.
 * The scratch blocks hold, at every position the query attends, exactly
 * what the chain's cache would, so es_attn_block_dense gives the chain's
 * block results and the fold (blocks in order, from block 0) its output.
 * (A K block is dimension-major: dimension e of position t at e * B + t; a
 * V block position-major: t * head_dim + e; kv_cache.c.)
 *
 * es_session_keep_path then moves the kept path's K and V to positions
 * n_past + j, so the cache equals the chain's.
 */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* The F16 cache's blocks as halves (es_kv_k_block / es_kv_v_block give bytes; trees run on
 * F16 caches only: es_forward_tree refuses a Q8_0 one). */
static inline const uint16_t *kv16_k(const es_kv *kv, int l, int g, int32_t b) {
    return (const uint16_t *)(const void *)es_kv_k_block(kv, l, g, b);
}
static inline const uint16_t *kv16_v(const es_kv *kv, int l, int g, int32_t b) {
    return (const uint16_t *)(const void *)es_kv_v_block(kv, l, g, b);
}


/* One es_tree_attention dispatch: units (node, KV head), taken in turn. */
typedef struct {
    es_session *s;
    const es_tree *t;
    int l;
    _Atomic int next;
} tree_task;

/* The ancestors of node i in depth order (anc[0] its root, anc[depth] = i);
 * returns 1 when each sits in the slot of its own position (anc[j] == j). */
static int ancestors(const es_tree *t, int i, int32_t *anc) {
    int d = t->depth[i], same = 1;
    for (int j = d, k = i; j >= 0; j--, k = t->parent[k]) {
        anc[j] = k;
        same &= k == j;
    }
    return same;
}

/* Block b of KV head g of layer l as node i's chain sees it (anc: its
 * ancestors, d its depth), into k_out / v_out. */
static void assemble_block(const es_kv *kv, int l, int g, int32_t b, const int32_t *anc, int d,
                           uint16_t *k_out, uint16_t *v_out) {
    int hd = kv->head_dim;
    size_t blk = (size_t)hd * ES_KV_BLOCK;
    memcpy(k_out, kv16_k(kv, l, g, b), blk * sizeof(uint16_t));
    memcpy(v_out, kv16_v(kv, l, g, b), blk * sizeof(uint16_t));
    int32_t p0 = b * ES_KV_BLOCK;
    for (int j = 0; j <= d; j++) {
        int32_t pos = kv->n_past + j, src = kv->n_past + anc[j];
        if (pos < p0 || pos >= p0 + ES_KV_BLOCK || src == pos) continue;
        const uint16_t *ks = kv16_k(kv, l, g, src / ES_KV_BLOCK) + src % ES_KV_BLOCK;
        const uint16_t *vs = kv16_v(kv, l, g, src / ES_KV_BLOCK) + (size_t)(src % ES_KV_BLOCK) * hd;
        for (int e = 0; e < hd; e++) k_out[(size_t)e * ES_KV_BLOCK + (pos - p0)] = ks[(size_t)e * ES_KV_BLOCK];
        memcpy(v_out + (size_t)(pos - p0) * hd, vs, (size_t)hd * sizeof(uint16_t));
    }
}

/* Unit u = (node i, KV head g): the node's query heads of that group, in
 * chunks of up to q_cap, over blocks 0 .. (n_past + depth) / B. */
static void tree_unit(tree_task *tt, int u, int ith) {
    es_session *s = tt->s;
    const es_tree *t = tt->t;
    const es_model_info *in = &s->model->info;
    const es_kv *kv = &s->kv;
    int hd = in->head_dim, grp = in->n_head / in->n_head_kv, pf = es_attn_part_floats(hd);
    int i = u / in->n_head_kv, g = u % in->n_head_kv, d = t->depth[i];
    size_t q_dim = (size_t)in->n_head * hd, blk = (size_t)hd * ES_KV_BLOCK;
    float *sc = s->att_ws + (size_t)ith * s->ws_floats;
    float *st = sc + (size_t)s->q_cap * ES_KV_BLOCK, *bp = st + (size_t)s->q_cap * pf;
    uint16_t *kt = t->tail + (size_t)ith * 2 * blk, *vt = kt + blk;
    int32_t anc[ES_MAX_TREE_NODES];
    int same = ancestors(t, i, anc);
    int32_t p = kv->n_past + d, last = p / ES_KV_BLOCK;
    for (int h0 = g * grp; h0 < (g + 1) * grp; h0 += s->q_cap) {
        int nq = (g + 1) * grp - h0 < s->q_cap ? (g + 1) * grp - h0 : s->q_cap;
        const float *qp[ES_MAX_UNIT_Q];
        float *dst[ES_MAX_UNIT_Q];
        int nv[ES_MAX_UNIT_Q];
        for (int k = 0; k < nq; k++) {
            qp[k] = s->q + (size_t)i * q_dim + (size_t)(h0 + k) * hd;
            dst[k] = bp + (size_t)k * pf;
        }
        for (int32_t b = 0; b <= last; b++) {
            const uint16_t *kb = kv16_k(kv, tt->l, g, b), *vb = kv16_v(kv, tt->l, g, b);
            if (!same && (b + 1) * ES_KV_BLOCK > kv->n_past) {
                assemble_block(kv, tt->l, g, b, anc, d, kt, vt);
                kb = kt;
                vb = vt;
            }
            int32_t c = p + 1 - b * ES_KV_BLOCK;
            for (int k = 0; k < nq; k++) nv[k] = c < ES_KV_BLOCK ? (int)c : ES_KV_BLOCK;
            es_attn_block_dense(nq, qp, nv, dst, hd, kb, vb, sc, s->model->attn_scale);
            for (int k = 0; k < nq; k++) es_attn_fold(st + (size_t)k * pf, dst[k], hd, b == 0);
        }
        for (int k = 0; k < nq; k++)
            es_attn_finish(s->att + (size_t)i * q_dim + (size_t)(h0 + k) * hd, st + (size_t)k * pf, hd);
    }
}

static void tree_worker(void *ctx, int ith, int nth) {
    tree_task *tt = ctx;
    int units = tt->t->n * tt->s->model->info.n_head_kv;
    (void)nth;
    for (int u; (u = atomic_fetch_add_explicit(&tt->next, 1, memory_order_relaxed)) < units;) tree_unit(tt, u, ith);
}

void es_tree_attention(es_session *s, const es_tree *t, int l) {
    tree_task tt = {.s = s, .t = t, .l = l};
    atomic_store_explicit(&tt.next, 0, memory_order_relaxed);
    es_pool_run(s->pool, tree_worker, &tt);
}

/* What es_forward_tree refuses on this session (ES_ERR_UNSUPPORTED), with the message. */
static es_status check_tree_session(es_session *s) {
    const char *why = s->kv.evict ? "KV eviction (kv_window > 0)"
                    : s->sparse_topk > 0 ? "sparse attention (sparse_topk > 0)"
                    : s->model->info.n_swa_layers > 0 ? "a model with sliding-window layers"
                    : s->kv.type == ES_KV_Q8_0 ? "a Q8_0 KV cache (kv_type)"
                    : NULL;
    if (!why) return ES_OK;
    es_set_err(s->err, sizeof s->err, "token-tree verification is not supported with %s: verify the "
               "branches as chains with es_forward", why);
    return ES_ERR_UNSUPPORTED;
}

es_status es_forward_tree(es_session *s, const int32_t *tokens, const int32_t *parents, int32_t n,
                          int32_t *argmax_out, float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    s->tree_n = 0;
    es_status st = check_tree_session(s);
    if (st != ES_OK) return st;
    if (n < 1 || n > ES_MAX_TREE_NODES || !parents) {
        es_set_err(s->err, sizeof s->err, "a tree needs n_nodes in [1, %d] (got %d) and parents%s",
                   (int)ES_MAX_TREE_NODES, (int)n, parents ? "" : " (NULL)");
        return ES_ERR_INVALID_ARG;
    }
    int32_t depth[ES_MAX_TREE_NODES], pos[3 * ES_MAX_TREE_NODES];
    for (int32_t i = 0; i < n; i++) {
        if (parents[i] < -1 || parents[i] >= i) {
            es_set_err(s->err, sizeof s->err, "parents[%d] = %d: a node's parent is -1 (the last cached "
                       "position) or an earlier node, in [-1, %d)", (int)i, (int)parents[i], (int)i);
            return ES_ERR_INVALID_ARG;
        }
        depth[i] = parents[i] < 0 ? 0 : depth[parents[i]] + 1;
        pos[3 * i] = pos[3 * i + 1] = pos[3 * i + 2] = s->kv.n_past + depth[i];
    }
    int nth = es_pool_capacity(s->pool);
    size_t blk = (size_t)s->model->info.head_dim * ES_KV_BLOCK;
    uint16_t *tail = malloc((size_t)nth * 2 * blk * sizeof(uint16_t));
    if (!tail) {
        es_set_err(s->err, sizeof s->err, "out of memory for the tree's attention scratch");
        return ES_ERR_NOMEM;
    }
    es_tree t = {.n = n, .parent = parents, .depth = depth, .tail = tail};
    st = es_forward_tree_run(s, tokens, pos, &t, argmax_out, logits_out, logits_mode);
    free(tail);
    return st;
}

/* Move K and V of slot src to slot dst, every layer and KV head. */
static void move_slot(es_kv *kv, int32_t src, int32_t dst) {
    int hd = kv->head_dim;
    for (int l = 0; l < kv->n_layer; l++)
        for (int g = 0; g < kv->n_head_kv; g++) {
            const uint16_t *ks = kv16_k(kv, l, g, src / ES_KV_BLOCK) + src % ES_KV_BLOCK;
            uint16_t *kd = (uint16_t *)kv16_k(kv, l, g, dst / ES_KV_BLOCK) + dst % ES_KV_BLOCK;
            for (int e = 0; e < hd; e++) kd[(size_t)e * ES_KV_BLOCK] = ks[(size_t)e * ES_KV_BLOCK];
            memcpy((uint16_t *)kv16_v(kv, l, g, dst / ES_KV_BLOCK) + (size_t)(dst % ES_KV_BLOCK) * hd,
                   kv16_v(kv, l, g, src / ES_KV_BLOCK) + (size_t)(src % ES_KV_BLOCK) * hd,
                   (size_t)hd * sizeof(uint16_t));
        }
}

es_status es_session_keep_path(es_session *s, const int32_t *nodes, int32_t n_path) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (s->tree_n == 0 || s->tree_past != s->kv.n_past) {
        es_set_err(s->err, sizeof s->err, "no tree to keep a path of: the session's last call was not an "
                   "es_forward_tree that succeeded (or it rolled back since)");
        return ES_ERR_INVALID_ARG;
    }
    if (n_path < 0 || n_path > s->tree_n || (n_path > 0 && !nodes)) {
        es_set_err(s->err, sizeof s->err, "a path of the tree needs n_path in [0, %d] (got %d) and nodes%s",
                   (int)s->tree_n, (int)n_path, nodes || n_path == 0 ? "" : " (NULL)");
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t j = 0; j < n_path; j++) {
        int32_t want = j == 0 ? -1 : nodes[j - 1];
        if (nodes[j] < 0 || nodes[j] >= s->tree_n || s->tree_parent[nodes[j]] != want) {
            if (nodes[j] < 0 || nodes[j] >= s->tree_n)
                es_set_err(s->err, sizeof s->err, "nodes[%d] = %d is not a node of the tree [0, %d)", (int)j,
                           (int)nodes[j], (int)s->tree_n);
            else if (j == 0)
                es_set_err(s->err, sizeof s->err, "nodes[0] = %d is not a root (its parent is %d)", (int)nodes[0],
                           (int)s->tree_parent[nodes[0]]);
            else
                es_set_err(s->err, sizeof s->err, "nodes[%d] = %d is not a child of nodes[%d] = %d (its parent "
                           "is %d)", (int)j, (int)nodes[j], (int)(j - 1), (int)want, (int)s->tree_parent[nodes[j]]);
            return ES_ERR_INVALID_ARG;
        }
    }
    /* nodes ascend (a parent precedes its child) and nodes[j] >= j, so a
     * slot is read before any move writes it */
    for (int32_t j = 0; j < n_path; j++)
        if (nodes[j] != j) move_slot(&s->kv, s->kv.n_past + nodes[j], s->kv.n_past + j);
    es_kv_advance(&s->kv, n_path);
    s->tree_n = 0;
    s->err[0] = '\0';
    return ES_OK;
}
