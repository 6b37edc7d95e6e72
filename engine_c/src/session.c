/*
 * session.c - the session's lifecycle: creation (KV cache, thread pool,
 * attention scratch), the scratch of a call sized on demand, rollback,
 * accessors. The forward pass is in forward.c, the KV cache in kv_cache.c.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "quant.h"


es_session_params es_session_default_params(void) {
    es_session_params p = {0, 0, 0, 0, 0, 0, 0, ES_KV_F16};
    return p;
}

static int online_cores(void) {
    long n = 1;
#ifdef _SC_NPROCESSORS_ONLN
    n = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (n < 1) n = 1;
    if (n > ES_MAX_THREADS) n = ES_MAX_THREADS;
    return (int)n;
}

static void free_scratch(es_session *s) {
    free(s->x); free(s->xb); free(s->q); free(s->k); free(s->v); free(s->att);
    free(s->gate); free(s->up); free(s->out); free(s->logits); free(s->rope);
    free(s->mm_scratch);
    free(s->glu_q8);
    free(s->am_val);
    free(s->am_idx);
    free(s->head_tmp);
    free((void *)s->att_done);
    s->att_done = NULL;
    s->glu_q8 = NULL;
    s->am_val = NULL;
    s->am_idx = NULL;
    s->head_tmp = NULL;
    s->head_tmp_floats = 0;
    s->x = s->xb = s->q = s->k = s->v = s->att = s->gate = s->up = s->out = NULL;
    s->logits = s->rope = NULL;
    s->mm_scratch = NULL;
    s->cap = 0;
    s->mm_bytes = 0;
}

static size_t max_scratch_bytes(const es_model *m, int n) {
    const es_model_info *in = &m->info;
    size_t b = 0, t;
    const es_layer *L = &m->layers[0];
    const es_tensor *ws[] = {L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down, m->output,
                             L->gate_inp};
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
        if (ws[i] == NULL) continue;   /* a mixture of experts has no dense FFN, a dense model no router */
        t = es_matmul_scratch_bytes(ws[i]->type, ws[i]->ne[0], n);
        if (t > b) b = t;
    }
    (void)in;
    return b;
}

/* Make room for n tokens per call. On failure the old buffers are kept. */
es_status es_session_ensure_scratch(es_session *s, int32_t n) {
    if (n <= s->cap) return ES_OK;
    const es_model_info *in = &s->model->info;
    size_t q_dim = (size_t)in->n_head * in->head_dim;
    size_t kv_dim = (size_t)in->n_head_kv * in->head_dim;
    size_t N = (size_t)n;
    size_t mm = max_scratch_bytes(s->model, n);
    size_t mm_alloc = (mm + 63) & ~(size_t)63;
    float *x = malloc(N * in->n_embd * sizeof(float));
    float *xb = malloc(N * in->n_embd * sizeof(float));
    float *q = malloc(N * q_dim * sizeof(float));
    float *k = malloc(N * kv_dim * sizeof(float));
    float *v = malloc(N * kv_dim * sizeof(float));
    float *att = malloc(N * q_dim * sizeof(float));
    float *gate = malloc(N * in->n_ff * sizeof(float));
    float *up = malloc(N * in->n_ff * sizeof(float));
    float *out = malloc(N * in->n_embd * sizeof(float));
    float *logits = malloc(N * in->n_vocab * sizeof(float));
    float *rope = malloc(N * 2 * in->rope_dim * sizeof(float) + sizeof(float));
    void *mms = aligned_alloc(64, mm_alloc ? mm_alloc : 64);
    size_t glu_alloc = (N * es_matmul_q8_row_bytes(ES_TYPE_Q8_0, in->n_ff) + 63) & ~(size_t)63;
    void *glu = aligned_alloc(64, glu_alloc ? glu_alloc : 64);
    if (glu) memset(glu, 0, glu_alloc ? glu_alloc : 64);
    size_t slots = ((size_t)in->n_vocab + ES_EPI_ROWS - 1) / ES_EPI_ROWS;
    float *am_val = malloc(N * slots * sizeof(float));
    int32_t *am_idx = malloc(N * slots * sizeof(int32_t));
    size_t ht = N * ES_EPI_ROWS > ES_HEAD_TMP_BYTES / sizeof(float) ? N * ES_EPI_ROWS : ES_HEAD_TMP_BYTES / sizeof(float);
    ht = (ht + 15) & ~(size_t)15;   /* each thread's buffer on its own cache lines */
    float *head_tmp = aligned_alloc(64, (size_t)s->n_threads * ht * sizeof(float));
    _Atomic int *att_done = malloc(N * sizeof *att_done);
    es_status moe = es_moe_scratch(s, n);
    if (moe != ES_OK || !x || !xb || !q || !k || !v || !att || !gate || !up || !out || !logits || !rope || !mms ||
        !glu || !am_val || !am_idx || !head_tmp || !att_done) {
        free(x); free(xb); free(q); free(k); free(v); free(att); free(gate); free(up);
        free(out); free(logits); free(rope); free(mms); free(glu); free(am_val); free(am_idx);
        free(head_tmp);
        free((void *)att_done);
        es_set_err(s->err, sizeof s->err, "out of memory for scratch of %d tokens", (int)n);
        return ES_ERR_NOMEM;
    }
    free_scratch(s);
    s->x = x; s->xb = xb; s->q = q; s->k = k; s->v = v; s->att = att;
    s->gate = gate; s->up = up; s->out = out; s->logits = logits; s->rope = rope;
    s->mm_scratch = mms;
    s->glu_q8 = glu;
    s->am_val = am_val;
    s->am_idx = am_idx;
    s->head_tmp = head_tmp;
    s->head_tmp_floats = ht;
    s->att_done = att_done;
    s->am_slots = (int32_t)slots;
    s->mm_bytes = mm;
    s->cap = n;
    return ES_OK;
}

