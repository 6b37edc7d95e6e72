/*
 * test_sparse.c - sparse attention (es_session_params sparse_topk K): a
 * key-split call attends, per global layer and KV head, block 0, the two
 * recent blocks and the K other blocks of the largest key bound. On
 * qwen3-mixed (GQA: 2 KV heads of 2 query heads) and llama-q4_1 (1 KV head
 * of 3), a generation of T = 640 positions (10 blocks):
 *   K covering every block: every logit bitwise a dense session's, in single
 *   steps and in verify-sized chunks;
 *   K = 2 (5 blocks of 10 kept at the end): the logits are bitwise the same
 *   on 1, 2 and 3 threads, and in a batch beside another session; rows whose
 *   context has at most K + 3 blocks are bitwise dense, every later row is
 *   not; each step's blocks (es_session_sparse_blocks) are K + 3 distinct
 *   ascending blocks holding 0 and the two recent ones, chosen alike on
 *   every thread count; a prefill call stays dense (no blocks reported);
 *   a rollback then the same steps again gives the same logits (the bounds
 *   keep nothing of the removed positions); a checksum of the logits
 *   recorded from the scalar build holds on every SIMD path.
 * Bad parameters are refused with a message, and so is KV eviction beside.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "tiny_models.h"

#define ROW ((size_t)N_VOCAB * sizeof(float))
#define T 640          /* 10 blocks */
#define PRE 100        /* a prefill call (query split: dense) before the steps */
#define MAXSEL 16

/* FNV-1a of the K = 2 single-step logits of each model, recorded from SIMD=scalar */
static const uint64_t SUMS[2] = {0x5aab756a7f5feca3ULL, 0x25c7c1b811b6e6faULL};

static char g_dir[256];

static es_session *sp_session(const es_model *m, int topk, int nt) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = T;
    sp.n_threads = nt;
    sp.sparse_topk = topk;
    return tm_session_params(m, &sp);
}

static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static void tokens(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 37 + salt * 13 + (i * i) % 7 + 3) % N_VOCAB);
}

/* tok[0, PRE) in one call, then the rest in calls of `chunk` tokens, all
 * logits into out (rows [PRE, T)); sel, when not NULL, gets each call's
 * blocks of (layer 0, KV head 0) then (last layer, last KV head): [T][2][MAXSEL + 1],
 * the count first. */
