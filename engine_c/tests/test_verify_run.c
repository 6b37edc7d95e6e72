/*
 * test_verify_run.c - es_verify_run: speculative rounds run in the engine give the tokens, the
 * rounds (drafts verified, drafts kept), the n_past and the KV cache of the caller's own verify
 * loop (es_forward over [pending] + drafts, then es_session_rollback), and the output of greedy
 * decoding one token at a time, on each tiny model (tiny_models.h) and on 1, 2 and 3 threads.
 *
 * The draft sequence is the greedy output itself (every round keeps every draft and the run
 * goes on to max_out, or to where fewer than k drafts are left), or that output with one token changed (the run ends with the round that
 * rejects it, or, when the changed token is a bonus position, with the round before it, every
 * draft kept). A stop id ends the run after the round that yields it; a set interrupt and a
 * max_ms that has passed end it after one round; a round never runs past n_ctx. Bad arguments
 * fail before any round with a message, the KV cache untouched; KV eviction and sparse
 * attention are refused, and so is a run whose round could verify more drafts than sliding-window
 * rings that wrap can roll back over. A run writes at most min(max_out, n_drafts + 1, n_ctx -
 * n_past) tokens whatever its max_out and k.
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

#define PROMPT 10
#define OUT 40              /* greedy tokens of the reference */
#define N_CTX 96

static char g_dir[256];

static int32_t prompt_tok(int i) { return (int32_t)((i * 53 + 7) % N_VOCAB); }

/* A session on m (ring slack for a verify of up to OUT drafts) with the prompt prefilled;
 * *first: the greedy token after it. */
static es_session *prompted(const es_model *m, int n_threads, int n_ctx, int32_t *first) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = n_ctx;
    sp.n_threads = n_threads;
    sp.swa_slack = OUT + 1;
    es_session *s = tm_session_params(m, &sp);
    if (!s) return NULL;
    int32_t p[PROMPT];
    for (int i = 0; i < PROMPT; i++) p[i] = prompt_tok(i);
    CHECK_EQ_INT(es_forward_last(s, p, PROMPT, first, NULL), ES_OK);
    return s;
}

/* The caller's loop that es_verify_run replaces, on its own session: the same rounds. */
static int loop_rounds(es_session *s, int32_t token, const int32_t *d, int32_t n_d, int32_t k, int32_t max_out,
                       const int32_t *stops, int n_stop, int32_t *out, int32_t *rk, int32_t *rr, int32_t *n_out) {
    int32_t pending = token, pos = 0, rounds = 0, buf[N_CTX + 1], am[N_CTX + 1];   /* k <= n_ctx - 1 */
    *n_out = 0;
    for (;;) {
        int32_t kr = k;
        if (n_d - pos < kr) kr = n_d - pos;
        if (max_out - *n_out - 1 < kr) kr = max_out - *n_out - 1;
        if (es_session_n_ctx(s) - es_session_n_past(s) - 1 < kr) kr = es_session_n_ctx(s) - es_session_n_past(s) - 1;
        if (kr < 1) break;
        buf[0] = pending;
        memcpy(buf + 1, d + pos, (size_t)kr * sizeof *buf);
        int32_t n0 = es_session_n_past(s);
        CHECK_EQ_INT(es_forward(s, buf, kr + 1, am, NULL, ES_LOGITS_NONE), ES_OK);
        int32_t r = 0;
        while (r < kr && am[r] == buf[r + 1]) r++;
        if (r < kr) CHECK_EQ_INT(es_session_rollback(s, n0 + 1 + r), ES_OK);
        int stop = 0;
        for (int32_t i = 0; i <= r; i++) {
            out[(*n_out)++] = i < r ? buf[i + 1] : am[r];
            for (int j = 0; j < n_stop; j++) stop |= stops[j] == out[*n_out - 1];
        }
        rk[rounds] = kr;
        rr[rounds++] = r;
        if (stop || r < kr || n_d - (pos + kr + 1) < k || am[kr] != d[pos + kr]) break;
        pending = am[kr];
        pos += kr + 1;
    }
    return rounds;
}

