/*
 * test_neon_parity.c - the build's SIMD path (NEON dotprod on aarch64, AVX2 /
 * AVX-512 on x86-64) against the scalar path, and this architecture against
 * the x86-64 build, on tiny models written by this test.
 *
 * Models (tiny_models.h: GGUF v3 written with a fixed integer PRNG, so every build
 * and architecture reads the same bytes):
 *   llama-q4_1    llama, Q4_1 matrices, tied Q8_0 token_embd (SmolLM2's types),
 *                 n_embd 192, 3 heads / 1 KV head of 64, n_ff 512, 2 layers
 *   qwen3-mixed   qwen3 (q/k RMSNorm, NEOX RoPE), n_embd 256, 4 / 2 heads of 64,
 *                 n_ff 512, 2 layers; layer 0 is Qwen3 Q4_K_M-like (Q4_K, Q6_K),
 *                 layer 1 has Q8_0, Q4_0, Q5_0, Q5_1, Q5_K, F16, BF16;
 *                 untied Q6_K output
 *   qwen2-f32     qwen2 (q/k/v biases), F32 matrices, n_embd 64, 2 layers
 * All have n_vocab 320 (not a multiple of 64, so kernel tails run).
 *
 * Checks, per model:
 *   kernels  every weight matrix: es_matmul_path with the build's kernels
 *            (and activation quantizer) equals the scalar reference bitwise,
 *            for N = 1, 2, 3, 5, 8, 12, 17, 33 on a 3-thread pool
 *   run      prefill 12 prompt tokens (logits of every position), then 23
 *            greedy decode steps (one token each, 3 threads): 35 logits rows
 *   batched  the same 35 tokens in one forward call on a 1-thread session,
 *            and rollback to the prompt then the 23 decode inputs in one
 *            call, give bitwise the same logits rows (verify == decode)
 *   argmax   the 35 argmax values equal those recorded from the x86-64
 *            build (tests/data/neon_parity_expected.txt)
 *   logits   the FNV-1a 64 checksum of each logits row (float32 bit
 *            patterns) equals the scalar build's: with ES_PARITY_SCALAR, the
 *            record of this architecture's scalar build of the same tree
 *            (.ci/aarch64.sh makes one), else the checksums of this
 *            architecture's scalar build in the expected file. So the SIMD
 *            forward is bitwise the scalar forward. Whether the x86-64 and
 *            aarch64 checksums agree is printed (they could differ in the
 *            last bit through libm's pow/sin/cos in the RoPE tables).
 *            When the forward pass's numerics change on purpose, re-record
 *            the expected file: engine_c/tests/data/record_neon_parity.py.
 *   simd     when ES_EXPECT_SIMD is set (by .ci/aarch64.sh): neon-a76 builds
 *            report "neon-dotprod" from es_simd_name(), scalar builds "scalar"
 *
 * Environment:
 *   ES_PARITY_EXPECTED  expected file (default tests/data/neon_parity_expected.txt,
 *                       relative to engine_c/, where make runs the tests)
 *   ES_PARITY_SCALAR    a record (ES_PARITY_RECORD output) of this
 *                       architecture's scalar build of the same tree: the
 *                       logits checksums are compared with it instead
 *   ES_PARITY_RECORD    write this build's results to that file instead of
 *                       comparing (record_neon_parity.py and .ci/aarch64.sh use it)
 *   ES_PARITY_KEEP_DIR  also keep the model files there (for inspection)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "internal.h"
#include "quant.h"
#include "tiny_models.h"

#if defined(__aarch64__)
#define ARCH_NAME "aarch64"
#elif defined(__x86_64__)
#define ARCH_NAME "x86_64"
#else
#define ARCH_NAME "other"
#endif

#define N_PROMPT 12
#define N_DECODE 23
#define N_ROWS (N_PROMPT + N_DECODE)

static uint64_t fnv1a(const void *p, size_t n, uint64_t h) {
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001B3ull;
    return h;
}
#define FNV_INIT 0xCBF29CE484222325ull

/* ---- the runs ---- */

typedef struct {
    int32_t argmax[N_ROWS];
    uint64_t row_fnv[N_ROWS];
    uint64_t fnv;              /* over all rows in order */
} run_result;

