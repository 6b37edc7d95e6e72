/* test_quant.c - dequantizers, activation quantization and es_matmul:
 * accuracy against a double-precision reference, and the determinism
 * contract (SIMD == scalar, one call over N rows == N calls, any pool size),
 * all bitwise. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "quant.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return (uint32_t)((rng_state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float rndf(float lo, float hi) { return lo + (hi - lo) * (float)(rnd() >> 8) / 16777216.0f; }
static uint16_t f16(float f) { return es_fp32_to_fp16(f); }
static void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v; p[1] = (uint8_t)(v >> 8); }

static const uint32_t all_types[] = {ES_TYPE_F32, ES_TYPE_F16, ES_TYPE_BF16, ES_TYPE_Q4_0,
                                     ES_TYPE_Q4_1, ES_TYPE_Q5_0, ES_TYPE_Q5_1, ES_TYPE_Q8_0,
                                     ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K};
#define N_TYPES (int)(sizeof all_types / sizeof all_types[0])

static int64_t blk_elems(uint32_t t) {
    switch (t) {
    case ES_TYPE_F32: case ES_TYPE_F16: case ES_TYPE_BF16: return 1;
    case ES_TYPE_Q4_K: case ES_TYPE_Q5_K: case ES_TYPE_Q6_K: return 256;
    default: return 32;
    }
}
static size_t blk_bytes(uint32_t t) {
    switch (t) {
    case ES_TYPE_F32: return 4;
    case ES_TYPE_F16: case ES_TYPE_BF16: return 2;
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

/* Random bytes with sane scales: every value finite and of moderate size. */
static void fill_block(uint32_t t, uint8_t *p) {
    size_t bb = blk_bytes(t);
    for (size_t i = 0; i < bb; i++) p[i] = (uint8_t)rnd();
    switch (t) {
    case ES_TYPE_F32: { float v = rndf(-1, 1); memcpy(p, &v, 4); break; }
    case ES_TYPE_F16: put16(p, f16(rndf(-1, 1))); break;
    case ES_TYPE_BF16: { float v = rndf(-1, 1); uint32_t u; memcpy(&u, &v, 4); put16(p, (uint16_t)(u >> 16)); break; }
    case ES_TYPE_Q4_0: case ES_TYPE_Q5_0: case ES_TYPE_Q8_0:
        put16(p, f16(rndf(-0.02f, 0.02f)));
        break;
    case ES_TYPE_Q4_1: case ES_TYPE_Q5_1: case ES_TYPE_Q4_K: case ES_TYPE_Q5_K:
        put16(p, f16(rndf(-0.02f, 0.02f)));
        put16(p + 2, f16(rndf(-0.05f, 0.05f)));
        break;
    case ES_TYPE_Q6_K: put16(p + 208, f16(rndf(-0.002f, 0.002f))); break;
    }
}

typedef struct {
    es_tensor t;
    uint8_t *data;
} wmat;

static wmat make_w(uint32_t type, int64_t n_in, int64_t n_out) {
    wmat m;
    memset(&m, 0, sizeof m);
    int64_t be = blk_elems(type);
    size_t rb = (size_t)(n_in / be) * blk_bytes(type);
    m.data = malloc(rb * (size_t)n_out + 1);
    for (int64_t r = 0; r < n_out; r++)
        for (int64_t b = 0; b < n_in / be; b++) fill_block(type, m.data + (size_t)r * rb + (size_t)b * blk_bytes(type));
    m.t.name = "w";
    m.t.type = type;
    m.t.n_dims = 2;
    m.t.ne[0] = n_in;
    m.t.ne[1] = n_out;
    m.t.ne[2] = m.t.ne[3] = 1;
    m.t.n_elements = n_in * n_out;
    m.t.row_bytes = rb;
    m.t.nbytes = rb * (size_t)n_out;
    m.t.data = m.data;
    /* quantized types: the SIMD kernels read the packed copy (none in a scalar build) */
    CHECK(es_tensor_pack(&m.t) >= 0);
    return m;
}

static void free_w(wmat *w) {
    es_tensor_unpack(&w->t);
    free(w->data);
}

static float *rand_x(int N, int64_t n_in) {
    float *x = malloc(sizeof(float) * (size_t)(N * n_in));
    for (int64_t i = 0; i < N * n_in; i++) x[i] = rndf(-2, 2);
    /* some structure: a zero block and a large outlier */
    if (n_in >= 64) {
        memset(x + 32, 0, 32 * sizeof(float));
        x[n_in - 1] = 40.0f;
    }
    return x;
}

static void *scratch_for(uint32_t type, int64_t n_in, int N) {
    size_t n = es_matmul_scratch_bytes(type, n_in, N);
    return aligned_alloc(64, n ? (n + 63) / 64 * 64 : 64);
}

/* Y computed as the contract says, but in double from dequantized rows. */
static void ref_double(const wmat *w, const float *X, int N, double *ref, double *mag) {
    int64_t n_in = w->t.ne[0], n_out = w->t.ne[1];
    float *wr = malloc(sizeof(float) * (size_t)n_in);
    float *xd = malloc(sizeof(float) * (size_t)n_in);
    int quant = w->t.type != ES_TYPE_F32 && w->t.type != ES_TYPE_F16 && w->t.type != ES_TYPE_BF16;
    int64_t ng = (n_in / 32 + 15) / 16;
    es_q8_group *g = aligned_alloc(64, sizeof(es_q8_group) * (size_t)(ng ? ng : 1));
    es_q8k_block *kb = aligned_alloc(64, sizeof(es_q8k_block) * (size_t)(n_in / 256 + 1));
    for (int n = 0; n < N; n++) {
        const float *x = X + (int64_t)n * n_in;
        if (quant && blk_elems(w->t.type) == 256) {   /* K types: one scale per 256 */
            es_quantize_row_q8k(x, n_in, kb);
            for (int64_t i = 0; i < n_in; i++) xd[i] = kb[i / 256].d * (float)kb[i / 256].qs[i % 256];
        } else if (quant) {
            es_quantize_row_q8(x, n_in, g);
            for (int64_t i = 0; i < n_in; i++) {
                int64_t j = i / 32, e = i % 32;
                const es_q8_group *gg = &g[j / 16];
                xd[i] = gg->d[j % 16] * (float)gg->qs[(e / 4) * 64 + (j % 16) * 4 + e % 4];
            }
        } else {
            memcpy(xd, x, sizeof(float) * (size_t)n_in);
        }
        for (int64_t r = 0; r < n_out; r++) {
            es_dequantize_row(w->t.type, w->data + (size_t)r * w->t.row_bytes, wr, n_in);
            double s = 0, a = 0;
            for (int64_t i = 0; i < n_in; i++) {
                s += (double)wr[i] * (double)xd[i];
                a += fabs((double)wr[i] * (double)xd[i]);
            }
            ref[n * n_out + r] = s;
            mag[n * n_out + r] = a;
        }
    }
    free(wr);
    free(xd);
    free(g);
    free(kb);
}

