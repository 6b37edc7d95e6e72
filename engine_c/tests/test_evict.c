/*
 * test_evict.c - KV eviction (es_session_params kv_sinks S, kv_window W):
 * every layer's query at p attends [0, S) U (p - W, p], kept in sink blocks
 * plus a ring of round_up(W + slack, 64) positions. Two cases, each run to
 * T positions, four times S + W and past n_ctx:
 *   S4W70    qwen3-mixed (GQA: 2 query heads a KV head), sinks inside block
 *            0 whose window start leaves block 0 at p = 133, slack 20: a
 *            ring of 2 blocks, so the window's first and last blocks share
 *            one ring block
 *   S100W40  llama-q4_1, sinks over 2 blocks, the second in part (the gap
 *            [100, p - 39) inside block 1 for p in [140, 166]), slack 16: a
 *            ring of 1 block
 * Every logit is bitwise one call's (run in pieces of the slack) on 1
 * thread: single steps on 3 threads, chunks shorter and longer than the
 * slack on 2, es_forward_last, es_decode, a batch beside a plain session; a
 * rollback as deep as the ring allows, then the rest again; one position
 * deeper is refused with a message, the KV cache unchanged. The rows before
 * the window drops anything are bitwise a plain session's, and later rows
 * are not. A checksum of the logits recorded from the scalar build holds on
 * every SIMD path. The KV bytes are the sinks plus the ring whatever T;
 * bad parameters are refused, and so is a model with sliding-window layers.
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
#define N_CTX 64       /* what the sessions are given: T runs past it */

static char g_dir[256];

typedef struct {
    const char *name;
    int model, sinks, window, slack, T;
    uint64_t sum;      /* FNV-1a of the logits of the T positions, recorded from SIMD=scalar */
} ev_case;

static const ev_case CASES[2] = {
    {"S4W70", 1, 4, 70, 20, 296, 0x1b85c8cc5172a61cULL},
    {"S100W40", 0, 100, 40, 16, 560, 0x44825e7fbb246eb4ULL},
};

static es_session *ev_session(const es_model *m, const ev_case *c, int nt) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = N_CTX;
    sp.n_threads = nt;
    sp.swa_slack = c->slack;
    sp.kv_sinks = c->sinks;
    sp.kv_window = c->window;
    return tm_session_params(m, &sp);
}

static void tokens(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 61 + salt * 17 + (i * i) % 11 + 5) % N_VOCAB);
}

static int ring_of(const ev_case *c) { return (c->window + c->slack + 63) / 64 * 64; }