/* Three greedy steps from token t on a and b: bitwise the same logits (the KV caches agree). */
static int same_next(es_session *a, es_session *b, int32_t t) {
    static float la[N_VOCAB], lb[N_VOCAB];
    int32_t ta = t, tb = t;
    for (int i = 0; i < 3; i++) {
        int32_t xa = -1, xb = -1;
        if (es_forward(a, &ta, 1, &xa, la, ES_LOGITS_LAST) != ES_OK) return 0;
        if (es_forward(b, &tb, 1, &xb, lb, ES_LOGITS_LAST) != ES_OK) return 0;
        if (xa != xb || memcmp(la, lb, sizeof la) != 0) return 0;
        ta = xa;
        tb = xb;
    }
    return 1;
}

/* 1 when positions [0, n) of every layer's K and V (F16 cache) are bitwise the same. */
static int kv_equal(const es_session *a, const es_session *b, int32_t n) {
    const es_kv *ka = &a->kv, *kb = &b->kv;
    for (int l = 0; l < ka->n_layer; l++)
        for (int g = 0; g < ka->n_head_kv; g++)
            for (int32_t bi = 0; bi * ES_KV_BLOCK < n; bi++) {
                int32_t rows = n - bi * ES_KV_BLOCK < ES_KV_BLOCK ? n - bi * ES_KV_BLOCK : ES_KV_BLOCK;
                const uint16_t *k1 = (const uint16_t *)(const void *)es_kv_k_block(ka, l, g, bi);
                const uint16_t *k2 = (const uint16_t *)(const void *)es_kv_k_block(kb, l, g, bi);
                for (int e = 0; e < ka->head_dim; e++)   /* K: [head_dim][block] */
                    if (memcmp(k1 + (size_t)e * ES_KV_BLOCK, k2 + (size_t)e * ES_KV_BLOCK, (size_t)rows * 2) != 0)
                        return 0;
                if (memcmp(es_kv_v_block(ka, l, g, bi), es_kv_v_block(kb, l, g, bi),
                           (size_t)rows * ka->head_dim * sizeof(uint16_t)) != 0)
                    return 0;
            }
    return 1;
}

/* One run against the loop and against greedy decoding: d the drafts (greedy[1..] edited),
 * k per round; checks tokens, rounds, n_past, the KV cache and the next steps. */
static void run_case(const es_model *m, int nt, int32_t first, const int32_t *greedy, const int32_t *d,
                     int32_t n_d, int32_t k, int32_t max_out, const int32_t *stops, int n_stop, int swa) {
    int32_t f1 = -1, f2 = -1;
    es_session *s = prompted(m, nt, N_CTX, &f1), *ref = prompted(m, 1, N_CTX, &f2);
    if (!s || !ref) goto done;
    CHECK_EQ_INT(f1, first);
    int32_t out[OUT + 1], rk[OUT + 1], rr[OUT + 1], lout[OUT + 1], lk[OUT + 1], lr[OUT + 1], ln = 0;
    float ms[OUT + 1], rb[OUT + 1];
    es_verify_run_args a = {.token = first, .drafts = d, .n_drafts = n_d, .k = k, .max_out = max_out,
                            .stop_ids = stops, .n_stop = n_stop, .tokens_out = out, .round_k = rk,
                            .round_r = rr, .ms_out = ms, .rollback_ms_out = rb};
    a.n_past_in = -2;
    CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
    CHECK_EQ_INT(a.n_past_in, PROMPT);   /* where a caller rolls back to after an error */
    int lrounds = loop_rounds(ref, first, d, n_d, k, max_out, stops, n_stop, lout, lk, lr, &ln);
    CHECK_EQ_INT(a.n_rounds, lrounds);
    CHECK_EQ_INT(a.n_out, ln);
    CHECK(memcmp(out, lout, (size_t)ln * sizeof *out) == 0);
    CHECK(memcmp(rk, lk, (size_t)lrounds * sizeof *rk) == 0);
    CHECK(memcmp(rr, lr, (size_t)lrounds * sizeof *rr) == 0);
    for (int i = 0; i < a.n_rounds; i++) {   /* a rollback timed where drafts were rejected */
        CHECK(ms[i] > 0.0f);
        CHECK(rr[i] < rk[i] ? rb[i] > 0.0f : rb[i] == 0.0f);
    }
    /* greedy decoding's own tokens after the pending one, whatever the drafts */
    CHECK(memcmp(out, greedy + 1, (size_t)a.n_out * sizeof *out) == 0);
    CHECK_EQ_INT(es_session_n_past(s), PROMPT + a.n_out);
    CHECK_EQ_INT(es_session_n_past(ref), PROMPT + a.n_out);
    if (!swa) CHECK(kv_equal(s, ref, PROMPT + a.n_out));
    CHECK(same_next(s, ref, out[a.n_out - 1]));
done:
    if (s) es_session_free(s);
    if (ref) es_session_free(ref);
}

