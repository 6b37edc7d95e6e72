/*
 * forward.c - the forward pass, top to bottom (forward_impl), and the calls
 * over it: es_forward, es_forward_last, es_forward_batch, es_decode(_batch), es_verify_run.
 *
 * A session owns one KV sequence (kv_cache.c: F16, blocks of ES_KV_BLOCK
 * positions; the layout is described in internal.h), a thread pool and the
 * scratch of one call. es_forward_batch runs the rows of several sessions
 * as one call on the first one's pool and scratch (fwd_seg, fwd_call).
 *
 * The stages of forward_impl, and which function or matmul epilogue does
 * each (an epilogue runs on the thread that computed those matmul columns,
 * while they are in its cache, instead of a dispatch of its own). Every matmul runs over the rows
 * of all the sessions; RoPE, the KV append and the attention use each row's
 * own session:
 *   embedding      x[i] = tok_embd[tokens[i]] (gemma3: times sqrtf(n_embd)); the
 *                  RoPE tables of the positions (global and sliding-window layers)
 *   per layer:
 *     norm         run_rows ROWS_NORM_ATTN: x += out (the last sublayer's
 *                  output, pending; gemma3: its post-norm first), xb =
 *                  rmsnorm(x), quantized for Wq/Wk/Wv
 *     q, k, v      one matmul over Wq, Wk, Wv; epilogue qkv_epi: biases, q/k
 *                  norms (qwen3), RoPE, k and v appended to the KV cache
 *     attention    es_attn_worker (attention.c: online softmax over KV
 *                  blocks, each session over its own; gemma3's local layers
 *                  over the sliding window); the unit that completes a token slice
 *                  quantizes its rows for W_o (es_forward_tree: es_tree_attention,
 *                  tree.c, each node over the cache and its ancestors)
 *     output proj. out = W_o . att (added to x by the next norm)
 *     FFN          run_rows ROWS_NORM_FFN (x += out, norm); a matmul over
 *                  W_gate, W_up with epilogue glu_epi (SwiGLU or GELU, quantized for
 *                  W_down); out = W_down . glu
 *   head           output_head: x += out, output norm, logits with epilogue
 *                  am_epi (argmax per chunk; am_local on per-thread chunks
 *                  when no logits are wanted)
 *   results        per session: argmax and logits of its head rows, n_past
 * A call longer than a session's sliding-window rings allow (es_kv.piece)
 * runs as several such passes (forward_run).
 *
 * Determinism: every per-row operation here (RMSNorm, RoPE, attention for one
 * (position, head), SwiGLU, residual adds, argmax) reads only its own row and
 * the KV positions before it, in a fixed order, so results do not depend on
 * N or on the thread split (the attention's own contract is above
 * attend_unit in attention.c). es_matmul keeps the same contract.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "attention.h"
#include "internal.h"
#include "quant.h"
#include "rowops.h"

#define EARLY_KV_PREFETCH (64 * 1024)   /* a layer's K or V up to this many bytes is prefetched whole */

/* ---- row kernels of the forward pass (the shared ones are in rowops.h) ---- */

/* Rotate one head in place. cs = [rope_dim/2] (cos, sin) pairs for this position.
 * The rotated pairs are gathered first and the two outputs computed in
 * separate loops: GCC 12 turns the interleaved form into vfmaddsub even under
 * -ffp-contract=off, which would break bitwise equality with the scalar build
 * (tests/test_engine_build.py allows FMA instructions only where a contract
 * has them). */
static void rope_head(float *h, const float *cs, int rope_dim, int neox) {
    enum { MAXH = 256 };            /* head_dim <= 512 (checked at load) */
    float x0[MAXH], x1[MAXH], c[MAXH], sn[MAXH], y0[MAXH], y1[MAXH];
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        x0[i] = h[neox ? i : 2 * i];
        x1[i] = h[neox ? i + half : 2 * i + 1];
        c[i] = cs[2 * i];
        sn[i] = cs[2 * i + 1];
    }
    for (int i = 0; i < half; i++) y0[i] = x0[i] * c[i] - x1[i] * sn[i];
    for (int i = 0; i < half; i++) y1[i] = x0[i] * sn[i] + x1[i] * c[i];
    for (int i = 0; i < half; i++) {
        h[neox ? i : 2 * i] = y0[i];
        h[neox ? i + half : 2 * i + 1] = y1[i];
    }
}

/* ---- the forward pass ---------------------------------------------------- */

/* One session's rows in a forward call (es_forward: one; es_forward_batch:
 * one per session that runs): its tokens are rows [row0, row0 + n) of the
 * call's scratch, and the output head reads its last head_n rows into head
 * rows [head0, head0 + head_n). */
typedef struct {
    es_session *seq;        /* its KV cache: positions seq->kv.n_past + (row - row0) */
    const int32_t *tokens;  /* [n] */
    int row0, n;
    int head0, head_n;
    int32_t *argmax_out;    /* [head_n] or NULL */
    float *logits_out;      /* per logits_mode (es_forward), over the head rows */
    int32_t logits_mode;    /* ES_LOGITS_* */
    const int32_t *pos_thw; /* [n][3] RoPE positions (es_forward_positions) or NULL: the KV positions */
    es_status *status;      /* NULL, or set to ES_ERR_BAD_WEIGHTS when a head row of it holds a NaN */
    const es_tree *tree;    /* es_forward_tree (the call's only segment): its rows are the tree's
                               nodes (tree.c), else NULL */
    const float *embd;      /* es_forward_embd: [rows with token ES_TOKEN_EMBD][n_embd], their inputs
                               in order (from this segment's first row), else NULL */
    const float *ds;        /* es_forward_embd: deepstack [n_ds][ds_stride][n_embd], offset to this
                               segment's first embedding row; added after text layer l < n_ds */
    int32_t ds_stride, n_ds;
} fwd_seg;

/* The state of one forward call that passes from stage to stage. */
typedef struct {
    es_session *s;          /* its thread pool and scratch */
    int n;                  /* rows in the call: the tokens of every session */
    const fwd_seg *seg;     /* [nseg] in row order, covering rows [0, n) */
    int nseg;
    int pending_out;        /* x += out is still to be done (by the next norm, per token) */
} fwd_call;

/* The rotation angle of pair j of a row at (t, h, w): the multimodal
 * RoPE's interleaved sections (Qwen3-VL; transformers' layout: pair j takes
 * h when j % 3 == 1 and j < 3 * sections[1], w when j % 3 == 2 and j < 3 *
 * sections[2], else t), or t alone for models without sections. */
static double rope_pos(const es_model_info *in, int j, const int32_t *thw) {
    if (in->rope_sections[0] + in->rope_sections[1] + in->rope_sections[2] == 0) return thw[0];
    if (j % 3 == 1 && j < 3 * in->rope_sections[1]) return thw[1];
    if (j % 3 == 2 && j < 3 * in->rope_sections[2]) return thw[2];
    return thw[0];
}

/* RoPE (cos, sin) tables of every row, at its session's position (or the
 * (t, h, w) positions its segment gives): the global layers' (base
 * rope_freq_base, positions times rope_freq_scale) and, for a model with
 * sliding-window layers, theirs (base rope_freq_base_swa). */
