/*
 * test_head.c - the output head's argmax when only the argmax is wanted (no
 * logits row is written: each matmul chunk is reduced in its thread's
 * buffer) against the argmax of the logits the same calls write.
 *
 * Models: the three tiny models (tiny_models.h) with an edited output head
 * (head_edit): HEAD_DUP on all three (every logit is tied with three other
 * rows, one in the same matmul chunk and two in others: the lowest index
 * must win). On qwen3-mixed (untied Q6_K head), HEAD_NAN and HEAD_NAN0 (NaN
 * block scales in the head) are refused at load with ES_ERR_BAD_WEIGHTS
 * naming output.weight (a NaN logits row at run time: test_weights.c).
 *
 * Per model and thread count (1, 2, 3), two sessions run the same calls:
 * a 150-token prompt with every row's head (more rows than the per-thread
 * buffer's default size holds at the head's granularity), verifies of 5,
 * single decode steps, a 33-row step and an es_forward_last. Session A asks
 * only for the argmax, B for the argmax and every row's logits. Checked:
 *   - A's and B's argmax both equal the first index of the largest logit
 *     of B's rows, row by row;
 *   - the argmax of every call equals the 1-thread run's;
 *   - A's session scratch logits were never written (filled with a pattern
 *     before the calls, unchanged after them);
 *   - the edit did what it is for: HEAD_DUP rows (at least 9 in 10) have
 *     the maximum more than once, and no logit is NaN.
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

#define N_CTX 256
#define PROMPT 150
#define MAX_ROWS PROMPT
#define PATTERN 0x6B   /* bytes of A's scratch logits before the calls */

typedef struct {
    int n;        /* tokens */
    int last;     /* es_forward_last (the head on the last token only) */
} call_spec;

static const call_spec CALLS[] = {
    {PROMPT, 0}, {5, 0}, {1, 0}, {1, 0}, {5, 0}, {33, 0}, {1, 0}, {5, 0}, {7, 1}, {1, 0}, {5, 0},
};
#define N_CALLS ((int)(sizeof CALLS / sizeof CALLS[0]))

/* The first index of the largest value (the engine's argmax rule), by a plain scan. */
static int32_t ref_argmax(const float *x, int n) {
    int32_t b = 0;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b]) b = i;
    return b;
}

static int32_t tok(int pos) { return (int32_t)((pos * 53 + 11) % N_VOCAB); }


static int32_t g_first[N_CALLS][MAX_ROWS];   /* the 1-thread run's argmax */

typedef struct {
    int ties, nan_logits, rows;
} head_stats;