static void prompt_tokens(int32_t *t) {
    for (int i = 0; i < N_PROMPT; i++) t[i] = (int32_t)((i * 37 + 5) % N_VOCAB);
}

/* (a) es_matmul_path: build kernels vs scalar reference, bitwise, on every matrix. */
static int check_kernels(const es_model *m, const char *mname) {
    es_pool *pool = es_pool_new(3);
    CHECK(pool != NULL);
    if (!pool) return 1;
    const es_tensor *mats[4 + 7 * 2];
    int nm = 0;
    mats[nm++] = m->tok_embd;
    if (m->output != m->tok_embd) mats[nm++] = m->output;
    for (int il = 0; il < m->info.n_layer && il < 2; il++) {
        const es_layer *L = &m->layers[il];
        const es_tensor *t[7] = {L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down};
        for (int i = 0; i < 7; i++) mats[nm++] = t[i];
    }
    int bad = 0;
    static const int Ns[] = {1, 2, 3, 5, 8, 12, 17, 33};
    const int n_Ns = (int)(sizeof Ns / sizeof Ns[0]);
    uint64_t s = 0xC0FFEE;
    for (int i = 0; i < nm; i++) {
        const es_tensor *W = mats[i];
        for (int k = 0; k < n_Ns; k++) {
            int N = Ns[k];
            int64_t n_in = W->ne[0], n_out = W->ne[1];
            float *X = malloc(sizeof(float) * (size_t)(N * n_in));
            float *Y0 = malloc(sizeof(float) * (size_t)(N * n_out));
            float *Y1 = malloc(sizeof(float) * (size_t)(N * n_out));
            size_t sb = es_matmul_scratch_bytes(W->type, n_in, N);
            void *scratch = aligned_alloc(64, (sb + 63) / 64 * 64 + 64);
            for (int64_t j = 0; j < N * n_in; j++) X[j] = rng_sym(&s, 2.0f);
            es_matmul_path(pool, W, X, N, Y0, n_out, scratch, 0);
            es_matmul_path(pool, W, X, N, Y1, n_out, scratch, 1);
            if (memcmp(Y0, Y1, sizeof(float) * (size_t)(N * n_out)) != 0) {
                int64_t at = 0;
                while (at < N * n_out && memcmp(&Y0[at], &Y1[at], 4) == 0) at++;
                fprintf(stderr, "  %s: %s (%s) N=%d: %s kernel differs from scalar at [%lld][%lld]: %.9g vs %.9g\n",
                        mname, W->name, es_type_name(W->type), N, es_simd_name(),
                        (long long)(at / n_out), (long long)(at % n_out), Y0[at], Y1[at]);
                bad++;
            }
            free(X); free(Y0); free(Y1); free(scratch);
        }
    }
    es_pool_free(pool);
    CHECK_EQ_INT(bad, 0);
    return bad;
}

static int new_session(const es_model *m, int n_threads, es_session **out) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = 64;
    sp.n_threads = n_threads;
    char err[256] = "";
    es_status st = es_session_new(m, &sp, out, err, sizeof err);
    if (st != ES_OK) fprintf(stderr, "  es_session_new: %d %s\n", (int)st, err);
    CHECK_EQ_INT(st, ES_OK);
    return st == ES_OK ? 0 : 1;
}

static int32_t argmax_row(const float *row) {
    int32_t best = 0;
    for (int32_t i = 1; i < N_VOCAB; i++)
        if (row[i] > row[best]) best = i;
    return best;
}