TEST(test_dequant_literal) {
    uint8_t b[34];
    /* Q4_0: d = 0.5, byte i = (i + 1) << 4 | i  -> y[i] = (i - 8) * 0.5, y[i + 16] = (i + 1 - 8) * 0.5 */
    put16(b, f16(0.5f));
    for (int i = 0; i < 16; i++) b[2 + i] = (uint8_t)((((i + 1) & 15) << 4) | i);
    float y[32];
    es_dequantize_row(ES_TYPE_Q4_0, b, y, 32);
    CHECK(y[0] == -4.0f && y[15] == 3.5f && y[16] == -3.5f && y[31] == -4.0f);
    /* Q4_1: d = 0.25, m = -1 */
    put16(b, f16(0.25f));
    put16(b + 2, f16(-1.0f));
    for (int i = 0; i < 16; i++) b[4 + i] = (uint8_t)((15 << 4) | i);
    es_dequantize_row(ES_TYPE_Q4_1, b, y, 32);
    CHECK(y[0] == -1.0f && y[4] == 0.0f && y[16] == 2.75f);
    /* Q8_0: d = 2, q = i - 16 */
    put16(b, f16(2.0f));
    for (int i = 0; i < 32; i++) b[2 + i] = (uint8_t)(int8_t)(i - 16);
    es_dequantize_row(ES_TYPE_Q8_0, b, y, 32);
    CHECK(y[0] == -32.0f && y[31] == 30.0f);
    /* Q5_0: d = 1, qs = 0, qh bit i set for odd i -> y = (16 * (i & 1)) - 16 */
    uint8_t b5[22];
    memset(b5, 0, sizeof b5);
    put16(b5, f16(1.0f));
    b5[2] = b5[3] = b5[4] = b5[5] = 0xAA;
    es_dequantize_row(ES_TYPE_Q5_0, b5, y, 32);
    CHECK(y[0] == -16.0f && y[1] == 0.0f && y[30] == -16.0f && y[31] == 0.0f);
}

TEST(test_dequant_k_literal) {
    /* Q4_K with scales: sub-block 0 sc = 1, m = 2 (j < 4 path); sub-block 4 sc = 3 | (1 << 4), m = 5 | (2 << 4) */
    uint8_t b[144];
    memset(b, 0, sizeof b);
    put16(b, f16(1.0f));
    put16(b + 2, f16(0.5f));
    uint8_t *s = b + 4;
    s[0] = 1 | (1 << 6);           /* sc0 = 1, high bits of sc4 = 1 */
    s[4] = 2 | (2 << 6);           /* m0 = 2, high bits of m4 = 2 */
    s[8] = 3 | (5 << 4);           /* sc4 low = 3, m4 low = 5 */
    for (int l = 0; l < 32; l++) b[16 + 64 + l] = 7;   /* sub-block 4: low nibbles of qs[64..95] */
    for (int l = 0; l < 32; l++) b[16 + l] = 0x90;     /* sub-block 0 low = 0, sub-block 1 high = 9 */
    float y[256];
    es_dequantize_row(ES_TYPE_Q4_K, b, y, 256);
    CHECK(y[0] == -1.0f);                              /* 1 * 1 * 0 - 0.5 * 2 */
    CHECK(y[128] == 19.0f * 7.0f - 0.5f * 37.0f);      /* sc4 = 19, m4 = 37 */
    /* Q6_K: d = 1, scales[0] = 2, ql = 0x21 at l = 0, qh = 0 -> q1 = 1 - 32, q3 = 2 - 32 */
    uint8_t q6[210];
    memset(q6, 0, sizeof q6);
    put16(q6 + 208, f16(1.0f));
    q6[0] = 0x21;
    q6[192] = 2;
    q6[196] = 3;
    es_dequantize_row(ES_TYPE_Q6_K, q6, y, 256);
    CHECK(y[0] == 2.0f * -31.0f);
    CHECK(y[64] == 3.0f * -30.0f);
    CHECK(y[1] == 2.0f * -32.0f);
}

TEST(test_quantize_activations) {
    float x[80];
    for (int i = 0; i < 80; i++) x[i] = (float)(i - 40) * 0.1f;
    memset(x + 32, 0, 32 * sizeof(float));
    es_q8_group g[1];
    es_quantize_row_q8(x, 80, g);
    CHECK(g->d[0] == fabsf(x[0]) / 127.0f);
    CHECK(g->qs[0] == -127);                 /* x[0] = -4 = -amax */
    CHECK(g->d[1] == 0.0f && g->qsum[1] == 0);
    CHECK(g->d[2] == x[79] / 127.0f);
    CHECK(g->d[3] == 0.0f);                  /* past the end: padding */
    int32_t s = 0;
    for (int e = 0; e < 32; e++) s += g->qs[(e / 4) * 64 + e % 4];
    CHECK_EQ_INT(s, g->qsum[0]);
    CHECK(es_matmul_scratch_bytes(ES_TYPE_Q4_1, 576, 5) == 5 * 2 * sizeof(es_q8_group));
    CHECK(es_matmul_scratch_bytes(ES_TYPE_F32, 576, 5) == 0);
}

