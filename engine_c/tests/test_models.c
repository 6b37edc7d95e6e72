/*
 * test_models.c - the architectures beyond the dense decoders:
 *   qwen3moe   one call over N tokens is bitwise N single steps on 1, 2 and
 *              3 threads; es_session_experts_read counts the union of the
 *              experts the call's rows chose (n_expert_used per layer for one
 *              token, more for a verify); the model info reports the experts
 *   qwen3vl    es_forward_positions with (p, p, p) is bitwise es_forward; other
 *              (h, w) positions change the result, other t on a model without
 *              sections does too, and (h, w) do not; a negative position fails
 *              with the KV cache untouched; the sections are read
 *   gemma3     a sliding window of 16 on layers 0 and 1 (pattern 3), crossed
 *              and run past: one call of 150 tokens, chunks of 70 / 5 / 75 and
 *              single steps give bitwise the same logits on 1, 2 and 3 threads;
 *              a rollback across the window (to 75, to 66) and new tokens
 *              give bitwise a fresh session's run; with a window larger than
 *              the context, rows 0..15 are bitwise the same and row 16 (the
 *              first whose window leaves position 0 out) differs; the keys
 *              are read (the pattern's default 6 makes every layer local)
 *   loading    a file whose expert or section keys are missing or out of
 *              range fails with a message naming the key; weights or a KV
 *              cache larger than the memory available are refused before
 *              anything is allocated (ECHOSPEC_MEM_AVAILABLE stands in for
 *              a small machine)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "tiny_models.h"

#define MOE 3
#define VL 4
#define GEMMA 5
#define N 9

static char g_dir[256];

static void prompt(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 37 + salt * 11 + 5) % N_VOCAB);
}

TEST(moe_call_equals_steps_any_threads) {
    es_model *m = tm_load(g_dir, MOE);
    if (!m) return;
    es_model_info in;
    CHECK_EQ_INT(es_model_get_info(m, &in), ES_OK);
    CHECK(strcmp(in.arch, "qwen3moe") == 0);
    CHECK_EQ_INT(in.n_expert, 8);
    CHECK_EQ_INT(in.n_expert_used, 3);
    CHECK_EQ_INT(in.n_ff_exp, 256);
    CHECK(in.weight_bytes < in.file_weight_bytes);   /* 3 of 8 experts a step */
    int32_t tok[N];
    prompt(tok, N, 1);
    float *ref = malloc(sizeof(float) * N * N_VOCAB), *got = malloc(sizeof(float) * N * N_VOCAB);
    es_session *r = tm_session(m, 1, 64);
    for (int i = 0; i < N && r; i++) {
        CHECK_EQ_INT(es_forward(r, &tok[i], 1, NULL, ref + (size_t)i * N_VOCAB, ES_LOGITS_LAST), ES_OK);
        CHECK_EQ_INT(es_session_experts_read(r), 2 * 3);   /* one row: its 3 experts in each of 2 layers */
    }
    for (int nt = 1; nt <= 3; nt++) {
        es_session *s = tm_session(m, nt, 64);
        if (!s) break;
        CHECK_EQ_INT(es_forward(s, tok, N, NULL, got, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(ref, got, sizeof(float) * N * N_VOCAB) == 0);
        int64_t read = es_session_experts_read(s);
        CHECK(read > 2 * 3 && read <= 2 * 8);   /* the union of 9 rows' choices, each expert once */
        /* a verify-like call after a rollback: the same bits again */
        CHECK_EQ_INT(es_session_rollback(s, 4), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok + 4, N - 4, NULL, got, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(ref + 4 * N_VOCAB, got, sizeof(float) * (N - 4) * N_VOCAB) == 0);
        es_session_free(s);
    }
    es_session_free(r);
    free(ref);
    free(got);
    es_model_free(m);
}

