/*
 * tiny_models.h - the tiny GGUF models of the engine's C tests, written by
 * the test itself with a fixed integer PRNG, so every build and
 * architecture reads the same bytes:
 *   MODELS[0] llama-q4_1    llama, Q4_1 matrices, tied Q8_0 token_embd (SmolLM2's types),
 *                           n_embd 192, 3 heads / 1 KV head of 64, n_ff 512, 2 layers
 *   MODELS[1] qwen3-mixed   qwen3 (q/k RMSNorm, NEOX RoPE), n_embd 256, 4 / 2 heads of 64,
 *                           n_ff 512, 2 layers; layer 0 is Qwen3 Q4_K_M-like (Q4_K, Q6_K),
 *                           layer 1 has Q8_0, Q4_0, Q5_0, Q5_1, Q5_K, F16, BF16;
 *                           untied Q6_K output
 *   MODELS[2] qwen2-f32     qwen2 (q/k/v biases), F32 matrices, n_embd 64, 2 layers
 *   MODELS[3] qwen3moe-kq   qwen3moe: n_embd 256, 4 / 2 heads of 64, 8 experts of FFN 256,
 *                           3 used per token, F32 router; layer 0's experts Q4_K (gate, up)
 *                           and Q6_K (down) as Q4_K_M makes them, layer 1's Q8_0 / Q5_0 / Q4_0;
 *                           untied Q6_K output
 *   MODELS[4] qwen3vl-q8    qwen3vl (the text decoder): n_embd 128, 4 / 2 heads of 32, rope
 *                           sections [6, 5, 5, 0], one deepstack layer, Q8_0, tied
 *   MODELS[5] gemma3-swa    gemma3: n_embd 128, 4 / 1 heads of 64, n_ff 256, 3 layers, sliding
 *                           window 16 with sliding_window_pattern 3 (layers 0 and 1 local,
 *                           layer 2 global; local RoPE base the default 10000), post-norms,
 *                           GELU FFN, scaled embeddings; Q8_0 (layer 2: Q4_0, Q5_0, Q4_1,
 *                           Q4_K), tied
 * (test_swa.c widens gemma3-swa to 4 layers with other windows.)
 * All have n_vocab N_VOCAB (320, not a multiple of 64, so kernel tails run)
 * and a training context of 256. write_model(&MODELS[i], path) writes one.
 * A copy of a spec with head set (HEAD_DUP, HEAD_NAN, HEAD_NAN0) writes
 * the same model with an edited output head (see head_edit).
 * Included by one test file each (static definitions).
 */
#ifndef ES_TEST_TINY_MODELS_H
#define ES_TEST_TINY_MODELS_H
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define N_VOCAB 320
#define MAX_MODELS 6
/* Weight std * sqrt(n_in) of the block matrices: large enough that greedy runs
 * wander over the vocabulary instead of settling on one token. */
#define MATRIX_SCALE 1.5f

/* ---- deterministic numbers (integer PRNG; float steps are exact or IEEE-fixed) ---- */

static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 24 bits (exact in float). */
static float rng_unit(uint64_t *s) { return (float)(rng_next(s) >> 40) * (1.0f / 16777216.0f); }

/* Uniform in [-a, a). */
static float rng_sym(uint64_t *s, float a) { return (rng_unit(s) * 2.0f - 1.0f) * a; }

/* ---- a growable byte buffer and a minimal GGUF v3 writer ---- */

typedef struct { uint8_t *p; size_t n, cap; } buf;