static void fill_rope_table(const fwd_call *c) {
    es_session *s = c->s;
    const es_model_info *in = &s->model->info;
    int half = in->rope_dim / 2;
    for (int k = 0; k < c->nseg; k++) {
        const fwd_seg *g = &c->seg[k];
        for (int i = g->row0; i < g->row0 + g->n; i++) {
            int32_t p = g->seq->kv.n_past + (i - g->row0);
            int32_t thw[3] = {p, p, p};
            if (g->pos_thw) memcpy(thw, g->pos_thw + 3 * (size_t)(i - g->row0), sizeof thw);
            for (int tab = 0; tab < (in->n_swa_layers > 0 ? 2 : 1); tab++) {
                float *cs = s->rope + ((size_t)i * 2 + (size_t)tab) * (size_t)in->rope_dim;
                double base = tab ? in->rope_freq_base_swa : in->rope_freq_base;
                double scale = tab ? 1.0 : in->rope_freq_scale;
                for (int j = 0; j < half; j++) {
                    double pos = rope_pos(in, j, thw) * scale;
                    double theta = pos * pow(base, -2.0 * j / (double)in->rope_dim);
                    cs[2 * j] = (float)cos(theta);
                    cs[2 * j + 1] = (float)sin(theta);
                }
            }
        }
    }
}

/* The row that head row i reads: the last head_n rows of its session. */
static int head_row(const fwd_call *c, int i) {
    const fwd_seg *g = c->seg;
    while (i >= g->head0 + g->head_n) g++;
    return g->row0 + g->n - g->head_n + (i - g->head0);
}

/* ---- per-token row work, shared out by token when there are several ---- */

enum { ROWS_NORM_ATTN, ROWS_NORM_FFN, ROWS_NORM_OUT };

/* One run_rows dispatch. */
typedef struct {
    const fwd_call *c;
    int l, n, op;
    size_t q8_rs;           /* also quantize each row written into mm_scratch, rows this many bytes apart (0: no) */
    uint32_t q8_type;       /* for this weight type (es_quantize_row_act) */
    _Atomic int next;
} rows_task;

/* Row i of a step of layer l (each token's row reads and writes only its own
 * data, so the split changes no bit):
 *   ROWS_NORM_ATTN / ROWS_NORM_FFN  x[i] += out[i] when a residual is
 *       pending (gemma3: x[i] += rmsnorm(out[i]) with the post-norm of the
 *       sublayer that wrote out), then xb[i] = rmsnorm(x[i]) with the layer's norm
 *   ROWS_NORM_OUT  the same residual, then xb[i] = output_norm(x[head_row(i)])
 * With t->q8_rs set, the row written (xb[i]) is also quantized into
 * row i of mm_scratch for es_matmul_many_pre: in the same task, on the same
 * thread, instead of a dispatch of its own. */
static void token_row(const rows_task *t, int i) {
    es_session *s = t->c->s;
    int l = t->l, op = t->op;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    size_t e = (size_t)in->n_embd;
    const es_tensor *wt = op == ROWS_NORM_ATTN ? L->attn_norm : op == ROWS_NORM_FFN ? L->ffn_norm : m->output_norm;
    int row = op == ROWS_NORM_OUT ? head_row(t->c, i) : i;
    float *x = s->x + (size_t)row * e;
    if (t->c->pending_out) {
        float *o = s->out + (size_t)row * e;
        /* the sublayer that wrote out: the previous layer's (or the last
         * layer's) FFN before an attention (or the output) norm, this
         * layer's attention before its FFN norm */
        const es_tensor *pn = op == ROWS_NORM_FFN ? L->attn_post_norm
                            : op == ROWS_NORM_ATTN ? (l > 0 ? m->layers[l - 1].ffn_post_norm : NULL)
                                                   : m->layers[in->n_layer - 1].ffn_post_norm;
        if (pn) rmsnorm(o, o, es_model_vec(m, pn), in->n_embd, in->norm_eps);
        for (size_t k = 0; k < e; k++) x[k] += o[k];
    }
    rmsnorm(s->xb + (size_t)i * e, x, es_model_vec(m, wt), in->n_embd, in->norm_eps);
    if (t->q8_rs)
        es_quantize_row_act(t->q8_type, s->xb + (size_t)i * e, in->n_embd, (uint8_t *)s->mm_scratch + (size_t)i * t->q8_rs);
}

/* The q/k/v matmul's epilogue (es_matmul_many_epi, chunks of whole heads),
 * for rows [r0, r1) of matrix mat (0 q, 1 k, 2 v) of every token i, by the
 * thread that computed them: the bias, the head's RMSNorm (qwen3, q and k),
 * RoPE at the row's position (q and k); k and v then go to its session's KV
 * cache (rounded to F16 there). The same operations per element as one
 * token's row at a time. */
/* What an epilogue of a step's matmul needs: the session, the layer, the
 * tokens of the step and (glu_epi) the bytes of a quantized row. */
typedef struct {
    es_session *s;
    int l, n;
    size_t rs;
    const fwd_call *c;      /* qkv_epi: the sessions of the rows */
} epi_task;

static void qkv_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    es_session *s = t->s;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[t->l];
    int hd = in->head_dim;
    size_t q_dim = (size_t)in->n_head * hd, kv_dim = (size_t)in->n_head_kv * hd;
    size_t dim = mat == 0 ? q_dim : kv_dim;
    float *base = mat == 0 ? s->q : mat == 1 ? s->k : s->v;
    const es_tensor *bt = mat == 0 ? L->bq : mat == 1 ? L->bk : L->bv;
    const es_tensor *nt = mat == 0 ? L->q_norm : mat == 1 ? L->k_norm : NULL;
    const float *b = bt ? es_model_vec(m, bt) : NULL, *hn = nt ? es_model_vec(m, nt) : NULL;
    const fwd_seg *g = t->c->seg;
    for (int i = 0; i < t->n; i++) {
        while (i >= g->row0 + g->n) g++;
        es_kv *kv = &g->seq->kv;
        float *y = base + (size_t)i * dim;
        if (b)
            for (int64_t r = r0; r < r1; r++) y[r] += b[r];
        if (mat < 2) {
            const float *cs = s->rope + ((size_t)i * 2 + (size_t)L->swa) * (size_t)in->rope_dim;
            for (int64_t h = r0 / hd; h < (r1 + hd - 1) / hd; h++) {
                float *yh = y + (size_t)h * hd;
                if (hn) rmsnorm(yh, yh, hn, hd, in->norm_eps);
                rope_head(yh, cs, in->rope_dim, in->rope_neox);
            }
        }
        if (mat == 1) es_kv_put_k(kv, t->l, kv->n_past + (i - g->row0), r0, r1, y);
        else if (mat == 2) es_kv_put_v(kv, t->l, kv->n_past + (i - g->row0), r0, r1, y);
    }
}