TEST(test_quantize_simd_vs_ref) {
    /* ties (x * id exactly k + 0.5), zero blocks, tiny and huge values, odd group ends */
    const int64_t ns[] = {32, 64, 512, 544, 576, 1536};
    for (int t = 0; t < 6; t++) {
        int64_t n = ns[t];
        float *x = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) x[i] = rndf(-3, 3);
        for (int64_t i = 0; i < n && i < 32; i++) x[i] = (float)(i - 16) * 0.5f;   /* amax 8: id = 127 / 8 */
        if (n >= 64) {
            memset(x + 32, 0, 32 * sizeof(float));
            x[33] = -0.0f;
        }
        if (n >= 128) for (int i = 64; i < 96; i++) x[i] = (i & 1) ? 1e-30f : -3e20f;
        int64_t ng = (n / 32 + 15) / 16;
        es_q8_group *a = aligned_alloc(64, sizeof(es_q8_group) * (size_t)ng);
        es_q8_group *b = aligned_alloc(64, sizeof(es_q8_group) * (size_t)ng);
        es_quantize_row_q8(x, n, a);
        es_quantize_row_q8_ref(x, n, b);
        CHECK(memcmp(a, b, sizeof(es_q8_group) * (size_t)ng) == 0);
        free(a);
        free(b);
        free(x);
    }
}

TEST(test_quantize_k_activations) {
    /* K records: one scale per 256, the int16 sums per 16 and 32, the
       formats' row sizes, SIMD == scalar on ties, zeros, tiny and huge values */
    float x[512];
    for (int i = 0; i < 512; i++) x[i] = (float)((i * 37) % 101 - 50) * 0.03f;
    x[300] = -9.0f;
    for (int i = 256; i < 272; i++) x[i] = 0.0f;
    es_q8k_block b[2], c[2];
    es_quantize_row_q8k(x, 512, b);
    es_quantize_row_q8k_ref(x, 512, c);
    CHECK(memcmp(b, c, sizeof b) == 0);
    CHECK(b[0].d == 1.5f / 127.0f);
    CHECK(b[1].d == 9.0f / 127.0f && b[1].qs[44] == -127 && b[1].s16[0] == 0);
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < 16; h++) {
            int32_t t = 0;
            for (int e = 0; e < 16; e++) t += b[s].qs[16 * h + e];
            CHECK_EQ_INT(t, b[s].s16[h]);
            if (h % 2) CHECK_EQ_INT(b[s].s16[h - 1] + t, b[s].s32[h / 2]);
        }
    CHECK(es_matmul_q8_row_bytes(ES_TYPE_Q4_K, 1024) == 4 * sizeof(es_q8k_block));
    CHECK(es_matmul_q8_row_bytes(ES_TYPE_Q8_0, 1024) == 2 * sizeof(es_q8_group));
    for (int n = 256; n <= 4096; n += 256)
        CHECK(es_matmul_q8_row_bytes(ES_TYPE_Q6_K, n) <= es_matmul_scratch_bytes(ES_TYPE_Q8_0, n, 1));
    float *y = malloc(sizeof(float) * 1536);
    for (int i = 0; i < 1536; i++) y[i] = rndf(-3, 3);
    for (int i = 0; i < 256; i++) y[i] = (float)(i % 64 - 32) * 0.25f;   /* amax 8: ties x * id = k + 1/2 */
    for (int i = 256; i < 512; i++) y[i] = (i & 1) ? 1e-30f : -3e20f;
    for (int i = 512; i < 768; i++) y[i] = -0.0f;
    es_q8k_block *p = aligned_alloc(64, 6 * sizeof *p), *q = aligned_alloc(64, 6 * sizeof *q);
    es_quantize_row_q8k(y, 1536, p);
    es_quantize_row_q8k_ref(y, 1536, q);
    CHECK(memcmp(p, q, 6 * sizeof *p) == 0);
    CHECK(p[2].d == 0.0f && p[2].s32[7] == 0);
    /* es_quantize_cols_act over disjoint ranges == the whole row */
    memset(p, 0xAB, 6 * sizeof *p);
    es_quantize_cols_act(ES_TYPE_Q5_K, y, 1536, 512, 1536, p);
    es_quantize_cols_act(ES_TYPE_Q5_K, y, 1536, 0, 512, p);
    CHECK(memcmp(p, q, 6 * sizeof *p) == 0);
    free(p);
    free(q);
    free(y);
}

/* Accuracy vs double reference plus all bitwise invariants for one shape. */
static void check_shape(uint32_t type, int64_t n_in, int64_t n_out, int N, es_pool **pools) {
    wmat w = make_w(type, n_in, n_out);
    float *X = rand_x(N, n_in);
    void *sc = scratch_for(type, n_in, N);
    size_t ysz = sizeof(float) * (size_t)(N * n_out);
    float *Y = malloc(ysz), *Ys = malloc(ysz), *Y1 = malloc(ysz), *Yp = malloc(ysz);
    double *ref = malloc(sizeof(double) * (size_t)(N * n_out)), *mag = malloc(sizeof(double) * (size_t)(N * n_out));

    es_matmul(NULL, &w.t, X, N, Y, n_out, sc);
    es_matmul_path(NULL, &w.t, X, N, Ys, n_out, sc, 1);
    int simd_eq = memcmp(Y, Ys, ysz) == 0;
    if (!simd_eq) fprintf(stderr, "  type %u n_in %lld n_out %lld N %d: SIMD != scalar\n", type, (long long)n_in, (long long)n_out, N);
    CHECK(simd_eq);

    ref_double(&w, X, N, ref, mag);
    int bad = 0;
    for (int64_t i = 0; i < N * n_out; i++)
        if (!(fabs((double)Y[i] - ref[i]) <= 2e-6 * mag[i] + 1e-30)) {
            if (bad++ < 3) fprintf(stderr, "  type %u [%lld]: %.9g vs %.9g (mag %.3g)\n", type, (long long)i, Y[i], ref[i], mag[i]);
        }
    CHECK_EQ_INT(bad, 0);

    /* N single calls */
    void *sc1 = scratch_for(type, n_in, 1);
    for (int n = 0; n < N; n++) es_matmul(NULL, &w.t, X + (int64_t)n * n_in, 1, Y1 + (int64_t)n * n_out, n_out, sc1);
    CHECK(memcmp(Y, Y1, ysz) == 0);
    /* pool sizes */
    for (int p = 0; pools && pools[p]; p++) {
        memset(Yp, 0xFF, ysz);
        es_matmul(pools[p], &w.t, X, N, Yp, n_out, sc);
        CHECK(memcmp(Y, Yp, ysz) == 0);
    }
    free(sc1);
    free_w(&w); free(X); free(sc); free(Y); free(Ys); free(Y1); free(Yp); free(ref); free(mag);
}

