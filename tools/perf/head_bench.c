/*
 * head_bench.c - the output head alone: es_matmul_many_epi over a random
 * [n_vocab][n_embd] matrix with an argmax epilogue, the logits written to a
 * [N][n_vocab] buffer (as the forward does when logits are wanted) against
 * each chunk in its thread's buffer (es_mm_epi.local, the argmax-only path).
 * The epilogue is the same scan in both; only where the chunk's values live
 * differs. Thread CPU time of the calling thread (1-thread pool: no
 * workers), median (min) of REPS calls per mode, the modes alternated (the
 * order flipped each round), and the median over the rounds of local minus
 * written; the two argmax results are checked equal.
 *
 *   make -C tools/perf head_bench        (SIMD=avx2 etc. for another path)
 *   tools/perf/build/head_bench TYPE N_VOCAB N_EMBD N REPS      (TYPE: q6_k or q8_0)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"
#include "quant.h"

static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint64_t rs = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)(rs >> 32);
}

typedef struct {
    int N;
    int64_t n_vocab;
    const float *Y;     /* written mode: the logits */
    float *val;         /* [N][chunks by ES_EPI_ROWS] */
    int32_t *idx;
    int64_t slots;
} head_ctx;

static void reduce(head_ctx *h, int64_t r0, int64_t r1, const float *y, int64_t ld) {
    for (int n = 0; n < h->N; n++) {
        const float *row = y + (size_t)n * (size_t)ld;
        int64_t b = 0;
        for (int64_t k = 1; k < r1 - r0; k++)
            if (row[k] > row[b]) b = k;
        h->idx[n * h->slots + r0 / ES_EPI_ROWS] = (int32_t)(r0 + b);
        h->val[n * h->slots + r0 / ES_EPI_ROWS] = row[b];
    }
}
static void epi_written(void *ctx, int mat, int64_t r0, int64_t r1) {
    head_ctx *h = ctx;
    reduce(h, r0, r1, h->Y + r0, h->n_vocab);
}
static void epi_local(void *ctx, int mat, int64_t r0, int64_t r1, const float *y, int64_t ldl) {
    reduce(ctx, r0, r1, y, ldl);
}