static void run(es_session *s, const int32_t *tok, int chunk, float *out, int32_t *sel, int n_layer, int n_kv) {
    CHECK_EQ_INT(es_forward(s, tok, PRE, NULL, out, ES_LOGITS_ALL), ES_OK);
    int32_t n = -1;
    CHECK_EQ_INT(es_session_sparse_blocks(s, 0, 0, NULL, 0, &n), ES_OK);
    CHECK_EQ_INT(n, 0);   /* prefill: dense */
    for (int p = PRE; p < T; p += chunk) {
        int c = chunk < T - p ? chunk : T - p;
        CHECK_EQ_INT(es_forward(s, tok + p, c, NULL, out + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
        for (int k = 0; sel && k < 2; k++) {
            int32_t *dst = sel + ((size_t)p * 2 + k) * (MAXSEL + 1);
            CHECK_EQ_INT(es_session_sparse_blocks(s, k ? n_layer - 1 : 0, k ? n_kv - 1 : 0, dst + 1, MAXSEL, &dst[0]),
                         ES_OK);
        }
    }
}

TEST(topk_covering_every_block_is_dense) {
    for (int which = 0; which < 2; which++) {
        es_model *m = tm_load(g_dir, which);
        if (!m) continue;
        int32_t tok[T];
        tokens(tok, T, which);
        float *ref = malloc(ROW * T), *got = malloc(ROW * T);
        es_session *d = sp_session(m, 0, 2);
        if (d) run(d, tok, 1, ref, NULL, 0, 0);
        const int chunks[2] = {1, 5};
        for (int c = 0; c < 2 && d; c++) {
            es_session *s = sp_session(m, T / 64, 1 + c);
            if (!s) continue;
            run(s, tok, chunks[c], got, NULL, 0, 0);
            CHECK(memcmp(ref, got, ROW * T) == 0);
            es_session_free(s);
        }
        es_session_free(d);
        free(ref);
        free(got);
        es_model_free(m);
    }
}

/* The blocks of one call: K + 3 distinct ascending, with 0, last - 1 and last. */
static void check_selection(const int32_t *sel, int K, int32_t last) {
    CHECK_EQ_INT(sel[0], K + 3);
    if (sel[0] != K + 3) return;
    const int32_t *b = sel + 1;
    CHECK_EQ_INT(b[0], 0);
    CHECK_EQ_INT(b[K + 1], last - 1);
    CHECK_EQ_INT(b[K + 2], last);
    for (int i = 1; i < K + 3; i++) CHECK(b[i] > b[i - 1]);
}

TEST(fewer_blocks_is_one_result_whatever_the_threads) {
    const int K = 2;
    for (int which = 0; which < 2; which++) {
        es_model *m = tm_load(g_dir, which);
        if (!m) continue;
        es_model_info in;
        es_model_get_info(m, &in);
        int32_t tok[T];
        tokens(tok, T, which + 2);
        float *dense = malloc(ROW * T), *ref = malloc(ROW * T), *got = malloc(ROW * T);
        size_t sel_n = (size_t)T * 2 * (MAXSEL + 1);
        int32_t *sref = calloc(sel_n, sizeof *sref), *sgot = calloc(sel_n, sizeof *sgot);
        es_session *d = sp_session(m, 0, 1), *s = sp_session(m, K, 1);
        if (d && s) {
            run(d, tok, 1, dense, NULL, 0, 0);
            run(s, tok, 1, ref, sref, in.n_layer, in.n_head_kv);
            /* the rows of a context of at most K + 3 blocks are dense, later ones not */
            int dense_rows = (K + 3) * 64, differ = 0, varied = 0;
            CHECK(memcmp(ref, dense, ROW * dense_rows) == 0);
            for (int r = dense_rows; r < T; r++)
                differ += memcmp(ref + (size_t)r * N_VOCAB, dense + (size_t)r * N_VOCAB, ROW) != 0;
            CHECK_EQ_INT(differ, T - dense_rows);
            for (int p = PRE; p < T; p++)
                for (int k = 0; k < 2; k++) {
                    const int32_t *sl = sref + ((size_t)p * 2 + k) * (MAXSEL + 1);
                    if (p < dense_rows) CHECK_EQ_INT(sl[0], 0);
                    else check_selection(sl, K, p / 64);
                    /* the chosen middle blocks are not always the first ones after the sink */
                    if (p >= dense_rows && sl[0] == K + 3 && sl[2] != 1) varied++;
                }
            CHECK(varied > 0);
            uint64_t h = fnv(ref, ROW * T);
            fprintf(stderr, "  %s (%s): logits checksum 0x%016llx\n", MODELS[which].name, es_simd_name(),
                    (unsigned long long)h);
            CHECK(h == SUMS[which]);
            fprintf(stderr, "  %s: %d of %d rows differ from dense, %d choices past block 1\n", MODELS[which].name,
                    differ, T - PRE, varied);
            for (int nt = 2; nt <= 3; nt++) {
                es_session *u = sp_session(m, K, nt);
                if (!u) continue;
                memset(sgot, 0, sel_n * sizeof *sgot);
                run(u, tok, 1, got, sgot, in.n_layer, in.n_head_kv);
                CHECK(memcmp(ref, got, ROW * T) == 0);
                CHECK(memcmp(sref, sgot, sel_n * sizeof *sref) == 0);
                es_session_free(u);
            }
            /* a rollback into a block, then the same steps: the same logits */
            int back = T - 100;
            CHECK_EQ_INT(es_session_rollback(s, back), ES_OK);
            int32_t other[40];
            tokens(other, 40, 9);
            CHECK_EQ_INT(es_forward(s, other, 40, NULL, NULL, ES_LOGITS_NONE), ES_OK);   /* other keys there */
            CHECK_EQ_INT(es_session_rollback(s, back), ES_OK);
            for (int p = back; p < T; p++)
                CHECK_EQ_INT(es_forward(s, tok + p, 1, NULL, got + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
            CHECK(memcmp(ref + (size_t)back * N_VOCAB, got + (size_t)back * N_VOCAB, ROW * (T - back)) == 0);
            /* verify-sized calls: the same on 1 and 3 threads */
            es_session *a = sp_session(m, K, 1), *b = sp_session(m, K, 3);
            if (a && b) {
                run(a, tok, 5, ref, NULL, 0, 0);
                run(b, tok, 5, got, NULL, 0, 0);
                CHECK(memcmp(ref, got, ROW * T) == 0);
            }
            es_session_free(a);
            es_session_free(b);
            /* a batch: the sparse session beside a dense one, on 2 threads */
            a = sp_session(m, K, 2);
            b = sp_session(m, 0, 1);
            if (a && b) {
                float *g2 = malloc(ROW * 8);
                CHECK_EQ_INT(es_forward(a, tok, T - 8, NULL, NULL, ES_LOGITS_NONE), ES_OK);
                es_batch_item it[2] = {
                    {a, tok + T - 8, 8, ES_HEAD_ALL, NULL, got, ES_LOGITS_ALL, ES_OK},
                    {b, tok, 8, ES_HEAD_ALL, NULL, g2, ES_LOGITS_ALL, ES_OK},
                };
                CHECK_EQ_INT(es_forward_batch(it, 2), ES_OK);
                es_session *c = sp_session(m, K, 1);
                float *want = malloc(ROW * 8);
                if (c) {
                    CHECK_EQ_INT(es_forward(c, tok, T - 8, NULL, NULL, ES_LOGITS_NONE), ES_OK);
                    CHECK_EQ_INT(es_forward(c, tok + T - 8, 8, NULL, want, ES_LOGITS_ALL), ES_OK);
                    CHECK(memcmp(want, got, ROW * 8) == 0);
                }
                CHECK(memcmp(dense, g2, ROW * 8) == 0);
                es_session_free(c);
                free(want);
                free(g2);
            }
            es_session_free(a);
            es_session_free(b);
        }
        es_session_free(d);
        es_session_free(s);
        free(dense);
        free(ref);
        free(got);
        free(sref);
        free(sgot);
        es_model_free(m);
    }
}

TEST(bad_parameters_are_refused) {
    es_model *m = tm_load(g_dir, 0);
    if (!m) return;
    const int32_t bad[] = {-1, -64, ES_MAX_SPARSE_TOPK + 1};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        es_session_params sp = es_session_default_params();
        sp.sparse_topk = bad[i];
        es_session *s = NULL;
        char err[256] = "";
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(s == NULL && strstr(err, "sparse_topk") != NULL);
    }
    es_session_params sp = es_session_default_params();
    sp.sparse_topk = 4;
    sp.kv_window = 128;
    es_session *s = NULL;
    char err[256] = "";
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_UNSUPPORTED);
    CHECK(s == NULL && strstr(err, "sparse attention") != NULL && strstr(err, "KV eviction") != NULL);
    /* the accessor: arguments out of range */
    s = sp_session(m, 4, 1);
    if (s) {
        int32_t blk[4], n = 0;
        CHECK_EQ_INT(es_session_sparse_blocks(s, 2, 0, blk, 4, &n), ES_ERR_INVALID_ARG);
        CHECK(strstr(es_session_last_error(s), "out of range") != NULL);
        CHECK_EQ_INT(es_session_sparse_blocks(s, 0, 1, blk, 4, &n), ES_ERR_INVALID_ARG);
        CHECK_EQ_INT(es_session_sparse_blocks(s, 0, 0, blk, 4, NULL), ES_ERR_INVALID_ARG);
        int32_t tok[T];
        tokens(tok, T, 5);
        CHECK_EQ_INT(es_forward(s, tok, T - 1, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok + T - 1, 1, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        CHECK_EQ_INT(es_session_sparse_blocks(s, 0, 0, blk, 4, &n), ES_ERR_INVALID_ARG);   /* 7 blocks > cap 4 */
        CHECK(strstr(es_session_last_error(s), "cap") != NULL);
        es_session_free(s);
    }
    es_model_free(m);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_sparse_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(topk_covering_every_block_is_dense);
    RUN(fewer_blocks_is_one_result_whatever_the_threads);
    RUN(bad_parameters_are_refused);
    rmdir(g_dir);
    return harness_report();
}