static uint64_t fnv(const void *p, size_t n) {
    const uint8_t *b = p;
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* Single steps, chunks, es_forward_last, es_decode and a batch: bitwise ref. */
static void check_splits(const es_model *m, const ev_case *c, const int32_t *tok, const float *ref) {
    int T = c->T;
    float *got = malloc(ROW * T);
    es_session *s = ev_session(m, c, 3);
    for (int i = 0; s && i < T; i++)
        CHECK_EQ_INT(es_forward(s, &tok[i], 1, NULL, got + (size_t)i * N_VOCAB, ES_LOGITS_LAST), ES_OK);
    CHECK(memcmp(ref, got, ROW * T) == 0);
    es_session_free(s);
    s = ev_session(m, c, 2);
    if (s) {
        const int chunks[] = {1, 5, c->slack - 1, c->slack, c->slack + 1, 3 * c->slack + 7, 9};
        for (int done = 0, k = 0; done < T; k++) {
            int n = chunks[k % 7] < T - done ? chunks[k % 7] : T - done;
            CHECK_EQ_INT(es_forward(s, tok + done, n, NULL, got + (size_t)done * N_VOCAB, ES_LOGITS_ALL), ES_OK);
            done += n;
        }
        CHECK(memcmp(ref, got, ROW * T) == 0);
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        int32_t am = -1;
        CHECK_EQ_INT(es_forward_last(s, tok, T, &am, got), ES_OK);
        CHECK(memcmp(ref + (size_t)(T - 1) * N_VOCAB, got, ROW) == 0);
        /* es_decode past n_ctx: each step is the es_forward of its token */
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok, 10, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        int32_t out[200], n_out = 0;
        CHECK_EQ_INT(es_decode(s, tok[10], 200, NULL, 0, NULL, out, NULL, &n_out), ES_OK);
        CHECK_EQ_INT(n_out, 200);
        CHECK_EQ_INT(es_session_n_past(s), 210);
        es_session *r = ev_session(m, c, 1);
        int32_t seq[211];
        memcpy(seq, tok, 11 * sizeof *seq);
        memcpy(seq + 11, out, 199 * sizeof *seq);
        int32_t am_all[210];
        if (r) CHECK_EQ_INT(es_forward(r, seq, 210, am_all, NULL, ES_LOGITS_NONE), ES_OK);
        CHECK(memcmp(am_all + 10, out, 200 * sizeof *out) == 0);
        es_session_free(r);
    }
    es_session_free(s);
    /* a batch: an eviction session at another depth beside a plain one */
    es_session *a = ev_session(m, c, 2), *p = tm_session(m, 1, 256);
    float *got2 = malloc(ROW * 40);
    if (a && p) {
        CHECK_EQ_INT(es_forward(a, tok, T - 40, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        es_batch_item it[2] = {
            {a, tok + T - 40, 40, ES_HEAD_ALL, NULL, got, ES_LOGITS_ALL, ES_OK},
            {p, tok, 40, ES_HEAD_ALL, NULL, got2, ES_LOGITS_ALL, ES_OK},
        };
        CHECK_EQ_INT(es_forward_batch(it, 2), ES_OK);
        CHECK(memcmp(ref + (size_t)(T - 40) * N_VOCAB, got, ROW * 40) == 0);
        CHECK(memcmp(ref, got2, ROW * 40) == 0);   /* before the window drops anything: plain */
    }
    es_session_free(a);
    es_session_free(p);
    free(got2);
    free(got);
}

/* Rollbacks: as deep as the ring reaches, then the rest again; deeper is refused. */
static void check_rollbacks(const es_model *m, const ev_case *c, const int32_t *tok, const float *ref) {
    int T = c->T, reach = T - (ring_of(c) - c->window + 1);
    es_session *s = ev_session(m, c, 2);
    if (!s) return;
    float *got = malloc(ROW * T);
    CHECK_EQ_INT(es_forward(s, tok, T, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_session_min_rollback(s), reach);
    CHECK_EQ_INT(es_session_rollback(s, reach - 1), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "out of reach") != NULL);
    CHECK(strstr(es_session_last_error(s), "KV eviction") != NULL);
    CHECK_EQ_INT(es_session_n_past(s), T);
    CHECK_EQ_INT(es_session_rollback(s, reach), ES_OK);
    CHECK_EQ_INT(es_forward(s, tok + reach, T - reach, NULL, got, ES_LOGITS_ALL), ES_OK);
    CHECK(memcmp(ref + (size_t)reach * N_VOCAB, got, ROW * (T - reach)) == 0);
    free(got);
    es_session_free(s);
}

TEST(eviction_is_one_rule_whatever_the_split) {
    for (int i = 0; i < 2; i++) {
        const ev_case *c = &CASES[i];
        es_model *m = tm_load(g_dir, c->model);
        if (!m) continue;
        int T = c->T;
        int32_t *tok = malloc(T * sizeof *tok);
        tokens(tok, T, i + 1);
        float *ref = malloc(ROW * T), *plain = malloc(ROW * T);
        es_session *s = ev_session(m, c, 1), *p = tm_session(m, 1, T);
        if (s && p) {
            CHECK_EQ_INT(es_forward(s, tok, T, NULL, ref, ES_LOGITS_ALL), ES_OK);   /* in pieces of the slack */
            CHECK_EQ_INT(es_forward(p, tok, T, NULL, plain, ES_LOGITS_ALL), ES_OK);
            /* [0, S) U (p - W, p] is [0, p] for p < S + W: plain; every later row drops something */
            int sw = c->sinks + c->window, differ = 0;
            CHECK(memcmp(ref, plain, ROW * sw) == 0);
            for (int r = sw; r < T; r++)
                differ += memcmp(ref + (size_t)r * N_VOCAB, plain + (size_t)r * N_VOCAB, ROW) != 0;
            CHECK_EQ_INT(differ, T - sw);
            uint64_t h = fnv(ref, ROW * T);
            fprintf(stderr, "  %s (%s): logits checksum 0x%016llx\n", c->name, es_simd_name(), (unsigned long long)h);
            CHECK(h == c->sum);
            check_splits(m, c, tok, ref);
            check_rollbacks(m, c, tok, ref);
        }
        es_session_free(s);
        es_session_free(p);
        free(ref);
        free(plain);
        free(tok);
        es_model_free(m);
    }
}

TEST(kv_bytes_are_the_sinks_and_the_ring) {
    es_model *m = tm_load(g_dir, 0);   /* 2 layers, 1 KV head of 64 */
    if (!m) return;
    const size_t pos_bytes = 2 * 2 * 64 * sizeof(uint16_t);   /* K and V of one position, both layers */
    for (int i = 0; i < 2; i++) {
        ev_case c = CASES[1];
        c.sinks = i ? 0 : 100;
        es_session *s = ev_session(m, &c, 1);
        if (!s) continue;
        size_t want = (size_t)((c.sinks + 63) / 64 * 64 + ring_of(&c)) * pos_bytes;
        CHECK_EQ_INT(es_session_kv_bytes(s), want);
        int32_t tok[1000];
        tokens(tok, 1000, 7);
        CHECK_EQ_INT(es_forward(s, tok, 1000, NULL, NULL, ES_LOGITS_NONE), ES_OK);   /* 1000 > n_ctx 64 */
        CHECK_EQ_INT(es_session_n_past(s), 1000);
        CHECK_EQ_INT(es_session_kv_bytes(s), want);
        CHECK_EQ_INT(es_session_n_ctx(s), N_CTX);
        es_session_free(s);
    }
    es_model_free(m);
}

TEST(bad_parameters_are_refused) {
    es_model *m = tm_load(g_dir, 0);
    if (!m) return;
    const int32_t bad[][2] = {{4, 0}, {-1, 64}, {0, -1}, {4, ES_MAX_CTX}, {0, ES_MAX_CTX + 1}, {ES_MAX_CTX + 1, 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        es_session_params sp = es_session_default_params();
        sp.kv_sinks = bad[i][0];
        sp.kv_window = bad[i][1];
        es_session *s = NULL;
        char err[256] = "";
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(s == NULL && strstr(err, "kv_sinks") != NULL && strstr(err, "kv_window") != NULL);
    }
    es_model_free(m);
    /* a model with sliding-window layers: not supported */
    es_model *g = tm_load(g_dir, 5);
    if (!g) return;
    es_session_params sp = es_session_default_params();
    sp.kv_sinks = 4;
    sp.kv_window = 64;
    es_session *s = NULL;
    char err[256] = "";
    CHECK_EQ_INT(es_session_new(g, &sp, &s, err, sizeof err), ES_ERR_UNSUPPORTED);
    CHECK(s == NULL && strstr(err, "sliding-window layers") != NULL);
    es_model_free(g);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_evict_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(eviction_is_one_rule_whatever_the_split);
    RUN(kv_bytes_are_the_sinks_and_the_ring);
    RUN(bad_parameters_are_refused);
    rmdir(g_dir);
    return harness_report();
}
