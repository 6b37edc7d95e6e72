/*
 * test_decode.c - es_decode: greedy steps run inside the engine give the
 * tokens, the KV cache and the n_past of the same es_forward calls made one
 * by one, on each tiny model (tiny_models.h) and on 1 and 2 threads; a stop
 * id ends the run after the step that produced it; a set interrupt ends it
 * after one step; bad arguments and a run that would overflow the KV cache
 * fail before any step with a message, the KV cache untouched.
 * es_decode_batch: four sessions with their own prompts, step budgets and
 * stop ids decode together, each bitwise what es_decode gives it alone, on
 * 1 and 2 threads; items with bad arguments fail alone; an interrupt ends
 * the run after one step for every session.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "tiny_models.h"

#define PROMPT 12
#define STEPS 24
#define N_CTX 64

static char g_dir[256];

static es_model *load(int which) { return tm_load(g_dir, which); }

/* A session on m with the prompt prefilled; *first: the greedy token after it. */
static es_session *prompted(const es_model *m, int n_threads, int n_ctx, int32_t *first) {
    es_session *s = tm_session(m, n_threads, n_ctx);
    if (!s) return NULL;
    int32_t p[PROMPT];
    for (int i = 0; i < PROMPT; i++) p[i] = (int32_t)((i * 53 + 7) % N_VOCAB);
    CHECK_EQ_INT(es_forward_last(s, p, PROMPT, first, NULL), ES_OK);
    return s;
}

static void decode_model(int which) {
    es_model *m = load(which);
    if (!m) return;
    /* the reference: STEPS calls of one token each */
    int32_t ref[STEPS + 1], tok0 = 0;   /* ref[STEPS]: the step after the run */
    es_session *r = prompted(m, 1, N_CTX, &tok0);
    int32_t cur = tok0;
    for (int i = 0; i <= STEPS && r; i++) {
        CHECK_EQ_INT(es_forward(r, &cur, 1, &ref[i], NULL, 0), ES_OK);
        cur = ref[i];
    }
    for (int nt = 1; nt <= 2 && r; nt++) {
        int32_t first = -1, out[STEPS], n = -1;
        float ms[STEPS];
        es_session *s = prompted(m, nt, N_CTX, &first);
        if (!s) break;
        CHECK_EQ_INT(first, tok0);
        int32_t stop_none = -1;   /* never a token */
        CHECK_EQ_INT(es_decode(s, first, STEPS, &stop_none, 1, NULL, out, ms, &n), ES_OK);
        CHECK_EQ_INT(n, STEPS);
        CHECK(memcmp(out, ref, sizeof out) == 0);
        CHECK_EQ_INT(es_session_n_past(s), PROMPT + STEPS);
        for (int i = 0; i < STEPS; i++) CHECK(ms[i] > 0.0f);
        /* the next step from the last token continues the reference */
        int32_t next = -1;
        CHECK_EQ_INT(es_forward(s, &out[STEPS - 1], 1, &next, NULL, 0), ES_OK);
        CHECK_EQ_INT(next, ref[STEPS]);

        /* a stop id: the run ends after the first step that produces it */
        CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
        int j = STEPS / 2;
        while (j > 0) {   /* a token's first occurrence */
            int seen = 0;
            for (int i = 0; i < j; i++) seen |= ref[i] == ref[j];
            if (!seen) break;
            j--;
        }
        int32_t stops[2] = {-1, ref[j]};
        CHECK_EQ_INT(es_decode(s, first, STEPS, stops, 2, NULL, out, NULL, &n), ES_OK);
        CHECK_EQ_INT(n, j + 1);
        CHECK(memcmp(out, ref, sizeof(int32_t) * (size_t)(j + 1)) == 0);
        CHECK_EQ_INT(es_session_n_past(s), PROMPT + j + 1);

        /* an interrupt already set: one step */
        CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
        int32_t stop_now = 1;
        CHECK_EQ_INT(es_decode(s, first, STEPS, NULL, 0, &stop_now, out, NULL, &n), ES_OK);
        CHECK_EQ_INT(n, 1);
        CHECK_EQ_INT(out[0], ref[0]);
        CHECK_EQ_INT(es_session_n_past(s), PROMPT + 1);
        es_session_free(s);
    }
    es_session_free(r);
    es_model_free(m);
}