es_status es_session_new(const es_model *model, const es_session_params *params,
                         es_session **out, char *err, size_t err_len) {
    if (out) *out = NULL;
    if (!model || !out) {
        es_set_err(err, err_len, "es_session_new: model and out must not be NULL");
        return ES_ERR_INVALID_ARG;
    }
    es_session_params p = params ? *params : es_session_default_params();
    if (p.n_ctx != 0 && (p.n_ctx < ES_MIN_CTX || p.n_ctx > ES_MAX_CTX)) {
        es_set_err(err, err_len, "n_ctx %d out of range [%d, %d] (0: the default)", (int)p.n_ctx,
                   ES_MIN_CTX, ES_MAX_CTX);
        return ES_ERR_INVALID_ARG;
    }
    if (p.n_threads < 0 || p.n_threads > ES_MAX_THREADS) {
        es_set_err(err, err_len, "n_threads %d out of range [0, %d]", (int)p.n_threads, ES_MAX_THREADS);
        return ES_ERR_INVALID_ARG;
    }
    if (p.swa_slack < 0 || p.swa_slack > ES_MAX_CTX) {
        es_set_err(err, err_len, "swa_slack %d out of range [0, %d] (0: the default %d)", (int)p.swa_slack,
                   ES_MAX_CTX, ES_SWA_SLACK);
        return ES_ERR_INVALID_ARG;
    }
    if (p.swa_full != 0 && p.swa_full != 1) {
        es_set_err(err, err_len, "swa_full %d is not 0 or 1", (int)p.swa_full);
        return ES_ERR_INVALID_ARG;
    }
    if (p.kv_sinks < 0 || p.kv_sinks > ES_MAX_CTX || p.kv_window < 0 || p.kv_window > ES_MAX_CTX ||
        (int64_t)p.kv_sinks + p.kv_window > ES_MAX_CTX || (p.kv_sinks > 0 && p.kv_window == 0)) {
        es_set_err(err, err_len, "KV eviction: kv_sinks %d and kv_window %d out of range (kv_window in "
                   "[1, %d], 0 for none, with kv_sinks 0; kv_sinks >= 0; kv_sinks + kv_window <= %d)",
                   (int)p.kv_sinks, (int)p.kv_window, ES_MAX_CTX, ES_MAX_CTX);
        return ES_ERR_INVALID_ARG;
    }
    const es_model_info *in = &model->info;
    if (p.kv_window > 0 && in->n_swa > 0 && in->n_swa_layers > 0) {
        es_set_err(err, err_len, "KV eviction (kv_window %d) is not supported on a model with "
                   "sliding-window layers (%s: %d of them)", (int)p.kv_window, in->arch, (int)in->n_swa_layers);
        return ES_ERR_UNSUPPORTED;
    }
    if (p.sparse_topk < 0 || p.sparse_topk > ES_MAX_SPARSE_TOPK) {
        es_set_err(err, err_len, "sparse attention: sparse_topk %d out of range [0, %d] (0: dense attention)",
                   (int)p.sparse_topk, ES_MAX_SPARSE_TOPK);
        return ES_ERR_INVALID_ARG;
    }
    if (p.sparse_topk > 0 && p.kv_window > 0) {
        es_set_err(err, err_len, "sparse attention (sparse_topk %d) is not supported with KV eviction (kv_window "
                   "%d): a step already attends only the sinks and the window", (int)p.sparse_topk, (int)p.kv_window);
        return ES_ERR_UNSUPPORTED;
    }
    if (p.kv_type != ES_KV_F16 && p.kv_type != ES_KV_Q8_0) {
        es_set_err(err, err_len, "kv_type %d is not a KV cache type (%d: F16, %d: Q8_0)", (int)p.kv_type,
                   ES_KV_F16, ES_KV_Q8_0);
        return ES_ERR_INVALID_ARG;
    }
    if (p.kv_type == ES_KV_Q8_0 && in->head_dim % 32 != 0) {
        es_set_err(err, err_len, "kv_type Q8_0 needs a head_dim that is a multiple of 32 (its blocks of 32 "
                   "values); %s has head_dim %d: use kv_type F16", in->arch, (int)in->head_dim);
        return ES_ERR_UNSUPPORTED;
    }
    int32_t n_ctx = p.n_ctx;
    if (n_ctx == 0) n_ctx = in->n_ctx_train < 4096 ? in->n_ctx_train : 4096;
    if (n_ctx < 1) n_ctx = 1;
    int n_threads = p.n_threads ? p.n_threads : online_cores();

    es_session *s = calloc(1, sizeof *s);
    if (!s) { es_set_err(err, err_len, "out of memory for the session"); return ES_ERR_NOMEM; }
    s->model = model;
    s->n_threads = n_threads;
    es_status kv_rc = es_kv_init(&s->kv, model, n_ctx, p.swa_slack ? p.swa_slack : ES_SWA_SLACK, p.swa_full,
                                 p.kv_sinks, p.kv_window, p.kv_type, err, err_len);
    if (kv_rc != ES_OK) {
        es_session_free(s);
        return kv_rc;
    }
    int grp = in->n_head / in->n_head_kv;
    s->group_cap = grp < ES_MAX_GROUP ? grp : ES_MAX_GROUP;
    s->q_cap = s->group_cap * KS_MAX_TOKENS > ATT_Q_TARGET ? s->group_cap * KS_MAX_TOKENS : ATT_Q_TARGET;
    s->ws_floats = (es_attn_ws_floats(in->head_dim, s->q_cap) + 15) & ~(size_t)15;
    s->att_ws = aligned_alloc(64, (size_t)n_threads * s->ws_floats * sizeof(float));
    s->parts = malloc((size_t)KS_MAX_TOKENS * (size_t)in->n_head * (size_t)s->kv.n_blk *
                      (size_t)es_attn_part_floats(in->head_dim) * sizeof(float));
    s->grp_done = malloc((size_t)in->n_head * sizeof *s->grp_done);
    if (!s->att_ws || !s->parts || !s->grp_done) {
        es_set_err(err, err_len, "out of memory for the attention scratch of %d threads", n_threads);
        es_session_free(s);
        return ES_ERR_NOMEM;
    }
    if (p.sparse_topk > 0) {
        es_status rc = es_sparse_alloc(s, p.sparse_topk, err, err_len);
        if (rc != ES_OK) {
            es_session_free(s);
            return rc;
        }
    }
    s->pool = es_pool_new(n_threads);
    if (!s->pool) {
        es_set_err(err, err_len, "could not start %d worker threads", n_threads - 1);
        es_session_free(s);
        return ES_ERR_INTERNAL;
    }
    if (es_session_ensure_scratch(s, 1) != ES_OK) {
        es_set_err(err, err_len, "%s", s->err);
        es_session_free(s);
        return ES_ERR_NOMEM;
    }
    *out = s;
    return ES_OK;
}