static void verify_run_model(int which) {
    es_model *m = tm_load(g_dir, which);
    if (!m) return;
    int swa = MODELS[which].n_swa > 0;
    /* greedy[0] = the first token after the prompt, then OUT one-token steps */
    int32_t greedy[OUT + 1], first = -1;
    es_session *g = prompted(m, 1, N_CTX, &first);
    if (!g) goto done;
    greedy[0] = first;
    for (int i = 0; i < OUT; i++) CHECK_EQ_INT(es_forward(g, &greedy[i], 1, &greedy[i + 1], NULL, 0), ES_OK);
    es_session_free(g);
    const int32_t *exact = greedy + 1;   /* the drafts after the pending token: all right */
    int32_t edit[OUT];
    static const int ks[3] = {1, 3, 5};
    for (int nt = 1; nt <= 3; nt++)
        for (int ki = 0; ki < 3; ki++) {
            int32_t k = ks[ki];
            /* every draft right: rounds of k drafts + bonus up to max_out */
            run_case(m, nt, first, greedy, exact, OUT, k, OUT, NULL, 0, swa);
            run_case(m, nt, first, greedy, exact, OUT, k, 17, NULL, 0, swa);
            /* a wrong draft inside the third round, and one at a bonus position */
            for (int at = 0; at < 2; at++) {
                int32_t c = at == 0 ? 2 * (k + 1) + k / 2 : (k + 1) + k;
                memcpy(edit, exact, sizeof edit);
                edit[c] = (edit[c] + 1) % N_VOCAB;
                run_case(m, nt, first, greedy, edit, OUT, k, OUT, NULL, 0, swa);
            }
            /* a stop id: the run ends with the round that yields it */
            int32_t stops[2] = {N_VOCAB + 5, greedy[9]};
            run_case(m, nt, first, greedy, exact, OUT, k, OUT, stops, 2, swa);
        }
done:
    es_model_free(m);
}

TEST(verify_run_llama_q4_1) { verify_run_model(0); }
TEST(verify_run_qwen3_mixed_kquants) { verify_run_model(1); }
TEST(verify_run_qwen2_f32) { verify_run_model(2); }
TEST(verify_run_qwen3moe_experts) { verify_run_model(3); }
TEST(verify_run_qwen3vl_sections) { verify_run_model(4); }
TEST(verify_run_gemma3_sliding_window) { verify_run_model(5); }