static void put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n) cap *= 2;
        b->p = realloc(b->p, cap);
        if (!b->p) { fprintf(stderr, "out of memory\n"); exit(2); }
        b->cap = cap;
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { uint8_t x[4] = {v, v >> 8, v >> 16, v >> 24}; put(b, x, 4); }
static void put_u64(buf *b, uint64_t v) { put_u32(b, (uint32_t)v); put_u32(b, (uint32_t)(v >> 32)); }
static void put_str(buf *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void put_u16(buf *b, uint16_t v) { uint8_t x[2] = {v, v >> 8}; put(b, x, 2); }
static void put_f32(buf *b, float f) { uint32_t u; memcpy(&u, &f, 4); put_u32(b, u); }

typedef struct {
    buf kv, info, data;
    uint64_t n_kv, n_tensors;
    char arch[16];
    uint64_t seed;
} gguf_w;

static void kv_u32(gguf_w *w, const char *suffix, uint32_t v) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", w->arch, suffix);
    put_str(&w->kv, key); put_u32(&w->kv, GGUF_T_UINT32); put_u32(&w->kv, v); w->n_kv++;
}
static void kv_u32_arr(gguf_w *w, const char *suffix, const int *v, int n) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", w->arch, suffix);
    put_str(&w->kv, key); put_u32(&w->kv, GGUF_T_ARRAY); put_u32(&w->kv, GGUF_T_INT32); put_u64(&w->kv, (uint64_t)n);
    for (int i = 0; i < n; i++) put_u32(&w->kv, (uint32_t)v[i]);
    w->n_kv++;
}
static void kv_f32(gguf_w *w, const char *suffix, float v) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", w->arch, suffix);
    put_str(&w->kv, key); put_u32(&w->kv, GGUF_T_FLOAT32); put_f32(&w->kv, v); w->n_kv++;
}

/* Append a tensor's info and data (data 32-byte aligned; offsets relative to the data section);
 * ne2 > 1: a 3-D tensor (the experts). */
static void add_tensor3(gguf_w *w, const char *name, uint32_t type, int64_t ne0, int64_t ne1, int64_t ne2,
                        const buf *bytes) {
    while (w->data.n % 32) put(&w->data, "", 1);
    put_str(&w->info, name);
    put_u32(&w->info, ne2 > 1 ? 3 : ne1 > 0 ? 2 : 1);
    put_u64(&w->info, (uint64_t)ne0);
    if (ne1 > 0) put_u64(&w->info, (uint64_t)ne1);
    if (ne2 > 1) put_u64(&w->info, (uint64_t)ne2);
    put_u32(&w->info, type);
    put_u64(&w->info, w->data.n);
    put(&w->data, bytes->p, bytes->n);
    w->n_tensors++;
}
static void add_tensor(gguf_w *w, const char *name, uint32_t type, int64_t ne0, int64_t ne1,
                       const buf *bytes) {
    add_tensor3(w, name, type, ne0, ne1, 1, bytes);
}

/* ---- random weights of every type (values keep activations O(1)) ---- */

/* The smallest integer >= sqrt(n), as a float (no libm: the same on every build). */
static float isqrt_up(int64_t n) {
    float sq = 1.0f;
    while (sq * sq < (float)n) sq += 1.0f;
    return sq;
}

/* One random block of `type` for a row of n_in inputs, appended to b. The
 * block scale is chosen so a weight has a standard deviation of about
 * scale / sqrt(n_in) (the divisors are the std of the integer weights). */
static void rand_block(uint64_t *s, uint32_t type, int64_t n_in, float scale, buf *b) {
    float std = scale / isqrt_up(n_in);
    float jit = 0.75f + 0.5f * rng_unit(s);
    uint8_t bytes[256];
    switch (type) {
    case ES_TYPE_Q4_0:
        put_u16(b, es_fp32_to_fp16(std / 4.6f * jit));
        for (int i = 0; i < 16; i++) bytes[i] = (uint8_t)rng_next(s);
        put(b, bytes, 16);
        break;
    case ES_TYPE_Q4_1: {
        float d = std / 4.6f * jit;
        put_u16(b, es_fp32_to_fp16(d));
        put_u16(b, es_fp32_to_fp16(-7.5f * d + rng_sym(s, d)));
        for (int i = 0; i < 16; i++) bytes[i] = (uint8_t)rng_next(s);
        put(b, bytes, 16);
        break;
    }
    case ES_TYPE_Q5_0:
        put_u16(b, es_fp32_to_fp16(std / 9.2f * jit));
        for (int i = 0; i < 20; i++) bytes[i] = (uint8_t)rng_next(s);
        put(b, bytes, 20);
        break;
    case ES_TYPE_Q5_1: {
        float d = std / 9.2f * jit;
        put_u16(b, es_fp32_to_fp16(d));
        put_u16(b, es_fp32_to_fp16(-15.5f * d + rng_sym(s, d)));
        for (int i = 0; i < 20; i++) bytes[i] = (uint8_t)rng_next(s);
        put(b, bytes, 20);
        break;
    }
    case ES_TYPE_Q8_0:
        put_u16(b, es_fp32_to_fp16(std / 73.0f * jit));
        for (int i = 0; i < 32; i++) bytes[i] = (uint8_t)(int8_t)((int)(rng_next(s) % 255) - 127);
        put(b, bytes, 32);
        break;
    case ES_TYPE_Q4_K:
    case ES_TYPE_Q5_K: {
        int five = type == ES_TYPE_Q5_K;
        float d = std / (five ? 32.0f * 9.2f : 32.0f * 4.6f) * jit;
        put_u16(b, es_fp32_to_fp16(d));
        put_u16(b, es_fp32_to_fp16((five ? 15.5f : 7.5f) * d));
        int n = 12 + (five ? 32 : 0) + 128;
        for (int i = 0; i < n; i++) bytes[i] = (uint8_t)rng_next(s);
        put(b, bytes, (size_t)n);
        break;
    }
    case ES_TYPE_Q6_K:
        for (int i = 0; i < 192; i++) bytes[i] = (uint8_t)rng_next(s);          /* ql, qh */
        for (int i = 0; i < 16; i++) bytes[192 + i] = (uint8_t)(int8_t)((int)(rng_next(s) % 127) - 63);
        put(b, bytes, 208);
        put_u16(b, es_fp32_to_fp16(std / (32.0f * 18.0f) * jit));
        break;
    default:
        fprintf(stderr, "rand_block: type %u\n", type);
        exit(2);
    }
}