TEST(test_matmul_all_types) {
    es_pool *pools[4] = {es_pool_new(1), es_pool_new(2), es_pool_new(3), NULL};
    CHECK(pools[0] && pools[1] && pools[2]);
    for (int ti = 0; ti < N_TYPES; ti++) {
        uint32_t t = all_types[ti];
        int64_t be = blk_elems(t);
        int64_t shapes[][2] = {{768, 37}, {be == 256 ? 256 : 32, 5}, {be == 256 ? 512 : 544, 19},
                               {be == 256 ? 1536 : 576, 1}};
        for (int s = 0; s < 4; s++) check_shape(t, shapes[s][0], shapes[s][1], 3, pools);
        if (be == 1) check_shape(t, 45, 7, 2, pools);   /* n_in not a multiple of the lanes */
        if (be == 32) {                                 /* ragged groups of 13 and 6 blocks */
            check_shape(t, 32 * 13, 11, 2, pools);
            check_shape(t, 32 * 22, 6, 2, pools);
            /* 150 blocks: the NEON / AVX2 packed kernels' segments of 64 records,
               a partial last one; 21 rows: a full and a partial 16-row group */
            check_shape(t, 32 * 150, 21, 3, pools);
        }
        if (be == 256) {
            check_shape(t, 256 * 7, 6, 2, pools);   /* 56 blocks: a group of 8 at the end */
            /* 11 super-blocks: the NEON K kernels' segments of 8 records, a partial
               last one (partial sums carried between segments); 21 rows */
            check_shape(t, 256 * 11, 21, 3, pools);
        }
    }
    for (int p = 0; p < 3; p++) es_pool_free(pools[p]);
}

TEST(test_matmul_n_1_to_17) {
    es_pool *pools[3] = {es_pool_new(2), es_pool_new(3), NULL};
    const uint32_t ts[] = {ES_TYPE_Q4_1, ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q6_K, ES_TYPE_F16};
    for (int ti = 0; ti < 5; ti++)
        for (int N = 1; N <= 17; N += (N < 5 ? 1 : 4)) check_shape(ts[ti], 576 - (ts[ti] == ES_TYPE_Q4_K || ts[ti] == ES_TYPE_Q6_K ? 64 : 0), 43, N, pools);
    /* full register tiles of 8 rows and the splits above 8 (16 = 8 + 8, 26 = 7 + 7 + 6 + 6)
       on the 576-wide rows with their 2-block tail */
    const int ns[] = {8, 16, 26};
    for (int ti = 0; ti < 2; ti++)
        for (int j = 0; j < 3; j++) check_shape(ts[ti], 576, 43, ns[j], pools);
    /* more rows than one activation tile (32) */
    check_shape(ES_TYPE_Q4_1, 64, 9, 40, pools);
    check_shape(ES_TYPE_F32, 48, 9, 40, pools);
    es_pool_free(pools[0]);
    es_pool_free(pools[1]);
}

TEST(test_matmul_ldy_and_special_x) {
    /* ldy > n_out leaves the gap untouched; zero and huge activations stay finite */
    wmat w = make_w(ES_TYPE_Q4_1, 64, 6);
    float X[2 * 64];
    for (int i = 0; i < 64; i++) { X[i] = 0.0f; X[64 + i] = (i & 1) ? 3e30f : -3e30f; }
    float Y[2 * 8];
    for (int i = 0; i < 16; i++) Y[i] = 123.0f;
    void *sc = scratch_for(ES_TYPE_Q4_1, 64, 2);
    es_matmul(NULL, &w.t, X, 2, Y, 8, sc);
    CHECK(Y[6] == 123.0f && Y[7] == 123.0f && Y[14] == 123.0f);
    for (int r = 0; r < 6; r++) CHECK(Y[r] == 0.0f);
    float Ys[16];
    memcpy(Ys, Y, sizeof Ys);
    es_matmul_path(NULL, &w.t, X, 2, Ys, 8, sc, 1);
    CHECK(memcmp(Y, Ys, sizeof Ys) == 0);
    free(sc);
    free_w(&w);
}

TEST(test_matmul_many) {
    /* q/k/v-like and mixed types (a Q4_K_M layer has Q4_K and Q6_K; an F16 one
     * shares X unquantized): one dispatch == separate calls, bitwise */
    es_pool *pools[3] = {NULL, es_pool_new(2), es_pool_new(3)};
    const uint32_t ts[4] = {ES_TYPE_Q4_K, ES_TYPE_Q6_K, ES_TYPE_F16, ES_TYPE_Q8_0};
    const int64_t outs[4] = {37, 16, 9, 130};
    for (int N = 1; N <= 9; N += 4) {
        wmat w[4];
        const es_tensor *W[4];
        float *Y[4], *Yr[4];
        int64_t ldy[4];
        for (int i = 0; i < 4; i++) {
            w[i] = make_w(ts[i], 512, outs[i]);
            W[i] = &w[i].t;
            ldy[i] = outs[i] + 3;
            Y[i] = calloc((size_t)(N * ldy[i]), sizeof(float));
            Yr[i] = calloc((size_t)(N * ldy[i]), sizeof(float));
        }
        float *X = rand_x(N, 512);
        void *sc = scratch_for(ES_TYPE_Q4_K, 512, N);
        for (int i = 0; i < 4; i++) es_matmul(NULL, W[i], X, N, Yr[i], ldy[i], sc);
        for (int p = 0; p < 3; p++) {
            for (int i = 0; i < 4; i++) memset(Y[i], 0, sizeof(float) * (size_t)(N * ldy[i]));
            es_matmul_many(pools[p], 4, W, X, N, Y, ldy, sc);
            for (int i = 0; i < 4; i++) CHECK(memcmp(Y[i], Yr[i], sizeof(float) * (size_t)(N * ldy[i])) == 0);
        }
        /* a matrix with another n_in gets NaN rows, the others are still right */
        wmat odd = make_w(ES_TYPE_Q4_0, 256, 5);
        const es_tensor *W2[2] = {W[0], &odd.t};
        float *Yo = calloc((size_t)(N * 5), sizeof(float));
        float *Y2[2] = {Y[0], Yo};
        int64_t ld2[2] = {ldy[0], 5};
        es_matmul_many(pools[1], 2, W2, X, N, Y2, ld2, sc);
        CHECK(memcmp(Y[0], Yr[0], sizeof(float) * (size_t)(N * ldy[0])) == 0);
        CHECK(isnan(Yo[0]) && isnan(Yo[N * 5 - 1]));
        free(Yo);
        free_w(&odd);
        for (int i = 0; i < 4; i++) { free_w(&w[i]); free(Y[i]); free(Yr[i]); }
        free(X);
        free(sc);
    }
    es_pool_free(pools[1]);
    es_pool_free(pools[2]);
}