TEST(vl_positions) {
    es_model *m = tm_load(g_dir, VL);
    if (!m) return;
    es_model_info in;
    CHECK_EQ_INT(es_model_get_info(m, &in), ES_OK);
    CHECK(strcmp(in.arch, "qwen3vl") == 0);
    CHECK_EQ_INT(in.rope_sections[0], 6);
    CHECK_EQ_INT(in.rope_sections[1], 5);
    CHECK_EQ_INT(in.rope_sections[2], 5);
    CHECK_EQ_INT(in.n_deepstack, 1);
    CHECK_EQ_INT(in.n_expert, 0);
    int32_t tok[N], thw[3 * N];
    prompt(tok, N, 2);
    float *a = malloc(sizeof(float) * N * N_VOCAB), *b = malloc(sizeof(float) * N * N_VOCAB);
    es_session *s = tm_session(m, 2, 64);
    if (s) {
        CHECK_EQ_INT(es_forward(s, tok, N, NULL, a, ES_LOGITS_ALL), ES_OK);
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        for (int i = 0; i < N; i++) thw[3 * i] = thw[3 * i + 1] = thw[3 * i + 2] = i;
        CHECK_EQ_INT(es_forward_positions(s, tok, N, thw, NULL, b, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(a, b, sizeof(float) * N * N_VOCAB) == 0);
        /* an image-like grid: h and w differ from t, which changes the rotation */
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        for (int i = 0; i < N; i++) {
            thw[3 * i + 1] = i / 3;
            thw[3 * i + 2] = i % 3;
        }
        CHECK_EQ_INT(es_forward_positions(s, tok, N, thw, NULL, b, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(a + N_VOCAB, b + N_VOCAB, sizeof(float) * (N - 1) * N_VOCAB) != 0);
        /* a negative position: refused, nothing appended */
        int32_t n_past = es_session_n_past(s);
        thw[4] = -1;
        CHECK_EQ_INT(es_forward_positions(s, tok, N, thw, NULL, b, ES_LOGITS_ALL), ES_ERR_INVALID_ARG);
        CHECK(strstr(es_session_last_error(s), "negative") != NULL);
        CHECK_EQ_INT(es_session_n_past(s), n_past);
        es_session_free(s);
    }
    es_model_free(m);
    /* a model without sections rotates by t alone */
    es_model *q = tm_load(g_dir, 1);
    es_session *t = q ? tm_session(q, 1, 64) : NULL;
    if (t) {
        CHECK_EQ_INT(es_forward(t, tok, N, NULL, a, ES_LOGITS_ALL), ES_OK);
        CHECK_EQ_INT(es_session_rollback(t, 0), ES_OK);
        for (int i = 0; i < N; i++) {
            thw[3 * i] = i;
            thw[3 * i + 1] = 100 + i;
            thw[3 * i + 2] = 7;
        }
        CHECK_EQ_INT(es_forward_positions(t, tok, N, thw, NULL, b, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(a, b, sizeof(float) * N * N_VOCAB) == 0);
        CHECK_EQ_INT(es_session_rollback(t, 0), ES_OK);
        for (int i = 0; i < N; i++) thw[3 * i] = 2 * i;
        CHECK_EQ_INT(es_forward_positions(t, tok, N, thw, NULL, b, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(a + N_VOCAB, b + N_VOCAB, sizeof(float) * (N - 1) * N_VOCAB) != 0);
    }
    es_session_free(t);
    es_model_free(q);
    free(a);
    free(b);
}

/* Write ms and expect its load to fail with st and a message containing want. */
static int load_fails(const model_spec *ms, es_status st, const char *want) {
    char path[512], err[256] = "";
    snprintf(path, sizeof path, "%s/bad.gguf", g_dir);
    if (write_model(ms, path) != 0) return 0;
    es_model *m = NULL;
    es_status got = es_model_load(path, NULL, &m, err, sizeof err);
    unlink(path);
    es_model_free(m);
    if (got != st || strstr(err, want) == NULL) {
        fprintf(stderr, "  load: status %d, message '%s'; wanted %d and '%s'\n", (int)got, err, (int)st, want);
        return 0;
    }
    return 1;
}

#define GT 150      /* tokens: past the window of 16 and two KV block boundaries */
#define GCTX 192

static void gemma_tokens(int32_t *t, int n, int salt) {
    for (int i = 0; i < n; i++) t[i] = (int32_t)((i * 53 + salt * 29 + 3) % N_VOCAB);
}

/* A fresh session on nt threads: toks[0..n0) in one call, then toks2[0..n2)
 * in one call with every row's logits into out. */
static void gemma_run(const es_model *m, int nt, const int32_t *toks, int n0, const int32_t *toks2, int n2,
                      float *out) {
    es_session *s = tm_session(m, nt, GCTX);
    if (!s) return;
    if (n0 > 0) CHECK_EQ_INT(es_forward(s, toks, n0, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_forward(s, toks2, n2, NULL, out, ES_LOGITS_ALL), ES_OK);
    es_session_free(s);
}

TEST(gemma3_sliding_window) {
    es_model *m = tm_load(g_dir, GEMMA);
    if (!m) return;
    es_model_info in;
    CHECK_EQ_INT(es_model_get_info(m, &in), ES_OK);
    CHECK(strcmp(in.arch, "gemma3") == 0);
    CHECK_EQ_INT(in.n_swa, 16);
    CHECK_EQ_INT(in.n_swa_layers, 2);
    CHECK(in.rope_freq_base_swa == 10000.0f && in.rope_freq_base == 1000000.0f && in.rope_freq_scale == 1.0f);
    size_t row = N_VOCAB * sizeof(float);
    int32_t tok[GT], tok2[GT];
    gemma_tokens(tok, GT, 1);
    gemma_tokens(tok2, GT, 2);
    float *ref = malloc(row * GT), *got = malloc(row * GT), *fresh = malloc(row * GT);
    es_session *r = tm_session(m, 1, GCTX);
    for (int i = 0; i < GT && r; i++)
        CHECK_EQ_INT(es_forward(r, &tok[i], 1, NULL, ref + (size_t)i * N_VOCAB, ES_LOGITS_LAST), ES_OK);
    es_session_free(r);
    for (int nt = 1; nt <= 3; nt++) {
        es_session *s = tm_session(m, nt, GCTX);
        if (!s) break;
        CHECK_EQ_INT(es_forward(s, tok, GT, NULL, got, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(ref, got, row * GT) == 0);
        /* chunks: a prefill, a verify-sized call (key split), the rest */
        CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok, 70, NULL, got, ES_LOGITS_ALL), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok + 70, 5, NULL, got + 70 * N_VOCAB, ES_LOGITS_ALL), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok + 75, GT - 75, NULL, got + 75 * N_VOCAB, ES_LOGITS_ALL), ES_OK);
        CHECK(memcmp(ref, got, row * GT) == 0);
        /* roll back across the window (position 75's window is (59, 75], in two
         * blocks) and continue with other tokens: a fresh run of the same */
        CHECK_EQ_INT(es_session_rollback(s, 75), ES_OK);
        CHECK_EQ_INT(es_forward(s, tok2, 40, NULL, got, ES_LOGITS_ALL), ES_OK);
        gemma_run(m, 1, tok, 75, tok2, 40, fresh);
        CHECK(memcmp(fresh, got, row * 40) == 0);
        CHECK_EQ_INT(es_session_rollback(s, 66), ES_OK);   /* a verify of 5 after a rollback */
        CHECK_EQ_INT(es_forward(s, tok2 + 100, 5, NULL, got, ES_LOGITS_ALL), ES_OK);
        gemma_run(m, 1, tok, 66, tok2 + 100, 5, fresh);
        CHECK(memcmp(fresh, got, row * 5) == 0);
        es_session_free(s);
    }
    es_model_free(m);

    /* a window wider than the context: the same model where no window is cut */
    model_spec ms = MODELS[GEMMA];
    ms.n_swa = 1000;
    char path[512], err[256] = "";
    snprintf(path, sizeof path, "%s/gemma-wide.gguf", g_dir);
    CHECK_EQ_INT(write_model(&ms, path), 0);
    m = NULL;
    CHECK_EQ_INT(es_model_load(path, NULL, &m, err, sizeof err), ES_OK);
    unlink(path);
    if (m) {
        gemma_run(m, 2, tok, 0, tok, 20, got);
        CHECK(memcmp(ref, got, row * 16) == 0);
        CHECK(memcmp(ref + 16 * N_VOCAB, got + 16 * N_VOCAB, row) != 0);
        es_model_free(m);
    }
    /* without the pattern key: llama.cpp's default 6, every layer of 3 local */
    ms = MODELS[GEMMA];
    ms.swa_pattern = -1;
    snprintf(path, sizeof path, "%s/gemma-pat.gguf", g_dir);
    CHECK_EQ_INT(write_model(&ms, path), 0);
    m = NULL;
    CHECK_EQ_INT(es_model_load(path, NULL, &m, err, sizeof err), ES_OK);
    unlink(path);
    if (m) {
        CHECK_EQ_INT(es_model_get_info(m, &in), ES_OK);
        CHECK_EQ_INT(in.n_swa_layers, 3);
        es_model_free(m);
    }
    free(ref);
    free(got);
    free(fresh);
}

TEST(bad_expert_and_section_keys) {
    model_spec ms = MODELS[MOE];
    ms.n_expert_used = 9;   /* more than the 8 experts */
    CHECK(load_fails(&ms, ES_ERR_FORMAT, "qwen3moe.expert_used_count = 9 out of range 1..8"));
    ms = MODELS[MOE];
    ms.n_expert = 0;        /* no expert keys (and a dense FFN instead) */
    CHECK(load_fails(&ms, ES_ERR_FORMAT, "missing key qwen3moe.expert_count"));
    ms = MODELS[VL];
    ms.sections[0] = 12;    /* 12 + 5 + 5 > 16 pairs of a 32-dim head */
    CHECK(load_fails(&ms, ES_ERR_FORMAT, "qwen3vl.rope.dimension_sections sums to 22"));
    ms = MODELS[VL];
    ms.sections[0] = ms.sections[1] = ms.sections[2] = 0;   /* written as absent */
    CHECK(load_fails(&ms, ES_ERR_FORMAT, "missing key qwen3vl.rope.dimension_sections"));
}

TEST(memory_refused_before_allocating) {
    char path[512], err[256] = "";
    snprintf(path, sizeof path, "%s/mem.gguf", g_dir);
    CHECK_EQ_INT(write_model(&MODELS[MOE], path), 0);
    setenv("ECHOSPEC_MEM_AVAILABLE", "100000", 1);   /* 100 kB: less than the repacked weights */
    es_model *m = NULL;
    es_status st = es_model_load(path, NULL, &m, err, sizeof err);
    if (strcmp(es_simd_name(), "scalar") != 0) {      /* scalar builds keep the weights mapped: no copy */
        CHECK_EQ_INT(st, ES_ERR_NOMEM);
        CHECK(strstr(err, "repacked weights need ") != NULL && strstr(err, " MiB but only 97.7 KiB") != NULL);
        CHECK(strstr(err, "(ECHOSPEC_MEM_AVAILABLE)") != NULL);
        CHECK(m == NULL);
    }
    es_model_free(m);
    unsetenv("ECHOSPEC_MEM_AVAILABLE");
    m = NULL;
    CHECK_EQ_INT(es_model_load(path, NULL, &m, err, sizeof err), ES_OK);
    setenv("ECHOSPEC_MEM_AVAILABLE", "1000000", 1);  /* 1 MB: the weights are loaded, the KV cache does not fit */
    es_session_params sp = es_session_default_params();
    sp.n_ctx = 65536;
    es_session *s = NULL;
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_NOMEM);
    CHECK(strstr(err, "KV cache of 65536 tokens needs ") != NULL && strstr(err, "only 976.6 KiB") != NULL);
    CHECK(s == NULL);
    setenv("ECHOSPEC_MEM_AVAILABLE", "0.5M", 1);       /* a suffix: 512 KiB */
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_NOMEM);
    CHECK(strstr(err, "only 512.0 KiB of memory is available (ECHOSPEC_MEM_AVAILABLE)") != NULL);
    const char *bad[] = {"lots", "8X", "-1", "1e30", "8 G"};
    for (int i = 0; i < 5; i++) {                      /* not a size: refused, not ignored */
        setenv("ECHOSPEC_MEM_AVAILABLE", bad[i], 1);
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(strstr(err, "is not a size") != NULL && strstr(err, bad[i]) != NULL);
        CHECK(s == NULL);
    }
    setenv("ECHOSPEC_MEM_AVAILABLE", "64GiB", 1);      /* enough: as without the variable */
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_OK);
    es_session_free(s);
    s = NULL;
    unsetenv("ECHOSPEC_MEM_AVAILABLE");
    CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_OK);
    es_session_free(s);
    es_model_free(m);
    unlink(path);
}

