/*
 * test_kvq8.c - the Q8_0 KV cache (es_session_params kv_type ES_KV_Q8_0):
 *   quantize on write: the int8s and scales the cache holds for a position
 *   are ggml's quantize_row_q8_0_ref of the key (value) row the forward
 *   computed, written out here in the test's own words, and q * d is within
 *   half a step (plus the F16 rounding of d) of the row;
 *   the contract: on llama-q4_1 (1 KV head of 3), qwen3-mixed (GQA) and
 *   gemma3-swa (sliding-window rings), the logits of T positions in single
 *   steps are bitwise those of verify-sized calls (5 tokens), of 1, 2 and 3
 *   threads, of a rollback then the same steps, and of a batch beside an F16
 *   session; the F16 session's are not (the cache is really Q8_0) but close;
 *   a checksum of the logits recorded from the scalar build holds on every
 *   SIMD path;
 *   KV eviction and sparse attention on a Q8_0 cache: verify-sized calls
 *   bitwise single steps (eviction), a K covering every block bitwise dense;
 *   es_session_kv_bytes is 34 / 64 of the F16 cache's;
 *   bad parameters: an unknown kv_type (ES_ERR_INVALID_ARG) and a head_dim
 *   that is not a multiple of 32 (qwen2-f32, 16: ES_ERR_UNSUPPORTED), each
 *   with a message naming kv_type.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "tiny_models.h"

#define ROW ((size_t)N_VOCAB * sizeof(float))
#define T 200          /* 4 blocks, the last in part */
#define PRE 40         /* a prefill call (query split) before the steps */

/* FNV-1a of the single-step Q8_0 logits of llama-q4_1, qwen3-mixed and gemma3-swa,
 * recorded from SIMD=scalar */
static const uint64_t SUMS[3] = {0xe8bf4bc35fd3ad59ULL, 0xe711b9ce8666be2dULL, 0xda365c21b07ff405ULL};
static const int WHICH[3] = {0, 1, 5};

static char g_dir[256];

static es_session *q8_session(const es_model *m, int kv_type, int nt) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = T;
    sp.n_threads = nt;
    sp.kv_type = kv_type;
    return tm_session_params(m, &sp);
}

static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static void tokens(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 41 + salt * 19 + (i * i) % 13 + 1) % N_VOCAB);
}