void es_session_free(es_session *s) {
    if (!s) return;
    es_pool_free(s->pool);
    free_scratch(s);
    es_moe_scratch_free(s);
    es_kv_free(&s->kv);
    free(s->att_ws);
    free(s->parts);
    es_sparse_free(s);
    free((void *)s->grp_done);
    free(s);
}

es_status es_session_set_threads(es_session *s, int32_t n_threads) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (n_threads < 1 || n_threads > s->n_threads || es_pool_set_active(s->pool, n_threads) != 0) {
        es_set_err(s->err, sizeof s->err, "n_threads %d out of range [1, %d] (the session's pool)",
                   (int)n_threads, (int)s->n_threads);
        return ES_ERR_INVALID_ARG;
    }
    s->err[0] = '\0';
    return ES_OK;
}

int32_t es_session_threads(const es_session *s) { return s ? es_pool_size(s->pool) : 0; }
int32_t es_session_pool_threads(const es_session *s) { return s ? s->n_threads : 0; }

int32_t es_session_n_past(const es_session *s) { return s ? s->kv.n_past : 0; }
int32_t es_session_n_ctx(const es_session *s) { return s ? s->kv.n_ctx : 0; }
size_t es_session_kv_bytes(const es_session *s) { return s ? es_kv_bytes(&s->kv) : 0; }
int32_t es_session_min_rollback(const es_session *s) { return s ? es_kv_min_past(&s->kv) : 0; }
const char *es_session_last_error(const es_session *s) { return s ? s->err : "session is NULL"; }
int64_t es_session_experts_read(const es_session *s) { return s ? s->moe_experts_read : 0; }

es_status es_session_rollback(es_session *s, int32_t n_past) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = es_kv_rollback(&s->kv, n_past, s->err, sizeof s->err);
    if (st == ES_OK) s->err[0] = '\0';
    return st;
}