/* A random matrix [n_out rows][n_in] of `type`, into b. */
static void gen_matrix(gguf_w *w, uint32_t type, int64_t n_in, int64_t n_out, float scale, buf *bp) {
    buf b = {0};
    float a = scale * 1.732f / isqrt_up(n_in); /* uniform [-a, a): std ~ scale / sqrt(n_in) */
    for (int64_t r = 0; r < n_out; r++) {
        if (type == ES_TYPE_F32) {
            for (int64_t i = 0; i < n_in; i++) put_f32(&b, rng_sym(&w->seed, a));
        } else if (type == ES_TYPE_F16) {
            for (int64_t i = 0; i < n_in; i++) put_u16(&b, es_fp32_to_fp16(rng_sym(&w->seed, a)));
        } else if (type == ES_TYPE_BF16) {
            for (int64_t i = 0; i < n_in; i++) {
                float f = rng_sym(&w->seed, a);
                uint32_t u;
                memcpy(&u, &f, 4);
                put_u16(&b, (uint16_t)(u >> 16));
            }
        } else {
            int64_t per = es_type_block_elems(type);
            for (int64_t j = 0; j < n_in / per; j++) rand_block(&w->seed, type, n_in, scale, &b);
        }
    }
    *bp = b;
}

/* A random matrix [n_out rows][n_in] of `type`, added as `name`. */
static void add_matrix(gguf_w *w, const char *name, uint32_t type, int64_t n_in, int64_t n_out,
                       float scale) {
    buf b;
    gen_matrix(w, type, n_in, n_out, scale, &b);
    add_tensor(w, name, type, n_in, n_out, &b);
    free(b.p);
}

/* Output-head edits (model_spec.head), for the argmax's ties and NaN rules:
 *   HEAD_DUP   row r copies row (r mod n_out / 2) rounded down to even: every
 *              logit equals those of 3 other rows, one next to it (the same
 *              chunk of the matmul) and two n_out / 2 away (other chunks)
 *   HEAD_NAN   HEAD_DUP, and rows 7k + 3 have a NaN scale (NaN logits)
 *   HEAD_NAN0  HEAD_NAN, and row 0 too (a NaN first logit)
 * NaN rows need an untied head of type Q8_0, Q6_K or F32. */
enum { HEAD_PLAIN, HEAD_DUP, HEAD_NAN, HEAD_NAN0 };
static void head_edit(int head, uint32_t type, int64_t n_out, buf *b) {
    size_t rb = b->n / (size_t)n_out;
    for (int64_t r = 0; r < n_out && head != HEAD_PLAIN; r++) {
        int64_t src = (r % (n_out / 2)) & ~(int64_t)1;
        if (src != r) memcpy(b->p + (size_t)r * rb, b->p + (size_t)src * rb, rb);
    }
    for (int64_t r = 0; r < n_out && head >= HEAD_NAN; r++) {
        if (!(r % 7 == 3 || (head == HEAD_NAN0 && r == 0))) continue;
        uint8_t *row = b->p + (size_t)r * rb;
        if (type == ES_TYPE_F32) {
            float nan = NAN;
            memcpy(row, &nan, 4);
        } else {
            size_t off = type == ES_TYPE_Q8_0 ? 0 : type == ES_TYPE_Q6_K ? 208 : rb;   /* the f16 scale d */
            if (off + 2 > rb) { fprintf(stderr, "head_edit: NaN rows of type %u\n", type); exit(2); }
            row[off] = 0x00;
            row[off + 1] = 0x7E;   /* f16 quiet NaN */
        }
    }
}