/* Prefill + greedy decode on 3 threads; then the batched and rollback re-runs. */
static int run_model(const es_model *m, const char *mname, run_result *res) {
    es_session *s = NULL, *s1 = NULL;
    if (new_session(m, 3, &s)) return 1;
    float *logits = calloc((size_t)N_ROWS * N_VOCAB, sizeof(float));
    float *again = calloc((size_t)N_ROWS * N_VOCAB, sizeof(float));
    int32_t toks[N_ROWS], am[N_ROWS];
    prompt_tokens(toks);
    int rc = 0;
    CHECK_EQ_INT(es_forward(s, toks, N_PROMPT, am, logits, 2), ES_OK);
    for (int t = 0; t < N_DECODE; t++) {
        toks[N_PROMPT + t] = am[N_PROMPT - 1 + t];
        float *row = logits + (size_t)(N_PROMPT + t) * N_VOCAB;
        es_status st = es_forward(s, &toks[N_PROMPT + t], 1, &am[N_PROMPT + t], row, 1);
        if (st != ES_OK) {
            fprintf(stderr, "  %s decode step %d: %s\n", mname, t, es_session_last_error(s));
            CHECK_EQ_INT(st, ES_OK);
            rc = 1;
            break;
        }
    }
    /* argmax_out agrees with the logits rows (ties to the lowest id) */
    for (int r = 0; r < N_ROWS && !rc; r++) CHECK_EQ_INT(am[r], argmax_row(logits + (size_t)r * N_VOCAB));
    res->fnv = FNV_INIT;
    for (int r = 0; r < N_ROWS; r++) {
        res->argmax[r] = am[r];
        res->row_fnv[r] = fnv1a(logits + (size_t)r * N_VOCAB, sizeof(float) * N_VOCAB, FNV_INIT);
        res->fnv = fnv1a(logits + (size_t)r * N_VOCAB, sizeof(float) * N_VOCAB, res->fnv);
    }
    /* verify-shaped: all 35 tokens in one call on one thread */
    if (!rc && new_session(m, 1, &s1) == 0) {
        CHECK_EQ_INT(es_forward(s1, toks, N_ROWS, NULL, again, 2), ES_OK);
        int same = memcmp(again, logits, sizeof(float) * (size_t)N_ROWS * N_VOCAB) == 0;
        if (!same) fprintf(stderr, "  %s: one 35-token call on 1 thread != prefill + 23 decode steps on 3\n", mname);
        CHECK(same);
    }
    /* rollback to the prompt, then the 23 decode inputs in one call */
    if (!rc) {
        CHECK_EQ_INT(es_session_rollback(s, N_PROMPT), ES_OK);
        CHECK_EQ_INT(es_forward(s, toks + N_PROMPT, N_DECODE, NULL, again, 2), ES_OK);
        int same = memcmp(again, logits + (size_t)N_PROMPT * N_VOCAB,
                          sizeof(float) * (size_t)N_DECODE * N_VOCAB) == 0;
        if (!same) fprintf(stderr, "  %s: rollback + one 23-token call != 23 decode steps\n", mname);
        CHECK(same);
    }
    es_session_free(s1);
    es_session_free(s);
    free(logits);
    free(again);
    return rc;
}

/* ---- the expected file ---- */

typedef struct {
    char name[32];
    int have_argmax;
    int32_t argmax[N_ROWS];
    int have_rows[2];              /* [0] x86_64, [1] aarch64 */
    uint64_t fnv[2], row_fnv[2][N_ROWS];
} expected_model;

static int arch_index(const char *a) { return strcmp(a, "x86_64") == 0 ? 0 : strcmp(a, "aarch64") == 0 ? 1 : -1; }

/* Parse the expected file: blocks of "model NAME", "argmax a0 ... a34",
 * "fnv ARCH HEX", "rows ARCH HEX0 ... HEX34". Returns models read, -1 if unreadable. */
static int read_expected(const char *path, expected_model *em, int max) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char line[8192];
    int n = 0;
    expected_model *cur = NULL;
    while (fgets(line, sizeof line, f)) {
        char *save = NULL, *tok = strtok_r(line, " \t\r\n", &save);
        if (!tok || tok[0] == '#') continue;
        if (strcmp(tok, "model") == 0 && n < max) {
            cur = &em[n++];
            memset(cur, 0, sizeof *cur);
            tok = strtok_r(NULL, " \t\r\n", &save);
            snprintf(cur->name, sizeof cur->name, "%s", tok ? tok : "");
        } else if (cur && strcmp(tok, "argmax") == 0) {
            int i = 0;
            while (i < N_ROWS && (tok = strtok_r(NULL, " \t\r\n", &save))) cur->argmax[i++] = (int32_t)atoi(tok);
            cur->have_argmax = i == N_ROWS;
        } else if (cur && (strcmp(tok, "fnv") == 0 || strcmp(tok, "rows") == 0)) {
            int rows = strcmp(tok, "rows") == 0;
            tok = strtok_r(NULL, " \t\r\n", &save);
            int a = tok ? arch_index(tok) : -1;
            if (a < 0) continue;
            if (!rows) {
                tok = strtok_r(NULL, " \t\r\n", &save);
                if (tok) cur->fnv[a] = strtoull(tok, NULL, 16);
            } else {
                int i = 0;
                while (i < N_ROWS && (tok = strtok_r(NULL, " \t\r\n", &save)))
                    cur->row_fnv[a][i++] = strtoull(tok, NULL, 16);
                cur->have_rows[a] = i == N_ROWS;
            }
        }
    }
    fclose(f);
    return n;
}