TEST(test_matmul_grouped) {
    /* the experts of a layer: each matrix on rows of its own, N = 1..33 per group, gate and up
     * sharing their rows (quantized once), mixed types and activation formats, a float matrix,
     * on 1, 2 and 3 threads: bitwise each matrix's own es_matmul */
    es_pool *pools[3] = {NULL, es_pool_new(2), es_pool_new(3)};
    enum { G = 7 };
    const uint32_t ts[G] = {ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q6_K, ES_TYPE_Q8_0, ES_TYPE_Q4_0, ES_TYPE_F16,
                            ES_TYPE_Q5_K};
    const int64_t outs[G] = {48, 48, 130, 37, 16, 9, 64};
    for (int n0 = 1; n0 <= 33; n0 += 8) {
        wmat w[G];
        es_mm_group g[G];
        float *X[G], *Yr[G];
        size_t ysz[G];
        for (int i = 0; i < G; i++) {
            int N = (n0 + 5 * i) % 33 + 1;
            if (i == 1) N = g[0].N;                       /* up shares gate's rows */
            w[i] = make_w(ts[i], 512, outs[i]);
            X[i] = i == 1 ? X[0] : rand_x(N, 512);
            int64_t ldy = outs[i] + 2;
            ysz[i] = sizeof(float) * (size_t)(N * ldy);
            g[i] = (es_mm_group){&w[i].t, X[i], N, calloc(1, ysz[i]), ldy};
            Yr[i] = calloc(1, ysz[i]);
            void *sc = scratch_for(ts[i], 512, N);
            es_matmul(NULL, &w[i].t, X[i], N, Yr[i], ldy, sc);
            free(sc);
        }
        size_t need = es_matmul_grouped_scratch(G, g);
        void *sc = aligned_alloc(64, (need + 63) / 64 * 64);
        for (int p = 0; p < 3; p++) {
            for (int i = 0; i < G; i++) memset(g[i].Y, 0, ysz[i]);
            es_matmul_grouped(pools[p], G, g, sc);
            for (int i = 0; i < G; i++) CHECK(memcmp(g[i].Y, Yr[i], ysz[i]) == 0);
        }
        free(sc);
        for (int i = 0; i < G; i++) {
            free_w(&w[i]);
            free(g[i].Y);
            free(Yr[i]);
            if (i != 1) free(X[i]);
        }
    }
    es_pool_free(pools[1]);
    es_pool_free(pools[2]);
}

/* What test_matmul_local's epilogue saw. */
typedef struct {
    float *Z;            /* [N][n_out] the chunks' values, assembled */
    int *cover;          /* [n_out] chunks that held each row */
    int64_t n_out;
    int N;
    const float *local;  /* the buffers given to the driver, and their extent */
    size_t local_floats, nth;
    int bad;             /* a chunk outside its thread's buffer, or misshaped */
} local_seen;

static void local_record(void *ctx, int mat, int64_t r0, int64_t r1, const float *y, int64_t ldl) {
    local_seen *ls = ctx;
    int in_buf = y >= ls->local && y < ls->local + ls->nth * ls->local_floats;
    if (mat != 0 || r0 < 0 || r1 > ls->n_out || r0 >= r1) { ls->bad = 1; return; }
    if (in_buf && (ldl != r1 - r0 || r0 % 32 != 0 || (size_t)(r1 - r0) * (size_t)ls->N > ls->local_floats ||
                   (size_t)(y - ls->local) % ls->local_floats != 0))
        ls->bad = 1;
    for (int64_t r = r0; r < r1; r++) {
        ls->cover[r]++;
        for (int n = 0; n < ls->N; n++) ls->Z[(int64_t)n * ls->n_out + r] = y[(int64_t)n * ldl + (r - r0)];
    }
}

TEST(test_matmul_local) {
    /* es_mm_epi.local: every chunk's values reach the epilogue from the thread's
       buffer, bitwise es_matmul's, each row in one chunk of at most
       local_floats / N rows; Y is not written. A buffer too small for one
       chunk, or local with joint, falls back to Y and one epilogue call. */
    es_pool *pools[3] = {NULL, es_pool_new(2), es_pool_new(3)};
    const int Ns[4] = {1, 2, 5, 33};
    const int64_t n_in = 512, n_out = 301;
    for (size_t ti = 0; ti < sizeof all_types / sizeof all_types[0]; ti++) {
        wmat w = make_w(all_types[ti], n_in, n_out);
        const es_tensor *W[1] = {&w.t};
        for (int ni = 0; ni < 4; ni++) {
            int N = Ns[ni];
            float *X = rand_x(N, n_in);
            void *sc = scratch_for(ES_TYPE_Q4_K, n_in, N);
            float *Yr = malloc(sizeof(float) * (size_t)(N * n_out)), *Y = malloc(sizeof(float) * (size_t)(N * n_out));
            float *Z = malloc(sizeof(float) * (size_t)(N * n_out));
            int *cover = malloc(sizeof(int) * (size_t)n_out);
            es_matmul(NULL, W[0], X, N, Yr, n_out, sc);
            for (int p = 0; p < 3; p++)
                for (int v = 0; v < 4; v++) {
                    /* buffers of 1 and 3 chunks of 32 rows (+ a ragged end), too small, joint */
                    size_t lf = v == 0 ? (size_t)N * 32 : v == 1 ? (size_t)N * 96 + 17 : (size_t)N * 32 - 1;
                    size_t nth = (size_t)es_pool_size(pools[p]);
                    float *local = malloc(sizeof(float) * nth * lf);
                    local_seen ls = {Z, cover, n_out, N, local, lf, nth, 0};
                    memset(Z, 0xFF, sizeof(float) * (size_t)(N * n_out));
                    memset(Y, 0x6B, sizeof(float) * (size_t)(N * n_out));
                    memset(cover, 0, sizeof(int) * (size_t)n_out);
                    es_mm_epi epi = {.ctx = &ls, .joint = v == 3, .gran = 32, .local_fn = local_record,
                                     .local = local, .local_floats = lf};
                    float *Yp[1] = {Y};
                    int64_t ld[1] = {n_out};
                    es_matmul_many_epi(pools[p], 1, W, X, N, Yp, ld, sc, 0, &epi);
                    CHECK_EQ_INT(ls.bad, 0);
                    int once = 1;
                    for (int64_t r = 0; r < n_out; r++) once &= cover[r] == 1;
                    CHECK(once);
                    int same = memcmp(Z, Yr, sizeof(float) * (size_t)(N * n_out)) == 0;
                    if (!same)
                        fprintf(stderr, "  type %u, N %d, pool %d, buffer %d: local values differ\n", all_types[ti],
                                N, p, v);
                    CHECK(same);
                    int untouched = 1;
                    for (int64_t i = 0; i < (int64_t)N * n_out; i++) {
                        uint32_t u;
                        memcpy(&u, &Y[i], 4);
                        untouched &= u == 0x6B6B6B6Bu;
                    }
                    if (v < 2) CHECK(untouched);
                    else CHECK(memcmp(Y, Yr, sizeof(float) * (size_t)(N * n_out)) == 0);   /* the fallback */
                    free(local);
                }
            free(X); free(sc); free(Yr); free(Y); free(Z); free(cover);
        }
        free_w(&w);
    }
    es_pool_free(pools[1]);
    es_pool_free(pools[2]);
}