static void run_threads(const es_model *m, const char *name, int head, int nt, head_stats *hs) {
    es_session *a = tm_session(m, nt, N_CTX), *b = tm_session(m, nt, N_CTX);
    if (!a || !b) return;
    CHECK_EQ_INT(es_session_ensure_scratch(a, MAX_ROWS), ES_OK);
    memset(a->logits, PATTERN, (size_t)a->cap * N_VOCAB * sizeof(float));
    static float logits[MAX_ROWS * N_VOCAB];
    int32_t am_a[MAX_ROWS], am_b[MAX_ROWS], toks[MAX_ROWS];
    int pos = 0;
    for (int c = 0; c < N_CALLS; c++) {
        int n = CALLS[c].n, rows = CALLS[c].last ? 1 : n;
        for (int i = 0; i < n; i++) toks[i] = tok(pos + i);
        memset(am_a, 0xA5, sizeof am_a);
        memset(am_b, 0x5A, sizeof am_b);
        if (CALLS[c].last) {
            CHECK_EQ_INT(es_forward_last(a, toks, n, am_a, NULL), ES_OK);
            CHECK_EQ_INT(es_forward_last(b, toks, n, am_b, logits), ES_OK);
        } else {
            CHECK_EQ_INT(es_forward(a, toks, n, am_a, NULL, 0), ES_OK);
            CHECK_EQ_INT(es_forward(b, toks, n, am_b, logits, 2), ES_OK);
        }
        pos += n;
        int bad = 0;
        for (int i = 0; i < rows; i++) {
            const float *row = logits + (size_t)i * N_VOCAB;
            int32_t want = ref_argmax(row, N_VOCAB);
            if (am_a[i] != want || am_b[i] != want) {
                if (bad++ < 4)
                    fprintf(stderr, "  %s head %d, %d threads, call %d row %d: argmax-only %d, with logits %d, "
                            "of the logits %d\n", name, head, nt, c, i, (int)am_a[i], (int)am_b[i], (int)want);
            }
            if (nt == 1) g_first[c][i] = am_a[i];
            else if (am_a[i] != g_first[c][i]) bad++;
            int at_max = 0, nan = 0;
            for (int v = 0; v < N_VOCAB; v++) {
                at_max += row[v] == row[want];
                nan += row[v] != row[v];
            }
            hs->ties += at_max > 1;
            hs->nan_logits += nan;
            hs->rows++;
        }
        CHECK_EQ_INT(bad, 0);
    }
    /* A's scratch logits are untouched: the argmax-only calls wrote none */
    const uint8_t *p = (const uint8_t *)a->logits;
    size_t changed = 0;
    for (size_t i = 0; i < (size_t)a->cap * N_VOCAB * sizeof(float); i++) changed += p[i] != PATTERN;
    if (changed) fprintf(stderr, "  %s head %d, %d threads: %zu bytes of the scratch logits written\n", name, head,
                         nt, changed);
    CHECK_EQ_INT(changed, 0);
    es_session_free(a);
    es_session_free(b);
}

static char g_dir[256];

static void head_model(int which, int head) {
    model_spec ms = MODELS[which];
    ms.head = head;
    char path[512];
    snprintf(path, sizeof path, "%s/%s-head%d.gguf", g_dir, ms.name, head);
    CHECK_EQ_INT(write_model(&ms, path), 0);
    es_model *m = NULL;
    char err[256] = "";
    es_status st = es_model_load(path, NULL, &m, err, sizeof err);
    if (head >= HEAD_NAN) {   /* NaN scales in the head: refused, naming it */
        CHECK_EQ_INT(st, ES_ERR_BAD_WEIGHTS);
        CHECK(m == NULL);
        CHECK(strstr(err, "'output.weight'") != NULL && strstr(err, "NaN") != NULL);
        unlink(path);
        return;
    }
    if (st != ES_OK) fprintf(stderr, "  %s: es_model_load: %s\n", ms.name, err);
    CHECK_EQ_INT(st, ES_OK);
    unlink(path);
    if (!m) return;
    head_stats hs = {0, 0, 0};
    for (int nt = 1; nt <= 3; nt++) run_threads(m, ms.name, head, nt, &hs);
    /* the edit is in effect: most rows have a tied maximum, and no NaN logits */
    CHECK(hs.rows > 3 * PROMPT);
    CHECK(hs.ties * 10 >= hs.rows * 9);
    CHECK_EQ_INT(hs.nan_logits, 0);
    es_model_free(m);
}

TEST(ties_llama_q4_1_tied_q8_0) { head_model(0, HEAD_DUP); }
TEST(ties_qwen3_q6_k) { head_model(1, HEAD_DUP); }
TEST(ties_qwen2_f32_tied) { head_model(2, HEAD_DUP); }
TEST(nan_rows_qwen3_q6_k_refused) { head_model(1, HEAD_NAN); }
TEST(nan_first_logit_qwen3_q6_k_refused) { head_model(1, HEAD_NAN0); }

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_head_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(ties_llama_q4_1_tied_q8_0);
    RUN(ties_qwen3_q6_k);
    RUN(ties_qwen2_f32_tied);
    RUN(nan_rows_qwen3_q6_k_refused);
    RUN(nan_first_logit_qwen3_q6_k_refused);
    rmdir(g_dir);
    return harness_report();
}
