/*
 * matmul.c - the es_matmul driver: output rows cut into chunks that the
 * pool's threads take (mm_task, mm_take, mm_worker), activations quantized
 * once per call (q8_worker), the kernel of each matrix chosen (packed SIMD,
 * lane SIMD or the scalar reference of quant.c), optional epilogues
 * (es_mm_epi), and the scratch sizing. Every kernel keeps the determinism
 * contract at the top of quant.c, so nothing here changes a bit of a result.
 *
 * es_matmul (and es_matmul_many, several matrices on one X) cut output rows
 * into contiguous chunks that the pool's threads take from an atomic
 * counter; a kernel handles its chunk for all N activation rows, unpacking
 * each weight block once per (up to) 32 activation rows. With a local
 * output (es_matmul_many_epi, es_mm_epi.local) a chunk [r0, r1) runs as
 * rows [0, r1 - r0) of the weights from row r0 on into its thread's buffer:
 * the same rows, so the same values (they depend on nothing but the row).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

static int is_float_type(uint32_t type) {
    return type == ES_TYPE_F32 || type == ES_TYPE_F16 || type == ES_TYPE_BF16;
}

static size_t q8_row_bytes(int64_t n_in) {
    int64_t nb = (n_in + QK - 1) / QK;
    return (size_t)((nb + ES_GROUP_BLOCKS - 1) / ES_GROUP_BLOCKS) * sizeof(es_q8_group);
}

static size_t q8k_row_bytes(int64_t n_in) { return (size_t)((n_in + QK_K - 1) / QK_K) * sizeof(es_q8k_block); }

/* The larger of the two row formats, so that a scratch serves either. */
size_t es_matmul_scratch_bytes(uint32_t type, int64_t n_in, int N) {
    if (is_float_type(type) || N <= 0 || n_in <= 0) return 0;
    size_t a = q8_row_bytes(n_in), b = q8k_row_bytes(n_in);
    return (a > b ? a : b) * (size_t)N;
}

size_t es_matmul_q8_row_bytes(uint32_t type, int64_t n_in) {
    if (is_float_type(type) || n_in <= 0) return 0;
    return es_act_block_elems(type) == QK_K ? q8k_row_bytes(n_in) : q8_row_bytes(n_in);
}

/* One weight matrix of a dispatch. */
typedef struct {
    es_mm_kernel k;
    const uint8_t *w;
    size_t row_bytes;
    int64_t rb_rows;        /* rows per row_bytes: 1, or ES_PACK_ROWS when packed (row_bytes a group) */
    int64_t n_out;
    const void *x;          /* es_q8_group rows or float rows */
    size_t x_stride;
    float *Y;
    int64_t ldy;
    int64_t chunk;          /* rows per chunk (a multiple of 4; of 16 when packed) */
    int64_t first;          /* index of its first chunk in the dispatch */
    int64_t n_in;           /* elements per row */
    int N;                  /* activation rows */
} mm_mat;

typedef struct {
    int nw;
    mm_mat *m;              /* [nw]: own, or es_matmul_grouped's */
    mm_mat own[ES_MATMUL_MAX];
    int64_t n_chunks;
    const es_mm_epi *epi;   /* es_matmul_many_epi: each chunk then its epilogue; joint:
                               chunk c is rows [c * m[0].chunk, ...) of every matrix */
    int nth;                /* threads of the dispatch: regions of rg */
    struct {
        _Atomic uint64_t lohi;   /* the chunks [lo, hi) a thread has left: lo | hi << 32 */
        char pad[56];
    } rg[ES_MAX_THREADS];
} mm_task;

/* The next chunk for thread ith: the front of its own region, else the
 * back of another's (-1 when none is left). */
static int64_t mm_take(mm_task *t, int ith) {
    for (int d = 0; d < t->nth; d++) {
        _Atomic uint64_t *r = &t->rg[(ith + d) % t->nth].lohi;
        uint64_t v = atomic_load_explicit(r, memory_order_relaxed);
        for (;;) {
            uint64_t lo = v & 0xFFFFFFFFu, hi = v >> 32;
            if (lo >= hi) break;
            uint64_t nv = d == 0 ? v + 1 : (hi - 1) << 32 | lo;
            if (atomic_compare_exchange_weak_explicit(r, &v, nv, memory_order_relaxed, memory_order_relaxed))
                return d == 0 ? (int64_t)lo : (int64_t)(hi - 1);
        }
    }
    return -1;
}