/* tok[0, PRE) in one call, then the rest in calls of `chunk` tokens, every row's logits into out. */
static void run(es_session *s, const int32_t *tok, int chunk, float *out) {
    CHECK_EQ_INT(es_forward(s, tok, PRE, NULL, out, ES_LOGITS_ALL), ES_OK);
    for (int p = PRE; p < T; p += chunk) {
        int c = chunk < T - p ? chunk : T - p;
        CHECK_EQ_INT(es_forward(s, tok + p, c, NULL, out + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
    }
}

/* ggml's quantize_row_q8_0_ref of one block, as its source reads. */
static void ref_q8_0(const float *x, float *d_out, int8_t *q) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
    const float d = amax / ((1 << 7) - 1);
    const float id = d ? 1.0f / d : 0.0f;
    *d_out = d;
    for (int j = 0; j < 32; j++) q[j] = (int8_t)roundf(x[j] * id);
}

TEST(quantize_on_write_is_ggml_q8_0) {
    /* a literal block first: amax 8 at element 0 -> 127, the half-way element rounds away from 0 */
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = (float)(j % 5) - 2.0f;
    x[0] = -8.0f;
    x[1] = 8.0f / 127.0f * 2.5f;   /* 2.5 steps: roundf gives 3 */
    uint16_t d;
    int8_t q[32];
    es_kv_quantize_q8_0(x, &d, q);
    CHECK_EQ_INT(q[0], -127);
    CHECK_EQ_INT(q[1], 3);
    CHECK_EQ_INT(q[2], (int)roundf(0.0f));
    CHECK_EQ_INT(q[4], (int)roundf(2.0f * 127.0f / 8.0f));   /* 31.75 -> 32 */
    CHECK(es_fp16_to_fp32(d) == es_fp16_to_fp32(es_fp32_to_fp16(8.0f / 127.0f)));
    float zero[32] = {0};
    es_kv_quantize_q8_0(zero, &d, q);
    CHECK_EQ_INT(d, 0);
    for (int j = 0; j < 32; j++) CHECK_EQ_INT(q[j], 0);

    /* the cache after a forward: the last layer's K and V rows of each position of the call */
    for (int w = 0; w < 2; w++) {
        es_model *m = tm_load(g_dir, WHICH[w]);
        if (!m) continue;
        es_model_info in;
        es_model_get_info(m, &in);
        es_session *s = q8_session(m, ES_KV_Q8_0, 2);
        int32_t tok[T];
        tokens(tok, T, w);
        const int n = 70, hd = in.head_dim, l = in.n_layer - 1;   /* positions [0, 70): two blocks */
        CHECK_EQ_INT(es_forward(s, tok, n, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        int bad_q = 0, bad_d = 0, bad_err = 0;
        for (int p = 0; s && p < n; p++)
            for (int g = 0; g < in.n_head_kv; g++)
                for (int kv = 0; kv < 2; kv++) {
                    const float *row = (kv ? s->v : s->k) + ((size_t)p * in.n_head_kv + g) * hd;
                    const uint8_t *blk = kv ? es_kv_v_block(&s->kv, l, g, p / 64) : es_kv_k_block(&s->kv, l, g, p / 64);
                    const int8_t *bq = (const int8_t *)blk;
                    const uint16_t *bs = (const uint16_t *)(const void *)(blk + (size_t)hd * 64);
                    int t = p % 64;
                    for (int j = 0; j < hd / 32; j++) {
                        float rd;
                        int8_t rq[32];
                        ref_q8_0(row + 32 * j, &rd, rq);
                        uint16_t sd = kv ? bs[(size_t)t * (hd / 32) + j] : bs[(size_t)j * 64 + t];
                        bad_d += sd != es_fp32_to_fp16(rd);
                        float dd = es_fp16_to_fp32(sd);
                        for (int e = 0; e < 32; e++) {
                            int dim = 32 * j + e;
                            int8_t cq = kv ? bq[(size_t)t * hd + dim] : bq[(size_t)dim * 64 + t];
                            bad_q += cq != rq[e];
                            /* round trip: half a step, plus 127 steps of d's F16 rounding */
                            float err = fabsf((float)cq * dd - row[dim]);
                            bad_err += err > rd * 0.5f + 127.0f * fabsf(dd - rd) + 1e-30f;
                        }
                    }
                }
        CHECK_EQ_INT(bad_q, 0);
        CHECK_EQ_INT(bad_d, 0);
        CHECK_EQ_INT(bad_err, 0);
        es_session_free(s);
        es_model_free(m);
    }
}

TEST(decode_verify_rollback_threads_batch_agree) {
    for (int w = 0; w < 3; w++) {
        es_model *m = tm_load(g_dir, WHICH[w]);
        if (!m) continue;
        int32_t tok[T];
        tokens(tok, T, w + 3);
        float *ref = malloc(ROW * T), *got = malloc(ROW * T), *f16 = malloc(ROW * T);
        es_session *s = q8_session(m, ES_KV_Q8_0, 1), *h = q8_session(m, ES_KV_F16, 1);
        if (s && h) {
            run(s, tok, 1, ref);
            run(h, tok, 1, f16);
            uint64_t sum = fnv(ref, ROW * T);
            fprintf(stderr, "  %s (%s): Q8_0 logits checksum 0x%016llx\n", MODELS[WHICH[w]].name, es_simd_name(),
                    (unsigned long long)sum);
            CHECK(sum == SUMS[w]);
            /* Q8_0 is not F16, but near it: every row differs somewhere, none by much */
            int same = 0;
            float maxd = 0.0f, maxl = 0.0f;
            for (int r = 0; r < T; r++) {
                same += memcmp(ref + (size_t)r * N_VOCAB, f16 + (size_t)r * N_VOCAB, ROW) == 0;
                for (int v = 0; v < N_VOCAB; v++) {
                    size_t i = (size_t)r * N_VOCAB + v;
                    float dd = fabsf(ref[i] - f16[i]);
                    maxd = dd > maxd ? dd : maxd;
                    maxl = fabsf(f16[i]) > maxl ? fabsf(f16[i]) : maxl;
                }
            }
            fprintf(stderr, "  %s: Q8_0 vs F16 logits: max |diff| %.4g (max |logit| %.4g)\n",
                    MODELS[WHICH[w]].name, (double)maxd, (double)maxl);
            CHECK(same < T / 2);
            CHECK(maxd < 0.1f * maxl);
            /* verify-sized calls, 2 and 3 threads */
            for (int nt = 1; nt <= 3; nt++) {
                es_session *u = q8_session(m, ES_KV_Q8_0, nt);
                if (!u) continue;
                run(u, tok, nt == 1 ? 5 : nt == 2 ? 1 : 7, got);
                CHECK(memcmp(ref, got, ROW * T) == 0);
                es_session_free(u);
            }
            /* a rollback into a block, other tokens written there, rolled back, the same steps again */
            int back = T - 50;
            CHECK_EQ_INT(es_session_rollback(s, back), ES_OK);
            int32_t other[20];
            tokens(other, 20, 11);
            CHECK_EQ_INT(es_forward(s, other, 20, NULL, NULL, ES_LOGITS_NONE), ES_OK);
            CHECK_EQ_INT(es_session_rollback(s, back), ES_OK);
            for (int p = back; p < T; p += 4) {
                int c = 4 < T - p ? 4 : T - p;
                CHECK_EQ_INT(es_forward(s, tok + p, c, NULL, got + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
            }
            CHECK(memcmp(ref + (size_t)back * N_VOCAB, got + (size_t)back * N_VOCAB, ROW * (T - back)) == 0);
            /* a batch on 2 threads: the Q8_0 session beside an F16 one */
            es_session *a = q8_session(m, ES_KV_Q8_0, 2), *b = q8_session(m, ES_KV_F16, 1);
            if (a && b) {
                float *g2 = malloc(ROW * 6);
                CHECK_EQ_INT(es_forward(a, tok, T - 6, NULL, NULL, ES_LOGITS_NONE), ES_OK);
                es_batch_item it[2] = {
                    {a, tok + T - 6, 6, ES_HEAD_ALL, NULL, got, ES_LOGITS_ALL, ES_OK},
                    {b, tok, 6, ES_HEAD_ALL, NULL, g2, ES_LOGITS_ALL, ES_OK},
                };
                CHECK_EQ_INT(es_forward_batch(it, 2), ES_OK);
                CHECK(memcmp(ref + (size_t)(T - 6) * N_VOCAB, got, ROW * 6) == 0);
                CHECK(memcmp(f16, g2, ROW * 6) == 0);
                free(g2);
            }
            es_session_free(a);
            es_session_free(b);
        }
        es_session_free(s);
        es_session_free(h);
        free(ref);
        free(got);
        free(f16);
        es_model_free(m);
    }
}

TEST(eviction_and_sparse_on_q8_0) {
    es_model *m = tm_load(g_dir, 0);
    if (!m) return;
    int32_t tok[T];
    tokens(tok, T, 7);
    float *ref = malloc(ROW * T), *got = malloc(ROW * T);
    /* KV eviction: sinks 4, window 70, slack 20 (a ring that wraps within T) */
    es_session_params sp = es_session_default_params();
    sp.n_ctx = 64;
    sp.swa_slack = 20;
    sp.kv_sinks = 4;
    sp.kv_window = 70;
    sp.kv_type = ES_KV_Q8_0;
    es_session *a = tm_session_params(m, &sp);
    sp.n_threads = 3;
    es_session *b = tm_session_params(m, &sp);
    if (a && b) {
        for (int p = 0; p < T; p++)
            CHECK_EQ_INT(es_forward(a, tok + p, 1, NULL, ref + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
        for (int p = 0; p < T; p += 5)
            CHECK_EQ_INT(es_forward(b, tok + p, 5, NULL, got + (size_t)p * N_VOCAB, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(ref, got, ROW * T) == 0);
        CHECK(es_session_min_rollback(a) > 0);   /* the ring wrapped */
    }
    es_session_free(a);
    es_session_free(b);
    /* sparse attention: K covering every block is dense; K = 1 is one result on 1 and 3 threads */
    es_session *d = q8_session(m, ES_KV_Q8_0, 2);
    if (d) run(d, tok, 1, ref);
    for (int k = 0; k < 2 && d; k++) {
        es_session_params pp = es_session_default_params();
        pp.n_ctx = T;
        pp.kv_type = ES_KV_Q8_0;
        pp.sparse_topk = k == 0 ? T / 64 + 1 : 1;
        pp.n_threads = 1;
        es_session *s1 = tm_session_params(m, &pp);
        pp.n_threads = 3;
        es_session *s3 = tm_session_params(m, &pp);
        if (s1 && s3) {
            run(s1, tok, 1, got);
            if (k == 0) CHECK(memcmp(ref, got, ROW * T) == 0);
            float *g3 = malloc(ROW * T);
            run(s3, tok, 1, g3);
            CHECK(memcmp(got, g3, ROW * T) == 0);
            if (k == 1) {
                int32_t blk[8], n = 0;   /* the last step chose 4 blocks (K + 3) of 4 possible: all */
                CHECK_EQ_INT(es_session_sparse_blocks(s1, 0, 0, blk, 8, &n), ES_OK);
                CHECK(n == 0 || n == 4);
            }
            free(g3);
        }
        es_session_free(s1);
        es_session_free(s3);
    }
    es_session_free(d);
    free(ref);
    free(got);
    es_model_free(m);
}

TEST(kv_bytes_halve) {
    for (int w = 0; w < 3; w++) {
        es_model *m = tm_load(g_dir, WHICH[w]);
        if (!m) continue;
        es_session *h = q8_session(m, ES_KV_F16, 1), *q = q8_session(m, ES_KV_Q8_0, 1);
        if (h && q) {
            size_t bh = es_session_kv_bytes(h), bq = es_session_kv_bytes(q);
            CHECK(bh > 0);
            CHECK_EQ_INT(bq * 64, bh * 34);
        }
        es_session_free(h);
        es_session_free(q);
        es_model_free(m);
    }
}

TEST(bad_parameters_are_refused) {
    es_model *m = tm_load(g_dir, 0);
    if (m) {
        const int32_t bad[] = {-1, 2, 8};
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
            es_session_params sp = es_session_default_params();
            sp.kv_type = bad[i];
            es_session *s = NULL;
            char err[256] = "";
            CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
            CHECK(s == NULL && strstr(err, "kv_type") != NULL);
        }
        CHECK_EQ_INT(es_session_default_params().kv_type, ES_KV_F16);
        es_model_free(m);
    }
    m = tm_load(g_dir, 2);   /* qwen2-f32: head_dim 16 */
    if (m) {
        es_session_params sp = es_session_default_params();
        sp.kv_type = ES_KV_Q8_0;
        es_session *s = NULL;
        char err[256] = "";
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_UNSUPPORTED);
        CHECK(s == NULL && strstr(err, "kv_type") != NULL && strstr(err, "head_dim 16") != NULL);
        sp.kv_type = ES_KV_F16;
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_OK);
        es_session_free(s);
        es_model_free(m);
    }
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_kvq8_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(quantize_on_write_is_ggml_q8_0);
    RUN(decode_verify_rollback_threads_batch_agree);
    RUN(eviction_and_sparse_on_q8_0);
    RUN(kv_bytes_halve);
    RUN(bad_parameters_are_refused);
    rmdir(g_dir);
    return harness_report();
}