/* A random F32 vector: center + uniform [-spread, spread). */
static void add_vector(gguf_w *w, const char *name, int64_t n, float center, float spread) {
    buf b = {0};
    for (int64_t i = 0; i < n; i++) put_f32(&b, center + rng_sym(&w->seed, spread));
    add_tensor(w, name, ES_TYPE_F32, n, 0, &b);
    free(b.p);
}

/* Matrix types of one layer: q, k, v, o, gate, up, down. */
typedef struct { uint32_t q, k, v, o, gate, up, down; } layer_types;

typedef struct {
    const char *name;
    const char *arch;
    int n_embd, n_head, n_head_kv, head_dim, n_ff, n_layer;
    uint32_t embd_type, output_type; /* output_type 0: tied */
    layer_types layers[4];           /* the first n_layer are written */
    uint64_t seed;
    int head;                        /* HEAD_PLAIN, or an edit of the output head (head_edit) */
    int n_expert, n_expert_used;     /* mixture of experts (qwen3moe): layer_types gate, up, down
                                        are the experts' types, n_ff the expert FFN; 0: dense */
    int sections[4], n_deepstack;    /* qwen3vl: multimodal RoPE sections, deepstack layers */
    int n_swa, swa_pattern;          /* gemma3: sliding window, every swa_pattern-th layer global */
} model_spec;

static const model_spec MODELS[MAX_MODELS] = {
    {"llama-q4_1", "llama", 192, 3, 1, 64, 512, 2, ES_TYPE_Q8_0, 0,
     {{ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1},
      {ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1, ES_TYPE_Q4_1}},
     0x5eed0001, HEAD_PLAIN, 0, 0, {0, 0, 0, 0}, 0, 0, 0},
    {"qwen3-mixed", "qwen3", 256, 4, 2, 64, 512, 2, ES_TYPE_Q8_0, ES_TYPE_Q6_K,
     {{ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q6_K, ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q6_K},
      {ES_TYPE_Q8_0, ES_TYPE_Q4_0, ES_TYPE_Q5_0, ES_TYPE_Q5_1, ES_TYPE_Q5_K, ES_TYPE_F16, ES_TYPE_BF16}},
     0x5eed0002, HEAD_PLAIN, 0, 0, {0, 0, 0, 0}, 0, 0, 0},
    {"qwen2-f32", "qwen2", 64, 4, 2, 16, 128, 2, ES_TYPE_F32, 0,
     {{ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32},
      {ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32, ES_TYPE_F32}},
     0x5eed0003, HEAD_PLAIN, 0, 0, {0, 0, 0, 0}, 0, 0, 0},
    {"qwen3moe-kq", "qwen3moe", 256, 4, 2, 64, 256, 2, ES_TYPE_Q8_0, ES_TYPE_Q6_K,
     {{ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q6_K, ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q4_K, ES_TYPE_Q6_K},
      {ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q5_0, ES_TYPE_Q4_0}},
     0x5eed0004, HEAD_PLAIN, 8, 3, {0, 0, 0, 0}, 0, 0, 0},
    {"qwen3vl-q8", "qwen3vl", 128, 4, 2, 32, 256, 2, ES_TYPE_Q8_0, 0,
     {{ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0},
      {ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0}},
     0x5eed0005, HEAD_PLAIN, 0, 0, {6, 5, 5, 0}, 1, 0, 0},
    {"gemma3-swa", "gemma3", 128, 4, 1, 64, 256, 3, ES_TYPE_Q8_0, 0,
     {{ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0},
      {ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0},
      {ES_TYPE_Q4_0, ES_TYPE_Q8_0, ES_TYPE_Q8_0, ES_TYPE_Q4_0, ES_TYPE_Q5_0, ES_TYPE_Q4_1, ES_TYPE_Q4_K}},
     0x5eed0006, HEAD_PLAIN, 0, 0, {0, 0, 0, 0}, 0, 16, 3},
};

