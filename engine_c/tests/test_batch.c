/*
 * test_batch.c - es_forward_batch: one forward over several sessions gives
 * each session bitwise what es_forward / es_forward_last give it alone.
 *
 * On the tiny models (tiny_models.h: llama Q4_1 with a Q8_0 embedding,
 * qwen3 with Q4_K_M-like and Q8_0 / Q4_0 / Q5 / F16 / BF16 layers, qwen2
 * F32, qwen3moe, qwen3vl, gemma3 with a sliding window of 16 that every
 * history here runs past), five sessions with histories of their own run three batched rounds
 * of mixed sizes: single decode steps past a KV block boundary, prompt
 * chunks of 40 and 30 tokens with the head on the last position, verifies of
 * 5 with every logits row, a 9-token step (the attention's query split) and
 * argmax-only steps. Every round's argmax and logits are compared bitwise
 * with the same steps run alone, session by session, on 1 thread; the
 * batches run on 1, 2 and 3 threads and in three orders of the items (so
 * another session's pool and scratch run the call each time). Sessions with
 * a pool of 3 threads also run every round alone and batched with their
 * thread count (es_session_set_threads) changed before each call, bitwise
 * the reference again; out-of-range counts fail with a message.
 *
 * Failures: items with a token out of the vocabulary, a step past the KV
 * capacity, a bad head, logits_mode 2 without a buffer, a duplicated
 * session, a session of another model and a NULL session fail alone with
 * their status and a message; the other items' results are still the
 * reference ones, and each failed session then runs its step alone with the
 * reference result (its KV cache was unchanged).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "internal.h"
#include "tiny_models.h"

#define N_SESS 5
#define ROUNDS 3
#define MAX_STEP 40
#define N_CTX 96

typedef struct {
    int hist;           /* tokens prefilled alone before the rounds */
    int n[ROUNDS];      /* tokens of each round's step */
    int32_t head;       /* ES_HEAD_ALL / ES_HEAD_LAST */
    int32_t mode;       /* logits_mode */
} sess_spec;

static const sess_spec SPECS[N_SESS] = {
    {70, {1, 1, 1}, ES_HEAD_ALL, 1},     /* decode steps in the second KV block (key split) */
    {0, {40, 30, 1}, ES_HEAD_LAST, 1},   /* a prompt in chunks, then its first step */
    {10, {5, 5, 5}, ES_HEAD_ALL, 2},     /* verifies of [pending] + 4 drafts, every row's logits */
    {60, {9, 3, 1}, ES_HEAD_ALL, 0},     /* 9 rows (query split) across the block boundary, argmax only */
    {3, {1, 12, 2}, ES_HEAD_LAST, 0},
};

/* The token at position pos of session k. */
static int32_t tok(int k, int pos) { return (int32_t)((pos * 37 + k * 101 + 5) % N_VOCAB); }

static void step_tokens(int k, int pos0, int n, int32_t *t) {
    for (int i = 0; i < n; i++) t[i] = tok(k, pos0 + i);
}

static int head_rows(const sess_spec *sp, int r) { return sp->head == ES_HEAD_LAST ? 1 : sp->n[r]; }
static int logits_rows(const sess_spec *sp, int r) {
    return sp->mode == 0 ? 0 : sp->mode == 1 ? 1 : head_rows(sp, r);
}
/* Tokens before round r. */
static int pos_before(const sess_spec *sp, int r) {
    int p = sp->hist;
    for (int i = 0; i < r; i++) p += sp->n[i];
    return p;
}

typedef struct {
    int32_t argmax[MAX_STEP];
    float logits[MAX_STEP * N_VOCAB];
} step_out;

static step_out g_ref[N_SESS][ROUNDS];


/* A session of session k's history (prefilled alone). */
static es_session *session_with_history(const es_model *m, int k, int n_threads) {
    es_session *s = tm_session(m, n_threads, N_CTX);
    if (s && SPECS[k].hist > 0) {
        int32_t t[N_CTX];
        step_tokens(k, 0, SPECS[k].hist, t);
        CHECK_EQ_INT(es_forward_last(s, t, SPECS[k].hist, NULL, NULL), ES_OK);
    }
    return s;
}

/* Session k's step of round r alone, as the scheduler would call it. */
static es_status step_alone(es_session *s, int k, int r, step_out *o) {
    const sess_spec *sp = &SPECS[k];
    int32_t t[MAX_STEP];
    step_tokens(k, pos_before(sp, r), sp->n[r], t);
    memset(o, 0xA5, sizeof *o);
    if (sp->head == ES_HEAD_LAST) return es_forward_last(s, t, sp->n[r], o->argmax, sp->mode ? o->logits : NULL);
    return es_forward(s, t, sp->n[r], o->argmax, sp->mode ? o->logits : NULL, sp->mode);
}

