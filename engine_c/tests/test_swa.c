/*
 * test_swa.c - the sliding-window layers' KV rings (gemma3's local layers
 * keep C = round_up(n_swa + swa_slack, 64) positions, position p at slot
 * p % C; es_session_params). Two models, each run far past its window and
 * around its ring several times:
 *   W80   gemma3-swa widened to 4 layers (3 local, 1 global), window 80,
 *         slack 20: C = 128, two blocks, so a window of 80 that starts
 *         inside a block spans three blocks and the first and last share
 *         one ring block
 *   W16   gemma3-swa as it is (2 local, 1 global), window 16, slack 8:
 *         C = 64, a ring of one block
 * Every logit is bitwise the full layout's (swa_full): one call (run in
 * pieces of the slack), chunks shorter and longer than the slack, and (W80)
 * single steps, es_forward_last, es_forward_batch, on 1, 2 and 3 threads; verify
 * rounds whose rollbacks go as deep as the ring allows (the next token's
 * window then starts at the ring's oldest position) and a fresh run of the
 * tokens that were kept; a rollback one position deeper is refused with a
 * message saying how far back the session can go, the KV cache unchanged;
 * a rollback to 0 works. The reported KV bytes: at n_ctx 8192 the local
 * layers hold C positions and the global one 8192; a short n_ctx keeps
 * every position; the memory check counts the rings; bad parameters are
 * refused.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "tiny_models.h"

#define GEMMA 5
#define T 256          /* tokens of a run: past a window of 80 three times, the ring of 128 twice */
#define CTX 320
#define ROW ((size_t)N_VOCAB * sizeof(float))

static char g_dir[256];

typedef struct {
    const char *name;
    int n_swa, n_layer, pattern, slack;
} swa_case;

static const swa_case CASES[2] = {
    {"W80", 80, 4, 4, 20},
    {"W16", 16, 3, 3, 8},
};

static es_model *load_case(const swa_case *c) {
    model_spec ms = MODELS[GEMMA];
    ms.n_swa = c->n_swa;
    ms.n_layer = c->n_layer;
    ms.swa_pattern = c->pattern;
    ms.layers[3] = ms.layers[0];
    char path[512], err[256] = "";
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, c->name);
    CHECK_EQ_INT(write_model(&ms, path), 0);
    es_model *m = NULL;
    es_status st = es_model_load(path, NULL, &m, err, sizeof err);
    if (st != ES_OK) fprintf(stderr, "  %s: es_model_load: %s\n", c->name, err);
    CHECK_EQ_INT(st, ES_OK);
    unlink(path);
    return m;
}

/* A session with the ring parameters (slack 0: the default; full 1: swa_full). */
static es_session *swa_session(const es_model *m, int nt, int n_ctx, int slack, int full) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = n_ctx;
    sp.n_threads = nt;
    sp.swa_slack = slack;
    sp.swa_full = full;
    return tm_session_params(m, &sp);
}

static void tokens(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 53 + salt * 29 + (i * i) % 7 + 3) % N_VOCAB);
}

/* The ring's length for a case (the formula of es_session_params). */
static int ring_of(const swa_case *c) { return (c->n_swa + c->slack + 63) / 64 * 64; }

/* One call on 1 and 3 threads; chunks around the slack on 2; with all set,
 * es_forward_last, single steps and a batch of two ring sessions too: every
 * row bitwise ref. */