TEST(test_matmul_many_pre_k) {
    /* rows pre-quantized with es_quantize_row_act for K weights (Q4_K q/k, Q6_K v)
       == es_matmul; a call that mixes the formats (Q4_K with Q8_0) ignores the
       pre-quantized rows (garbage here) and quantizes X per format */
    es_pool *pool = es_pool_new(2);
    const int N = 5;
    const int64_t n_in = 768;
    wmat a = make_w(ES_TYPE_Q4_K, n_in, 37), b = make_w(ES_TYPE_Q6_K, n_in, 21), c = make_w(ES_TYPE_Q8_0, n_in, 19);
    float *X = rand_x(N, n_in);
    void *sc = scratch_for(ES_TYPE_Q8_0, n_in, N);
    size_t rs = es_matmul_q8_row_bytes(ES_TYPE_Q4_K, n_in);
    CHECK(rs == 3 * sizeof(es_q8k_block));
    float *Yr[3], *Y[3];
    int64_t ld[3] = {37, 21, 19};
    const es_tensor *W[3] = {&a.t, &b.t, &c.t};
    for (int i = 0; i < 3; i++) {
        Yr[i] = malloc(sizeof(float) * (size_t)(N * ld[i]));
        Y[i] = malloc(sizeof(float) * (size_t)(N * ld[i]));
        es_matmul(NULL, W[i], X, N, Yr[i], ld[i], sc);
    }
    for (int n = 0; n < N; n++) es_quantize_row_act(ES_TYPE_Q6_K, X + n * n_in, n_in, (uint8_t *)sc + (size_t)n * rs);
    es_matmul_many_pre(pool, 2, W, X, N, Y, ld, sc);
    for (int i = 0; i < 2; i++) CHECK(memcmp(Y[i], Yr[i], sizeof(float) * (size_t)(N * ld[i])) == 0);
    const es_tensor *Wm[2] = {&a.t, &c.t};
    float *Ym[2] = {Y[0], Y[2]};
    int64_t ldm[2] = {37, 19};
    memset(sc, 0x5A, es_matmul_scratch_bytes(ES_TYPE_Q8_0, n_in, N));
    es_matmul_many_pre(pool, 2, Wm, X, N, Ym, ldm, sc);
    CHECK(memcmp(Y[0], Yr[0], sizeof(float) * (size_t)(N * 37)) == 0);
    CHECK(memcmp(Y[2], Yr[2], sizeof(float) * (size_t)(N * 19)) == 0);
    for (int i = 0; i < 3; i++) { free(Y[i]); free(Yr[i]); }
    free_w(&a); free_w(&b); free_w(&c);
    free(X);
    free(sc);
    es_pool_free(pool);
}

TEST(test_unsupported_type) {
    wmat w = make_w(ES_TYPE_Q4_0, 32, 2);
    w.t.type = ES_TYPE_Q2_K;
    float X[32] = {0}, Y[2] = {0, 0};
    CHECK(!es_matmul_supported(ES_TYPE_Q2_K));
    es_matmul(NULL, &w.t, X, 1, Y, 2, NULL);
    CHECK(isnan(Y[0]) && isnan(Y[1]));
    free_w(&w);
}

/* The KV cache's F16 row conversion (the SIMD path where the build has one)
 * is bitwise the scalar es_fp32_to_fp16 on every float32 class: random bit
 * patterns (NaNs, infinities, subnormals included), rounding ties, the
 * F16 overflow and underflow edges; and the scalar NaN rule is the
 * hardware's (quiet, payload truncated). */
TEST(test_fp16_row) {
    enum { N = 4099 };
    static uint32_t bits[N];
    static const uint32_t edge[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7f800001u,
                                    0xffc00000u, 0x7fffe000u, 0x477fefffu, 0x477ff000u, 0x477fe000u,
                                    0x33000000u, 0x33000001u, 0x32ffffffu, 0x387fc000u, 0x38800000u,
                                    0x3f801000u, 0x3f803000u, 0x3f800fffu, 0xc7800000u, 0x00000001u};
    size_t ne = sizeof edge / sizeof edge[0];
    for (int i = 0; i < N; i++) {
        uint32_t r = rnd();
        bits[i] = i < (int)ne ? edge[i] : (i % 3 == 0 ? r : 0x30000000u + r % 0x18000000u);
    }
    float x[N];
    memcpy(x, bits, sizeof x);
    uint16_t h[N];
    for (int n = 1; n <= N; n += n < 40 ? 1 : 509) {
        memset(h, 0xAB, sizeof h);
        es_fp32_to_fp16_row(h, x, n);
        int bad = 0;
        for (int i = 0; i < n; i++) bad += h[i] != es_fp32_to_fp16(x[i]);
        CHECK_EQ_INT(bad, 0);
        CHECK(n == N || h[n] == 0xABAB);
    }
    CHECK_EQ_INT(es_fp32_to_fp16(x[4]), 0x7e00);   /* signalling NaN, payload 1: quiet, payload gone */
    CHECK_EQ_INT(es_fp32_to_fp16(x[5]), 0xfe00);
    CHECK_EQ_INT(es_fp32_to_fp16(x[6]), 0x7fff);
    CHECK_EQ_INT(es_fp32_to_fp16(x[7]), 0x7bff);   /* 65519.99: largest finite */
    CHECK_EQ_INT(es_fp32_to_fp16(x[8]), 0x7c00);   /* 65520 rounds to inf */
    CHECK_EQ_INT(es_fp32_to_fp16(x[10]), 0x0000);  /* 2^-25: tie to even (0) */
    CHECK_EQ_INT(es_fp32_to_fp16(x[11]), 0x0001);
    CHECK_EQ_INT(es_fp32_to_fp16(x[15]), 0x3c00);  /* 1 + 2^-11: tie to even */
    CHECK_EQ_INT(es_fp32_to_fp16(x[16]), 0x3c02);  /* 1 + 3 * 2^-11: tie to even (up) */
}

