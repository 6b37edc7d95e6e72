/*
 * test_weights.c - the weights check at load and NaN logits at run time
 * (es_model_load and es_forward in echospec_engine.h).
 *
 * At load: in every tensor of every tiny model (tiny_models.h: all the
 * tensor types the engine takes), one block scale (d, or the second scale
 * m / dmin where the type has one) or one float element set to NaN or
 * +-inf makes es_model_load return ES_ERR_BAD_WEIGHTS, with a message
 * naming the tensor and the block (element) and no model; a span of
 * tensor data overwritten with 0xFF bytes is refused the same way; the
 * clean files load with and without ES_MODEL_CHECK_WEIGHTS, and an unknown
 * flag bit is ES_ERR_INVALID_ARG.
 *
 * At run time: a NaN written into the loaded model's output norm (the
 * model's own float copy) makes every call that computes a head row fail
 * with ES_ERR_BAD_WEIGHTS naming the position (es_forward with and without
 * logits, es_forward_last, es_decode, es_forward_batch per item), with the
 * KV cache unchanged: once the value is restored the session continues
 * bitwise as a session that never saw the NaN; finite norm weights whose
 * products overflow (an infinite head input) fail the same way. Models: llama-q4_1 (a
 * quantized head, where the NaN would otherwise be quantized away into a
 * token 0) and qwen2-f32 (a float head: NaN logits).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "echospec_engine.h"
#include "harness.h"
#include "internal.h"
#include "tiny_models.h"

static char g_dir[256];

/* Overwrite n bytes at offset off of the file at path. 0 on success. */
static int patch(const char *path, size_t off, const void *bytes, size_t n) {
    FILE *f = fopen(path, "r+b");
    if (!f) return -1;
    int ok = fseek(f, (long)off, SEEK_SET) == 0 && fwrite(bytes, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

/* Byte offset of the f16 scale k (0: d, 1: m / dmin) in a block of type t, -1 when none. */
static int scale_off(uint32_t t, int k) {
    switch (t) {
    case ES_TYPE_Q4_0: case ES_TYPE_Q5_0: case ES_TYPE_Q8_0: return k == 0 ? 0 : -1;
    case ES_TYPE_Q4_1: case ES_TYPE_Q5_1: case ES_TYPE_Q4_K: case ES_TYPE_Q5_K: return 2 * k;
    case ES_TYPE_Q6_K: return k == 0 ? 208 : -1;
    default: return -1;
    }
}

/* Load path with flags; the status, *err filled. Frees a model that loaded. */
static es_status load_status(const char *path, int32_t flags, char *err, size_t err_len) {
    es_model_params p = es_model_default_params();
    p.flags = flags;
    es_model *m = (es_model *)1;
    err[0] = '\0';
    es_status st = es_model_load(path, &p, &m, err, err_len);
    if (st != ES_OK) CHECK(m == NULL);
    es_model_free(st == ES_OK ? m : NULL);
    return st;
}

/* Every tensor of model `which`, one at a time: a bad value in it is refused, naming it. */
static void corrupt_each_tensor(int which) {
    const model_spec *ms = &MODELS[which];
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, ms->name);
    CHECK_EQ_INT(write_model(ms, path), 0);
    CHECK_EQ_INT(load_status(path, 0, err, sizeof err), ES_OK);
    CHECK_EQ_INT(load_status(path, ES_MODEL_CHECK_WEIGHTS, err, sizeof err), ES_OK);
    es_gguf *g = NULL;
    CHECK_EQ_INT(es_gguf_open(path, &g, err, sizeof err), ES_OK);
    if (!g) return;
    int tested = 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const es_tensor *t = &g->tensors[i];
        size_t off = (size_t)((const uint8_t *)t->data - (const uint8_t *)g->map);
        size_t bb = es_type_block_bytes(t->type), nb = t->nbytes / bb, at = nb / 2;
        int k = (int)(i % 2) && scale_off(t->type, 1) >= 0 ? 1 : 0;   /* the second scale on odd tensors */
        uint8_t old[4], bad[4];
        size_t n;
        char want[96];
        if (t->type == ES_TYPE_F32) {
            float v = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
            memcpy(bad, &v, 4);
            n = 4;
            off += 4 * at;
            snprintf(want, sizeof want, "element %zu of", at);
        } else if (t->type == ES_TYPE_F16 || t->type == ES_TYPE_BF16) {
            uint16_t h = t->type == ES_TYPE_F16 ? (i % 2 ? 0x7c00 : 0xfe00) : (i % 2 ? 0xff80 : 0x7fc1);
            memcpy(bad, &h, 2);
            n = 2;
            off += 2 * at;
            snprintf(want, sizeof want, "element %zu of", at);
        } else {
            uint16_t h = i % 2 ? 0xfc00 : 0x7e00;   /* -inf, NaN */
            memcpy(bad, &h, 2);
            n = 2;
            off += at * bb + (size_t)scale_off(t->type, k);
            snprintf(want, sizeof want, "block %zu of %zu has scale %s", at, nb,
                     k == 0 ? "d" : t->type == ES_TYPE_Q4_1 || t->type == ES_TYPE_Q5_1 ? "m" : "dmin");
        }
        memcpy(old, (const uint8_t *)g->map + off, n);
        char name[96];
        snprintf(name, sizeof name, "tensor '%s'", t->name);
        for (int full = 0; full < 2; full++) {
            CHECK_EQ_INT(patch(path, off, bad, n), 0);
            es_status st = load_status(path, full ? ES_MODEL_CHECK_WEIGHTS : 0, err, sizeof err);
            CHECK_EQ_INT(st, ES_ERR_BAD_WEIGHTS);
            if (!strstr(err, name) || !strstr(err, want)) {
                fprintf(stderr, "  %s: want \"%s\" and \"%s\" in: %s\n", ms->name, name, want, err);
                CHECK(0);
            }
            CHECK_EQ_INT(patch(path, off, old, n), 0);
        }
        tested++;
    }
    CHECK_EQ_INT(tested, g->n_tensors);
    CHECK_EQ_INT(load_status(path, 0, err, sizeof err), ES_OK);   /* restored */
    es_gguf_close(g);
    unlink(path);
}