static void write_record(FILE *f, const char *mname, const run_result *r) {
    fprintf(f, "model %s\nargmax", mname);
    for (int i = 0; i < N_ROWS; i++) fprintf(f, " %d", r->argmax[i]);
    fprintf(f, "\nfnv %s %016llx\nrows %s", ARCH_NAME, (unsigned long long)r->fnv, ARCH_NAME);
    for (int i = 0; i < N_ROWS; i++) fprintf(f, " %016llx", (unsigned long long)r->row_fnv[i]);
    fprintf(f, "\n");
}

static void compare(const expected_model *e, const expected_model *sc, const char *mname,
                    const run_result *r) {
    if (!e) {
        fprintf(stderr, "  %s: no expected record in the expected file\n", mname);
        CHECK(e != NULL);
        return;
    }
    CHECK(e->have_argmax);
    int first = -1;
    for (int i = 0; i < N_ROWS && first < 0; i++)
        if (e->argmax[i] != r->argmax[i]) first = i;
    if (first >= 0)
        fprintf(stderr, "  %s: argmax differs from the x86-64 build at row %d: %d vs %d (x86-64)\n",
                mname, first, r->argmax[first], e->argmax[first]);
    CHECK_EQ_INT(first, -1);
    int a = arch_index(ARCH_NAME);
    if (a < 0) {
        printf("  %s: no logits record for %s; argmax compared only\n", mname, ARCH_NAME);
        return;
    }
    /* the reference checksums: this tree's scalar build, else the expected file's */
    const expected_model *ref = sc ? sc : e;
    const char *what = sc ? "this tree's scalar build (ES_PARITY_SCALAR)" : "the expected file's scalar build";
    if (sc && !sc->have_rows[a]) fprintf(stderr, "  %s: ES_PARITY_SCALAR has no %s rows\n", mname, ARCH_NAME);
    CHECK(ref->have_rows[a]);
    int row = -1;
    for (int i = 0; i < N_ROWS && row < 0; i++)
        if (ref->row_fnv[a][i] != r->row_fnv[i]) row = i;
    if (row >= 0)
        fprintf(stderr, "  %s: logits row %d differs from %s on %s (fnv %016llx vs %016llx): either the %s "
                "path is not bitwise the scalar path, or the forward numerics changed (then re-record: "
                "engine_c/tests/data/record_neon_parity.py)\n", mname, row, what, ARCH_NAME,
                (unsigned long long)r->row_fnv[row], (unsigned long long)ref->row_fnv[a][row], es_simd_name());
    CHECK_EQ_INT(row, -1);
    CHECK(ref->fnv[a] == r->fnv);
    if (sc && (e->fnv[a] != sc->fnv[a]))
        printf("  %s: note: this tree's %s scalar logits differ from the expected file's (numerics changed "
               "since it was recorded)\n", mname, ARCH_NAME);
    int other = 1 - a;
    if (e->have_rows[other])
        printf("  %s: logits checksum %016llx (%s, %s); x86-64 and aarch64 scalar logits are %s\n", mname,
               (unsigned long long)r->fnv, ARCH_NAME, es_simd_name(),
               e->fnv[0] == e->fnv[1] ? "bitwise identical" : "not bitwise identical (libm), argmax identical");
}

/* ---- tests ---- */