TEST(test_simd_name) {
    const char *s = es_quant_simd_name();
    CHECK(!strcmp(s, "avx512") || !strcmp(s, "avx2") || !strcmp(s, "neon-dotprod") ||
          !strcmp(s, "neon") || !strcmp(s, "scalar"));
#ifdef ES_FORCE_SCALAR
    CHECK(!strcmp(s, "scalar"));
#endif
    printf("  simd path: %s\n", s);
}

TEST(test_pack_per_build) {
    /* Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 are packed (and the packed kernels run, compared
       with the scalar ones above) exactly where the build has packed
       kernels: AVX-512, AVX2, NEON with dotprod; never in a scalar build.
       Q4_K / Q5_K / Q6_K: AVX-512, AVX2 and NEON with dotprod as well. */
    const char *s = es_quant_simd_name();
    int want = !strcmp(s, "avx512") || !strcmp(s, "avx2") || !strcmp(s, "neon-dotprod");
    int want_k = !strcmp(s, "avx512") || !strcmp(s, "avx2") || !strcmp(s, "neon-dotprod");
#ifdef ES_FORCE_SCALAR
    CHECK(!want && !want_k);
#endif
    const uint32_t ts[8] = {ES_TYPE_Q4_0, ES_TYPE_Q4_1, ES_TYPE_Q5_0, ES_TYPE_Q5_1,
                            ES_TYPE_Q8_0, ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K};
    for (int i = 0; i < 8; i++) {
        wmat w = make_w(ts[i], 512, 20);
        es_tensor_unpack(&w.t);
        CHECK(w.t.packed == NULL);
        int r = es_tensor_pack(&w.t);
        CHECK_EQ_INT(r, blk_elems(ts[i]) == 256 ? want_k : want);
        CHECK((w.t.packed != NULL) == (r == 1));
        /* 2 groups x (16 blocks or 2 super-blocks) */
        if (r == 1) CHECK(w.t.packed_bytes == 2 * (512 / (size_t)blk_elems(ts[i])) * es_pack_record_bytes(ts[i]));
        free_w(&w);
    }
}

TEST(test_matmul_k_n_1_to_33) {
    /* the packed K kernels: every N from 1 to 33 (register tiles of 1..8
       rows and their splits), rows ending in a partial 16-row group, rows
       of 2 super-blocks (one activation group) and of 3 (a lone one) */
    es_pool *pools[3] = {es_pool_new(2), es_pool_new(3), NULL};
    const uint32_t ts[3] = {ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K};
    for (int ti = 0; ti < 3; ti++)
        for (int N = 1; N <= 33; N++) check_shape(ts[ti], N % 2 ? 768 : 512, N % 3 ? 37 : 16, N, N % 4 ? NULL : pools);
    es_pool_free(pools[0]);
    es_pool_free(pools[1]);
}

TEST(test_matmul_blocks_n_1_to_33) {
    /* the packed kernels of the 32-element block types: every N from 1 to 33
       (register tiles and their splits), the 576-wide rows of SmolLM2 (18
       blocks: a group and a 2-block tail), rows ending in a partial 16-row
       group (37: a last group of 5 rows, one half) or in full groups (16:
       both halves at once), 150 blocks (segments of 64 records) */
    es_pool *pools[3] = {es_pool_new(2), es_pool_new(3), NULL};
    const uint32_t ts[5] = {ES_TYPE_Q4_0, ES_TYPE_Q4_1, ES_TYPE_Q5_0, ES_TYPE_Q5_1, ES_TYPE_Q8_0};
    for (int ti = 0; ti < 5; ti++) {
        for (int N = 1; N <= 33; N++) check_shape(ts[ti], N % 2 ? 576 : 512, N % 3 ? 37 : 16, N, N % 4 ? NULL : pools);
        check_shape(ts[ti], 32 * 150, 21, 5, pools);
    }
    es_pool_free(pools[0]);
    es_pool_free(pools[1]);
}

/* Q5_0 / Q5_1 values from a packed record (quant.h), element e of row r. */
static float packed_q5_value(uint32_t type, const uint8_t *rec, int r, int e) {
    int c = (e % 16) / 4, b = e % 4;
    uint8_t qb = rec[64 * c + 4 * r + b];
    int q = e < 16 ? qb & 15 : qb >> 4;
    int chunk = e / 4;   /* elements 4 chunk .. 4 chunk + 3 */
    q |= ((rec[ES_PK_Q5_QH + 4 * r + b] >> chunk) & 1) << 4;
    uint16_t dh, mh;
    memcpy(&dh, rec + ES_PK_Q5_D + 2 * r, 2);
    if (type == ES_TYPE_Q5_0) return (float)(q - 16) * es_fp16_to_fp32(dh);
    memcpy(&mh, rec + ES_PK_Q5_M + 2 * r, 2);
    return (float)q * es_fp16_to_fp32(dh) + es_fp16_to_fp32(mh);
}