static void check_splits(const es_model *m, const swa_case *c, const int32_t *tok, const float *ref, int all) {
    float *got = malloc(ROW * T);
    for (int nt = 1; nt <= 3; nt += 2) {
        es_session *s = swa_session(m, nt, CTX, c->slack, 0);
        if (!s) break;
        CHECK_EQ_INT(es_forward(s, tok, T, NULL, got, ES_LOGITS_ALL), ES_OK);   /* in pieces of the slack */
        CHECK(memcmp(ref, got, ROW * T) == 0);
        CHECK_EQ_INT(es_session_min_rollback(s), T - (ring_of(c) - c->n_swa + 1));
        es_session_free(s);
    }
    es_session *s = swa_session(m, 2, CTX, c->slack, 0);
    if (s) {
        const int chunks[] = {1, 5, c->slack - 1, c->slack, c->slack + 1, 3 * c->slack + 7, 9};
        for (int done = 0, k = 0; done < T; k++) {
            int n = chunks[k % 7] < T - done ? chunks[k % 7] : T - done;
            CHECK_EQ_INT(es_forward(s, tok + done, n, NULL, got + (size_t)done * N_VOCAB, ES_LOGITS_ALL), ES_OK);
            done += n;
        }
        CHECK(memcmp(ref, got, ROW * T) == 0);
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);   /* a reset always works */
        CHECK_EQ_INT(es_session_min_rollback(s), 0);
    }
    if (s && all) {
        /* es_forward_last over more than the slack: the last row, and its argmax */
        int32_t am = -1, am_ref = 0;
        CHECK_EQ_INT(es_forward_last(s, tok, T, &am, got), ES_OK);
        const float *last = ref + (size_t)(T - 1) * N_VOCAB;
        CHECK(memcmp(last, got, ROW) == 0);
        for (int v = 1; v < N_VOCAB; v++) am_ref = last[v] > last[am_ref] ? v : am_ref;
        CHECK_EQ_INT(am, am_ref);
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        for (int i = 0; i < T; i++)
            CHECK_EQ_INT(es_forward(s, &tok[i], 1, NULL, got + (size_t)i * N_VOCAB, ES_LOGITS_LAST), ES_OK);
        CHECK(memcmp(ref, got, ROW * T) == 0);
    }
    es_session_free(s);
    if (!all) {
        free(got);
        return;
    }
    /* a batch: two ring sessions at other depths, each item longer than the slack */
    es_session *a = swa_session(m, 3, CTX, c->slack, 0), *b = swa_session(m, 1, CTX, c->slack, 0);
    float *got2 = malloc(ROW * T);
    if (a && b) {
        CHECK_EQ_INT(es_forward(a, tok, 100, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        CHECK_EQ_INT(es_forward(b, tok, 37, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        es_batch_item it[2] = {
            {.session = a, .tokens = tok + 100, .n_tokens = T - 100, .head = ES_HEAD_ALL, .logits_out = got,
             .logits_mode = ES_LOGITS_ALL},
            {.session = b, .tokens = tok + 37, .n_tokens = 2 * c->slack + 3, .head = ES_HEAD_LAST,
             .logits_out = got2, .logits_mode = ES_LOGITS_LAST}};
        CHECK_EQ_INT(es_forward_batch(it, 2), ES_OK);
        CHECK(memcmp(ref + 100 * N_VOCAB, got, ROW * (T - 100)) == 0);
        CHECK(memcmp(ref + (size_t)(37 + 2 * c->slack + 2) * N_VOCAB, got2, ROW) == 0);
    }
    es_session_free(a);
    es_session_free(b);
    free(got2);
    free(got);
}

/* Verify rounds on a ring session and a full-layout one side by side: K + 1
 * tokens, then a rollback keeping r of them, sometimes as deep as the ring
 * allows; every row bitwise equal, and at the end a fresh full-layout run
 * of the tokens kept. A rollback one deeper than es_session_min_rollback is
 * refused and changes nothing. */
static void check_rollbacks(const es_model *m, const swa_case *c, const int32_t *tok) {
    es_session *s = swa_session(m, 2, CTX, c->slack, 0), *f = swa_session(m, 1, CTX, 0, 1);
    int32_t *hist = malloc(sizeof(int32_t) * CTX), draft[T];
    float *a = malloc(ROW * T), *b = malloc(ROW * T);
    tokens(draft, T, 7);
    if (!s || !f) goto done;
    int n = 130, reach = ring_of(c) - c->n_swa + 1, deep = 0, hi_max = 0, last_deep = 0;
    memcpy(hist, tok, sizeof(int32_t) * (size_t)n);
    CHECK_EQ_INT(es_forward(s, hist, n, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_forward(f, hist, n, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    for (int round = 1; n + c->slack < CTX - 8 && round < 1000; round++) {
        int k1 = 1 + (round * 5) % (c->slack < 17 ? c->slack : 17);   /* K + 1 of a verify, at most the slack */
        if (round % 4 == 3) k1 = c->slack;
        const int32_t *in = draft + (round * 13) % (T - k1);
        CHECK_EQ_INT(es_forward(s, in, k1, NULL, a, ES_LOGITS_ALL), ES_OK);
        CHECK_EQ_INT(es_forward(f, in, k1, NULL, b, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(a, b, ROW * (size_t)k1) == 0);
        memcpy(hist + n, in, sizeof(int32_t) * (size_t)k1);
        int hi = n + k1, keep;
        hi_max = hi > hi_max ? hi : hi_max;   /* the furthest position written bounds the rollback */
        int32_t lo = es_session_min_rollback(s);
        if (hi_max > ring_of(c)) CHECK_EQ_INT(lo, hi_max - reach);   /* the ring has wrapped */
        if (lo > 0 && hi == hi_max && round - last_deep >= 3) {   /* at the frontier: n_past moves on */
            last_deep = round;
            /* one past the edge: refused, the message says how far back it can go */
            CHECK_EQ_INT(es_session_rollback(s, lo - 1), ES_ERR_INVALID_ARG);
            char want[64];
            snprintf(want, sizeof want, "n_past >= %d, or to 0", (int)lo);
            CHECK(strstr(es_session_last_error(s), want) != NULL);
            CHECK(strstr(es_session_last_error(s), "out of reach") != NULL);
            CHECK_EQ_INT(es_session_n_past(s), hi);
            keep = lo;             /* the deepest rollback there is: across the window's edge */
            deep++;
        } else {
            keep = n + 1 + (round * 7) % k1;
            if (keep > hi) keep = hi;
        }
        CHECK_EQ_INT(es_session_rollback(s, keep), ES_OK);
        CHECK_EQ_INT(es_session_rollback(f, keep), ES_OK);
        n = keep;
    }
    CHECK(deep >= 3);
    /* a call longer than the slack from the deepest point, then a fresh run */
    CHECK_EQ_INT(es_session_rollback(s, es_session_min_rollback(s)), ES_OK);
    n = es_session_n_past(s);
    CHECK_EQ_INT(es_session_rollback(f, n), ES_OK);
    int k1 = 2 * c->slack + 5 < CTX - n ? 2 * c->slack + 5 : CTX - n;
    CHECK_EQ_INT(es_forward(s, draft, k1, NULL, a, ES_LOGITS_ALL), ES_OK);
    CHECK_EQ_INT(es_forward(f, draft, k1, NULL, b, ES_LOGITS_ALL), ES_OK);
    CHECK(memcmp(a, b, ROW * (size_t)k1) == 0);
    memcpy(hist + n, draft, sizeof(int32_t) * (size_t)k1);
    es_session *fresh = swa_session(m, 3, CTX, 0, 1);
    if (fresh) {
        CHECK_EQ_INT(es_forward(fresh, hist, n + k1, NULL, b, ES_LOGITS_LAST), ES_OK);
        CHECK(memcmp(a + (size_t)(k1 - 1) * N_VOCAB, b, ROW) == 0);
        es_session_free(fresh);
    }
    /* the full layout reaches any n_past; the ring only a reset that deep */
    CHECK_EQ_INT(es_session_min_rollback(f), 0);
    CHECK_EQ_INT(es_session_rollback(f, 1), ES_OK);
    CHECK_EQ_INT(es_session_rollback(s, 1), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
    CHECK_EQ_INT(es_forward(s, hist, 40, NULL, a, ES_LOGITS_LAST), ES_OK);
    CHECK_EQ_INT(es_session_rollback(f, 0), ES_OK);
    CHECK_EQ_INT(es_forward(f, hist, 40, NULL, b, ES_LOGITS_LAST), ES_OK);
    CHECK(memcmp(a, b, ROW) == 0);
done:
    es_session_free(s);
    es_session_free(f);
    free(hist);
    free(a);
    free(b);
}

TEST(rings_are_bitwise_the_full_layout) {
    int32_t tok[T];
    tokens(tok, T, 1);
    float *ref = malloc(ROW * T);
    for (int i = 0; i < 2; i++) {
        const swa_case *c = &CASES[i];
        es_model *m = load_case(c);
        if (!m) continue;
        es_model_info in;
        CHECK_EQ_INT(es_model_get_info(m, &in), ES_OK);
        CHECK_EQ_INT(in.n_swa, c->n_swa);
        CHECK_EQ_INT(in.n_swa_layers, c->n_layer - 1);
        es_session *f = swa_session(m, 2, CTX, 0, 1);
        if (f) {
            CHECK_EQ_INT(es_forward(f, tok, T, NULL, ref, ES_LOGITS_ALL), ES_OK);
            es_session_free(f);
            fprintf(stderr, "  %s: ring %d\n", c->name, ring_of(c));
            check_splits(m, c, tok, ref, i == 0);   /* the calls' pieces: on the first model only */
            check_rollbacks(m, c, tok);
        }
        es_model_free(m);
    }
    free(ref);
}

TEST(kv_bytes_follow_the_window) {
    const swa_case *c = &CASES[0];
    es_model *m = load_case(c);
    if (!m) return;
    const size_t pos_bytes = 2 * 64 * sizeof(uint16_t);   /* K and V of one position: 1 KV head of 64 */
    const int ring = (80 + ES_SWA_SLACK + 63) / 64 * 64;  /* the default slack: 384 */
    es_session *s = swa_session(m, 1, 8192, 0, 0), *f = swa_session(m, 1, 8192, 0, 1);
    if (s && f) {
        CHECK_EQ_INT(es_session_kv_bytes(s), (8192 + 3 * ring) * pos_bytes);
        CHECK_EQ_INT(es_session_kv_bytes(f), 4 * 8192 * pos_bytes);
        CHECK_EQ_INT(es_session_n_ctx(s), 8192);
    }
    es_session_free(s);
    es_session_free(f);
    s = swa_session(m, 1, 300, 0, 0);   /* shorter than the ring: every position */
    if (s) {
        CHECK_EQ_INT(es_session_kv_bytes(s), 4 * 320 * pos_bytes);
        int32_t tok[300];
        tokens(tok, 300, 3);
        CHECK_EQ_INT(es_forward(s, tok, 300, NULL, NULL, ES_LOGITS_NONE), ES_OK);
        CHECK_EQ_INT(es_session_min_rollback(s), 0);
        CHECK_EQ_INT(es_session_rollback(s, 1), ES_OK);
        es_session_free(s);
    }
    s = swa_session(m, 1, 8192, 1000, 0);   /* a larger slack, a larger ring */
    if (s) CHECK_EQ_INT(es_session_kv_bytes(s), (8192 + 3 * 1088) * pos_bytes);
    es_session_free(s);
    CHECK_EQ_INT(es_session_kv_bytes(NULL), 0);
    CHECK_EQ_INT(es_session_min_rollback(NULL), 0);
    /* a model without a window: every layer keeps n_ctx, the parameters change nothing */
    es_model *q = tm_load(g_dir, 0);
    s = q ? swa_session(q, 1, 1000, 10, 0) : NULL;
    if (s) CHECK_EQ_INT(es_session_kv_bytes(s), 2 * 1024 * 2 * 64 * sizeof(uint16_t));   /* 2 layers */
    es_session_free(s);
    es_model_free(q);
    es_model_free(m);
}

TEST(memory_check_counts_the_rings) {
    es_model *m = load_case(&CASES[0]);
    if (!m) return;
    es_session_params sp = es_session_default_params();
    sp.n_ctx = 65536;
    sp.n_threads = 1;
    es_session *s = NULL;
    char err[256] = "";
    /* full: 4 layers * 65536 * 256 bytes = 64 MiB; rings: (65536 + 3 * 384) * 256 bytes = 16.3 MiB */
    setenv("ECHOSPEC_MEM_AVAILABLE", "32M", 1);
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_OK);
    if (s) CHECK_EQ_INT(es_session_kv_bytes(s), (65536 + 3 * 384) * 256);
    es_session_free(s);
    s = NULL;
    sp.swa_full = 1;
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_NOMEM);
    CHECK(strstr(err, "KV cache of 65536 tokens needs 64.0 MiB") != NULL);
    CHECK(s == NULL);
    sp.swa_full = 0;
    setenv("ECHOSPEC_MEM_AVAILABLE", "16M", 1);
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_NOMEM);
    CHECK(strstr(err, "(3 sliding-window layers keeping 384) needs 16.3 MiB") != NULL);
    unsetenv("ECHOSPEC_MEM_AVAILABLE");
    /* parameters out of range */
    const int32_t slack_bad[] = {-1, ES_MAX_CTX + 1}, full_bad[] = {-1, 2};
    for (int i = 0; i < 2; i++) {
        sp = es_session_default_params();
        sp.swa_slack = slack_bad[i];
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(s == NULL && strstr(err, "swa_slack") != NULL);
        sp = es_session_default_params();
        sp.swa_full = full_bad[i];
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(s == NULL && strstr(err, "swa_full") != NULL);
    }
    es_model_free(m);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_swa_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(rings_are_bitwise_the_full_layout);
    RUN(kv_bytes_follow_the_window);
    RUN(memory_check_counts_the_rings);
    rmdir(g_dir);
    return harness_report();
}