/* Write the model of `ms` to `path`. Returns 0 on success. */
static int write_model(const model_spec *ms, const char *path) {
    gguf_w w;
    memset(&w, 0, sizeof w);
    snprintf(w.arch, sizeof w.arch, "%s", ms->arch);
    w.seed = ms->seed;
    put_str(&w.kv, "general.architecture"); put_u32(&w.kv, GGUF_T_STRING); put_str(&w.kv, ms->arch);
    w.n_kv++;
    put_str(&w.kv, "general.alignment"); put_u32(&w.kv, GGUF_T_UINT32); put_u32(&w.kv, 32); w.n_kv++;
    kv_u32(&w, "block_count", (uint32_t)ms->n_layer);
    kv_u32(&w, "context_length", 256);
    kv_u32(&w, "embedding_length", (uint32_t)ms->n_embd);
    kv_u32(&w, "feed_forward_length", (uint32_t)ms->n_ff);
    if (ms->n_expert) {
        kv_u32(&w, "expert_count", (uint32_t)ms->n_expert);
        kv_u32(&w, "expert_used_count", (uint32_t)ms->n_expert_used);
        kv_u32(&w, "expert_feed_forward_length", (uint32_t)ms->n_ff);
    }
    if (ms->sections[0]) {
        kv_u32_arr(&w, "rope.dimension_sections", ms->sections, 4);
        kv_u32(&w, "n_deepstack_layers", (uint32_t)ms->n_deepstack);
    }
    kv_u32(&w, "attention.head_count", (uint32_t)ms->n_head);
    kv_u32(&w, "attention.head_count_kv", (uint32_t)ms->n_head_kv);
    kv_u32(&w, "attention.key_length", (uint32_t)ms->head_dim);
    kv_u32(&w, "attention.value_length", (uint32_t)ms->head_dim);
    kv_f32(&w, "rope.freq_base", strcmp(ms->arch, "llama") == 0 ? 10000.0f : 1000000.0f);
    kv_f32(&w, "attention.layer_norm_rms_epsilon", 1e-6f);
    if (ms->n_swa) {   /* swa_pattern < 0: the pattern key absent */
        kv_u32(&w, "attention.sliding_window", (uint32_t)ms->n_swa);
        if (ms->swa_pattern >= 0) kv_u32(&w, "attention.sliding_window_pattern", (uint32_t)ms->swa_pattern);
    }

    const int E = ms->n_embd, Q = ms->n_head * ms->head_dim, KV = ms->n_head_kv * ms->head_dim;
    const int qwen2 = strcmp(ms->arch, "qwen2") == 0, gemma3 = strcmp(ms->arch, "gemma3") == 0;
    const int qwen3 = strncmp(ms->arch, "qwen3", 5) == 0 || gemma3;   /* q/k head norms */
    buf hb;
    gen_matrix(&w, ms->embd_type, E, N_VOCAB, 2.0f, &hb);
    if (!ms->output_type) head_edit(ms->head, ms->embd_type, N_VOCAB, &hb);
    add_tensor(&w, "token_embd.weight", ms->embd_type, E, N_VOCAB, &hb);
    free(hb.p);
    char name[64];
    for (int il = 0; il < ms->n_layer; il++) {
        const layer_types *t = &ms->layers[il];
#define NAME(s) (snprintf(name, sizeof name, "blk.%d.%s", il, s), name)
        add_vector(&w, NAME("attn_norm.weight"), E, 1.0f, 0.2f);
        add_matrix(&w, NAME("attn_q.weight"), t->q, E, Q, MATRIX_SCALE);
        add_matrix(&w, NAME("attn_k.weight"), t->k, E, KV, MATRIX_SCALE);
        add_matrix(&w, NAME("attn_v.weight"), t->v, E, KV, MATRIX_SCALE);
        if (qwen2) {
            add_vector(&w, NAME("attn_q.bias"), Q, 0.0f, 0.2f);
            add_vector(&w, NAME("attn_k.bias"), KV, 0.0f, 0.2f);
            add_vector(&w, NAME("attn_v.bias"), KV, 0.0f, 0.2f);
        }
        if (qwen3) {
            add_vector(&w, NAME("attn_q_norm.weight"), ms->head_dim, 1.0f, 0.2f);
            add_vector(&w, NAME("attn_k_norm.weight"), ms->head_dim, 1.0f, 0.2f);
        }
        add_matrix(&w, NAME("attn_output.weight"), t->o, Q, E, MATRIX_SCALE);
        if (gemma3) add_vector(&w, NAME("post_attention_norm.weight"), E, 1.0f, 0.2f);
        add_vector(&w, NAME("ffn_norm.weight"), E, 1.0f, 0.2f);
        if (gemma3) add_vector(&w, NAME("post_ffw_norm.weight"), E, 1.0f, 0.2f);
        if (ms->n_expert) {   /* router, then each 3-D tensor as n_expert matrices one after another */
            add_matrix(&w, NAME("ffn_gate_inp.weight"), ES_TYPE_F32, E, ms->n_expert, 4.0f);
            const struct { const char *n; uint32_t type; int in, out; } ex[3] = {
                {"ffn_gate_exps.weight", t->gate, E, ms->n_ff}, {"ffn_up_exps.weight", t->up, E, ms->n_ff},
                {"ffn_down_exps.weight", t->down, ms->n_ff, E}};
            for (int i = 0; i < 3; i++) {
                buf b;
                gen_matrix(&w, ex[i].type, ex[i].in, (int64_t)ex[i].out * ms->n_expert, MATRIX_SCALE, &b);
                add_tensor3(&w, NAME(ex[i].n), ex[i].type, ex[i].in, ex[i].out, ms->n_expert, &b);
                free(b.p);
            }
        } else {
            add_matrix(&w, NAME("ffn_gate.weight"), t->gate, E, ms->n_ff, MATRIX_SCALE);
            add_matrix(&w, NAME("ffn_up.weight"), t->up, E, ms->n_ff, MATRIX_SCALE);
            add_matrix(&w, NAME("ffn_down.weight"), t->down, ms->n_ff, E, MATRIX_SCALE);
        }
#undef NAME
    }
    add_vector(&w, "output_norm.weight", E, 1.0f, 0.2f);
    if (ms->output_type) {
        gen_matrix(&w, ms->output_type, E, N_VOCAB, 2.0f, &hb);
        head_edit(ms->head, ms->output_type, N_VOCAB, &hb);
        add_tensor(&w, "output.weight", ms->output_type, E, N_VOCAB, &hb);
        free(hb.p);
    }

    buf out = {0};
    put(&out, "GGUF", 4);
    put_u32(&out, 3);
    put_u64(&out, w.n_tensors);
    put_u64(&out, w.n_kv);
    put(&out, w.kv.p, w.kv.n);
    put(&out, w.info.p, w.info.n);
    while (out.n % 32) put(&out, "", 1);
    put(&out, w.data.p, w.data.n);
    FILE *f = fopen(path, "wb");
    int ok = f && fwrite(out.p, 1, out.n, f) == out.n;
    if (f && fclose(f) != 0) ok = 0;
    free(out.p); free(w.kv.p); free(w.info.p); free(w.data.p);
    return ok ? 0 : -1;
}