TEST(bad_scale_llama_q4_1) { corrupt_each_tensor(0); }
TEST(bad_scale_qwen3_mixed) { corrupt_each_tensor(1); }
TEST(bad_value_qwen2_f32) { corrupt_each_tensor(2); }
TEST(bad_scale_qwen3moe_kq) { corrupt_each_tensor(3); }
TEST(bad_scale_gemma3_swa) { corrupt_each_tensor(5); }

/* 2 KiB of 0xFF in the middle of the largest tensor of qwen3-mixed (f16 0xFFFF is NaN). */
TEST(ff_span_refused) {
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/ff.gguf", g_dir);
    CHECK_EQ_INT(write_model(&MODELS[1], path), 0);
    es_gguf *g = NULL;
    CHECK_EQ_INT(es_gguf_open(path, &g, err, sizeof err), ES_OK);
    if (!g) return;
    const es_tensor *big = &g->tensors[0];
    for (int64_t i = 1; i < g->n_tensors; i++)
        if (g->tensors[i].nbytes > big->nbytes) big = &g->tensors[i];
    char name[96];
    snprintf(name, sizeof name, "tensor '%s'", big->name);
    size_t off = (size_t)((const uint8_t *)big->data - (const uint8_t *)g->map) + big->nbytes / 2;
    es_gguf_close(g);
    uint8_t ff[2048];
    memset(ff, 0xFF, sizeof ff);
    CHECK_EQ_INT(patch(path, off, ff, sizeof ff), 0);
    CHECK_EQ_INT(load_status(path, 0, err, sizeof err), ES_ERR_BAD_WEIGHTS);
    CHECK(strstr(err, name) != NULL && strstr(err, "NaN") != NULL);
    unlink(path);
}

TEST(unknown_flag_refused) {
    char path[512], err[512];
    snprintf(path, sizeof path, "%s/flags.gguf", g_dir);
    CHECK_EQ_INT(write_model(&MODELS[2], path), 0);
    CHECK_EQ_INT(load_status(path, 4, err, sizeof err), ES_ERR_INVALID_ARG);
    CHECK(strstr(err, "ES_MODEL_CHECK_WEIGHTS") != NULL);
    unlink(path);
}

#define PROMPT 6