TEST(decode_llama_q4_1) { decode_model(0); }
TEST(decode_qwen3_mixed_kquants) { decode_model(1); }
TEST(decode_qwen2_f32) { decode_model(2); }
TEST(decode_qwen3moe_experts) { decode_model(3); }
TEST(decode_qwen3vl_sections) { decode_model(4); }
TEST(decode_gemma3_swa) { decode_model(5); }

#define NB 4

static void decode_batch_model(int which) {
    es_model *m = load(which);
    if (!m) return;
    static const int budget[NB] = {20, 7, 20, 13};
    int32_t first[NB], ref[NB][STEPS], nref[NB];
    int32_t stops[NB][1];
    /* each alone, with a stop id taken from its own output for sessions 2 and 3 */
    for (int k = 0; k < NB; k++) {
        es_session *s = tm_session(m, 1, N_CTX);
        if (!s) { es_model_free(m); return; }
        int32_t p[PROMPT];
        for (int i = 0; i < PROMPT; i++) p[i] = (int32_t)((i * 53 + k * 29 + 7) % N_VOCAB);
        CHECK_EQ_INT(es_forward_last(s, p, PROMPT, &first[k], NULL), ES_OK);
        int32_t all[STEPS], n = 0;
        CHECK_EQ_INT(es_decode(s, first[k], budget[k], NULL, 0, NULL, all, NULL, &n), ES_OK);
        stops[k][0] = k >= 2 ? all[budget[k] / 2] : -1;
        CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
        CHECK_EQ_INT(es_decode(s, first[k], budget[k], stops[k], 1, NULL, ref[k], NULL, &nref[k]), ES_OK);
        if (k >= 2) CHECK(nref[k] <= budget[k] / 2 + 1);
        es_session_free(s);
    }
    for (int nt = 1; nt <= 2; nt++) {
        es_session *ss[NB];
        es_decode_item it[NB];
        int32_t out[NB][STEPS];
        float ms[STEPS];
        for (int k = 0; k < NB; k++) {
            ss[k] = tm_session(m, nt, N_CTX);
            int32_t p[PROMPT], f = -1;
            for (int i = 0; i < PROMPT; i++) p[i] = (int32_t)((i * 53 + k * 29 + 7) % N_VOCAB);
            CHECK_EQ_INT(es_forward_last(ss[k], p, PROMPT, &f, NULL), ES_OK);
            it[k] = (es_decode_item){ss[k], first[k], budget[k], stops[k], 1, out[k], -1, ES_ERR_INTERNAL};
        }
        int32_t steps = -1;
        CHECK_EQ_INT(es_decode_batch(it, NB, NULL, ms, &steps), ES_OK);
        int most = 0;
        for (int k = 0; k < NB; k++) {
            CHECK_EQ_INT(it[k].status, ES_OK);
            CHECK_EQ_INT(it[k].n_out, nref[k]);
            CHECK(memcmp(out[k], ref[k], sizeof(int32_t) * (size_t)nref[k]) == 0);
            CHECK_EQ_INT(es_session_n_past(ss[k]), PROMPT + nref[k]);
            if (nref[k] > most) most = nref[k];
        }
        CHECK_EQ_INT(steps, most);
        /* bad items fail alone: a token out of range, a run past n_ctx, a session twice */
        for (int k = 0; k < NB; k++) CHECK_EQ_INT(es_session_rollback(ss[k], PROMPT), ES_OK);
        es_decode_item bad[NB + 1];
        memcpy(bad, it, sizeof it);
        bad[1].token = N_VOCAB;
        bad[3].max_steps = N_CTX;
        bad[NB] = it[0];
        CHECK(es_decode_batch(bad, NB + 1, NULL, NULL, NULL) != ES_OK);
        CHECK_EQ_INT(bad[1].status, ES_ERR_INVALID_ARG);
        CHECK_EQ_INT(bad[3].status, ES_ERR_CAPACITY);
        CHECK_EQ_INT(bad[NB].status, ES_ERR_INVALID_ARG);   /* the same session as item 0 */
        CHECK_EQ_INT(bad[1].n_out + bad[3].n_out + bad[NB].n_out, 0);
        CHECK_EQ_INT(es_session_n_past(ss[1]), PROMPT);
        CHECK_EQ_INT(es_session_n_past(ss[3]), PROMPT);
        for (int k = 0; k <= 2; k += 2) {
            CHECK_EQ_INT(bad[k].status, ES_OK);
            CHECK(memcmp(out[k], ref[k], sizeof(int32_t) * (size_t)nref[k]) == 0);
        }
        /* an interrupt already set: one step each */
        for (int k = 0; k < NB; k++) CHECK_EQ_INT(es_session_rollback(ss[k], PROMPT), ES_OK);
        int32_t stop_now = 1;
        CHECK_EQ_INT(es_decode_batch(it, NB, &stop_now, NULL, &steps), ES_OK);
        CHECK_EQ_INT(steps, 1);
        for (int k = 0; k < NB; k++) {
            CHECK_EQ_INT(it[k].n_out, 1);
            CHECK_EQ_INT(out[k][0], ref[k][0]);
        }
        for (int k = 0; k < NB; k++) es_session_free(ss[k]);
    }
    CHECK_EQ_INT(es_decode_batch(NULL, 1, NULL, NULL, NULL), ES_ERR_INVALID_ARG);
    es_model_free(m);
}

