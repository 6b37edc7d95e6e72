/*
 * kernel_bench.c - time es_matmul on the SmolLM2-135M shapes.
 *
 * One "step" is every matmul of a forward pass: 30 layers x (q, k, v, o,
 * gate, up, down; Q4_1) + the output projection (Q8_0, 576 -> 49152), with
 * distinct random weights per layer (96 MiB, like the real model, so the
 * weights stream from memory). Prints, for N = 1, 2, 5, 9, 17 activation
 * rows, the median ms of a step, the weight bandwidth in GB/s and the ratio
 * to N = 1, plus a per-shape breakdown at N = 1.
 *
 *   make -C tools/perf kernel_bench      (SIMD=avx2 etc. for another path)
 *   tools/perf/build/kernel_bench [n_threads=2] [reps=15] [wall|cpu]
 *   tools/perf/build/kernel_bench types [reps=15]     per-type compute cost (see types_bench)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "quant.h"

static clockid_t clk = CLOCK_MONOTONIC;
static double now_ms(void) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static uint64_t rs = 88172645463325252ull;
static uint32_t rnd(void) {
    rs ^= rs << 13;
    rs ^= rs >> 7;
    rs ^= rs << 17;
    return (uint32_t)rs;
}

/* Block bytes / elements and the byte offsets of the fp16 scales of a block. */
static size_t blk_bytes(uint32_t t) {
    switch (t) {
    case ES_TYPE_Q4_0: return 18;
    case ES_TYPE_Q4_1: return 20;
    case ES_TYPE_Q5_0: return 22;
    case ES_TYPE_Q5_1: return 24;
    case ES_TYPE_Q8_0: return 34;
    case ES_TYPE_Q4_K: return 144;
    case ES_TYPE_Q5_K: return 176;
    case ES_TYPE_Q6_K: return 210;
    default: return 0;
    }
}
static int64_t blk_elems(uint32_t t) { return t == ES_TYPE_Q4_K || t == ES_TYPE_Q5_K || t == ES_TYPE_Q6_K ? 256 : 32; }

static es_tensor make(uint32_t type, int64_t n_in, int64_t n_out) {
    size_t bb = blk_bytes(type);
    es_tensor t;
    memset(&t, 0, sizeof t);
    t.type = type;
    t.n_dims = 2;
    t.ne[0] = n_in;
    t.ne[1] = n_out;
    t.ne[2] = t.ne[3] = 1;
    t.row_bytes = (size_t)(n_in / blk_elems(type)) * bb;
    t.nbytes = t.row_bytes * (size_t)n_out;
    uint8_t *d = aligned_alloc(64, (t.nbytes + 63) / 64 * 64);
    for (size_t i = 0; i < t.nbytes; i++) d[i] = (uint8_t)rnd();
    for (size_t b = 0; b < t.nbytes / bb; b++) { /* sane fp16 scales: 0x2000 ~ 0.0078 */
        uint8_t *p = d + b * bb + (type == ES_TYPE_Q6_K ? 208 : 0);
        p[0] = 0;
        p[1] = 0x20;
        if (type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1 || type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K) { p[2] = 0; p[3] = 0xA0; }
    }
    t.data = d;
    if (es_tensor_pack(&t) < 0) { fprintf(stderr, "out of memory\n"); exit(1); }
    return t;
}

/* "types": each packed type on one cache-hot 1024 x 1024 matrix, 1 thread,
 * N = 1, 2, 5, 9, 17: the compute cost in ns per KiB of weights per
 * activation row, and per 256 weights (the same work for every type). */
static int types_bench(int reps);

#define NL 30
#define NM (NL * 7 + 1)