static void combine(const head_ctx *h, int32_t *out) {
    for (int n = 0; n < h->N; n++) {
        int32_t best = -1;
        float bv = 0;
        for (int64_t c = 0; c < h->slots; c++) {
            int32_t i = h->idx[n * h->slots + c];
            if (i < 0) continue;
            if (best < 0 || h->val[n * h->slots + c] > bv) {
                best = i;
                bv = h->val[n * h->slots + c];
            }
        }
        out[n] = best;
    }
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: %s q6_k|q8_0 N_VOCAB N_EMBD N REPS\n", argv[0]);
        return 2;
    }
    uint32_t type = strcmp(argv[1], "q8_0") == 0 ? ES_TYPE_Q8_0 : ES_TYPE_Q6_K;
    int64_t nv = atoll(argv[2]), ne = atoll(argv[3]);
    int N = atoi(argv[4]), reps = atoi(argv[5]);
    if (nv < 32 || ne < 256 || ne % 256 || N < 1 || N > 64 || reps < 1) {
        fprintf(stderr, "N_VOCAB >= 32, N_EMBD a multiple of 256, N in [1, 64], REPS >= 1\n");
        return 2;
    }
    size_t bb = type == ES_TYPE_Q8_0 ? sizeof(es_block_q8_0) : sizeof(es_block_q6_K);
    int64_t be = type == ES_TYPE_Q8_0 ? 32 : 256;
    size_t rb = (size_t)(ne / be) * bb;
    uint8_t *data = malloc(rb * (size_t)nv);
    if (!data) return 1;
    for (size_t i = 0; i < rb * (size_t)nv; i++) data[i] = (uint8_t)rnd();
    for (int64_t r = 0; r < nv; r++)   /* finite scales */
        for (int64_t b = 0; b < ne / be; b++) {
            uint8_t *blk = data + (size_t)r * rb + (size_t)b * bb;
            uint16_t d = es_fp32_to_fp16((float)(rnd() % 1000 + 1) * 1e-6f);
            size_t off = type == ES_TYPE_Q8_0 ? 0 : 208;
            blk[off] = (uint8_t)d;
            blk[off + 1] = (uint8_t)(d >> 8);
        }
    es_tensor t;
    memset(&t, 0, sizeof t);
    t.name = "output";
    t.type = type;
    t.n_dims = 2;
    t.ne[0] = ne;
    t.ne[1] = nv;
    t.ne[2] = t.ne[3] = 1;
    t.n_elements = ne * nv;
    t.row_bytes = rb;
    t.nbytes = rb * (size_t)nv;
    t.data = data;
    es_tensor_pack(&t);
    float *X = malloc(sizeof(float) * (size_t)(N * ne)), *Y = malloc(sizeof(float) * (size_t)(N * nv));
    for (int64_t i = 0; i < N * ne; i++) X[i] = (float)((int)(rnd() % 2001) - 1000) * 1e-3f;
    size_t scb = es_matmul_scratch_bytes(type, ne, N);
    void *sc = aligned_alloc(64, (scb + 63) / 64 * 64);
    size_t lf = (size_t)N * ES_EPI_ROWS > ES_HEAD_TMP_BYTES / 4 ? (size_t)N * ES_EPI_ROWS : ES_HEAD_TMP_BYTES / 4;
    float *local = aligned_alloc(64, (lf * sizeof(float) + 63) / 64 * 64);
    int64_t slots = (nv + ES_EPI_ROWS - 1) / ES_EPI_ROWS;
    head_ctx h = {N, nv, Y, malloc(sizeof(float) * (size_t)(N * slots)), malloc(sizeof(int32_t) * (size_t)(N * slots)),
                  slots};
    double *tw = malloc(sizeof(double) * (size_t)reps), *tl = malloc(sizeof(double) * (size_t)reps);
    int32_t aw[64], al[64];
    const es_tensor *W[1] = {&t};
    float *Yp[1] = {Y};
    int64_t ld[1] = {nv};
    int bad = 0;
    for (int r = 0; r < reps; r++)
        for (int j = 0; j < 2; j++) {
            int loc = (r + j) % 2;
            memset(h.idx, 0xFF, sizeof(int32_t) * (size_t)(N * slots));
            es_mm_epi ew = {.fn = epi_written, .ctx = &h, .joint = 1, .gran = ES_EPI_ROWS};
            es_mm_epi el = {.ctx = &h, .gran = ES_EPI_ROWS, .local_fn = epi_local, .local = local, .local_floats = lf};
            double a = cpu_ms();
            es_matmul_many_epi(NULL, 1, W, X, N, Yp, ld, sc, 0, loc ? &el : &ew);
            combine(&h, loc ? al : aw);
            (loc ? tl : tw)[r] = cpu_ms() - a;
        }
    for (int n = 0; n < N; n++) bad += aw[n] != al[n];
    double *d = malloc(sizeof(double) * (size_t)reps);
    for (int r = 0; r < reps; r++) d[r] = tl[r] - tw[r];
    qsort(d, (size_t)reps, sizeof(double), cmp);
    qsort(tw, (size_t)reps, sizeof(double), cmp);
    qsort(tl, (size_t)reps, sizeof(double), cmp);
    printf("%s [%lld x %lld], N %d, %s: logits written %.3f ms (min %.3f), local chunks %.3f ms (min %.3f), "
           "local minus written per round (median) %+.3f ms%s\n",
           argv[1], (long long)nv, (long long)ne, N, es_quant_simd_name(), tw[reps / 2], tw[0], tl[reps / 2], tl[0],
           d[reps / 2], bad ? "  ARGMAX DIFFERS" : "");
    return bad != 0;
}