/* The calls that compute a head row fail on a NaN, naming the position, and change nothing. */
static void nan_at_run_time(int which) {
    es_model *m = tm_load(g_dir, which);
    if (!m) return;
    es_session *a = tm_session(m, 2, 64), *b = tm_session(m, 2, 64), *ref = tm_session(m, 2, 64);
    if (!a || !b || !ref) return;
    int32_t prompt[PROMPT], am[8], am_ref[8], toks[8];
    for (int i = 0; i < PROMPT; i++) prompt[i] = (i * 37 + 5) % N_VOCAB;
    CHECK_EQ_INT(es_forward(a, prompt, PROMPT, am, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_forward(b, prompt, PROMPT, am, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_forward(ref, prompt, PROMPT, am_ref, NULL, ES_LOGITS_NONE), ES_OK);
    float *norm = (float *)es_model_vec(m, m->output_norm);
    CHECK(norm != NULL);
    if (!norm) return;
    float keep = norm[3];
    norm[3] = NAN;
    static float logits[8 * N_VOCAB];
    int32_t v[4] = {am_ref[PROMPT - 1], 7, 8, 9};
    char want[64];
    snprintf(want, sizeof want, "logits of position %d hold a NaN", PROMPT);
    for (int mode = 0; mode < 3; mode++) {   /* a decode step, a verify with and without logits */
        int n = mode == 0 ? 1 : 4;
        memset(am, 0x55, sizeof am);
        CHECK_EQ_INT(es_forward(a, v, n, am, mode == 2 ? logits : NULL, mode == 2 ? ES_LOGITS_ALL : ES_LOGITS_NONE),
                     ES_ERR_BAD_WEIGHTS);
        CHECK(strstr(es_session_last_error(a), want) != NULL);
        CHECK_EQ_INT(es_session_n_past(a), PROMPT);
        CHECK_EQ_INT(am[0], 0x55555555);   /* no argmax made up */
    }
    CHECK_EQ_INT(es_forward_last(a, v, 3, am, NULL), ES_ERR_BAD_WEIGHTS);
    CHECK(strstr(es_session_last_error(a), "position 8") != NULL);
    int32_t n_out = -1;
    float ms[4];
    CHECK_EQ_INT(es_decode(a, v[0], 4, NULL, 0, NULL, toks, ms, &n_out), ES_ERR_BAD_WEIGHTS);
    CHECK_EQ_INT(n_out, 0);
    CHECK_EQ_INT(es_session_n_past(a), PROMPT);
    es_batch_item items[2] = {
        {.session = a, .tokens = v, .n_tokens = 2, .head = ES_HEAD_ALL, .argmax_out = am},
        {.session = b, .tokens = v, .n_tokens = 1, .head = ES_HEAD_LAST, .argmax_out = am + 4},
    };
    CHECK_EQ_INT(es_forward_batch(items, 2), ES_ERR_BAD_WEIGHTS);
    CHECK_EQ_INT(items[0].status, ES_ERR_BAD_WEIGHTS);
    CHECK_EQ_INT(items[1].status, ES_ERR_BAD_WEIGHTS);
    CHECK(strstr(es_session_last_error(b), want) != NULL);
    CHECK_EQ_INT(es_session_n_past(b), PROMPT);
    /* restored: the sessions go on as one that never saw the NaN */
    norm[3] = keep;
    int32_t n_ref = -1, n_a = -1, toks_ref[8];
    CHECK_EQ_INT(es_decode(ref, v[0], 8, NULL, 0, NULL, toks_ref, NULL, &n_ref), ES_OK);
    CHECK_EQ_INT(es_decode(a, v[0], 8, NULL, 0, NULL, toks, NULL, &n_a), ES_OK);
    CHECK_EQ_INT(n_a, 8);
    CHECK(memcmp(toks, toks_ref, sizeof toks) == 0);
    CHECK_EQ_INT(es_forward(b, v, 1, am, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(am[0], toks_ref[0]);
    /* finite weights whose product overflows: the head's input is infinite */
    const int64_t e = m->info.n_embd;
    float *saved = malloc((size_t)e * sizeof *saved);
    if (!saved) return;
    memcpy(saved, norm, (size_t)e * sizeof *saved);
    for (int64_t k = 0; k < e; k++) norm[k] = 3.4e38f;
    CHECK_EQ_INT(es_forward(b, v, 1, am, NULL, ES_LOGITS_NONE), ES_ERR_BAD_WEIGHTS);
    CHECK(strstr(es_session_last_error(b), "position 7") != NULL);
    memcpy(norm, saved, (size_t)e * sizeof *saved);
    free(saved);
    es_session_free(a);
    es_session_free(b);
    es_session_free(ref);
    es_model_free(m);
}

TEST(nan_at_run_time_quantized_head) { nan_at_run_time(0); }
TEST(nan_at_run_time_f32_head) { nan_at_run_time(2); }

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_weights_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(bad_scale_llama_q4_1);
    RUN(bad_scale_qwen3_mixed);
    RUN(bad_value_qwen2_f32);
    RUN(bad_scale_qwen3moe_kq);
    RUN(bad_scale_gemma3_swa);
    RUN(ff_span_refused);
    RUN(unknown_flag_refused);
    RUN(nan_at_run_time_quantized_head);
    RUN(nan_at_run_time_f32_head);
    rmdir(g_dir);
    return harness_report();
}