/* Output rows are cut into contiguous chunks (about 8 per thread and
 * matrix). Each thread owns a contiguous region of them and takes its
 * chunks in order, so its weight stream runs on from one chunk to the next
 * and the prefetches ahead of a chunk serve its next one; a thread whose
 * region is done takes chunks from the back of another's, so a thread that
 * was preempted (or runs on a slower core) does fewer of them. Which thread
 * computes a row never changes its value. */
static void mm_worker(void *ctx, int ith, int nth) {
    mm_task *t = ctx;
    (void)nth;
    for (;;) {
        int64_t c = mm_take(t, ith);
        if (c < 0) break;
        if (t->epi && t->epi->joint) {   /* rows [r0, r1) of every matrix, then the epilogue on them */
            int64_t r0 = c * t->m[0].chunk;
            int64_t r1 = r0 + t->m[0].chunk < t->m[0].n_out ? r0 + t->m[0].chunk : t->m[0].n_out;
            for (int i = 0; i < t->nw; i++) {
                const mm_mat *m = &t->m[i];
                m->k(m->w, m->row_bytes, r0, r1, m->n_in, m->x, m->x_stride, m->N, m->Y, m->ldy);
            }
            t->epi->fn(t->epi->ctx, -1, r0, r1);
            continue;
        }
        int i = 0, hi = t->nw - 1;   /* the last matrix whose first chunk is <= c */
        while (i < hi) {
            int mid = (i + hi + 1) / 2;
            if (t->m[mid].first <= c) i = mid;
            else hi = mid - 1;
        }
        const mm_mat *m = &t->m[i];
        int64_t r0 = (c - m->first) * m->chunk;
        int64_t r1 = r0 + m->chunk < m->n_out ? r0 + m->chunk : m->n_out;
        if (t->epi && t->epi->local) {
            /* the chunk as rows [0, r1 - r0) of the weights from row r0 on (r0 is a multiple of
               rb_rows), into this thread's buffer with rows r1 - r0 floats apart */
            float *y = t->epi->local + (size_t)ith * t->epi->local_floats;
            m->k(m->w + (size_t)(r0 / m->rb_rows) * m->row_bytes, m->row_bytes, 0, r1 - r0, m->n_in, m->x,
                 m->x_stride, m->N, y, r1 - r0);
            t->epi->local_fn(t->epi->ctx, i, r0, r1, y, r1 - r0);
            continue;
        }
        m->k(m->w, m->row_bytes, r0, r1, m->n_in, m->x, m->x_stride, m->N, m->Y, m->ldy);
        if (t->epi) t->epi->fn(t->epi->ctx, i, r0, r1);
    }
}

/* Activation rows to quantize (contract step 1), shared out by rows. */
typedef struct {
    const float *X;
    int64_t n_in;
    int N;
    void *scratch;
    size_t rs;
    int force_scalar;
    int k;   /* K-type rows (es_q8k_block) */
    _Atomic int next;
} q8_task;

