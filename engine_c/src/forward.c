/*
 * forward.c - sessions, the KV cache, rollback and the forward pass.
 *
 * A session owns one KV sequence:
 *   k_cache  float32 [n_layer][n_head_kv][head_dim][k_stride]  (transposed:
 *            the positions of one key dimension are contiguous, so the
 *            scores of 8 or 16 positions are one vector operation per
 *            dimension; k_stride >= n_ctx, see kv_k_stride)
 *   v_cache  float32 [n_layer][n_ctx][n_head_kv * head_dim]
 * Positions [0, n_past) are valid. A forward over N tokens writes positions
 * [n_past, n_past + N) and then advances n_past; rollback only moves n_past
 * back, so a later forward overwrites the removed positions and nothing of
 * them can leak into a result (attention reads positions <= its own).
 *
 * Determinism: every per-row operation here (RMSNorm, RoPE, attention for one
 * (position, head), SwiGLU, residual adds, argmax) reads only its own row and
 * the KV positions before it, in a fixed order, so results do not depend on
 * N or on the thread split. es_matmul keeps the same contract.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "quant.h"

#define ES_MAX_CTX (1 << 20)
#define ES_MAX_THREADS 256
#define ES_MAX_GROUP 32     /* query heads attended together per work unit */
#define ATT_Q_TARGET 12     /* queries (tokens x heads of one KV head) an attention unit aims at */
#define EARLY_KV_PREFETCH (128 * 1024)   /* a layer's K or V up to this many bytes is prefetched whole */

struct es_session {
    const es_model *model;
    int32_t n_ctx;          /* KV capacity (tokens) */
    int32_t n_past;         /* valid KV positions (tokens) */
    int32_t n_threads;
    es_pool *pool;
    float *k_cache;         /* [n_layer][n_head_kv][head_dim][k_stride] */
    size_t k_stride;        /* floats from one key dimension's row to the next */
    int pending_out;        /* a forward step: x += out is still to be done (by the next norm) */
    int out_first;          /* a forward step: first position the output head reads */
    float *v_cache;         /* [n_layer][n_ctx][kv_dim] */
    /* scratch, sized for cap tokens per call */
    int32_t cap;
    float *x;               /* [cap][n_embd] residual stream */
    float *xb;              /* [cap][n_embd] normed input of a sublayer */
    float *q;               /* [cap][q_dim] */
    float *k;               /* [cap][kv_dim] */
    float *v;               /* [cap][kv_dim] */
    float *att;             /* [cap][q_dim] attention output */
    float *gate;            /* [cap][n_ff] */
    float *up;              /* [cap][n_ff] */
    float *out;             /* [cap][n_embd] sublayer output */
    float *logits;          /* [cap][n_vocab] */
    float *rope;            /* [cap][rope_dim] cos, sin interleaved per pair */
    size_t q8_rs;           /* run_rows: also quantize each row written into mm_scratch, rows this many bytes apart (0: no) */
    int32_t group_cap;      /* min(n_head / n_head_kv, ES_MAX_GROUP) */
    int32_t q_cap;          /* queries of an attention unit, at most max(group_cap, ATT_Q_TARGET) */
    float *scores;          /* [n_threads][q_cap][n_ctx] attention weights */
    void *mm_scratch;       /* es_matmul scratch, 64-byte aligned */
    float *am_val;          /* [cap][am_slots] argmax of each output-matmul chunk (am_epi): value, */
    int32_t *am_idx;        /* and index in the row (-1: only NaNs; < -1: no chunk starts there) */
    int32_t am_slots;       /* ceil(n_vocab / ES_EPI_ROWS) */
    _Atomic int *att_done;  /* [cap] attention units done per token slice */
    void *glu_q8;           /* [cap] SwiGLU output rows quantized for W_down (glu_epi), 64-byte
                               aligned, zeroed at allocation (the padding of a row's last group) */
    size_t mm_bytes;
    char err[256];
};

/* ---- small row kernels (fixed 8-lane accumulation order) ---------------- */

/* 8 float lanes as a GCC vector (lowered to AVX, SSE or NEON as the target has). */
typedef float v8f __attribute__((vector_size(32)));
/* AW lanes, for loops whose lanes are independent elements (attention over
 * positions or dimensions): the width changes no element's operations, so
 * it follows the registers of the target (16 on AVX-512, 8 on AVX2 / NEON,
 * where 16-lane accumulators would spill). */
#if defined(__AVX512F__)
#define AW 16
#else
#define AW 8
#endif
typedef float vaf __attribute__((vector_size(AW * 4)));

/* Keep a loaded vector in a register. Where one K or V vector feeds the
 * products of several queries, GCC folds the load into each multiply as a
 * memory operand, one 64-byte load per product, and the loads, not the
 * arithmetic, bound the loop (AVX-512: 12 loads per position for 3 queries). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX__)   /* vaf is one ymm or zmm register */
#define IN_REG(v) __asm__("" : "+v"(v))
#else   /* NEON: vaf spans two registers; left to the compiler */
#define IN_REG(v) ((void)0)
#endif

/* Dot product with lane j accumulating elements j, j + 8, j + 16, ... in
 * order, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)): the same bits on every target. */
static inline float dot8(const float *a, const float *b, int n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    float l[8];
    memcpy(l, &acc, sizeof l);
    for (; i < n; i++) l[i & 7] += a[i] * b[i];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]; x and y may alias. */