/* Interrupt, max_ms, the context's end, bad arguments and unsupported sessions. */
TEST(verify_run_limits_and_errors) {
    es_model *m = tm_load(g_dir, 0);
    if (!m) return;
    int32_t greedy[OUT + 1], first = -1;
    es_session *s = prompted(m, 1, N_CTX, &first);
    if (!s) goto done;
    greedy[0] = first;
    for (int i = 0; i < OUT; i++) CHECK_EQ_INT(es_forward(s, &greedy[i], 1, &greedy[i + 1], NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
    int32_t out[OUT + 1], rk[OUT + 1], rr[OUT + 1], one = 1;
    es_verify_run_args a = {.token = first, .drafts = greedy + 1, .n_drafts = OUT, .k = 3, .max_out = OUT,
                            .tokens_out = out, .round_k = rk, .round_r = rr};
    /* a set interrupt, and a max_ms already passed: one round */
    a.interrupt = &one;
    CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
    CHECK_EQ_INT(a.n_rounds, 1);
    CHECK_EQ_INT(a.n_out, 4);
    CHECK_EQ_INT(es_session_n_past(s), PROMPT + 4);
    CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
    a.interrupt = NULL;
    a.max_ms = 1e-9;
    CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
    CHECK_EQ_INT(a.n_rounds, 1);
    CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
    a.max_ms = 0;
    /* the context's end: the last round shrinks to the room left, up to n_past = n_ctx */
    es_session *c = prompted(m, 1, PROMPT + 12, &first);
    if (c) {
        CHECK_EQ_INT(es_verify_run(c, &a), ES_OK);
        CHECK_EQ_INT(es_session_n_past(c), PROMPT + 12);
        CHECK_EQ_INT(a.n_out, 12);
        CHECK(memcmp(out, greedy + 1, 12 * sizeof *out) == 0);
        /* full: no room for a round of one draft */
        a.token = out[11];
        CHECK_EQ_INT(es_verify_run(c, &a), ES_ERR_INVALID_ARG);
        CHECK(strstr(es_session_last_error(c), "no room") != NULL);
        CHECK_EQ_INT(es_session_n_past(c), PROMPT + 12);
        a.token = first;
        es_session_free(c);
    }
    /* bad arguments: refused before any round, the KV cache untouched */
    es_verify_run_args bad[6];
    for (int i = 0; i < 6; i++) bad[i] = a;
    bad[0].n_drafts = 0;
    bad[1].k = 0;
    bad[2].max_out = 1;
    bad[3].tokens_out = NULL;
    bad[4].token = N_VOCAB;
    int32_t wrong[2] = {1, -3};
    bad[5].drafts = wrong;
    bad[5].n_drafts = 2;
    for (int i = 0; i < 6; i++) {
        CHECK_EQ_INT(es_verify_run(s, &bad[i]), ES_ERR_INVALID_ARG);
        CHECK(es_session_last_error(s)[0] != '\0');
        CHECK_EQ_INT(bad[i].n_out, 0);
        CHECK_EQ_INT(bad[i].n_past_in, PROMPT);
        CHECK_EQ_INT(es_session_n_past(s), PROMPT);
    }
    CHECK_EQ_INT(es_verify_run(s, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_verify_run(NULL, &a), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(a.n_past_in, -1);
    /* after the refusals a run still gives greedy decoding's tokens */
    CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
    CHECK_EQ_INT(a.n_out, OUT);
    CHECK(memcmp(out, greedy + 1, OUT * sizeof *out) == 0);
    /* KV eviction and sparse attention: refused */
    for (int which = 0; which < 2; which++) {
        es_session_params sp = es_session_default_params();
        sp.n_ctx = N_CTX;
        sp.n_threads = 1;
        if (which == 0) sp.kv_window = 32;
        else sp.sparse_topk = 1;
        es_session *u = tm_session_params(m, &sp);
        if (!u) continue;
        int32_t p[PROMPT];
        for (int i = 0; i < PROMPT; i++) p[i] = prompt_tok(i);
        CHECK_EQ_INT(es_forward_last(u, p, PROMPT, &first, NULL), ES_OK);
        a.token = first;
        CHECK_EQ_INT(es_verify_run(u, &a), ES_ERR_UNSUPPORTED);
        CHECK(strstr(es_session_last_error(u), which == 0 ? "eviction" : "sparse") != NULL);
        CHECK_EQ_INT(es_session_n_past(u), PROMPT);
        es_session_free(u);
    }
    es_session_free(s);
done:
    es_model_free(m);
}

/* A sliding-window session whose rings wrap (gemma3-swa, n_swa 16, swa_slack 1: rings of 64
 * positions, n_ctx 96): a round can roll back ring - n_swa + 1 = 49 positions after its forward.
 * A run whose rounds could verify more drafts than ring - n_swa (also the reach of the forward's
 * own undo on error) is refused before any round, the KV cache untouched; at that bound a round
 * that rejects its first draft after the rings wrapped rolls back as the loop does. */
#define SWA_CTX N_CTX
#define SWA_LONG 80
static es_session *swa_session(const es_model *m, int32_t n_prompt, int32_t *first) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = SWA_CTX;
    sp.n_threads = 1;
    sp.swa_slack = 1;
    es_session *s = tm_session_params(m, &sp);
    if (!s) return NULL;
    int32_t p[SWA_CTX];
    for (int i = 0; i < n_prompt; i++) p[i] = prompt_tok(i);
    CHECK_EQ_INT(es_forward_last(s, p, n_prompt, first, NULL), ES_OK);
    return s;
}

TEST(verify_run_within_the_rings_reach) {
    es_model *m = tm_load(g_dir, 5);
    if (!m) return;
    int32_t g[SWA_LONG + 1], first = -1, f2 = -1;
    es_session *s = swa_session(m, PROMPT, &first), *ref = NULL;
    if (!s) goto done;
    g[0] = first;
    for (int i = 0; i < SWA_LONG; i++) CHECK_EQ_INT(es_forward(s, &g[i], 1, &g[i + 1], NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
    es_session_free(s);
    /* the first draft wrong: a round of 55 drafts would roll back 55 positions after writing 56 */
    int32_t d[SWA_LONG], out[SWA_CTX], rk[SWA_CTX], rr[SWA_CTX];
    memcpy(d, g + 1, sizeof d);
    d[0] = (d[0] + 1) % N_VOCAB;
    s = swa_session(m, PROMPT, &first);
    if (!s) goto done;
    es_verify_run_args a = {.token = first, .drafts = d, .n_drafts = SWA_LONG, .k = 55, .max_out = SWA_CTX,
                            .tokens_out = out, .round_k = rk, .round_r = rr};
    CHECK_EQ_INT(es_verify_run(s, &a), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "roll back") != NULL);
    CHECK_EQ_INT(a.n_rounds, 0);
    CHECK_EQ_INT(es_session_n_past(s), PROMPT);
    /* the bound (ring - n_swa = 48 drafts) counts the rounds the run can make: fewer drafts, a
       lower max_out or the room left in n_ctx keep a larger k in reach */
    a.n_drafts = 48;
    CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
    CHECK_EQ_INT(a.n_rounds, 1);
    CHECK_EQ_INT(a.n_out, 1);
    CHECK_EQ_INT(out[0], g[1]);
    CHECK_EQ_INT(es_session_n_past(s), PROMPT + 1);
    es_session_free(s);
    /* at the bound after the rings wrapped (a prompt of 30: the round writes to 79, the rings hold
       [15, 79)): k = 48 with the first draft wrong rolls back 48 positions, as the loop does */
    s = swa_session(m, 30, &first);
    if (!s) goto done;
    int32_t h[SWA_LONG], n_h = SWA_CTX - 30 - 1;
    h[0] = first;
    for (int i = 0; i + 1 < n_h; i++) CHECK_EQ_INT(es_forward(s, &h[i], 1, &h[i + 1], NULL, 0), ES_OK);
    es_session_free(s);
    s = swa_session(m, 30, &first);
    ref = swa_session(m, 30, &f2);
    if (!s || !ref) goto done;
    int32_t hd[SWA_LONG], lout[SWA_CTX], lk[SWA_CTX], lr[SWA_CTX], ln = 0;
    memcpy(hd, h + 1, (size_t)(n_h - 1) * sizeof *hd);
    hd[0] = (hd[0] + 1) % N_VOCAB;
    es_verify_run_args b = {.token = first, .drafts = hd, .n_drafts = n_h - 1, .k = 48, .max_out = SWA_CTX,
                            .tokens_out = out, .round_k = rk, .round_r = rr};
    CHECK_EQ_INT(es_verify_run(s, &b), ES_OK);
    int lrounds = loop_rounds(ref, first, hd, n_h - 1, 48, SWA_CTX, NULL, 0, lout, lk, lr, &ln);
    CHECK_EQ_INT(b.n_rounds, lrounds);
    CHECK_EQ_INT(b.n_out, ln);
    CHECK_EQ_INT(rk[0], 48);
    CHECK_EQ_INT(rr[0], 0);
    CHECK_EQ_INT(out[0], h[1]);
    CHECK_EQ_INT(es_session_n_past(s), 31);
    CHECK(same_next(s, ref, out[b.n_out - 1]));
done:
    if (s) es_session_free(s);
    if (ref) es_session_free(ref);
    es_model_free(m);
}

/* How much a run writes: at most min(max_out, n_drafts + 1, n_ctx - n_past) tokens and as many
 * rounds, so arrays of that size serve any max_out and k (here INT32_MAX, the arrays sized by the
 * context: the sanitizer build checks no write goes past them). */
TEST(verify_run_writes_within_the_context) {
    es_model *m = tm_load(g_dir, 0);
    if (!m) return;
    int32_t greedy[OUT + 1], first = -1;
    es_session *s = prompted(m, 1, PROMPT + 12, &first);
    if (!s) goto done;
    int32_t *out = malloc(12 * sizeof *out), *rk = malloc(12 * sizeof *rk), *rr = malloc(12 * sizeof *rr);
    float *ms = malloc(12 * sizeof *ms), *rb = malloc(12 * sizeof *rb);
    greedy[0] = first;
    for (int i = 0; i < 12; i++) CHECK_EQ_INT(es_forward(s, &greedy[i], 1, &greedy[i + 1], NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
    if (out && rk && rr && ms && rb)
        for (int32_t k = 1; k <= 2; k++) {
            es_verify_run_args a = {.token = first, .drafts = greedy + 1, .n_drafts = 11,
                                    .k = k == 1 ? INT32_MAX : 1, .max_out = INT32_MAX, .tokens_out = out,
                                    .round_k = rk, .round_r = rr, .ms_out = ms, .rollback_ms_out = rb};
            CHECK_EQ_INT(es_session_rollback(s, PROMPT), ES_OK);
            CHECK_EQ_INT(es_verify_run(s, &a), ES_OK);
            CHECK_EQ_INT(a.n_out, 12);   /* the 11 drafts and a bonus: n_past reaches n_ctx */
            CHECK_EQ_INT(a.n_rounds, k == 1 ? 1 : 6);
            CHECK(memcmp(out, greedy + 1, (size_t)a.n_out * sizeof *out) == 0);
            CHECK_EQ_INT(es_session_n_past(s), PROMPT + a.n_out);
        }
    free(out);
    free(rk);
    free(rr);
    free(ms);
    free(rb);
    es_session_free(s);
done:
    es_model_free(m);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_verify_run_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(verify_run_llama_q4_1);
    RUN(verify_run_qwen3_mixed_kquants);
    RUN(verify_run_qwen2_f32);
    RUN(verify_run_qwen3moe_experts);
    RUN(verify_run_qwen3vl_sections);
    RUN(verify_run_gemma3_sliding_window);
    RUN(verify_run_limits_and_errors);
    RUN(verify_run_within_the_rings_reach);
    RUN(verify_run_writes_within_the_context);
    rmdir(g_dir);
    return harness_report();
}