static int same_out(const step_out *a, const step_out *b, int k, int r) {
    const sess_spec *sp = &SPECS[k];
    return memcmp(a->argmax, b->argmax, sizeof(int32_t) * (size_t)head_rows(sp, r)) == 0 &&
           memcmp(a->logits, b->logits, sizeof(float) * (size_t)logits_rows(sp, r) * N_VOCAB) == 0;
}

/* The reference: every session alone on 1 thread. */
static void reference(const es_model *m) {
    for (int k = 0; k < N_SESS; k++) {
        es_session *s = session_with_history(m, k, 1);
        if (!s) return;
        for (int r = 0; r < ROUNDS; r++) CHECK_EQ_INT(step_alone(s, k, r, &g_ref[k][r]), ES_OK);
        es_session_free(s);
    }
}

static const int ORDERS[3][N_SESS] = {{0, 1, 2, 3, 4}, {4, 3, 2, 1, 0}, {2, 4, 0, 3, 1}};

/* Item for session k's step of round r (tokens in t, outputs in o). */
static es_batch_item item_for(es_session *s, int k, int r, int32_t *t, step_out *o) {
    const sess_spec *sp = &SPECS[k];
    step_tokens(k, pos_before(sp, r), sp->n[r], t);
    memset(o, 0x5A, sizeof *o);
    es_batch_item it = {s, t, sp->n[r], sp->head, o->argmax, sp->mode ? o->logits : NULL, sp->mode, ES_ERR_INTERNAL};
    return it;
}

static void batched(const es_model *m, const char *mname) {
    static step_out got[N_SESS];
    static int32_t toks[N_SESS][MAX_STEP];
    for (int nt = 1; nt <= 3; nt++)
        for (int o = 0; o < 3; o++) {
            es_session *ss[N_SESS];
            for (int k = 0; k < N_SESS; k++) ss[k] = session_with_history(m, k, nt);
            for (int r = 0; r < ROUNDS; r++) {
                es_batch_item items[N_SESS];
                for (int j = 0; j < N_SESS; j++) {
                    int k = ORDERS[o][j];
                    items[j] = item_for(ss[k], k, r, toks[k], &got[k]);
                }
                CHECK_EQ_INT(es_forward_batch(items, N_SESS), ES_OK);
                for (int j = 0; j < N_SESS; j++) {
                    int k = ORDERS[o][j];
                    CHECK_EQ_INT(items[j].status, ES_OK);
                    CHECK_EQ_INT(es_session_n_past(ss[k]), pos_before(&SPECS[k], r + 1));
                    int same = same_out(&got[k], &g_ref[k][r], k, r);
                    if (!same)
                        fprintf(stderr, "  %s: %d threads, order %d, round %d: session %d differs from alone\n",
                                mname, nt, o, r, k);
                    CHECK(same);
                }
            }
            for (int k = 0; k < N_SESS; k++) es_session_free(ss[k]);
        }
}

/* Sessions with a pool of 3 threads whose count (es_session_set_threads)
 * changes before every call: each round runs once alone per session, on
 * rotating counts, and once as a batch whose first item's count (the one
 * that runs it) changes each round; both are the reference bitwise. Out of
 * range counts fail with a message and leave the count as it was. */