static void rows_worker(void *ctx, int ith, int nth) {
    rows_task *t = ctx;
    for (int i; (i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n;) token_row(t, i);
}

/* token_row for i in [0, n) (rows quantized for weight type q8_type, q8_rs
 * bytes apart, 0: not): on the calling thread for one token, on the pool for
 * several. Clears the pending residual after a norm. */
static void run_rows(fwd_call *c, int l, int n, int op, size_t q8_rs, uint32_t q8_type) {
    rows_task t = {.c = c, .l = l, .n = n, .op = op, .q8_rs = q8_rs, .q8_type = q8_type};
    if (n > 1) es_pool_run(c->s->pool, rows_worker, &t);
    else rows_worker(&t, 0, 1);
    c->pending_out = 0;
}

/* Bytes of a quantized row of n_in for the matrices w[0..nw) when the rows
 * of a step (n > 1, run on the pool) are to be quantized by run_rows, and in
 * *type the weight type whose activation format they take; 0 when one token
 * (run on the calling thread, nothing to save), all float, or the quantized
 * matrices need both formats (32-element and K-type activations: the matmul
 * then quantizes per format). */
static size_t pre_q8_rs(int n, int nw, const es_tensor *const *w, uint32_t *type) {
    size_t rs = 0;
    for (int i = 0; i < nw && n >= 2; i++) {
        size_t r = es_matmul_q8_row_bytes(w[i]->type, w[i]->ne[0]);
        if (r == 0) continue;
        if (rs && es_act_block_elems(w[i]->type) != es_act_block_elems(*type)) return 0;
        rs = r;
        *type = w[i]->type;
    }
    return rs;
}


/* Attention sublayer of one block: x += Wo . attn(norm(x)). */
static void attention_block(fwd_call *c, int l) {
    es_session *s = c->s;
    int n = c->n;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    int hd = in->head_dim, q_dim = in->n_head * hd, kv_dim = in->n_head_kv * hd;
    const es_tensor *wqkv[3] = {L->wq, L->wk, L->wv};
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(n, 3, wqkv, &qt8);
    run_rows(c, l, n, ROWS_NORM_ATTN, rs, qt8);
    /* Ask for this layer's cached K and V rows now: they arrive in cache while
     * the q/k/v matmul streams its weights, instead of one memory latency at
     * a time in the attention (the weight stream of the last step pushed
     * them out of every cache). */
    for (int k = 0; k < c->nseg; k++) {
        const es_kv *kv = &c->seg[k].seq->kv;
        int32_t used = (kv->n_past + ES_KV_BLOCK - 1) / ES_KV_BLOCK;
        if (used > kv->layer[l].nb) used = kv->layer[l].nb;   /* a ring: all of it */
        if ((size_t)used * kv->blk_bytes * (size_t)kv->n_head_kv <= EARLY_KV_PREFETCH)
            es_kv_prefetch(kv, l, used);   /* longer contexts: sequential streams, left to the hardware */
    }
    /* q [n][q_dim], k [n][kv_dim], v [n][kv_dim] in one dispatch */
    float *yqkv[3] = {s->q, s->k, s->v};
    int64_t ldqkv[3] = {q_dim, kv_dim, kv_dim};
    /* biases, q/k norms, RoPE, and k and v into the caches in the epilogue */
    epi_task qt = {s, l, n, 0, c};
    es_mm_epi epi = {.fn = qkv_epi, .ctx = &qt, .joint = 0, .gran = hd};
    es_matmul_many_epi(s->pool, 3, wqkv, s->xb, n, yqkv, ldqkv, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wo[1] = {L->wo};
    float *yo[1] = {s->out};
    int64_t ldo[1] = {in->n_embd};
    /* each session's attention over its own KV cache, all in one dispatch */
    size_t wo_rs = es_matmul_q8_row_bytes(L->wo->type, L->wo->ne[0]);
    if (c->seg[0].tree) {   /* a token tree (tree.c), then its rows quantized for W_o as the units do */
        es_tree_attention(s, c->seg[0].tree, l);
        for (int i = 0; wo_rs && i < n; i++)
            es_quantize_row_act(L->wo->type, s->att + (size_t)i * q_dim, q_dim, (uint8_t *)s->mm_scratch + (size_t)i * wo_rs);
        if (wo_rs) es_matmul_many_pre(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
        else es_matmul_many(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
        c->pending_out = 1;
        return;
    }
    attn_task at[ES_MAX_BATCH];
    attn_batch ab = {.s = s, .t = at, .nt = c->nseg};
    for (int k = 0; k < c->nseg; k++) {
        const fwd_seg *g = &c->seg[k];
        at[k] = (attn_task){.s = s, .seq = g->seq, .row0 = g->row0, .layer = l, .n = g->n, .rs = wo_rs};
        ab.end[k] = (k ? ab.end[k - 1] : 0) + es_attn_shape(s, &at[k]);
    }
    atomic_store_explicit(&ab.next, 0, memory_order_relaxed);
    es_pool_run(s->pool, es_attn_worker, &ab);
    if (wo_rs) es_matmul_many_pre(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    else es_matmul_many(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    c->pending_out = 1;            /* x += out: done by the next norm, per token */
}

/* The epilogue of the gate/up matmul (es_matmul_many_epi), for the
 * columns [r0, r1) of every token's row, by the thread that computed them:
 * gate = silu(gate) * up (gemma3: gelu(gate) * up), then its blocks quantized for W_down into glu_q8
 * when W_down is quantized (rs bytes a row). */
static void glu_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t n_ff = s->model->info.n_ff;
    for (int i = 0; i < t->n; i++) {
        float *g = s->gate + (size_t)i * (size_t)n_ff;
        if (s->model->gelu) gelu_row(g + r0, s->up + (size_t)i * (size_t)n_ff + r0, (size_t)(r1 - r0));
        else swiglu_row(g + r0, s->up + (size_t)i * (size_t)n_ff + r0, (size_t)(r1 - r0));
        if (t->rs)
            es_quantize_cols_act(s->model->layers[t->l].w_down->type, g, n_ff, r0, r1,
                                 (uint8_t *)s->glu_q8 + (size_t)i * t->rs);
    }
}

/* FFN sublayer: x += W_down . (silu(W_gate . norm(x)) * (W_up . norm(x))). */
static void ffn_block(fwd_call *c, int l) {
    es_session *s = c->s;
    int n = c->n;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    if (L->exp_gate) {   /* mixture of experts (moe.c) */
        run_rows(c, l, n, ROWS_NORM_FFN, 0, 0);
        es_moe_ffn(s, l, n);
        c->pending_out = 1;
        return;
    }
    const es_tensor *wgu[2] = {L->w_gate, L->w_up};              /* gate, up [n][n_ff] */
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(n, 2, wgu, &qt8);
    run_rows(c, l, n, ROWS_NORM_FFN, rs, qt8);
    float *ygu[2] = {s->gate, s->up};
    int64_t ldgu[2] = {in->n_ff, in->n_ff};
    /* SwiGLU and its quantization for W_down in the matmul's epilogue, by
     * the thread that computed those columns, while they are in its cache;
     * chunks of whole activation blocks of W_down's format (K types: 256) */
    epi_task g = {s, l, n, es_matmul_q8_row_bytes(L->w_down->type, in->n_ff), c};
    int64_t gran = es_act_block_elems(L->w_down->type) > ES_EPI_ROWS ? es_act_block_elems(L->w_down->type) : ES_EPI_ROWS;
    es_mm_epi epi = {.fn = glu_epi, .ctx = &g, .joint = 1, .gran = g.rs ? gran : ES_EPI_ROWS};
    es_matmul_many_epi(s->pool, 2, wgu, s->xb, n, ygu, ldgu, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wd[1] = {L->w_down};
    int64_t ldd[1] = {in->n_embd};
    float *yd[1] = {s->out};
    if (g.rs) es_matmul_many_pre(s->pool, 1, wd, s->gate, n, yd, ldd, s->glu_q8);
    else es_matmul_many(s->pool, 1, wd, s->gate, n, yd, ldd, s->mm_scratch);
    c->pending_out = 1;
}

/* Output-matmul epilogue, local form (es_mm_epi.local_fn): for logits
 * columns [r0, r1) of every head row i, at y[i * ldl + (r - r0)], the value
 * and index of the first largest logit in slot r0 / ES_EPI_ROWS, or index
 * -1 when a logit of the chunk is NaN (no order puts a NaN above or below
 * the others, so the row has no argmax: am_combine reports it). */
static void am_local(void *ctx, int mat, int64_t r0, int64_t r1, const float *y, int64_t ldl) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t len = r1 - r0;
    for (int i = 0; i < t->n; i++) {
        const float *row = y + (size_t)i * (size_t)ldl;   /* logit r at row[r - r0] */
        size_t slot = (size_t)i * (size_t)s->am_slots + (size_t)(r0 / ES_EPI_ROWS);
        int nan = 0;
        for (int64_t k = 0; k < len; k++) nan |= row[k] != row[k];
        int32_t idx = nan ? -1 : argmax_row(row, (int)len);
        s->am_idx[slot] = nan ? -1 : (int32_t)r0 + idx;
        s->am_val[slot] = nan ? 0.0f : row[idx];
    }
}

/* The same over the logits written to s->logits (es_mm_epi.fn). */
static void am_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    const es_session *s = t->s;
    am_local(ctx, mat, r0, r1, s->logits + r0, s->model->info.n_vocab);
}

/* argmax_row of logits row i from the chunks' results: the first index of
 * the largest logit (chunks in order, a later chunk only when strictly
 * larger), or -1 when a chunk holds a NaN (am_local's index -1; the slots
 * no chunk wrote hold output_head's 0xFEFEFEFE, also negative). */
static int32_t am_combine(const es_session *s, int i) {
    for (int32_t c = 0; c < s->am_slots; c++)
        if (s->am_idx[(size_t)i * (size_t)s->am_slots + (size_t)c] == -1) return -1;
    int32_t best = -1;
    float bv = 0.0f;
    for (int32_t c = 0; c < s->am_slots; c++) {
        size_t slot = (size_t)i * (size_t)s->am_slots + (size_t)c;
        int32_t idx = s->am_idx[slot];
        if (idx < 0) continue;
        if (best < 0 || s->am_val[slot] > bv) {
            best = idx;
            bv = s->am_val[slot];
        }
    }
    return best < 0 ? 0 : best;
}

static es_status check_forward_args_ex(es_session *s, const int32_t *tokens, int32_t n,
                                       float *logits_out, int32_t mode, int allow_embd) {
    const es_model_info *in = &s->model->info;
    if (!tokens || n <= 0) {
        es_set_err(s->err, sizeof s->err, "forward needs n_tokens >= 1 (got %d)", (int)n);
        return ES_ERR_INVALID_ARG;
    }
    if ((mode != ES_LOGITS_NONE && mode != ES_LOGITS_LAST && mode != ES_LOGITS_ALL) ||
        (mode != ES_LOGITS_NONE && !logits_out)) {
        es_set_err(s->err, sizeof s->err, "logits_mode %d invalid or logits_out NULL", (int)mode);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < n; i++) {
        if (allow_embd && tokens[i] == ES_TOKEN_EMBD) continue;
        if (tokens[i] < 0 || tokens[i] >= in->n_vocab) {
            es_set_err(s->err, sizeof s->err, "token %d at index %d outside the vocabulary [0, %d)",
                       (int)tokens[i], (int)i, (int)in->n_vocab);
            return ES_ERR_INVALID_ARG;
        }
    }
    if ((int64_t)s->kv.n_past + n > es_kv_capacity(&s->kv)) {
        es_set_err(s->err, sizeof s->err, "KV cache full: n_past %d + %d tokens > %s %d",
                   (int)s->kv.n_past, (int)n, s->kv.evict ? "the last position" : "n_ctx",
                   (int)es_kv_capacity(&s->kv));
        return ES_ERR_CAPACITY;
    }
    return ES_OK;
}

static es_status check_forward_args(es_session *s, const int32_t *tokens, int32_t n,
                                    float *logits_out, int32_t mode) {
    return check_forward_args_ex(s, tokens, n, logits_out, mode, 0);
}

/* Deepstack (es_forward_embd): after text layer l, the rows of embedding inputs get their
 * segment's deepstack row of layer l added to the hidden state. The FFN's output is still
 * pending (x += out at the next norm): it is added first, then the deepstack row, so each such
 * row is (x + out) + ds as in transformers; out is zeroed (the next norm adds 0). */
static void deepstack_add(fwd_call *c, int l) {
    es_session *s = c->s;
    const size_t e = (size_t)s->model->info.n_embd;
    for (int k = 0; k < c->nseg; k++) {
        const fwd_seg *g = &c->seg[k];
        if (!g->ds || l >= g->n_ds) continue;
        int j = 0;
        for (int i = 0; i < g->n; i++) {
            if (g->tokens[i] != ES_TOKEN_EMBD) continue;
            float *x = s->x + (size_t)(g->row0 + i) * e, *o = s->out + (size_t)(g->row0 + i) * e;
            const float *d = g->ds + ((size_t)l * (size_t)g->ds_stride + (size_t)j++) * e;
            for (size_t q = 0; q < e; q++) {
                x[q] += o[q];
                x[q] += d[q];
                o[q] = 0.0f;
            }
        }
    }
}

/* The output head over the call's out_rows head rows (head_row): the pending
 * residual and the output norm (run_rows ROWS_NORM_OUT, which quantizes
 * the rows for the head), then logits [out_rows][n_vocab] = W_out . xb in
 * one matmul over all the head rows (a verify's K + 1 rows read each weight
 * group once), whose epilogue takes the argmax of each chunk of logits on
 * the thread that computed it (am_combine then picks the first largest).
 * When no session wants logits (want_logits 0), the chunks go to the
 * thread's buffer in s->head_tmp instead of s->logits (am_local): no logits
 * row is written. A head row whose normed input holds a NaN or an infinity
 * is marked as a NaN row too (am_combine gives -1): a quantized head could
 * turn it into zeros or finite garbage (es_quantize_row_act keeps NaN out of
 * a block's scale), and a NaN anywhere in the residual stream makes the
 * whole normed row NaN. */
static void output_head(fwd_call *c, int out_rows, int want_logits) {
    es_session *s = c->s;
    const es_model *m = s->model;
    const es_tensor *wout[1] = {m->output};
    float *ylog[1] = {s->logits};
    int64_t ldlog[1] = {m->info.n_vocab};
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(out_rows, 1, wout, &qt8);
    run_rows(c, 0, out_rows, ROWS_NORM_OUT, rs, qt8);
    memset(s->am_idx, 0xFE, (size_t)out_rows * (size_t)s->am_slots * sizeof(int32_t));
    epi_task at = {s, 0, out_rows, 0, c};
    es_mm_epi epi = {.fn = am_epi, .ctx = &at, .joint = 1, .gran = ES_EPI_ROWS};
    if (!want_logits)
        epi = (es_mm_epi){.ctx = &at, .gran = ES_EPI_ROWS, .local_fn = am_local, .local = s->head_tmp,
                          .local_floats = s->head_tmp_floats};
    es_matmul_many_epi(s->pool, 1, wout, s->xb, out_rows, ylog, ldlog, s->mm_scratch, rs != 0, &epi);
    size_t e = (size_t)m->info.n_embd;
    for (int i = 0; i < out_rows; i++) {
        const float *xr = s->xb + (size_t)i * e;
        int nan = 0;
        for (size_t k = 0; k < e; k++) nan |= !(xr[k] - xr[k] == 0.0f);   /* NaN or +-inf */
        if (nan) s->am_idx[(size_t)i * (size_t)s->am_slots] = -1;
    }
}

/*
 * The forward pass over the rows of the sessions seg[0..nseg) (in row order,
 * covering [0, n) with n their total tokens; the output head runs on each
 * one's last head_n rows), on the pool and scratch of s. Arguments are
 * checked by the callers; on failure every KV cache is unchanged.
 *
 * The stages are in the map at the top of this file.
 */
static es_status forward_impl(es_session *s, const fwd_seg *seg, int nseg) {
    int n = seg[nseg - 1].row0 + seg[nseg - 1].n, out_rows = seg[nseg - 1].head0 + seg[nseg - 1].head_n;
    es_status st;
    if ((st = es_session_ensure_scratch(s, n)) != ES_OK) return st;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    fwd_call c = {.s = s, .n = n, .seg = seg, .nseg = nseg};
    s->moe_experts_read = 0;
    for (int k = 0; k < nseg; k++) seg[k].seq->tree_n = 0;   /* the rows overwrite a tree's slots */

    for (int k = 0; k < nseg; k++)   /* embedding */
        for (int i = 0, j = 0; i < seg[k].n; i++) {
            if (seg[k].tokens[i] == ES_TOKEN_EMBD) {   /* es_forward_embd: the given row */
                memcpy(s->x + (size_t)(seg[k].row0 + i) * in->n_embd, seg[k].embd + (size_t)j++ * in->n_embd,
                       (size_t)in->n_embd * sizeof(float));
                continue;
            }
            const uint8_t *row = (const uint8_t *)m->tok_embd->data + (size_t)seg[k].tokens[i] * m->tok_embd->row_bytes;
            float *x = s->x + (size_t)(seg[k].row0 + i) * in->n_embd;
            es_dequantize_row(m->tok_embd->type, row, x, in->n_embd);
            if (m->emb_scale != 0.0f)   /* gemma3: times sqrtf(n_embd), as llama.cpp's ggml_scale */
                for (int d = 0; d < in->n_embd; d++) x[d] *= m->emb_scale;
        }
    fill_rope_table(&c);
    es_pool_begin(s->pool);
    for (int l = 0; l < in->n_layer; l++) {
        attention_block(&c, l);     /* norm, q/k/v + RoPE + KV append, attention, output projection */
        ffn_block(&c, l);           /* norm, gate/up + SwiGLU, down projection */
        deepstack_add(&c, l);       /* es_forward_embd's deepstack rows (none otherwise) */
    }
    int want_logits = 0;
    for (int k = 0; k < nseg; k++) want_logits |= seg[k].logits_mode != ES_LOGITS_NONE;
    if (out_rows > 0)   /* none: a piece of a longer call (forward_run) that wants only its last row */
        output_head(&c, out_rows, want_logits);
    es_pool_end(s->pool);

    es_status ret = ES_OK;
    for (int k = 0; k < nseg; k++) {
        const fwd_seg *g = &seg[k];
        int bad = -1;
        for (int i = 0; i < g->head_n && bad < 0; i++)
            if (am_combine(s, g->head0 + i) < 0) bad = i;
        if (bad >= 0) {   /* its KV cache is not advanced: n_past as before */
            es_set_err(g->seq->err, sizeof g->seq->err, "the logits of position %d hold a NaN (or the output "
                       "head's input is not finite), so no token can be chosen; the model's weights are corrupt",
                       (int)(g->seq->kv.n_past + g->n - g->head_n + bad));
            if (g->status) *g->status = ES_ERR_BAD_WEIGHTS;
            ret = ES_ERR_BAD_WEIGHTS;
            continue;
        }
        if (g->argmax_out)
            for (int i = 0; i < g->head_n; i++) g->argmax_out[i] = am_combine(s, g->head0 + i);
        if (g->logits_mode == ES_LOGITS_LAST)
            memcpy(g->logits_out, s->logits + (size_t)(g->head0 + g->head_n - 1) * in->n_vocab,
                   (size_t)in->n_vocab * sizeof(float));
        else if (g->logits_mode == ES_LOGITS_ALL)
            memcpy(g->logits_out, s->logits + (size_t)g->head0 * in->n_vocab,
                   (size_t)g->head_n * in->n_vocab * sizeof(float));
        if (g->tree) {   /* the nodes stay in their slots for es_session_keep_path; n_past stays */
            g->seq->tree_n = g->n;
            g->seq->tree_past = g->seq->kv.n_past;
            memcpy(g->seq->tree_parent, g->tree->parent, (size_t)g->n * sizeof(int32_t));
        } else {
            es_kv_advance(&g->seq->kv, g->n);
        }
        g->seq->err[0] = '\0';
    }
    return ret;
}

/* Piece k of segment g, which starts done tokens in: rows [row0, row0 + n)
 * of the piece's call and head rows from head0. An ES_HEAD_ALL segment
 * (head_n == n) keeps the head of every row, the others only the last
 * piece's last row; logits go where the whole call would have written them. */
static fwd_seg seg_piece(const fwd_seg *g, int done, int n, int row0, int head0, int32_t n_vocab) {
    int all = g->head_n == g->n, last = done + n == g->n;
    fwd_seg q = *g;
    q.tokens = g->tokens + done;
    q.pos_thw = g->pos_thw ? g->pos_thw + 3 * (size_t)done : NULL;
    if (g->embd) {   /* the embedding rows before this piece */
        size_t before = 0;
        for (int i = 0; i < done; i++) before += g->tokens[i] == ES_TOKEN_EMBD;
        size_t e = (size_t)g->seq->model->info.n_embd;
        q.embd = g->embd + before * e;
        q.ds = g->ds ? g->ds + before * e : NULL;
    }
    q.row0 = row0;
    q.n = n;
    q.head0 = head0;
    q.head_n = all ? n : last ? 1 : 0;
    if (q.head_n == 0) {
        q.argmax_out = NULL;
        q.logits_mode = ES_LOGITS_NONE;
    } else if (all) {
        if (q.argmax_out) q.argmax_out += done;
        if (q.logits_mode == ES_LOGITS_ALL) q.logits_out += (size_t)done * (size_t)n_vocab;
        else if (q.logits_mode == ES_LOGITS_LAST && !last) q.logits_mode = ES_LOGITS_NONE;
    }
    return q;
}

/*
 * forward_impl over seg[0..nseg), in pieces where a session's KV cache
 * limits the tokens one forward writes (es_kv.piece: a sliding-window ring
 * holds the window plus that many positions): each round runs the next piece
 * of every segment that has tokens left. A position's results do not depend
 * on how the tokens before it were split into calls (the contract at the
 * top), so the pieces give bitwise the results of one call. The first round
 * has the most rows, so the scratch it sizes serves the others: only it can
 * fail (ES_ERR_NOMEM), before anything runs. A segment whose head row holds a
 * NaN (ES_ERR_BAD_WEIGHTS in its status) stops there and is rolled back to
 * its n_past before the call (where its rings still reach it, es_kv_min_past).
 */
static es_status forward_run(es_session *s, const fwd_seg *seg, int nseg) {
    int split = 0;
    for (int k = 0; k < nseg; k++) {
        int32_t lim = seg[k].seq->kv.piece;
        split |= lim > 0 && seg[k].n > lim;
    }
    if (!split) return forward_impl(s, seg, nseg);
    int done[ES_MAX_BATCH] = {0};
    int32_t past0[ES_MAX_BATCH];
    es_status pst[ES_MAX_BATCH], ret = ES_OK;
    for (int k = 0; k < nseg; k++) {
        past0[k] = seg[k].seq->kv.n_past;
        pst[k] = ES_OK;
    }
    for (;;) {
        fwd_seg p[ES_MAX_BATCH];
        int np = 0, rows = 0, heads = 0;
        for (int k = 0; k < nseg; k++) {
            int rem = seg[k].n - done[k], lim = seg[k].seq->kv.piece;
            if (rem <= 0) continue;   /* finished, or stopped by a NaN */
            int n = lim > 0 && rem > lim ? lim : rem;
            p[np] = seg_piece(&seg[k], done[k], n, rows, heads, s->model->info.n_vocab);
            p[np].status = &pst[k];
            rows += n;
            heads += p[np++].head_n;
            done[k] += n;
        }
        if (np == 0) return ret;
        es_status st = forward_impl(s, p, np);
        if (st != ES_OK && st != ES_ERR_BAD_WEIGHTS) return st;
        for (int k = 0; k < nseg && st != ES_OK; k++) {
            if (pst[k] == ES_OK || done[k] == seg[k].n + 1) continue;
            char tmp[8];   /* a rollback the rings no longer reach leaves n_past after the last piece */
            es_kv_rollback(&seg[k].seq->kv, past0[k], tmp, sizeof tmp);
            done[k] = seg[k].n + 1;   /* marks it finished and reported */
            if (seg[k].status) *seg[k].status = ES_ERR_BAD_WEIGHTS;
            ret = ES_ERR_BAD_WEIGHTS;
        }
    }
}

es_status es_forward(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_out,
                     float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_forward_args(s, tokens, n, logits_out, logits_mode);
    if (st != ES_OK) return st;
    fwd_seg g = {s, tokens, 0, n, 0, n, argmax_out, logits_out, logits_mode, NULL, NULL, NULL, NULL, NULL, 0, 0};
    return forward_run(s, &g, 1);
}

es_status es_forward_tree_run(es_session *s, const int32_t *tokens, const int32_t *pos_thw, const es_tree *t,
                              int32_t *argmax_out, float *logits_out, int32_t logits_mode) {
    es_status st = check_forward_args(s, tokens, t->n, logits_out, logits_mode);
    if (st != ES_OK) return st;
    fwd_seg g = {s, tokens, 0, t->n, 0, t->n, argmax_out, logits_out, logits_mode, pos_thw, NULL, t, NULL, NULL, 0, 0};
    return forward_impl(s, &g, 1);
}

es_status es_forward_positions(es_session *s, const int32_t *tokens, int32_t n, const int32_t *pos_thw,
                               int32_t *argmax_out, float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_forward_args(s, tokens, n, logits_out, logits_mode);
    if (st != ES_OK) return st;
    for (int32_t i = 0; pos_thw && i < 3 * n; i++)
        if (pos_thw[i] < 0) {
            es_set_err(s->err, sizeof s->err, "position %d of token %d is negative (%d)", (int)(i % 3),
                       (int)(i / 3), (int)pos_thw[i]);
            return ES_ERR_INVALID_ARG;
        }
    fwd_seg g = {s, tokens, 0, n, 0, n, argmax_out, logits_out, logits_mode, pos_thw, NULL, NULL, NULL, NULL, 0, 0};
    return forward_run(s, &g, 1);
}

es_status es_forward_embd(es_session *s, const int32_t *tokens, int32_t n, const int32_t *pos_thw,
                          const float *embd, int32_t n_embd_rows, const float *deepstack, int32_t n_deepstack,
                          int32_t *argmax_out, float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_forward_args_ex(s, tokens, n, logits_out, logits_mode, 1);
    if (st != ES_OK) return st;
    const es_model *m = s->model;
    int32_t rows = 0;
    for (int32_t i = 0; i < n; i++) rows += tokens[i] == ES_TOKEN_EMBD;
    if (rows != n_embd_rows || (n_embd_rows > 0 && !embd)) {
        es_set_err(s->err, sizeof s->err, "es_forward_embd: %d tokens are ES_TOKEN_EMBD but n_embd_rows is %d%s",
                   (int)rows, (int)n_embd_rows, n_embd_rows > 0 && !embd ? " and embd is NULL" : "");
        return ES_ERR_INVALID_ARG;
    }
    if (n_deepstack < 0 || n_deepstack > m->info.n_layer || (n_deepstack > 0) != (deepstack != NULL)) {
        es_set_err(s->err, sizeof s->err, "es_forward_embd: n_deepstack %d (deepstack %s) outside [0, n_layer %d]",
                   (int)n_deepstack, deepstack ? "given" : "NULL", (int)m->info.n_layer);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t l = 0; l < n_deepstack; l++)
        if (m->layers[l].ffn_post_norm) {
            es_set_err(s->err, sizeof s->err, "es_forward_embd: deepstack on a model with FFN post-norms");
            return ES_ERR_UNSUPPORTED;
        }
    for (int32_t i = 0; pos_thw && i < 3 * n; i++)
        if (pos_thw[i] < 0) {
            es_set_err(s->err, sizeof s->err, "position %d of token %d is negative (%d)", (int)(i % 3),
                       (int)(i / 3), (int)pos_thw[i]);
            return ES_ERR_INVALID_ARG;
        }
    fwd_seg g = {s, tokens, 0, n, 0, n, argmax_out, logits_out, logits_mode, pos_thw, NULL, NULL,
                 rows ? embd : NULL, n_deepstack ? deepstack : NULL, rows, n_deepstack};
    return forward_run(s, &g, 1);
}

es_status es_forward_last(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_last,
                          float *logits_last) {
    if (!s) return ES_ERR_INVALID_ARG;
    int32_t mode = logits_last ? ES_LOGITS_LAST : ES_LOGITS_NONE;
    es_status st = check_forward_args(s, tokens, n, logits_last, mode);
    if (st != ES_OK) return st;
    fwd_seg g = {s, tokens, 0, n, 0, 1, argmax_last, logits_last, mode, NULL, NULL, NULL, NULL, NULL, 0, 0};
    return forward_run(s, &g, 1);
}

/* Item i's own checks (es_forward_batch's contract), with m the batch's model;
 * the message goes on its session. */
static es_status check_batch_item(const es_batch_item *items, int32_t n_items, int32_t i, const es_model *m) {
    const es_batch_item *it = &items[i];
    es_session *q = it->session;
    if (!q) return ES_ERR_INVALID_ARG;
    if (q->model != m) {
        es_set_err(q->err, sizeof q->err, "batch item %d: its session is on another model than the batch's",
                   (int)i);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t j = 0; j < n_items; j++)
        if (j != i && items[j].session == q) {
            es_set_err(q->err, sizeof q->err, "batch items %d and %d have the same session", (int)i, (int)j);
            return ES_ERR_INVALID_ARG;
        }
    if (it->head != ES_HEAD_ALL && it->head != ES_HEAD_LAST) {
        es_set_err(q->err, sizeof q->err, "batch item %d: head %d is not ES_HEAD_ALL or ES_HEAD_LAST",
                   (int)i, (int)it->head);
        return ES_ERR_INVALID_ARG;
    }
    return check_forward_args(q, it->tokens, it->n_tokens, it->logits_out, it->logits_mode);
}

es_status es_forward_batch(es_batch_item *items, int32_t n_items) {
    if (!items || n_items < 1 || n_items > ES_MAX_BATCH) return ES_ERR_INVALID_ARG;
    const es_model *m = NULL;
    for (int32_t i = 0; i < n_items && !m; i++)
        if (items[i].session) m = items[i].session->model;
    fwd_seg seg[ES_MAX_BATCH];
    int nseg = 0, rows = 0, heads = 0;
    for (int32_t i = 0; i < n_items; i++) {
        es_batch_item *it = &items[i];
        it->status = check_batch_item(items, n_items, i, m);
        if (it->status != ES_OK) continue;
        int head_n = it->head == ES_HEAD_LAST ? 1 : it->n_tokens;
        seg[nseg++] = (fwd_seg){it->session, it->tokens, rows, it->n_tokens, heads, head_n,
                                it->argmax_out, it->logits_out, it->logits_mode, NULL, &it->status, NULL,
                                NULL, NULL, 0, 0};
        rows += it->n_tokens;
        heads += head_n;
    }
    if (nseg > 0) {
        es_session *run = seg[0].seq;
        es_status st = forward_run(run, seg, nseg);
        if (st != ES_OK && st != ES_ERR_BAD_WEIGHTS)   /* the scratch: nothing ran (a NaN: in its item's status) */
            for (int32_t i = 0; i < n_items; i++)
                if (items[i].status == ES_OK) {
                    items[i].status = st;
                    if (items[i].session != run) es_set_err(items[i].session->err, sizeof items[i].session->err, "%s", run->err);
                }
    }
    for (int32_t i = 0; i < n_items; i++)
        if (items[i].status != ES_OK) return items[i].status;
    return ES_OK;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* Item i's own checks (es_decode_batch's contract); the message goes on its session. */
static es_status check_decode_item(const es_decode_item *items, int32_t n_items, int32_t i) {
    const es_decode_item *it = &items[i];
    es_session *q = it->session;
    if (!q) return ES_ERR_INVALID_ARG;
    if (!it->tokens_out || it->max_steps < 1 || it->n_stop < 0 || (it->n_stop > 0 && !it->stop_ids)) {
        es_set_err(q->err, sizeof q->err, "decode needs max_steps >= 1 (got %d), n_stop >= 0 (got %d)%s",
                   (int)it->max_steps, (int)it->n_stop,
                   !it->tokens_out ? " and tokens_out" : it->n_stop > 0 && !it->stop_ids ? " and stop_ids" : "");
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t j = 0; j < i; j++)
        if (items[j].session == q) {
            es_set_err(q->err, sizeof q->err, "decode items %d and %d have the same session", (int)j, (int)i);
            return ES_ERR_INVALID_ARG;
        }
    es_status st = check_forward_args(q, &it->token, 1, NULL, ES_LOGITS_NONE);
    if (st != ES_OK) return st;
    if ((int64_t)q->kv.n_past + it->max_steps > es_kv_capacity(&q->kv)) {   /* the whole run's room up front */
        es_set_err(q->err, sizeof q->err, "KV cache full: n_past %d + %d decode steps > %s %d",
                   (int)q->kv.n_past, (int)it->max_steps, q->kv.evict ? "the last position" : "n_ctx",
                   (int)es_kv_capacity(&q->kv));
        return ES_ERR_CAPACITY;
    }
    return ES_OK;
}

es_status es_decode_batch(es_decode_item *items, int32_t n_items, const int32_t *interrupt, float *ms_out,
                          int32_t *n_steps) {
    if (n_steps) *n_steps = 0;
    if (!items || n_items < 1 || n_items > ES_MAX_BATCH) return ES_ERR_INVALID_ARG;
    int32_t cur[ES_MAX_BATCH], live[ES_MAX_BATCH], n_live = 0;
    for (int32_t i = 0; i < n_items; i++) {
        items[i].n_out = 0;
        items[i].status = check_decode_item(items, n_items, i);
        if (items[i].status == ES_OK) {
            cur[i] = items[i].token;
            live[n_live++] = i;
        }
    }
    es_batch_item b[ES_MAX_BATCH];
    for (int32_t step = 0; n_live > 0; step++) {
        for (int32_t k = 0; k < n_live; k++) {
            es_decode_item *it = &items[live[k]];
            b[k] = (es_batch_item){.session = it->session, .tokens = &cur[live[k]], .n_tokens = 1,
                                   .head = ES_HEAD_ALL, .argmax_out = &it->tokens_out[step]};
        }
        double t0 = ms_out ? now_ms() : 0.0;
        es_forward_batch(b, n_live);
        if (ms_out) ms_out[step] = (float)(now_ms() - t0);
        if (n_steps) *n_steps = step + 1;
        int32_t kept = 0;
        for (int32_t k = 0; k < n_live; k++) {
            int32_t i = live[k];
            es_decode_item *it = &items[i];
            if (b[k].status != ES_OK) {   /* its KV cache as after its last step done */
                it->status = b[k].status;
                continue;
            }
            it->n_out = step + 1;
            cur[i] = it->tokens_out[step];
            int stop = it->n_out == it->max_steps;
            for (int32_t j = 0; j < it->n_stop && !stop; j++) stop = it->stop_ids[j] == cur[i];
            if (!stop) live[kept++] = i;
        }
        n_live = kept;
        if (interrupt && __atomic_load_n(interrupt, __ATOMIC_ACQUIRE)) break;
    }
    for (int32_t i = 0; i < n_items; i++)
        if (items[i].status != ES_OK) return items[i].status;
    return ES_OK;
}

es_status es_decode(es_session *s, int32_t token, int32_t max_steps, const int32_t *stop_ids, int32_t n_stop,
                    const int32_t *interrupt, int32_t *tokens_out, float *ms_out, int32_t *n_out) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (n_out) *n_out = 0;
    if (!n_out) {
        es_set_err(s->err, sizeof s->err, "decode needs n_out");
        return ES_ERR_INVALID_ARG;
    }
    es_decode_item it = {s, token, max_steps, stop_ids, n_stop, tokens_out, 0, ES_OK};
    es_status st = es_decode_batch(&it, 1, interrupt, ms_out, NULL);
    *n_out = it.n_out;
    return st;
}

const char *es_simd_name(void) { return es_quant_simd_name(); }

/* The most drafts a round of the run can verify: min(k, n_drafts, max_out - 1, the room in n_ctx
 * for the drafts after the pending token); a run writes at most that plus one positions a round. */
static int32_t verify_run_most_drafts(const es_session *s, const es_verify_run_args *a) {
    int32_t most = a->k < a->n_drafts ? a->k : a->n_drafts, ctx = s->kv.n_ctx - s->kv.n_past - 1;
    if (a->max_out - 1 < most) most = a->max_out - 1;
    return ctx < most ? ctx : most;
}

/* es_verify_run's checks before any round; the message goes on s. */
static es_status check_verify_run(es_session *s, const es_verify_run_args *a) {
    if (!a || !a->drafts || !a->tokens_out || !a->round_k || !a->round_r || a->n_drafts < 1 || a->k < 1 ||
        a->max_out < 2 || a->n_stop < 0 || (a->n_stop > 0 && !a->stop_ids)) {
        es_set_err(s->err, sizeof s->err,
                   "a verify run needs its args with drafts, tokens_out, round_k and round_r, n_drafts >= 1,"
                   " k >= 1, max_out >= 2 and n_stop >= 0 (with stop_ids)");
        return ES_ERR_INVALID_ARG;
    }
    if (s->kv.evict || s->sparse_topk > 0) {
        es_set_err(s->err, sizeof s->err, "a verify run needs a session without %s",
                   s->kv.evict ? "KV eviction" : "sparse attention");
        return ES_ERR_UNSUPPORTED;
    }
    int32_t n_vocab = s->model->info.n_vocab;
    for (int32_t i = -1; i < a->n_drafts; i++) {
        int32_t t = i < 0 ? a->token : a->drafts[i];
        if (t < 0 || t >= n_vocab) {
            if (i < 0) es_set_err(s->err, sizeof s->err, "token %d outside the vocabulary [0, %d)", (int)t, (int)n_vocab);
            else es_set_err(s->err, sizeof s->err, "draft %d at index %d outside the vocabulary [0, %d)", (int)t, (int)i,
                            (int)n_vocab);
            return ES_ERR_INVALID_ARG;
        }
    }
    if ((int64_t)s->kv.n_past + 2 > s->kv.n_ctx) {
        es_set_err(s->err, sizeof s->err, "KV cache full: n_past %d leaves no room for a round of one draft in n_ctx %d",
                   (int)s->kv.n_past, (int)s->kv.n_ctx);
        return ES_ERR_INVALID_ARG;
    }
    /* rings that wrap: a round of kr drafts must be able to roll back over all of them, and its
       forward to undo itself (kr + 1 positions), from the furthest position it wrote */
    int32_t most = verify_run_most_drafts(s, a), reach = s->kv.ring - s->kv.n_swa;
    if (s->kv.piece > 0 && most > reach) {
        es_set_err(s->err, sizeof s->err, "a round of %d drafts could not roll back: the sliding-window rings of "
                   "%d positions (window %d) let a round verify at most %d; lower k or raise swa_slack",
                   (int)most, (int)s->kv.ring, (int)s->kv.n_swa, (int)reach);
        return ES_ERR_INVALID_ARG;
    }
    return ES_OK;
}

es_status es_verify_run(es_session *s, es_verify_run_args *a) {
    if (a) {
        a->n_rounds = a->n_out = 0;
        a->n_past_in = s ? s->kv.n_past : -1;
    }
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_verify_run(s, a);
    if (st != ES_OK) return st;
    int32_t cap = verify_run_most_drafts(s, a);
    int32_t *buf = malloc(2 * ((size_t)cap + 1) * sizeof *buf), *am = buf + cap + 1;
    if (!buf) {
        es_set_err(s->err, sizeof s->err, "out of memory for a verify run of k %d", (int)a->k);
        return ES_ERR_NOMEM;
    }
    double t0 = now_ms();
    int32_t pending = a->token, pos = 0;
    for (;;) {
        int32_t kr = a->k, left = a->n_drafts - pos, room = a->max_out - a->n_out - 1;
        int32_t ctx = s->kv.n_ctx - s->kv.n_past - 1;
        if (left < kr) kr = left;
        if (room < kr) kr = room;
        if (ctx < kr) kr = ctx;
        if (kr < 1) break;   /* only after a round: the first has room (checked) */
        buf[0] = pending;
        memcpy(buf + 1, a->drafts + pos, (size_t)kr * sizeof *buf);
        int32_t n0 = s->kv.n_past;
        double f0 = now_ms();
        st = es_forward(s, buf, kr + 1, am, NULL, ES_LOGITS_NONE);
        if (st != ES_OK) break;
        double f1 = now_ms(), b1 = f1;
        int32_t r = 0;
        while (r < kr && am[r] == buf[r + 1]) r++;
        if (r < kr) {
            if ((st = es_session_rollback(s, n0 + 1 + r)) != ES_OK) break;
            b1 = now_ms();
        }
        int stop = 0;
        for (int32_t i = 0; i <= r; i++) {
            int32_t t = i < r ? buf[i + 1] : am[r];
            a->tokens_out[a->n_out++] = t;
            for (int32_t j = 0; j < a->n_stop; j++) stop |= a->stop_ids[j] == t;
        }
        a->round_k[a->n_rounds] = kr;
        a->round_r[a->n_rounds] = r;
        if (a->ms_out) a->ms_out[a->n_rounds] = (float)(f1 - f0);
        if (a->rollback_ms_out) a->rollback_ms_out[a->n_rounds] = (float)(b1 - f1);
        a->n_rounds++;
        /* on only while every draft was kept, the bonus is the next draft, and a whole round of k
           drafts follows it (a shorter rest is the caller's, to draft with more after it) */
        if (stop || r < kr || (int64_t)a->n_drafts - pos - kr - 1 < a->k || am[kr] != a->drafts[pos + kr]) break;
        if (a->max_ms > 0 && now_ms() - t0 >= a->max_ms) break;
        if (a->interrupt && __atomic_load_n(a->interrupt, __ATOMIC_ACQUIRE)) break;
        pending = am[kr];
        pos += kr + 1;
    }
    free(buf);
    return st;
}