static void q8_worker(void *ctx, int ith, int nth) {
    q8_task *t = ctx;
    for (int n; (n = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->N;) {
        void *g = (uint8_t *)t->scratch + (size_t)n * t->rs;
        const float *x = t->X + (int64_t)n * t->n_in;
        if (t->k) {
            if (t->force_scalar) es_quantize_row_q8k_ref(x, t->n_in, g);
            else es_quantize_row_q8k(x, t->n_in, g);
        } else if (t->force_scalar) {
            es_quantize_row_q8_ref(x, t->n_in, g);
        } else {
            es_quantize_row_q8(x, t->n_in, g);
        }
    }
}

/* 1: a quantized type with K-type activations, 0: one with 32-element
 * blocks, -1: float or unsupported. */
static int act_format(uint32_t type) {
    if (is_float_type(type) || !es_matmul_supported(type)) return -1;
    return es_act_block_elems(type) == QK_K;
}

/* The kernel of W for this build into m (k, w, row_bytes, rb_rows): the
 * packed SIMD kernel of a packed tensor, the lane SIMD kernel of a type that
 * is never packed, else the scalar reference (force_scalar: always); m->k
 * NULL when the type is unsupported. Returns the chunk granularity in rows. */
static int64_t pick_kernel(const es_tensor *W, int force_scalar, mm_mat *m) {
    uint32_t type = W->type;
    m->k = NULL;
    m->w = W->data;
    m->row_bytes = W->row_bytes;
    m->rb_rows = 1;
    if (!force_scalar && W->packed != NULL && (m->k = es_packed_kernel(type)) != NULL) {
        m->w = W->packed;
        m->row_bytes = (size_t)(W->ne[0] / es_pack_block_elems(type)) * es_pack_record_bytes(type);
        m->rb_rows = ES_PACK_ROWS;
        return ES_PACK_ROWS;
    }
    if (!force_scalar && es_pack_record_bytes(type) == 0) {
        m->k = es_x86_kernel(type);
        if (!m->k) m->k = es_neon_kernel(type);
    }
    if (!m->k) m->k = es_ref_kernel(type);
    return 4;
}

static void matmul_many(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                        float *const *Y, const int64_t *ldy, void *scratch, int force_scalar, int pre,
                        const es_mm_epi *epi) {
    if (nw < 1 || nw > ES_MATMUL_MAX || N <= 0) return;
    int fmts = 0;   /* bit f: a matrix with activation format f */
    for (int i = 0; i < nw; i++)
        if (act_format(W[i]->type) >= 0) fmts |= 1 << act_format(W[i]->type);
    if (fmts == 3 && !epi) {   /* both formats: one dispatch per format, each quantizing X */
        for (int f = 0; f < 2; f++) {
            const es_tensor *Wf[ES_MATMUL_MAX];
            float *Yf[ES_MATMUL_MAX];
            int64_t ldf[ES_MATMUL_MAX];
            int nf = 0;
            for (int i = 0; i < nw; i++)
                if (W[i]->ne[0] != W[0]->ne[0]) {   /* another n_in: NaN rows, as below */
                    for (int n = 0; f == 0 && n < N; n++)
                        for (int64_t r = 0; r < W[i]->ne[1]; r++) Y[i][(int64_t)n * ldy[i] + r] = NAN;
                } else if ((act_format(W[i]->type) == 1) == f) {
                    Wf[nf] = W[i];
                    Yf[nf] = Y[i];
                    ldf[nf++] = ldy[i];
                }
            if (nf) matmul_many(pool, nf, Wf, X, N, Yf, ldf, scratch, force_scalar, 0, NULL);
        }
        return;
    }
    if (epi) {   /* every matrix supported and of one n_in (joint: of one n_out; K types: a multiple of 256),
                    a granularity of 16k rows, one activation format; local: not joint, room for a chunk */
        int ok = epi->gran > 0 && epi->gran % 16 == 0 && fmts != 3;
        if (epi->local) ok = ok && !epi->joint && epi->local_fn && epi->local_floats / (size_t)N >= (size_t)epi->gran;
        for (int i = 0; i < nw && ok; i++)
            ok = W[i]->ne[0] == W[0]->ne[0] && es_matmul_supported(W[i]->type) &&
                 (!epi->joint || W[i]->ne[1] == W[0]->ne[1]) &&
                 (es_act_block_elems(W[i]->type) != QK_K || W[i]->ne[0] % QK_K == 0);
        if (!ok) {
            matmul_many(pool, nw, W, X, N, Y, ldy, scratch, force_scalar, pre, NULL);
            if (epi->local) {
                if (epi->local_fn)
                    for (int i = 0; i < nw; i++) epi->local_fn(epi->ctx, i, 0, W[i]->ne[1], Y[i], ldy[i]);
            } else if (epi->joint) {
                epi->fn(epi->ctx, -1, 0, W[0]->ne[1]);
            } else {
                for (int i = 0; i < nw; i++) epi->fn(epi->ctx, i, 0, W[i]->ne[1]);
            }
            return;
        }
    }
    mm_task t;
    memset(&t, 0, offsetof(mm_task, rg));   /* rg: set below for the threads of the dispatch */
    t.m = t.own;
    int64_t n_in = W[0]->ne[0];
    int nth = es_pool_size(pool), need_q8 = 0, kfmt = fmts == 2;
    size_t rs = kfmt ? q8k_row_bytes(n_in) : q8_row_bytes(n_in);
    for (int i = 0; i < nw; i++) {
        uint32_t type = W[i]->type;
        mm_mat *m = &t.m[t.nw];
        int64_t gran = pick_kernel(W[i], force_scalar, m);
        if (!m->k || W[i]->ne[0] != n_in || (es_act_block_elems(type) == QK_K && n_in % QK_K != 0)) {
            /* unsupported: make the failure visible, never crash */
            for (int n = 0; n < N; n++)
                for (int64_t r = 0; r < W[i]->ne[1]; r++) Y[i][(int64_t)n * ldy[i] + r] = NAN;
            continue;
        }
        t.nw++;
        m->n_in = n_in;
        m->N = N;
        m->n_out = W[i]->ne[1];
        m->Y = Y[i];
        m->ldy = ldy[i];
        if (is_float_type(type)) {
            m->x = X;
            m->x_stride = (size_t)n_in * sizeof(float);
        } else {
            m->x = scratch;
            m->x_stride = rs;
            need_q8 = 1;
        }
        int64_t chunk = (m->n_out + (int64_t)nth * 8 - 1) / ((int64_t)nth * 8);
        if (epi) gran = epi->gran;   /* a multiple of 4 and 16 */
        m->chunk = chunk < 16 ? (gran > 16 ? gran : 16) : (chunk + gran - 1) / gran * gran;
        if (epi && epi->local) {   /* at most the thread's buffer (checked above: room for gran rows) */
            int64_t cap = (int64_t)(epi->local_floats / (size_t)N) / gran * gran;
            if (m->chunk > cap) m->chunk = cap;
        }
        m->first = t.n_chunks;
        t.n_chunks += (m->n_out + m->chunk - 1) / m->chunk;
    }
    if (t.nw == 0) return;
    t.epi = epi;
    if (epi && epi->joint) t.n_chunks = (t.m[0].n_out + t.m[0].chunk - 1) / t.m[0].chunk;
    if (need_q8 && !pre) {   /* several rows: quantized by the pool's threads, one row each in turn */
        q8_task qt = {X, n_in, N, scratch, rs, force_scalar, kfmt, 0};
        if (pool && N > 1) es_pool_run(pool, q8_worker, &qt);
        else q8_worker(&qt, 0, 1);
    }
    t.nth = pool ? nth : 1;
    for (int i = 0; i < t.nth; i++)
        atomic_init(&t.rg[i].lohi, (uint64_t)(t.n_chunks * i / t.nth) | (uint64_t)(t.n_chunks * (i + 1) / t.nth) << 32);
    if (pool) es_pool_run(pool, mm_worker, &t);
    else mm_worker(&t, 0, 1);
}

void es_matmul_path(es_pool *pool, const es_tensor *W, const float *X, int N,
                    float *Y, int64_t ldy, void *scratch, int force_scalar) {
    matmul_many(pool, 1, &W, X, N, &Y, &ldy, scratch, force_scalar, 0, NULL);
}

void es_matmul_many(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                    float *const *Y, const int64_t *ldy, void *scratch) {
    matmul_many(pool, nw, W, X, N, Y, ldy, scratch, 0, 0, NULL);
}

void es_matmul_many_pre(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                        float *const *Y, const int64_t *ldy, void *scratch) {
    matmul_many(pool, nw, W, X, N, Y, ldy, scratch, 0, 1, NULL);
}

void es_matmul_many_epi(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                        float *const *Y, const int64_t *ldy, void *scratch, int pre,
                        const es_mm_epi *epi) {
    matmul_many(pool, nw, W, X, N, Y, ldy, scratch, 0, pre, epi);
}

void es_matmul(es_pool *pool, const es_tensor *W, const float *X, int N,
               float *Y, int64_t ldy, void *scratch) {
    es_matmul_path(pool, W, X, N, Y, ldy, scratch, 0);
}

/* ---- grouped: each matrix on rows of its own (the experts of a layer) ---- */

/* The activation rows of the groups that need quantizing, one job per
 * distinct (X, n_in, format), rows shared out in turn over all jobs. */
typedef struct {
    const float *X;
    int64_t n_in;
    int N, k;           /* rows; K-type rows */
    uint8_t *dst;       /* quantized rows, rs bytes apart */
    size_t rs;
    int64_t row0;       /* index of its first row in the task */
} gq_job;

typedef struct {
    const gq_job *job;
    int nj;
    int64_t rows;
    _Atomic int64_t next;
} gq_task;

static void gq_worker(void *ctx, int ith, int nth) {
    gq_task *t = ctx;
    (void)ith;
    (void)nth;
    int j = 0;
    for (int64_t r; (r = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->rows;) {
        while (j + 1 < t->nj && r >= t->job[j + 1].row0) j++;
        const gq_job *q = &t->job[j];
        int64_t n = r - q->row0;
        const float *x = q->X + n * q->n_in;
        if (q->k) es_quantize_row_q8k(x, q->n_in, (es_q8k_block *)(void *)(q->dst + (size_t)n * q->rs));
        else es_quantize_row_q8(x, q->n_in, (es_q8_group *)(void *)(q->dst + (size_t)n * q->rs));
    }
}

size_t es_matmul_grouped_scratch(int ng, const es_mm_group *g) {
    size_t b = 0;
    for (int i = 0; i < ng; i++) b += ((es_matmul_q8_row_bytes(g[i].W->type, g[i].W->ne[0]) * (size_t)g[i].N) + 63) & ~(size_t)63;
    return b;
}

void es_matmul_grouped(es_pool *pool, int ng, const es_mm_group *g, void *scratch) {
    if (ng < 1) return;
    mm_mat *mats = malloc((size_t)ng * sizeof *mats);
    gq_job *jobs = malloc((size_t)ng * sizeof *jobs);
    mm_task *t = malloc(sizeof *t);
    if (!mats || !jobs || !t) {   /* make the failure visible, never crash */
        for (int i = 0; i < ng; i++)
            for (int n = 0; n < g[i].N; n++)
                for (int64_t r = 0; r < g[i].W->ne[1]; r++) g[i].Y[(int64_t)n * g[i].ldy + r] = NAN;
        free(mats); free(jobs); free(t);
        return;
    }
    memset(t, 0, offsetof(mm_task, rg));
    t->m = mats;
    int nth = pool ? es_pool_size(pool) : 1, nj = 0;
    int64_t total_out = 0, q_rows = 0;
    uint8_t *q = scratch;
    for (int i = 0; i < ng; i++) total_out += g[i].W->ne[1];
    /* a chunk of about total / (8 * threads) rows, at least one packed group */
    int64_t target = (total_out + (int64_t)nth * 8 - 1) / ((int64_t)nth * 8);
    for (int i = 0; i < ng; i++) {
        const es_tensor *W = g[i].W;
        mm_mat *m = &mats[t->nw];
        int64_t gran = pick_kernel(W, 0, m);
        int64_t n_in = W->ne[0];
        if (!m->k || g[i].N < 1 || (es_act_block_elems(W->type) == QK_K && n_in % QK_K != 0)) {
            for (int n = 0; n < g[i].N; n++)
                for (int64_t r = 0; r < W->ne[1]; r++) g[i].Y[(int64_t)n * g[i].ldy + r] = NAN;
            continue;
        }
        t->nw++;
        m->n_in = n_in;
        m->N = g[i].N;
        m->n_out = W->ne[1];
        m->Y = g[i].Y;
        m->ldy = g[i].ldy;
        if (is_float_type(W->type)) {
            m->x = g[i].X;
            m->x_stride = (size_t)n_in * sizeof(float);
        } else {
            int kf = es_act_block_elems(W->type) == QK_K;
            size_t rs = es_matmul_q8_row_bytes(W->type, n_in);
            int same = -1;   /* the rows quantized for an earlier matrix (gate and up of one expert) */
            for (int j = nj - 1; j >= 0 && j >= nj - 2 && same < 0; j--)
                if (jobs[j].X == g[i].X && jobs[j].n_in == n_in && jobs[j].k == kf && jobs[j].N == g[i].N) same = j;
            if (same < 0) {
                jobs[nj] = (gq_job){g[i].X, n_in, g[i].N, kf, q, rs, q_rows};
                q += ((rs * (size_t)g[i].N) + 63) & ~(size_t)63;
                q_rows += g[i].N;
                same = nj++;
            }
            m->x = jobs[same].dst;
            m->x_stride = rs;
        }
        m->chunk = target < gran ? gran : (target + gran - 1) / gran * gran;
        if (m->chunk < 16) m->chunk = 16;
        m->first = t->n_chunks;
        t->n_chunks += (m->n_out + m->chunk - 1) / m->chunk;
    }
    if (t->nw > 0) {
        gq_task qt = {jobs, nj, q_rows, 0};
        if (pool && q_rows > 1) es_pool_run(pool, gq_worker, &qt);
        else if (q_rows > 0) gq_worker(&qt, 0, 1);
        t->nth = nth;
        for (int i = 0; i < t->nth; i++)
            atomic_init(&t->rg[i].lohi, (uint64_t)(t->n_chunks * i / t->nth) | (uint64_t)(t->n_chunks * (i + 1) / t->nth) << 32);
        if (pool) es_pool_run(pool, mm_worker, t);
        else mm_worker(t, 0, 1);
    }
    free(mats);
    free(jobs);
    free(t);
}