TEST(n_ctx_range) {
    char path[512], err[256] = "";
    snprintf(path, sizeof path, "%s/ctx.gguf", g_dir);
    CHECK_EQ_INT(write_model(&MODELS[MOE], path), 0);
    es_model *m = NULL;
    CHECK_EQ_INT(es_model_load(path, NULL, &m, err, sizeof err), ES_OK);
    es_session_params sp = es_session_default_params();
    es_session *s = NULL;
    const int32_t bad[] = {-1, 1, ES_MIN_CTX - 1, ES_MAX_CTX + 1};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sp.n_ctx = bad[i];
        err[0] = 0;
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_ERR_INVALID_ARG);
        CHECK(s == NULL && strstr(err, "out of range") != NULL);
    }
    const int32_t good[] = {0, ES_MIN_CTX};   /* 0: the default */
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        sp.n_ctx = good[i];
        CHECK_EQ_INT(es_session_new(m, &sp, &s, err, sizeof err), ES_OK);
        es_session_free(s);
        s = NULL;
    }
    es_model_free(m);
    unlink(path);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_models_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(moe_call_equals_steps_any_threads);
    RUN(vl_positions);
    RUN(gemma3_sliding_window);
    RUN(bad_expert_and_section_keys);
    RUN(memory_refused_before_allocating);
    RUN(n_ctx_range);
    rmdir(g_dir);
    return harness_report();
}