/* A session on m with the params sp (needs harness.h): fails the test with
 * es_session_new's message when it cannot be made. */
static inline es_session *tm_session_params(const es_model *m, const es_session_params *sp) {
    es_session *s = NULL;
    char err[256] = "";
    es_status st = es_session_new(m, sp, &s, err, sizeof err);
    if (st != ES_OK) fprintf(stderr, "  es_session_new: %s\n", err);
    CHECK_EQ_INT(st, ES_OK);
    return s;
}

/* A session on m with n_threads and n_ctx, the other params at their defaults. */
static inline es_session *tm_session(const es_model *m, int n_threads, int n_ctx) {
    es_session_params sp = es_session_default_params();
    sp.n_ctx = n_ctx;
    sp.n_threads = n_threads;
    return tm_session_params(m, &sp);
}

/* Model `which` of MODELS written to DIR and loaded (needs harness.h): fails the test with
 * es_model_load's message when it cannot be loaded; the file is removed again. */
static inline es_model *tm_load(const char *dir, int which) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, MODELS[which].name);
    CHECK_EQ_INT(write_model(&MODELS[which], path), 0);
    es_model *m = NULL;
    char err[256] = "";
    es_status st = es_model_load(path, NULL, &m, err, sizeof err);
    if (st != ES_OK) fprintf(stderr, "  %s: es_model_load: %s\n", MODELS[which].name, err);
    CHECK_EQ_INT(st, ES_OK);
    unlink(path);
    return m;
}

#endif /* ES_TEST_TINY_MODELS_H */