TEST(decode_batch_llama_q4_1) { decode_batch_model(0); }
TEST(decode_batch_qwen3_mixed_kquants) { decode_batch_model(1); }
TEST(decode_batch_qwen2_f32) { decode_batch_model(2); }
TEST(decode_batch_qwen3moe_experts) { decode_batch_model(3); }
TEST(decode_batch_gemma3_swa) { decode_batch_model(5); }

/* Refusals: before any step, the KV cache unchanged, a message on the session. */
TEST(decode_refusals) {
    es_model *m = load(0);
    if (!m) return;
    int32_t first = 0, out[8], n = 7, one = 1;
    es_session *s = prompted(m, 1, PROMPT + 4, &first);
    if (s) {
        struct { int32_t token, steps, n_stop; const int32_t *stop; int32_t *out; int32_t *n; es_status want; } c[] = {
            {first, 0, 0, NULL, out, &n, ES_ERR_INVALID_ARG},        /* no steps */
            {first, 2, -1, NULL, out, &n, ES_ERR_INVALID_ARG},       /* n_stop < 0 */
            {first, 2, 1, NULL, out, &n, ES_ERR_INVALID_ARG},        /* stop ids missing */
            {first, 2, 1, &one, NULL, &n, ES_ERR_INVALID_ARG},       /* no tokens_out */
            {first, 2, 0, NULL, out, NULL, ES_ERR_INVALID_ARG},      /* no n_out */
            {N_VOCAB, 2, 0, NULL, out, &n, ES_ERR_INVALID_ARG},      /* token out of range */
            {-1, 2, 0, NULL, out, &n, ES_ERR_INVALID_ARG},
            {first, 5, 0, NULL, out, &n, ES_ERR_CAPACITY},           /* 12 + 5 > n_ctx 16 */
        };
        for (size_t i = 0; i < sizeof c / sizeof *c; i++) {
            n = 7;
            CHECK_EQ_INT(es_decode(s, c[i].token, c[i].steps, c[i].stop, c[i].n_stop, NULL, c[i].out, NULL, c[i].n),
                         c[i].want);
            if (c[i].n) CHECK_EQ_INT(n, 0);
            CHECK_EQ_INT(es_session_n_past(s), PROMPT);
            CHECK(es_session_last_error(s)[0] != '\0');
        }
        /* the room that is left is usable */
        CHECK_EQ_INT(es_decode(s, first, 4, NULL, 0, NULL, out, NULL, &n), ES_OK);
        CHECK_EQ_INT(n, 4);
        CHECK_EQ_INT(es_session_n_past(s), PROMPT + 4);
        es_session_free(s);
    }
    CHECK_EQ_INT(es_decode(NULL, 0, 1, NULL, 0, NULL, out, NULL, &n), ES_ERR_INVALID_ARG);
    es_model_free(m);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_decode_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(decode_llama_q4_1);
    RUN(decode_qwen3_mixed_kquants);
    RUN(decode_qwen2_f32);
    RUN(decode_qwen3moe_experts);
    RUN(decode_qwen3vl_sections);
    RUN(decode_gemma3_swa);
    RUN(decode_batch_llama_q4_1);
    RUN(decode_batch_qwen3_mixed_kquants);
    RUN(decode_batch_qwen2_f32);
    RUN(decode_batch_qwen3moe_experts);
    RUN(decode_batch_gemma3_swa);
    RUN(decode_refusals);
    rmdir(g_dir);
    return harness_report();
}