static expected_model g_expected[MAX_MODELS], g_scalar[MAX_MODELS];
static int g_n_expected = -1, g_n_scalar = 0;
static FILE *g_record = NULL;
static char g_dir[256];

static const expected_model *find_model(const expected_model *em, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(em[i].name, name) == 0) return &em[i];
    return NULL;
}

static void parity(int which) {
    const model_spec *ms = &MODELS[which];
    char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, ms->name);
    CHECK_EQ_INT(write_model(ms, path), 0);
    es_model *m = NULL;
    char err[256] = "";
    es_model_params mp = es_model_default_params();
    es_status st = es_model_load(path, &mp, &m, err, sizeof err);
    if (st != ES_OK) fprintf(stderr, "  %s: es_model_load: %s\n", ms->name, err);
    CHECK_EQ_INT(st, ES_OK);
    if (st != ES_OK) return;
    check_kernels(m, ms->name);
    run_result r;
    memset(&r, 0, sizeof r);
    if (run_model(m, ms->name, &r) == 0) {
        if (g_record) write_record(g_record, ms->name, &r);
        else {
            const expected_model *sc = find_model(g_scalar, g_n_scalar, ms->name);
            if (g_n_scalar > 0 && !sc) fprintf(stderr, "  %s: not in ES_PARITY_SCALAR\n", ms->name);
            CHECK(g_n_scalar == 0 || sc != NULL);
            compare(find_model(g_expected, g_n_expected, ms->name), sc, ms->name, &r);
        }
    }
    es_model_free(m);
}

TEST(parity_llama_q4_1) { parity(0); }
TEST(parity_qwen3_mixed_kquants) { parity(1); }
TEST(parity_qwen2_f32) { parity(2); }

TEST(simd_path_is_the_expected_one) {
    const char *want = getenv("ES_EXPECT_SIMD");
    const char *got = es_simd_name();
    printf("  simd path: %s (%s)\n", got, ARCH_NAME);
    if (!want || !*want) return;
    const char *name = strcmp(want, "neon-a76") == 0 ? "neon-dotprod"
                     : strcmp(want, "scalar") == 0 ? "scalar" : want;
    if (strcmp(got, name) != 0)
        fprintf(stderr, "  ES_EXPECT_SIMD=%s: es_simd_name() is \"%s\", expected \"%s\"\n", want, got, name);
    CHECK(strcmp(got, name) == 0);
}

int main(void) {
    const char *keep = getenv("ES_PARITY_KEEP_DIR");
    const char *tmp = getenv("TMPDIR");
    if (keep && *keep) {
        snprintf(g_dir, sizeof g_dir, "%s", keep);
    } else {
        snprintf(g_dir, sizeof g_dir, "%s/es_parity_XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    }
    const char *rec = getenv("ES_PARITY_RECORD");
    if (rec && *rec) {
        g_record = fopen(rec, "w");
        if (!g_record) { perror(rec); return 2; }
    } else {
        const char *exp = getenv("ES_PARITY_EXPECTED");
        if (!exp || !*exp) exp = "tests/data/neon_parity_expected.txt";
        g_n_expected = read_expected(exp, g_expected, MAX_MODELS);
        if (g_n_expected < 0) fprintf(stderr, "  cannot read the expected file %s (run from engine_c/)\n", exp);
        const char *sc = getenv("ES_PARITY_SCALAR");
        if (sc && *sc) {
            g_n_scalar = read_expected(sc, g_scalar, MAX_MODELS);
            if (g_n_scalar < 0) {
                fprintf(stderr, "  cannot read ES_PARITY_SCALAR=%s\n", sc);
                return 2;
            }
        }
    }
    RUN(simd_path_is_the_expected_one);
    RUN(parity_llama_q4_1);
    RUN(parity_qwen3_mixed_kquants);
    RUN(parity_qwen2_f32);
    if (g_record) fclose(g_record);
    if (!(keep && *keep)) {
        for (int i = 0; i < MAX_MODELS; i++) {
            char path[512];
            snprintf(path, sizeof path, "%s/%s.gguf", g_dir, MODELS[i].name);
            unlink(path);
        }
        rmdir(g_dir);
    }
    return harness_report();
}