static void empty_task(void *ctx, int ith, int nth) { (void)ctx; (void)ith; (void)nth; }

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "types")) return types_bench(argc > 2 ? atoi(argv[2]) : 15);
    int nth = argc > 1 ? atoi(argv[1]) : 2;
    int reps = argc > 2 ? atoi(argv[2]) : 15;
    /* "cpu": process CPU time instead of wall time (for a loaded host; with
     * 1 thread it is the pure compute cost) */
    if (argc > 3 && !strcmp(argv[3], "cpu")) clk = CLOCK_PROCESS_CPUTIME_ID;
    static es_tensor w[NM];
    const int64_t shp[7][2] = {{576, 576}, {576, 192}, {576, 192}, {576, 576}, {576, 1536}, {576, 1536}, {1536, 576}};
    const char *names[8] = {"q", "k", "v", "o", "gate", "up", "down", "output"};
    double bytes = 0;
    for (int l = 0; l < NL; l++)
        for (int m = 0; m < 7; m++) { w[l * 7 + m] = make(ES_TYPE_Q4_1, shp[m][0], shp[m][1]); bytes += (double)w[l * 7 + m].nbytes; }
    w[NM - 1] = make(ES_TYPE_Q8_0, 576, 49152);
    bytes += (double)w[NM - 1].nbytes;
    const int Ns[5] = {1, 2, 5, 9, 17};
    float *X = malloc(sizeof(float) * 17 * 1536);
    for (int i = 0; i < 17 * 1536; i++) X[i] = (float)((int)(rnd() % 2001) - 1000) / 500.0f;
    float *Y = malloc(sizeof(float) * 17 * 49152);
    void *sc = aligned_alloc(64, es_matmul_scratch_bytes(ES_TYPE_Q4_1, 1536, 17));
    es_pool *pool = es_pool_new(nth);
    printf("simd %s, threads %d, weights %.1f MiB per step, median of %d, %s time\n", es_quant_simd_name(), nth,
           bytes / (1 << 20), reps, clk == CLOCK_MONOTONIC ? "wall" : "process CPU");
    double t1 = 0;
    double *ts = malloc(sizeof(double) * (size_t)reps);
    for (int ni = 0; ni < 5; ni++) {
        int N = Ns[ni];
        for (int r = -2; r < reps; r++) {
            double t0 = now_ms();
            es_pool_begin(pool);
            for (int m = 0; m < NM; m++) es_matmul(pool, &w[m], X, N, Y, w[m].ne[1], sc);
            es_pool_end(pool);
            if (r >= 0) ts[r] = now_ms() - t0;
        }
        qsort(ts, (size_t)reps, sizeof *ts, cmp);
        double med = ts[reps / 2];
        if (N == 1) t1 = med;
        printf("N=%2d  step %7.3f ms  %6.1f GB/s  %6.3f ms/row  ratio to N=1 %.2f\n", N, med, bytes / med / 1e6, med / N,
               med / t1);
    }
    /* per-shape at N = 1 over all layers (streaming) */
    printf("per shape, N=1, summed over the 30 layers (output: once):\n");
    for (int m = 0; m < 8; m++) {
        for (int r = -2; r < reps; r++) {
            double t0 = now_ms();
            es_pool_begin(pool);
            if (m < 7)
                for (int l = 0; l < NL; l++) es_matmul(pool, &w[l * 7 + m], X, 1, Y, w[l * 7 + m].ne[1], sc);
            else
                es_matmul(pool, &w[NM - 1], X, 1, Y, 49152, sc);
            es_pool_end(pool);
            if (r >= 0) ts[r] = now_ms() - t0;
        }
        qsort(ts, (size_t)reps, sizeof *ts, cmp);
        double b = m < 7 ? (double)w[m].nbytes * NL : (double)w[NM - 1].nbytes;
        printf("  %-6s %7.3f ms  %6.1f GB/s\n", names[m], ts[reps / 2], b / ts[reps / 2] / 1e6);
    }
    /* dispatch cost of an empty task: inside begin/end (spinning workers) and outside */
    for (int mode = 0; mode < 2; mode++) {
        int runs = mode ? 2000 : 100000;
        double t0 = now_ms();
        if (!mode) es_pool_begin(pool);
        for (int i = 0; i < runs; i++) es_pool_run(pool, empty_task, NULL);
        if (!mode) es_pool_end(pool);
        printf("es_pool_run of an empty task, %s: %.2f us\n", mode ? "without begin/end" : "inside begin/end",
               (now_ms() - t0) * 1e3 / runs);
    }
    /* cache-hot: one layer's q (Q4_1 576 x 576, 203 KiB) repeated, 1 thread: compute cost */
    for (int ni = 0; ni < 5; ni++) {
        int N = Ns[ni];
        for (int r = -2; r < reps; r++) {
            double t0 = now_ms();
            for (int i = 0; i < 100; i++) es_matmul(NULL, &w[0], X, N, Y, 576, sc);
            if (r >= 0) ts[r] = (now_ms() - t0) / 100;
        }
        qsort(ts, (size_t)reps, sizeof *ts, cmp);
        printf("hot q 576x576 1 thread N=%2d: %7.4f ms, %.3f ns per weight block per row\n", N, ts[reps / 2],
               ts[reps / 2] * 1e6 / (576.0 * 18 * N));
    }
    es_pool_free(pool);
    return 0;
}

static int types_bench(int reps) {
    clk = CLOCK_THREAD_CPUTIME_ID;
    const uint32_t ts[8] = {ES_TYPE_Q4_0, ES_TYPE_Q4_1, ES_TYPE_Q5_0, ES_TYPE_Q5_1, ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K};
    const char *names[8] = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"};
    const int Ns[5] = {1, 2, 5, 9, 17};
    const int64_t n = 1024;
    float *X = malloc(sizeof(float) * 17 * n), *Y = malloc(sizeof(float) * 17 * n);
    for (int i = 0; i < 17 * n; i++) X[i] = (float)((int)(rnd() % 2001) - 1000) / 500.0f;
    void *sc = aligned_alloc(64, es_matmul_scratch_bytes(ES_TYPE_Q4_1, n, 17));
    double *tm = malloc(sizeof(double) * (size_t)reps);
    printf("simd %s, 1 thread, cache-hot 1024 x 1024, thread CPU time, median of %d\n", es_quant_simd_name(), reps);
    printf("type  packed  ns/KiB/row at N = 1, 2, 5, 9, 17        ns/256 weights/row at N = 1, 2, 5, 9, 17\n");
    for (int ti = 0; ti < 8; ti++) {
        es_tensor w = make(ts[ti], n, n);
        double kib = (double)w.nbytes / 1024, per[5];
        printf("%-5s %-6s", names[ti], w.packed ? "yes" : "no");
        for (int ni = 0; ni < 5; ni++) {
            int N = Ns[ni];
            for (int r = -2; r < reps; r++) {
                double t0 = now_ms();
                for (int i = 0; i < 20; i++) es_matmul(NULL, &w, X, N, Y, n, sc);
                if (r >= 0) tm[r] = (now_ms() - t0) / 20;
            }
            qsort(tm, (size_t)reps, sizeof *tm, cmp);
            per[ni] = tm[reps / 2] * 1e6 / N;
            printf(" %6.1f", per[ni] / kib);
        }
        printf("   ");
        for (int ni = 0; ni < 5; ni++) printf(" %6.2f", per[ni] / ((double)n * n / 256));
        printf("\n");
        es_tensor_unpack(&w);
        free((void *)w.data);
    }
    return 0;
}