static void rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    float ss = dot8(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

/* Rotate one head in place. cs = [rope_dim/2] (cos, sin) pairs for this position.
 * The rotated pairs are gathered first and the two outputs computed in
 * separate loops: GCC 12 turns the interleaved form into vfmaddsub even under
 * -ffp-contract=off, which would break bitwise equality with the scalar build
 * (tests/test_engine_build.py checks the library for FMA instructions). */
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

/*
 * exp(x) for float32: Cephes' expf (range reduction by ln 2, a degree-6
 * polynomial, scaling by 2^n through the exponent bits); relative error about
 * 2e-7. expv (below) is the same sequence of IEEE operations on AW lanes
 * (floor is truncate-then-adjust in both, exact for the clamped range), so
 * the lane and scalar forms give the same bits on every target, with no
 * libm call.
 */

#define EXP_LO -87.0f
#define EXP_HI 88.0f

static inline float exp_cephes(float x) {
    x = x < EXP_LO ? EXP_LO : x;
    x = x > EXP_HI ? EXP_HI : x;
    float fx = x * 1.44269504088896341f + 0.5f;
    float n = (float)(int32_t)fx;
    n = n > fx ? n + -1.0f : n;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/* AW lanes of int32, and a lane-wise select m ? a : b (m from a vector
 * comparison: -1 or 0). */
typedef int32_t vai __attribute__((vector_size(AW * 4)));
static inline vaf va_splat(float a) { return (vaf){0} + a; }
static inline vaf va_sel(vai m, vaf a, vaf b) {
    vai ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    vai r = (ai & m) | (bi & ~m);
    vaf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp_cephes on AW lanes (16 on AVX-512: half the instructions of 8). */
static inline vaf expv(vaf x) {
    x = va_sel(x < va_splat(EXP_LO), va_splat(EXP_LO), x);
    x = va_sel(x > va_splat(EXP_HI), va_splat(EXP_HI), x);
    vaf fx = x * va_splat(1.44269504088896341f) + va_splat(0.5f);
    vaf n = __builtin_convertvector(__builtin_convertvector(fx, vai), vaf);
    n = va_sel(n > fx, n + va_splat(-1.0f), n);
    vaf r = x - n * va_splat(0.693359375f);
    r = r - n * va_splat(-2.12194440e-4f);
    vaf z = r * r;
    vaf y = va_splat(1.9875691500e-4f);
    y = y * r + va_splat(1.3981999507e-3f);
    y = y * r + va_splat(8.3334519073e-3f);
    y = y * r + va_splat(4.1665795894e-2f);
    y = y * r + va_splat(1.6666665459e-1f);
    y = y * r + va_splat(5.0000001201e-1f);
    y = y * z + r + va_splat(1.0f);
    vai e = (__builtin_convertvector(n, vai) + 127) << 23;
    vaf scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/* x[i] = exp(x[i] - m) for i in [0, n). */
static void exp_sub_row(float *x, float m, int n) {
    int i = 0;
    for (; i + AW <= n; i += AW) {
        vaf v;
        memcpy(&v, x + i, sizeof v);
        v = expv(v - va_splat(m));
        memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {   /* the tail as one vector (expv's lanes are exp_cephes) */
        vaf v = {0};
        memcpy(&v, x + i, (size_t)(n - i) * sizeof(float));
        v = expv(v - va_splat(m));
        memcpy(x + i, &v, (size_t)(n - i) * sizeof(float));
    }
}

/* g[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i] for i in [0, n). */
static void swiglu_row(float *g, const float *u, size_t n) {
    size_t i = 0;
    for (; i + AW <= n; i += AW) {
        vaf gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        gv = (gv / (va_splat(1.0f) + expv(-gv))) * uv;
        memcpy(g + i, &gv, sizeof gv);
    }
    for (; i < n; i++) g[i] = (g[i] / (1.0f + exp_cephes(-g[i]))) * u[i];
}

/* The largest of x[0..n), n >= 1, as a scalar loop of "x[i] > best" from
 * best = x[0] finds it (NaNs after x[0] are passed over; NaN when x[0] is
 * NaN): by AW lanes, exact in any order. */
static float max_row(const float *x, int n) {
    int t = 0;
    float m = x[0];
    if (n >= AW) {
        vaf mv = va_splat(x[0]);
        for (; t + AW <= n; t += AW) {
            vaf v;
            memcpy(&v, x + t, sizeof v);
            mv = va_sel(v > mv, v, mv);
        }
        for (int l = 0; l < AW; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

/* The first index of the largest value (NaNs are never chosen; 0 when x[0]
 * is NaN): max_row, then the first element equal to it. */
static int32_t argmax_row(const float *x, int n) {
    float bv = max_row(x, n);
    if (bv != bv) return 0;   /* x[0] is NaN */
    for (int j = 0; j < n; j++)
        if (x[j] == bv) return j;
    return 0;
}

/* ---- session lifecycle --------------------------------------------------- */

es_session_params es_session_default_params(void) {
    es_session_params p = {0, 0};
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
    free((void *)s->att_done);
    s->att_done = NULL;
    s->glu_q8 = NULL;
    s->am_val = NULL;
    s->am_idx = NULL;
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
    const es_tensor *ws[] = {L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down, m->output};
    for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) {
        t = es_matmul_scratch_bytes(ws[i]->type, ws[i]->ne[0], n);
        if (t > b) b = t;
    }
    (void)in;
    return b;
}

/* Make room for n tokens per call. On failure the old buffers are kept. */
static es_status ensure_scratch(es_session *s, int32_t n) {
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
    float *rope = malloc(N * in->rope_dim * sizeof(float) + sizeof(float));
    void *mms = aligned_alloc(64, mm_alloc ? mm_alloc : 64);
    size_t glu_alloc = (N * es_matmul_q8_row_bytes(ES_TYPE_Q8_0, in->n_ff) + 63) & ~(size_t)63;
    void *glu = aligned_alloc(64, glu_alloc ? glu_alloc : 64);
    if (glu) memset(glu, 0, glu_alloc ? glu_alloc : 64);
    size_t slots = ((size_t)in->n_vocab + ES_EPI_ROWS - 1) / ES_EPI_ROWS;
    float *am_val = malloc(N * slots * sizeof(float));
    int32_t *am_idx = malloc(N * slots * sizeof(int32_t));
    _Atomic int *att_done = malloc(N * sizeof *att_done);
    if (!x || !xb || !q || !k || !v || !att || !gate || !up || !out || !logits || !rope || !mms || !glu ||
        !am_val || !am_idx || !att_done) {
        free(x); free(xb); free(q); free(k); free(v); free(att); free(gate); free(up);
        free(out); free(logits); free(rope); free(mms); free(glu); free(am_val); free(am_idx);
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
    s->att_done = att_done;
    s->am_slots = (int32_t)slots;
    s->mm_bytes = mm;
    s->cap = n;
    return ES_OK;
}

/* Floats from one row of the transposed K cache to the next: n_ctx rounded
 * up to whole 64-byte lines, plus one line when that count of lines is even.
 * An odd count of lines puts the rows of one head (read together, a vector
 * of positions at a time) in different L1 sets; with n_ctx a power of two
 * they all fell into one or two sets of the 8-way L1 and evicted each other
 * (the attention of a 5-token step at depth 64, cache hot, one thread:
 * 36.0 -> 27.1 us a layer with n_ctx = 4096, 28.3 -> 26.4 with 512). */
static size_t kv_k_stride(int32_t n_ctx) {
    size_t lines = ((size_t)n_ctx + 15) / 16;
    if (lines % 2 == 0) lines++;
    return lines * 16;
}

es_status es_session_new(const es_model *model, const es_session_params *params,
                         es_session **out, char *err, size_t err_len) {
    if (out) *out = NULL;
    if (!model || !out) {
        es_set_err(err, err_len, "es_session_new: model and out must not be NULL");
        return ES_ERR_INVALID_ARG;
    }
    es_session_params p = params ? *params : es_session_default_params();
    if (p.n_ctx < 0 || p.n_ctx > ES_MAX_CTX) {
        es_set_err(err, err_len, "n_ctx %d out of range [0, %d]", (int)p.n_ctx, ES_MAX_CTX);
        return ES_ERR_INVALID_ARG;
    }
    if (p.n_threads < 0 || p.n_threads > ES_MAX_THREADS) {
        es_set_err(err, err_len, "n_threads %d out of range [0, %d]", (int)p.n_threads, ES_MAX_THREADS);
        return ES_ERR_INVALID_ARG;
    }
    const es_model_info *in = &model->info;
    int32_t n_ctx = p.n_ctx;
    if (n_ctx == 0) n_ctx = in->n_ctx_train < 4096 ? in->n_ctx_train : 4096;
    if (n_ctx < 1) n_ctx = 1;
    int n_threads = p.n_threads ? p.n_threads : online_cores();

    es_session *s = calloc(1, sizeof *s);
    if (!s) { es_set_err(err, err_len, "out of memory for the session"); return ES_ERR_NOMEM; }
    s->model = model;
    s->n_ctx = n_ctx;
    s->n_threads = n_threads;
    size_t kv_dim = (size_t)in->n_head_kv * in->head_dim;
    size_t kv_elems = (size_t)in->n_layer * (size_t)n_ctx * kv_dim;
    s->k_stride = kv_k_stride(n_ctx);
    /* + 16 floats: the last key row may be read one vector past its end
     * (attend_group's tail block; those lanes are never used) */
    s->k_cache = calloc((size_t)in->n_layer * kv_dim * s->k_stride + 16, sizeof(float));
    s->v_cache = malloc(kv_elems * sizeof(float));
    int grp = in->n_head / in->n_head_kv;
    s->group_cap = grp < ES_MAX_GROUP ? grp : ES_MAX_GROUP;
    s->q_cap = s->group_cap > ATT_Q_TARGET ? s->group_cap : ATT_Q_TARGET;
    s->scores = malloc((size_t)n_threads * (size_t)s->q_cap * (size_t)n_ctx * sizeof(float));
    if (!s->k_cache || !s->v_cache || !s->scores) {
        es_set_err(err, err_len, "out of memory for a KV cache of %d tokens (%zu bytes)",
                   (int)n_ctx, 2 * kv_elems * sizeof(float));
        es_session_free(s);
        return ES_ERR_NOMEM;
    }
    s->pool = es_pool_new(n_threads);
    if (!s->pool) {
        es_set_err(err, err_len, "could not start %d worker threads", n_threads - 1);
        es_session_free(s);
        return ES_ERR_INTERNAL;
    }
    if (ensure_scratch(s, 1) != ES_OK) {
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
    free(s->k_cache);
    free(s->v_cache);
    free(s->scores);
    free(s);
}

int32_t es_session_n_past(const es_session *s) { return s ? s->n_past : 0; }
int32_t es_session_n_ctx(const es_session *s) { return s ? s->n_ctx : 0; }
const char *es_session_last_error(const es_session *s) { return s ? s->err : "session is NULL"; }

es_status es_session_rollback(es_session *s, int32_t n_past) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (n_past < 0 || n_past > s->n_past) {
        es_set_err(s->err, sizeof s->err, "rollback to n_past %d outside [0, %d]",
                   (int)n_past, (int)s->n_past);
        return ES_ERR_INVALID_ARG;
    }
    s->n_past = n_past;
    s->err[0] = '\0';
    return ES_OK;
}

/* ---- attention ----------------------------------------------------------- */

typedef struct {
    es_session *s;
    int layer;
    int n;              /* tokens in this call */
    int per, split;     /* query heads per unit, units per KV head group */
    int ts, nsl;        /* tokens per unit, token slices */
    size_t rs;          /* > 0: the unit that completes a token slice quantizes its att rows
                           into mm_scratch for W_o (rows rs bytes apart) */
    _Atomic int next;   /* next work unit to take */
} attn_task;

/*
 * Attention, softmax(q . K^T / sqrt(head_dim)) . V (GQA), over the queries
 * of one work unit: tokens [i0, i1) of the step times query heads [h0, h1),
 * which all read KV head g. Token i attends positions [0, n_past + i].
 * Every query's result is computed by the same operations, in the same
 * order, as if it were computed alone: score = (sum over d = 0, 1, ... of
 * q[d] * k_t[d], a product then a sum, in order) * scale, a vector of
 * positions at a time; max; exp; the sequential sum over t; a * (1 / sum);
 * then o[d] = 0, o[d] += a_t * v_t[d] for t in order. So the grouping of
 * queries into units and slices, the vector width and the thread split
 * change no bit. The queries of a unit share each K and V row load.
 *   sc: scratch of (i1 - i0) * (h1 - h0) * (n_past + i1) floats
 */

/* Queries of one score slice: up to SCORE_Q side by side, each K vector
 * loaded once for all (2 * SCORE_Q accumulators). */
#if defined(__AVX512F__)
#define SCORE_Q 6
#else
#define SCORE_Q 4
#endif

/* o[j][0..64) = sum_t a[j][t] * V[t][0..64) for t in [t0, t1), for nj (a
 * constant) queries side by side, each V row loaded once; the accumulators
 * start at 0 (cont = 0) or at o[j] (cont = 1, continuing a sum over
 * [0, t0) stored there: a float stored and reloaded is the same float). */
#if defined(__AVX512F__)
#define AXPY_Q 3   /* 3 queries x 4 accumulators of 16 floats + 4 V vectors fit the 32 registers */
#else
#define AXPY_Q 1
#endif
static inline __attribute__((always_inline)) void axpy_q64(const int nj, float *const *o, const float *const *a,
                                                           int t0, int t1, const float *vc, size_t kv_dim,
                                                           int cont) {
    vaf acc[AXPY_Q][64 / AW];
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < 64 / AW; k++) {
            if (cont) memcpy(&acc[j][k], o[j] + AW * k, sizeof acc[j][k]);
            else acc[j][k] = (vaf){0};
        }
    for (int t = t0; t < t1; t++) {
        const float *vr = vc + (size_t)t * kv_dim;
        vaf v[64 / AW];
        for (int k = 0; k < 64 / AW; k++) {
            memcpy(&v[k], vr + AW * k, sizeof v[k]);
            IN_REG(v[k]);
        }
        for (int j = 0; j < nj; j++) {
            float av = a[j][t];
            for (int k = 0; k < 64 / AW; k++) acc[j][k] += av * v[k];
        }
    }
    /* element by element: with one copy of the whole array GCC kept the
     * accumulators in memory, stored back at every position (the attention
     * of a 5-token step: 26.4 -> 23.7 us a layer) */
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < 64 / AW; k++) memcpy(o[j] + AW * k, &acc[j][k], sizeof acc[j][k]);
}

/* The same for any head size, one query, positions [0, n). */
static void axpy_row(float *o, const float *a, const float *vc, size_t kv_dim, int n, int hd) {
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float *vr = vc + (size_t)t * kv_dim;
        for (int d = 0; d < hd; d++) o[d] += a[t] * vr[d];
    }
}

/* Scores of nj (a constant 1..SCORE_Q after inlining) queries q[j] against
 * positions [0, n) of the transposed keys kt ([hd][nc]), AW positions per
 * vector: sc[j * ld + t] = (sum_d q[j][d] * k[d][t]) * scale. The last
 * vector reads up to AW - 1 floats past position n - 1 (inside the cache's
 * allocation) and stores only the lanes below n. */
static inline __attribute__((always_inline)) void scores_v(const int nj, const float *const *q, int hd,
                                                        const float *kt, size_t nc, int n, float scale,
                                                        float *sc, size_t ld) {
    int t = 0;
    for (; t + 2 * AW <= n; t += 2 * AW) {   /* two blocks of AW side by side: 2 * nj independent sums */
        vaf acc[SCORE_Q], acc2[SCORE_Q];
        for (int j = 0; j < nj; j++) acc[j] = acc2[j] = (vaf){0};
        for (int d = 0; d < hd; d++) {
            vaf kv, kv2;
            memcpy(&kv, kt + (size_t)d * nc + t, sizeof kv);
            memcpy(&kv2, kt + (size_t)d * nc + t + AW, sizeof kv2);
            IN_REG(kv);
            IN_REG(kv2);
            for (int j = 0; j < nj; j++) {
                float qv = q[j][d];
                acc[j] += qv * kv;
                acc2[j] += qv * kv2;
            }
        }
        for (int j = 0; j < nj; j++) {
            vaf sv = acc[j] * scale, sv2 = acc2[j] * scale;
            memcpy(sc + (size_t)j * ld + t, &sv, sizeof sv);
            memcpy(sc + (size_t)j * ld + t + AW, &sv2, sizeof sv2);
        }
    }
    for (; t < n; t += AW) {   /* the rest; a last partial block reads past n and drops those lanes */
        vaf acc[SCORE_Q];
        for (int j = 0; j < nj; j++) acc[j] = (vaf){0};
        for (int d = 0; d < hd; d++) {
            vaf kv;
            memcpy(&kv, kt + (size_t)d * nc + t, sizeof kv);
            IN_REG(kv);
            for (int j = 0; j < nj; j++) acc[j] += q[j][d] * kv;
        }
        size_t m = (size_t)(n - t < AW ? n - t : AW);
        for (int j = 0; j < nj; j++) {
            vaf sv = acc[j] * scale;
            memcpy(sc + (size_t)j * ld + t, &sv, m * sizeof(float));
        }
    }
}

static void attend_unit(es_session *s, int layer, int g, int h0, int h1, int i0, int i1, float *sc) {
    const es_model_info *in = &s->model->info;
    int hd = in->head_dim;
    size_t kv_dim = (size_t)in->n_head_kv * hd;
    size_t q_dim = (size_t)in->n_head * hd;
    int nh = h1 - h0, nq = (i1 - i0) * nh;
    size_t ld = (size_t)s->n_past + (size_t)i1;   /* sc row stride: the longest row */
    const float *kt = s->k_cache + ((size_t)layer * in->n_head_kv + (size_t)g) * (size_t)hd * s->k_stride;
    const float *vc = s->v_cache + ((size_t)layer * s->n_ctx) * kv_dim + (size_t)g * hd;
    float scale = 1.0f / sqrtf((float)hd);
    const float *qp[ES_MAX_GROUP];
    float *op[ES_MAX_GROUP], *ap[ES_MAX_GROUP];
    int len[ES_MAX_GROUP];
    for (int k = 0; k < nq; k++) {   /* queries by token, then head: rows of one token are side by side */
        int i = i0 + k / nh, h = h0 + k % nh;
        qp[k] = s->q + (size_t)i * q_dim + (size_t)h * hd;
        op[k] = s->att + (size_t)i * q_dim + (size_t)h * hd;
        ap[k] = sc + (size_t)k * ld;
        len[k] = s->n_past + i + 1;
    }
    /* V rows are hd floats at a stride of kv_dim: ask for them now, they are
     * needed after the scores (and are in DRAM after a step's weight stream).
     * Shorter caches were asked for whole before the q/k/v matmul. */
    if ((size_t)s->n_past * kv_dim * sizeof(float) > EARLY_KV_PREFETCH)
        for (size_t t = 0; t < ld; t++)
            for (int o = 0; o < hd; o += 16) __builtin_prefetch(vc + t * kv_dim + o, 0, 3);
    /* scores, slices of SCORE_Q queries sharing each K load, each over the
     * positions of its longest (last) query */
    for (int k0 = 0; k0 < nq; k0 += SCORE_Q) {
        int nj = nq - k0 < SCORE_Q ? nq - k0 : SCORE_Q, n = len[k0 + nj - 1];
        switch (nj) {
        case 1: scores_v(1, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
        case 2: scores_v(2, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
        case 3: scores_v(3, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
#if SCORE_Q > 4
        case 4: scores_v(4, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
        case 5: scores_v(5, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
        default: scores_v(SCORE_Q, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
#else
        default: scores_v(SCORE_Q, qp + k0, hd, kt, s->k_stride, n, scale, ap[k0], ld); break;
#endif
        }
    }
    float sum[ES_MAX_GROUP];
    int nmin = nq > 0 ? len[0] : 0;   /* the first query is the shortest */
    for (int k = 0; k < nq; k++) {
        exp_sub_row(ap[k], max_row(ap[k], len[k]), len[k]);
        sum[k] = 0.0f;
    }
    for (int t = 0; t < nmin; t++)       /* the sequential sums, side by side */
        for (int k = 0; k < nq; k++) sum[k] += ap[k][t];
    for (int k = 0; k < nq; k++)
        for (int t = nmin; t < len[k]; t++) sum[k] += ap[k][t];
    for (int k = 0; k < nq; k++) {
        float inv = 1.0f / sum[k], *row = ap[k];
        for (int t = 0; t < len[k]; t++) row[t] = row[t] * inv;
    }
    if (hd != 64) {
        for (int k = 0; k < nq; k++) axpy_row(op[k], ap[k], vc, kv_dim, len[k], hd);
        return;
    }
    /* queries side by side over the positions they all attend, then each
     * query's own last positions */
    int k = 0;
    for (; k + AXPY_Q <= nq; k += AXPY_Q) {
        int lo = len[k];
        axpy_q64(AXPY_Q, op + k, (const float *const *)ap + k, 0, lo, vc, kv_dim, 0);
        for (int j = k; j < k + AXPY_Q; j++)
            if (len[j] > lo) axpy_q64(1, op + j, (const float *const *)ap + j, lo, len[j], vc, kv_dim, 1);
    }
    for (; k < nq; k++) axpy_q64(1, op + k, (const float *const *)ap + k, 0, len[k], vc, kv_dim, 0);
}

/* Work units: (token slice, KV head, slice of its query heads), taken in
 * turn from a counter. The shape is chosen in attention_block. */
static void attn_worker(void *ctx, int ith, int nth) {
    attn_task *t = ctx;
    es_session *s = t->s;
    const es_model_info *in = &s->model->info;
    int grp = in->n_head / in->n_head_kv;
    int total = t->nsl * in->n_head_kv * t->split;
    float *sc = s->scores + (size_t)ith * (size_t)s->q_cap * s->n_ctx;
    (void)nth;
    /* a thread that was preempted (a busy host) does fewer units; the split
     * changes no bit */
    for (int u; (u = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < total;) {
        int part = u % t->split, g = (u / t->split) % in->n_head_kv, sl = u / (t->split * in->n_head_kv);
        int h0 = g * grp + part * t->per;
        int h1 = h0 + t->per < (g + 1) * grp ? h0 + t->per : (g + 1) * grp;
        int i0 = sl * t->ts, i1 = i0 + t->ts < t->n ? i0 + t->ts : t->n;
        if (h0 < h1 && i0 < i1) attend_unit(s, t->layer, g, h0, h1, i0, i1, sc);
        /* the last unit of a token slice (acq_rel: it sees the others' att
         * writes) quantizes the slice's rows for W_o, instead of a dispatch */
        if (t->rs && atomic_fetch_add_explicit(&s->att_done[sl], 1, memory_order_acq_rel) ==
                         in->n_head_kv * t->split - 1)
            for (int i = i0; i < i1; i++)
                es_quantize_row_q8(s->att + (size_t)i * in->n_head * in->head_dim, (int64_t)in->n_head * in->head_dim,
                                   (es_q8_group *)(void *)((uint8_t *)s->mm_scratch + (size_t)i * t->rs));
    }
}

/* The unit shape for n tokens: heads of a KV group split in two only when
 * even one token per unit gives fewer than two units per thread (and more
 * when a group exceeds the scratch), then as many tokens per unit as keep
 * about ATT_Q_TARGET queries, in balanced slices, at least two units per
 * thread where the tokens allow. */
static void attn_shape(const es_session *s, attn_task *t) {
    const es_model_info *in = &s->model->info;
    int grp = in->n_head / in->n_head_kv, n = t->n, units_min = 2 * s->n_threads;
    int split = (n * in->n_head_kv < units_min && grp > 1) ? 2 : 1;
    while ((grp + split - 1) / split > s->group_cap) split++;
    int per = (grp + split - 1) / split;
    int ts = ATT_Q_TARGET / per;
    ts = ts < 1 ? 1 : ts > n ? n : ts;
    int nsl = (n + ts - 1) / ts;
    while (nsl < n && nsl * in->n_head_kv * split < units_min) nsl++;
    ts = (n + nsl - 1) / nsl;
    t->per = per;
    t->split = split;
    t->ts = ts;
    t->nsl = (n + ts - 1) / ts;
}

/* ---- the forward pass ---------------------------------------------------- */



static void fill_rope_table(es_session *s, int n) {
    const es_model_info *in = &s->model->info;
    int half = in->rope_dim / 2;
    for (int i = 0; i < n; i++) {
        double pos = (double)(s->n_past + i);
        for (int j = 0; j < half; j++) {
            double theta = pos * pow((double)in->rope_freq_base, -2.0 * j / (double)in->rope_dim);
            s->rope[(size_t)i * in->rope_dim + 2 * j] = (float)cos(theta);
            s->rope[(size_t)i * in->rope_dim + 2 * j + 1] = (float)sin(theta);
        }
    }
}

/* ---- per-token row work, shared out by token when there are several ---- */

enum { ROWS_NORM_ATTN, ROWS_NORM_FFN, ROWS_NORM_OUT };

/* Row i of a step of layer l (each token's row reads and writes only its own
 * data, so the split changes no bit):
 *   ROWS_NORM_ATTN / ROWS_NORM_FFN  x[i] += out[i] when a residual is
 *       pending, then xb[i] = rmsnorm(x[i]) with the layer's norm
 *   ROWS_NORM_OUT  the same residual, then xb[i] = output_norm(x[out_first + i])
 * With s->q8_rs set, the row written (xb[i]) is also quantized into
 * row i of mm_scratch for es_matmul_many_pre: in the same task, on the same
 * thread, instead of a dispatch of its own. */
static void quantize_row(es_session *s, int i, const float *x, int64_t n) {
    if (s->q8_rs) es_quantize_row_q8(x, n, (es_q8_group *)(void *)((uint8_t *)s->mm_scratch + (size_t)i * s->q8_rs));
}

static void token_row(es_session *s, int l, int op, int i) {
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    size_t e = (size_t)in->n_embd;
    const es_tensor *wt = op == ROWS_NORM_ATTN ? L->attn_norm : op == ROWS_NORM_FFN ? L->ffn_norm : m->output_norm;
    int row = op == ROWS_NORM_OUT ? s->out_first + i : i;
    float *x = s->x + (size_t)row * e;
    if (s->pending_out) {
        const float *o = s->out + (size_t)row * e;
        for (size_t k = 0; k < e; k++) x[k] += o[k];
    }
    rmsnorm(s->xb + (size_t)i * e, x, es_model_vec(m, wt), in->n_embd, in->norm_eps);
    quantize_row(s, i, s->xb + (size_t)i * e, in->n_embd);
}

/* The q/k/v matmul's epilogue (es_matmul_many_epi, chunks of whole heads),
 * for rows [r0, r1) of matrix mat (0 q, 1 k, 2 v) of every token i, by the
 * thread that computed them: the bias, the head's RMSNorm (qwen3, q and k),
 * RoPE at position n_past + i (q and k); k then goes to the transposed K
 * cache and v to the V cache. The same operations per element as one
 * token's row at a time. */
/* What an epilogue of a step's matmul needs: the session, the layer, the
 * tokens of the step and (glu_epi) the bytes of a quantized row. */
typedef struct {
    es_session *s;
    int l, n;
    size_t rs;
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
    float *kl = s->k_cache + (size_t)t->l * kv_dim * s->k_stride + s->n_past;   /* [kv_dim][k_stride] */
    for (int i = 0; i < t->n; i++) {
        float *y = base + (size_t)i * dim;
        if (b)
            for (int64_t r = r0; r < r1; r++) y[r] += b[r];
        if (mat < 2) {
            const float *cs = s->rope + (size_t)i * in->rope_dim;
            for (int64_t h = r0 / hd; h < (r1 + hd - 1) / hd; h++) {
                float *yh = y + (size_t)h * hd;
                if (hn) rmsnorm(yh, yh, hn, hd, in->norm_eps);
                rope_head(yh, cs, in->rope_dim, in->rope_neox);
            }
        }
        if (mat == 1)
            for (int64_t r = r0; r < r1; r++) kl[(size_t)r * s->k_stride + i] = y[r];
        else if (mat == 2)
            memcpy(s->v_cache + ((size_t)t->l * s->n_ctx + (size_t)s->n_past + (size_t)i) * kv_dim + r0, y + r0,
                   (size_t)(r1 - r0) * sizeof(float));
    }
}

typedef struct {
    es_session *s;
    int l, n, op;
    _Atomic int next;
} rows_task;

static void rows_worker(void *ctx, int ith, int nth) {
    rows_task *t = ctx;
    for (int i; (i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n;)
        token_row(t->s, t->l, t->op, i);
}

/* token_row for i in [0, n): on the calling thread for one token, on the
 * pool for several. Clears the pending residual after a norm. */
static void run_rows(es_session *s, int l, int n, int op) {
    rows_task t = {s, l, n, op, 0};
    if (n > 1) es_pool_run(s->pool, rows_worker, &t);
    else rows_worker(&t, 0, 1);
    s->pending_out = 0;
}

/* Bytes of a quantized row of n_in for the matrices w[0..nw) when the rows
 * of a step (n > 1, run on the pool) are to be quantized by run_rows; 0 when
 * one token (run on the calling thread, nothing to save) or all float. */
static size_t pre_q8_rs(int n, int nw, const es_tensor *const *w) {
    if (n < 2) return 0;
    for (int i = 0; i < nw; i++) {
        size_t rs = es_matmul_q8_row_bytes(w[i]->type, w[i]->ne[0]);
        if (rs) return rs;
    }
    return 0;
}


/* Attention sublayer of one block: x += Wo . attn(norm(x)). */
static void attention_block(es_session *s, int l, int n) {
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    int hd = in->head_dim, q_dim = in->n_head * hd, kv_dim = in->n_head_kv * hd;
    const es_tensor *wqkv[3] = {L->wq, L->wk, L->wv};
    size_t rs = pre_q8_rs(n, 3, wqkv);
    s->q8_rs = rs;
    run_rows(s, l, n, ROWS_NORM_ATTN);
    s->q8_rs = 0;
    /* Ask for this layer's cached K and V rows now: they arrive in cache while
     * the q/k/v matmul streams its weights, instead of one memory latency at
     * a time in the attention (the weight stream of the last step pushed
     * them out of every cache). */
    {
        const float *kb = s->k_cache + (size_t)l * kv_dim * s->k_stride;
        const char *vb = (const char *)(s->v_cache + (size_t)l * s->n_ctx * kv_dim);
        size_t bytes = (size_t)s->n_past * kv_dim * sizeof(float);
        if (bytes <= EARLY_KV_PREFETCH) {   /* longer contexts: left to the hardware and attend_group */
            for (int r = 0; r < kv_dim; r++)
                for (size_t o = 0; o < (size_t)s->n_past * sizeof(float); o += 64)
                    __builtin_prefetch((const char *)(kb + (size_t)r * s->k_stride) + o, 0, 2);
            for (size_t o = 0; o < bytes; o += 64) __builtin_prefetch(vb + o, 0, 2);
        }
    }
    /* q [n][q_dim], k [n][kv_dim], v [n][kv_dim] in one dispatch */
    float *yqkv[3] = {s->q, s->k, s->v};
    int64_t ldqkv[3] = {q_dim, kv_dim, kv_dim};
    /* biases, q/k norms, RoPE, and k and v into the caches in the epilogue */
    epi_task qt = {s, l, n, 0};
    es_mm_epi epi = {qkv_epi, &qt, 0, hd};
    es_matmul_many_epi(s->pool, 3, wqkv, s->xb, n, yqkv, ldqkv, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wo[1] = {L->wo};
    float *yo[1] = {s->out};
    int64_t ldo[1] = {in->n_embd};
    attn_task t = {s, l, n, 0, 0, 0, 0, es_matmul_q8_row_bytes(L->wo->type, L->wo->ne[0]), 0};
    attn_shape(s, &t);
    for (int i = 0; t.rs && i < t.nsl; i++) atomic_store_explicit(&s->att_done[i], 0, memory_order_relaxed);
    es_pool_run(s->pool, attn_worker, &t);
    if (t.rs) es_matmul_many_pre(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    else es_matmul_many(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    s->pending_out = 1;            /* x += out: done by the next norm, per token */
}

/* The epilogue of the gate/up matmul (es_matmul_many_epi), for the
 * columns [r0, r1) of every token's row, by the thread that computed them:
 * gate = silu(gate) * up, then its blocks quantized for W_down into glu_q8
 * when W_down is quantized (rs bytes a row). */
static void glu_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t n_ff = s->model->info.n_ff;
    for (int i = 0; i < t->n; i++) {
        float *g = s->gate + (size_t)i * (size_t)n_ff;
        swiglu_row(g + r0, s->up + (size_t)i * (size_t)n_ff + r0, (size_t)(r1 - r0));
        if (t->rs)
            es_quantize_blocks_q8(g, n_ff, r0 / QK, (r1 + QK - 1) / QK,
                                  (es_q8_group *)(void *)((uint8_t *)s->glu_q8 + (size_t)i * t->rs));
    }
}

/* FFN sublayer: x += W_down . (silu(W_gate . norm(x)) * (W_up . norm(x))). */
static void ffn_block(es_session *s, int l, int n) {
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    const es_tensor *wgu[2] = {L->w_gate, L->w_up};              /* gate, up [n][n_ff] */
    size_t rs = pre_q8_rs(n, 2, wgu);
    s->q8_rs = rs;
    run_rows(s, l, n, ROWS_NORM_FFN);
    s->q8_rs = 0;
    float *ygu[2] = {s->gate, s->up};
    int64_t ldgu[2] = {in->n_ff, in->n_ff};
    /* SwiGLU and its quantization for W_down in the matmul's epilogue, by
     * the thread that computed those columns, while they are in its cache */
    epi_task g = {s, l, n, es_matmul_q8_row_bytes(L->w_down->type, in->n_ff)};
    es_mm_epi epi = {glu_epi, &g, 1, ES_EPI_ROWS};
    es_matmul_many_epi(s->pool, 2, wgu, s->xb, n, ygu, ldgu, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wd[1] = {L->w_down};
    int64_t ldd[1] = {in->n_embd};
    float *yd[1] = {s->out};
    if (g.rs) es_matmul_many_pre(s->pool, 1, wd, s->gate, n, yd, ldd, s->glu_q8);
    else es_matmul_many(s->pool, 1, wd, s->gate, n, yd, ldd, s->mm_scratch);
    s->pending_out = 1;
}

/* Output-matmul epilogue: for logits columns [r0, r1) of every row, the
 * value and index of the first largest non-NaN logit (index -1 when all are
 * NaN), in slot r0 / ES_EPI_ROWS. */
static void am_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t nv = s->model->info.n_vocab;
    for (int i = 0; i < t->n; i++) {
        const float *row = s->logits + (size_t)i * (size_t)nv;
        size_t slot = (size_t)i * (size_t)s->am_slots + (size_t)(r0 / ES_EPI_ROWS);
        int64_t k = r0;
        while (k < r1 && row[k] != row[k]) k++;   /* argmax_row needs a first value that is not NaN */
        int32_t idx = k < r1 ? (int32_t)(k + argmax_row(row + k, (int)(r1 - k))) : -1;
        s->am_idx[slot] = idx;
        s->am_val[slot] = idx >= 0 ? row[idx] : 0.0f;
    }
}

/* argmax_row of logits row i from the chunks' results: 0 when the first
 * logit is NaN, else the first index of the largest non-NaN logit (chunks
 * in order, a later chunk only when strictly larger). */
static int32_t am_combine(const es_session *s, int i) {
    if (s->logits[(size_t)i * (size_t)s->model->info.n_vocab] != s->logits[(size_t)i * (size_t)s->model->info.n_vocab])
        return 0;
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

static es_status check_forward_args(es_session *s, const int32_t *tokens, int32_t n,
                                    float *logits_out, int32_t mode) {
    const es_model_info *in = &s->model->info;
    if (!tokens || n <= 0) {
        es_set_err(s->err, sizeof s->err, "forward needs n_tokens >= 1 (got %d)", (int)n);
        return ES_ERR_INVALID_ARG;
    }
    if (mode < 0 || mode > 2 || (mode != 0 && !logits_out)) {
        es_set_err(s->err, sizeof s->err, "logits_mode %d invalid or logits_out NULL", (int)mode);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= in->n_vocab) {
            es_set_err(s->err, sizeof s->err, "token %d at index %d outside the vocabulary [0, %d)",
                       (int)tokens[i], (int)i, (int)in->n_vocab);
            return ES_ERR_INVALID_ARG;
        }
    }
    if ((int64_t)s->n_past + n > s->n_ctx) {
        es_set_err(s->err, sizeof s->err, "KV cache full: n_past %d + %d tokens > n_ctx %d",
                   (int)s->n_past, (int)n, (int)s->n_ctx);
        return ES_ERR_CAPACITY;
    }
    return ES_OK;
}

/* The forward pass over n tokens; the output head runs on the last out_rows
 * positions only (n for es_forward, 1 for es_forward_last). Arguments are
 * checked by the callers; the KV cache is unchanged on failure. */
static es_status forward_impl(es_session *s, const int32_t *tokens, int32_t n, int32_t out_rows,
                              int32_t *argmax_out, float *logits_out, int32_t logits_mode) {
    es_status st;
    if ((st = ensure_scratch(s, n)) != ES_OK) return st;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;

    /* embedding lookup: x[i] = tok_embd[tokens[i]] */
    for (int i = 0; i < n; i++) {
        const uint8_t *row = (const uint8_t *)m->tok_embd->data + (size_t)tokens[i] * m->tok_embd->row_bytes;
        es_dequantize_row(m->tok_embd->type, row, s->x + (size_t)i * in->n_embd, in->n_embd);
    }
    fill_rope_table(s, n);
    s->pending_out = 0;
    es_pool_begin(s->pool);
    for (int l = 0; l < in->n_layer; l++) {
        attention_block(s, l, n);
        ffn_block(s, l, n);
    }
    /* output head over positions [n - out_rows, n): logits [out_rows][n_vocab] */
    s->out_first = n - out_rows;
    const es_tensor *wout[1] = {m->output};
    float *ylog[1] = {s->logits};
    int64_t ldlog[1] = {in->n_vocab};
    size_t rs = pre_q8_rs(out_rows, 1, wout);
    s->q8_rs = rs;
    run_rows(s, 0, out_rows, ROWS_NORM_OUT);
    s->q8_rs = 0;
    /* the argmax of each chunk of logits by the thread that computed it, in
     * the matmul's epilogue; then the first largest of the chunks' */
    memset(s->am_idx, 0xFE, (size_t)out_rows * (size_t)s->am_slots * sizeof(int32_t));
    epi_task at = {s, 0, out_rows, 0};
    es_mm_epi epi = {am_epi, &at, 1, ES_EPI_ROWS};
    es_matmul_many_epi(s->pool, 1, wout, s->xb, out_rows, ylog, ldlog, s->mm_scratch, rs != 0, &epi);
    es_pool_end(s->pool);

    if (argmax_out)
        for (int i = 0; i < out_rows; i++) argmax_out[i] = am_combine(s, i);
    if (logits_mode == 1)
        memcpy(logits_out, s->logits + (size_t)(out_rows - 1) * in->n_vocab, (size_t)in->n_vocab * sizeof(float));
    else if (logits_mode == 2)
        memcpy(logits_out, s->logits, (size_t)out_rows * in->n_vocab * sizeof(float));
    s->n_past += n;
    s->err[0] = '\0';
    return ES_OK;
}

es_status es_forward(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_out,
                     float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_forward_args(s, tokens, n, logits_out, logits_mode);
    if (st != ES_OK) return st;
    return forward_impl(s, tokens, n, n, argmax_out, logits_out, logits_mode);
}

es_status es_forward_last(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_last,
                          float *logits_last) {
    if (!s) return ES_ERR_INVALID_ARG;
    int32_t mode = logits_last ? 1 : 0;
    es_status st = check_forward_args(s, tokens, n, logits_last, mode);
    if (st != ES_OK) return st;
    return forward_impl(s, tokens, n, 1, argmax_last, logits_last, mode);
}

const char *es_simd_name(void) { return es_quant_simd_name(); }