static void flipped_threads(const es_model *m, const char *mname) {
    static step_out got[N_SESS];
    static int32_t toks[N_SESS][MAX_STEP];
    es_session *alone[N_SESS], *ss[N_SESS];
    for (int k = 0; k < N_SESS; k++) {
        alone[k] = session_with_history(m, k, 3);
        ss[k] = session_with_history(m, k, 3);
    }
    for (int k = 0; k < N_SESS; k++) {
        if (!alone[k] || !ss[k]) goto out;
        CHECK_EQ_INT(es_session_pool_threads(ss[k]), 3);
        CHECK_EQ_INT(es_session_threads(ss[k]), 3);
    }
    for (int r = 0; r < ROUNDS; r++) {
        for (int k = 0; k < N_SESS; k++) {
            int nt = 1 + (k + r) % 3;
            CHECK_EQ_INT(es_session_set_threads(alone[k], nt), ES_OK);
            CHECK_EQ_INT(es_session_threads(alone[k]), nt);
            CHECK_EQ_INT(step_alone(alone[k], k, r, &got[k]), ES_OK);
            int same = same_out(&got[k], &g_ref[k][r], k, r);
            if (!same) fprintf(stderr, "  %s: alone on %d of 3 threads, round %d: session %d differs\n", mname, nt, r, k);
            CHECK(same);
        }
        es_batch_item items[N_SESS];
        for (int j = 0; j < N_SESS; j++) {
            int k = ORDERS[r % 3][j];
            CHECK_EQ_INT(es_session_set_threads(ss[k], 1 + (2 * j + r) % 3), ES_OK);
            items[j] = item_for(ss[k], k, r, toks[k], &got[k]);
        }
        CHECK_EQ_INT(es_forward_batch(items, N_SESS), ES_OK);
        for (int j = 0; j < N_SESS; j++) {
            int k = ORDERS[r % 3][j];
            int same = same_out(&got[k], &g_ref[k][r], k, r);
            if (!same)
                fprintf(stderr, "  %s: batch on %d of 3 threads, round %d: session %d differs\n", mname,
                        1 + r % 3, r, k);
            CHECK(same);
        }
    }
    /* bad counts: ES_ERR_INVALID_ARG with a message; the count stays */
    CHECK_EQ_INT(es_session_set_threads(ss[0], 2), ES_OK);
    const int32_t bad[] = {0, -1, 4, ES_MAX_THREADS + 1, INT32_MIN};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_EQ_INT(es_session_set_threads(ss[0], bad[i]), ES_ERR_INVALID_ARG);
        CHECK(strstr(es_session_last_error(ss[0]), "out of range") != NULL);
        CHECK_EQ_INT(es_session_threads(ss[0]), 2);
    }
    CHECK_EQ_INT(es_session_set_threads(NULL, 1), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_threads(NULL), 0);
    CHECK_EQ_INT(es_session_pool_threads(NULL), 0);
out:
    for (int k = 0; k < N_SESS; k++) {
        es_session_free(alone[k]);
        es_session_free(ss[k]);
    }
}