TEST(test_pack_layout_q5) {
    const uint32_t ts[2] = {ES_TYPE_Q5_0, ES_TYPE_Q5_1};
    const int64_t n_in = 96, n_out = 21, nb = n_in / 32, ng = 2;
    for (int ti = 0; ti < 2; ti++) {
        uint32_t t = ts[ti];
        size_t rec = es_pack_record_bytes(t);
        CHECK(rec == 16 * blk_bytes(t));
        CHECK(es_pack_block_elems(t) == 32);
        wmat w = make_w(t, n_in, n_out);
        uint8_t *pk = malloc((size_t)(ng * nb) * rec);
        memset(pk, 0xAB, (size_t)(ng * nb) * rec);
        es_pack_rows(t, w.data, w.t.row_bytes, n_in, n_out, pk);
        float ref[96];
        int bad = 0;
        for (int64_t row = 0; row < ng * 16; row++) {
            if (row < n_out) es_dequantize_row(t, w.data + (size_t)row * w.t.row_bytes, ref, n_in);
            for (int64_t j = 0; j < nb; j++) {
                const uint8_t *rp = pk + (size_t)((row / 16) * nb + j) * rec;
                for (int e = 0; e < 32; e++) {
                    float v = packed_q5_value(t, rp, (int)(row % 16), e);
                    float want = row < n_out ? ref[j * 32 + e] : 0.0f;
                    if (memcmp(&v, &want, 4) != 0 && !(row >= n_out && v == 0.0f)) bad++;
                }
            }
        }
        if (bad) fprintf(stderr, "  type %u: %d values differ\n", t, bad);
        CHECK_EQ_INT(bad, 0);
        free(pk);
        free_w(&w);
    }
}

/* The documented packed layouts (quant.h), read back independently: the
 * dequantized values of every row from its packed records equal
 * es_dequantize_row of the original row bitwise, and padding rows are zero.
 * es_pack_rows works in every build, whether or not it has a packed kernel. */
static float packed_k_value(uint32_t type, const uint8_t *rec, int r, int j, int e) {
    int k = e / 4, b = e % 4;
    if (type == ES_TYPE_Q6_K) {
        int h = j / 4, s = j % 4;
        uint8_t lb = rec[(2 * h + (s & 1)) * 512 + 64 * k + 4 * r + b];
        uint8_t hb = rec[ES_PK_Q6K_QH + 512 * h + 64 * k + 4 * r + b];
        int q = ((s >= 2 ? lb >> 4 : lb & 15) | (((hb >> (2 * s)) & 3) << 4)) - 32;
        int8_t sc = (int8_t)rec[ES_PK_Q6K_SC + 16 * (2 * j + e / 16) + r];
        uint16_t dh;
        memcpy(&dh, rec + ES_PK_Q6K_D + 2 * r, 2);
        return es_fp16_to_fp32(dh) * (float)sc * (float)q;
    }
    int five = type == ES_TYPE_Q5_K;
    uint8_t qb = rec[(j / 2) * 512 + 64 * k + 4 * r + b];
    int q = (j & 1) ? qb >> 4 : qb & 15;
    if (five) q |= ((rec[ES_PK_Q5K_QH + 64 * k + 4 * r + b] >> j) & 1) << 4;
    uint8_t s12[12];
    size_t so = five ? ES_PK_Q5K_SC : ES_PK_Q4K_SC;
    for (int w = 0; w < 3; w++) memcpy(s12 + 4 * w, rec + so + 64 * w + 4 * r, 4);
    int sc, m;
    es_scale_min_k4(j, s12, &sc, &m);
    uint16_t dh, mh;
    memcpy(&dh, rec + (five ? ES_PK_Q5K_D : ES_PK_Q4K_D) + 2 * r, 2);
    memcpy(&mh, rec + (five ? ES_PK_Q5K_DMIN : ES_PK_Q4K_DMIN) + 2 * r, 2);
    float d1 = es_fp16_to_fp32(dh) * (float)sc, m1 = es_fp16_to_fp32(mh) * (float)m;
    return d1 * (float)q - m1;
}

TEST(test_pack_layout_k) {
    const uint32_t ts[3] = {ES_TYPE_Q4_K, ES_TYPE_Q5_K, ES_TYPE_Q6_K};
    const int64_t n_in = 768, n_out = 21, nb = n_in / 256, ng = 2;
    for (int ti = 0; ti < 3; ti++) {
        uint32_t t = ts[ti];
        size_t rec = es_pack_record_bytes(t);
        CHECK(rec == 16 * blk_bytes(t));
        CHECK(es_pack_block_elems(t) == 256);
        wmat w = make_w(t, n_in, n_out);
        uint8_t *pk = malloc((size_t)(ng * nb) * rec);
        memset(pk, 0xAB, (size_t)(ng * nb) * rec);
        es_pack_rows(t, w.data, w.t.row_bytes, n_in, n_out, pk);
        float ref[768];
        int bad = 0;
        for (int64_t row = 0; row < ng * 16; row++) {
            if (row < n_out) es_dequantize_row(t, w.data + (size_t)row * w.t.row_bytes, ref, n_in);
            for (int64_t s = 0; s < nb; s++) {
                const uint8_t *rp = pk + (size_t)((row / 16) * nb + s) * rec;
                for (int i = 0; i < 256; i++) {
                    float v = packed_k_value(t, rp, (int)(row % 16), i / 32, i % 32);
                    float want = row < n_out ? ref[s * 256 + i] : 0.0f;
                    if (memcmp(&v, &want, 4) != 0 && !(row >= n_out && v == 0.0f)) bad++;
                }
            }
        }
        if (bad) fprintf(stderr, "  type %u: %d values differ\n", t, bad);
        CHECK_EQ_INT(bad, 0);
        free(pk);
        free_w(&w);
    }
}

int main(void) {
    RUN(test_dequant_literal);
    RUN(test_dequant_k_literal);
    RUN(test_quantize_activations);
    RUN(test_quantize_simd_vs_ref);
    RUN(test_quantize_k_activations);
    RUN(test_matmul_all_types);
    RUN(test_matmul_n_1_to_17);
    RUN(test_matmul_k_n_1_to_33);
    RUN(test_matmul_blocks_n_1_to_33);
    RUN(test_matmul_ldy_and_special_x);
    RUN(test_matmul_many);
    RUN(test_matmul_grouped);
    RUN(test_matmul_many_pre_k);
    RUN(test_matmul_local);
    RUN(test_unsupported_type);
    RUN(test_fp16_row);
    RUN(test_simd_name);
    RUN(test_pack_per_build);
    RUN(test_pack_layout_k);
    RUN(test_pack_layout_q5);
    return harness_report();
}