/* One batch with failing items among good ones. */
static void failures(const es_model *m, const es_model *other, const char *mname) {
    static step_out got[N_SESS], bad_out;
    static int32_t toks[N_SESS][MAX_STEP];
    es_session *ss[N_SESS];
    for (int k = 0; k < N_SESS; k++) ss[k] = session_with_history(m, k, 2);
    es_session *small = tm_session(m, 2, ES_MIN_CTX), *foreign = tm_session(other, 1, 16);
    if (!small || !foreign) return;
    int32_t fill[ES_MIN_CTX - 2];   /* leaves room for 2 tokens: the 3 below do not fit */
    for (int i = 0; i < ES_MIN_CTX - 2; i++) fill[i] = 1 + i;
    CHECK_EQ_INT(es_forward(small, fill, ES_MIN_CTX - 2, NULL, NULL, 0), ES_OK);
    int32_t bad_tok[2] = {1, N_VOCAB}, three[3] = {7, 8, 9};

    /* round 0 of sessions 0, 2, 4 are good; 1 has a token out of range, 3 a bad head */
    es_batch_item items[10];
    int n = 0;
    items[n++] = item_for(ss[0], 0, 0, toks[0], &got[0]);
    items[n] = item_for(ss[1], 1, 0, toks[1], &got[1]);
    toks[1][7] = -3;
    n++;
    items[n++] = item_for(ss[2], 2, 0, toks[2], &got[2]);
    items[n] = item_for(ss[3], 3, 0, toks[3], &got[3]);
    items[n++].head = 2;
    items[n++] = (es_batch_item){small, three, 3, ES_HEAD_ALL, bad_out.argmax, NULL, 0, ES_OK};     /* 14 + 3 > 16 */
    items[n++] = item_for(ss[4], 4, 0, toks[4], &got[4]);
    items[n++] = (es_batch_item){foreign, three, 3, ES_HEAD_ALL, NULL, NULL, 0, ES_OK};             /* other model */
    items[n++] = (es_batch_item){NULL, three, 3, ES_HEAD_ALL, NULL, NULL, 0, ES_OK};
    int n_past_small = es_session_n_past(small);
    es_status st = es_forward_batch(items, n);
    CHECK_EQ_INT(st, ES_ERR_INVALID_ARG);   /* the first failed item's */
    static const es_status want[8] = {ES_OK, ES_ERR_INVALID_ARG, ES_OK, ES_ERR_INVALID_ARG, ES_ERR_CAPACITY,
                                      ES_OK, ES_ERR_INVALID_ARG, ES_ERR_INVALID_ARG};
    for (int j = 0; j < n; j++) CHECK_EQ_INT(items[j].status, want[j]);
    for (int k = 0; k < N_SESS; k += 2) {
        int same = same_out(&got[k], &g_ref[k][0], k, 0);
        if (!same) fprintf(stderr, "  %s: session %d beside failing items differs from alone\n", mname, k);
        CHECK(same);
    }
    CHECK(strstr(es_session_last_error(ss[1]), "outside the vocabulary") != NULL);
    CHECK(strstr(es_session_last_error(ss[3]), "head") != NULL);
    CHECK(strstr(es_session_last_error(small), "KV cache full") != NULL);
    CHECK(strstr(es_session_last_error(foreign), "another model") != NULL);
    CHECK(es_session_last_error(ss[0])[0] == '\0');
    CHECK_EQ_INT(es_session_n_past(ss[1]), SPECS[1].hist);
    CHECK_EQ_INT(es_session_n_past(ss[3]), SPECS[3].hist);
    CHECK_EQ_INT(es_session_n_past(small), n_past_small);
    CHECK_EQ_INT(es_session_n_past(foreign), 0);
    /* the failed sessions' KV caches were unchanged: their steps alone give the reference */
    for (int k = 1; k < N_SESS; k += 2) {
        CHECK_EQ_INT(step_alone(ss[k], k, 0, &got[k]), ES_OK);
        CHECK(same_out(&got[k], &g_ref[k][0], k, 0));
    }

    /* round 1: logits wanted without a buffer, a duplicated session (both
     * of its items fail), a good one; then a batch of failures only */
    n = 0;
    items[n] = item_for(ss[0], 0, 1, toks[0], &got[0]);
    items[n++].logits_out = NULL;
    items[n++] = item_for(ss[1], 1, 1, toks[1], &got[1]);
    items[n++] = item_for(ss[2], 2, 1, toks[2], &got[2]);
    items[n++] = (es_batch_item){ss[1], three, 3, ES_HEAD_ALL, NULL, NULL, 0, ES_OK};
    CHECK_EQ_INT(es_forward_batch(items, n), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(items[0].status, ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(items[1].status, ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(items[2].status, ES_OK);
    CHECK_EQ_INT(items[3].status, ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(ss[1]), "same session") != NULL);
    CHECK(strstr(es_session_last_error(ss[0]), "logits") != NULL);
    CHECK(same_out(&got[2], &g_ref[2][1], 2, 1));
    CHECK_EQ_INT(es_session_n_past(ss[0]), pos_before(&SPECS[0], 1));
    CHECK_EQ_INT(es_session_n_past(ss[1]), pos_before(&SPECS[1], 1));
    es_batch_item only_bad = {ss[0], bad_tok, 2, ES_HEAD_ALL, NULL, NULL, 0, ES_OK};
    CHECK_EQ_INT(es_forward_batch(&only_bad, 1), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(only_bad.status, ES_ERR_INVALID_ARG);
    for (int k = 0; k < 2; k++) {
        CHECK_EQ_INT(step_alone(ss[k], k, 1, &got[k]), ES_OK);
        CHECK(same_out(&got[k], &g_ref[k][1], k, 1));
    }

    /* whole-call errors touch nothing */
    CHECK_EQ_INT(es_forward_batch(NULL, 1), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_batch(items, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_batch(items, ES_MAX_BATCH + 1), ES_ERR_INVALID_ARG);
    for (int k = 0; k < N_SESS; k++) es_session_free(ss[k]);
    es_session_free(small);
    es_session_free(foreign);
}

static char g_dir[256];

static es_model *load(int which) { return tm_load(g_dir, which); }

static void batch_model(int which) {
    es_model *m = load(which), *other = load((which + 1) % MAX_MODELS);
    if (m && other) {
        reference(m);
        batched(m, MODELS[which].name);
        flipped_threads(m, MODELS[which].name);
        failures(m, other, MODELS[which].name);
    }
    es_model_free(m);
    es_model_free(other);
}

TEST(batch_llama_q4_1) { batch_model(0); }
TEST(batch_qwen3_mixed_kquants) { batch_model(1); }
TEST(batch_qwen2_f32) { batch_model(2); }
TEST(batch_qwen3moe_experts) { batch_model(3); }
TEST(batch_qwen3vl_sections) { batch_model(4); }
TEST(batch_gemma3_swa) { batch_model(5); }

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_batch_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(batch_llama_q4_1);
    RUN(batch_qwen3_mixed_kquants);
    RUN(batch_qwen2_f32);
    RUN(batch_qwen3moe_experts);
    RUN(batch_qwen3vl_sections);
    RUN(batch_gemma3_swa);
    rmdir(g_dir);
    return harness_report();
}
