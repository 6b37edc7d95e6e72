/*
 * test_tree.c - es_forward_tree and es_session_keep_path: token-tree
 * verification gives every node bitwise what es_forward gives the last row
 * of its root-to-node path as a chain, and keeping a path leaves the KV
 * cache bitwise as decoding that path would.
 *
 * On the tiny models without a sliding window (tiny_models.h: llama Q4_1,
 * qwen3 with mixed K-quants, qwen2 F32, qwen3moe, qwen3vl with RoPE
 * sections), random trees (a fixed seed; 1 to 24 nodes, parents drawn from
 * the earlier nodes or -1, chains and bushy trees) after histories of 0,
 * 5, 60 and 70 tokens (so paths cross the KV block at 64 and start inside
 * the second block), on 1, 2 and 3 threads:
 *   every node's argmax and logits row == es_forward over its path on a
 *   1-thread reference session (bitwise), also in ES_LOGITS_NONE and
 *   ES_LOGITS_LAST;
 *   after es_session_keep_path of a random root-to-node path: n_past, the K
 *   and V of every position, and the logits of three decode steps == the
 *   reference that ran the path with es_forward.
 * Failures: bad trees and paths give ES_ERR_INVALID_ARG (capacity:
 * ES_ERR_CAPACITY) with a message, and the KV cache is unchanged (a decode
 * step then gives the reference result); a path after another call, after a
 * rollback or twice is refused; gemma3 (sliding window), KV eviction and
 * sparse attention give ES_ERR_UNSUPPORTED.
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

/* The F16 cache's blocks as halves (es_kv_k_block / es_kv_v_block give bytes; trees run on
 * F16 caches only: es_forward_tree refuses a Q8_0 one). */
static inline const uint16_t *kv16_k(const es_kv *kv, int l, int g, int32_t b) {
    return (const uint16_t *)(const void *)es_kv_k_block(kv, l, g, b);
}
static inline const uint16_t *kv16_v(const es_kv *kv, int l, int g, int32_t b) {
    return (const uint16_t *)(const void *)es_kv_v_block(kv, l, g, b);
}


#define N_CTX 160
#define MAX_N 24          /* nodes of a random tree: past a block's edge after the histories of 60 and 70 */
#define TREES 4          /* per history and thread count: TREES / 2 (kept small: CI runs this under qemu) */

static const int HISTS[4] = {0, 5, 60, 70};

static int32_t hist_tok(int pos) { return (int32_t)((pos * 37 + 11) % N_VOCAB); }

/* A random tree of n nodes: mostly extending recent nodes (long paths), sometimes new roots. */
static void random_tree(uint64_t *rng, int n, int32_t *tokens, int32_t *parents) {
    int chain = rng_next(rng) % 4 == 0;
    for (int i = 0; i < n; i++) {
        tokens[i] = (int32_t)(rng_next(rng) % N_VOCAB);
        if (chain) parents[i] = i - 1;
        else if (i == 0 || rng_next(rng) % 8 == 0) parents[i] = -1;
        else {
            int back = (int)(rng_next(rng) % 3) + 1;
            parents[i] = i - back < 0 ? -1 : i - back;
        }
    }
}

/* Node i's path, root first, into path (tokens into ptok when not NULL); returns its length. */
static int path_of(const int32_t *parents, const int32_t *tokens, int i, int32_t *path, int32_t *ptok) {
    int32_t rev[MAX_N];
    int n = 0;
    for (int k = i; k >= 0; k = parents[k]) rev[n++] = k;
    for (int j = 0; j < n; j++) {
        path[j] = rev[n - 1 - j];
        if (ptok) ptok[j] = tokens[path[j]];
    }
    return n;
}

static void prefill(es_session *s, int hist) {
    int32_t t[N_CTX];
    CHECK_EQ_INT(es_session_rollback(s, 0), ES_OK);
    for (int i = 0; i < hist; i++) t[i] = hist_tok(i);
    if (hist > 0) CHECK_EQ_INT(es_forward(s, t, hist, NULL, NULL, ES_LOGITS_NONE), ES_OK);
}

/* 1 when positions [0, n) of every layer's K and V are bitwise the same in a and b. */
static int kv_equal(const es_session *a, const es_session *b, int32_t n) {
    const es_kv *ka = &a->kv, *kb = &b->kv;
    int hd = ka->head_dim;
    for (int l = 0; l < ka->n_layer; l++)
        for (int g = 0; g < ka->n_head_kv; g++)
            for (int32_t p = 0; p < n; p++) {
                const uint16_t *k1 = kv16_k(ka, l, g, p / ES_KV_BLOCK) + p % ES_KV_BLOCK;
                const uint16_t *k2 = kv16_k(kb, l, g, p / ES_KV_BLOCK) + p % ES_KV_BLOCK;
                for (int e = 0; e < hd; e++)
                    if (k1[(size_t)e * ES_KV_BLOCK] != k2[(size_t)e * ES_KV_BLOCK]) return 0;
                const uint16_t *v1 = kv16_v(ka, l, g, p / ES_KV_BLOCK) + (size_t)(p % ES_KV_BLOCK) * hd;
                const uint16_t *v2 = kv16_v(kb, l, g, p / ES_KV_BLOCK) + (size_t)(p % ES_KV_BLOCK) * hd;
                if (memcmp(v1, v2, (size_t)hd * sizeof(uint16_t)) != 0) return 0;
            }
    return 1;
}

static float g_tree_logits[MAX_N * N_VOCAB], g_ref_logits[MAX_N * N_VOCAB];

/* Three decode steps from token t on a and on b: bitwise the same logits and argmax. */
static int same_decode(es_session *a, es_session *b, int32_t t) {
    int ok = 1;
    for (int k = 0; k < 3; k++) {
        int32_t am1 = -1, am2 = -2;
        CHECK_EQ_INT(es_forward(a, &t, 1, &am1, g_tree_logits, ES_LOGITS_LAST), ES_OK);
        CHECK_EQ_INT(es_forward(b, &t, 1, &am2, g_ref_logits, ES_LOGITS_LAST), ES_OK);
        ok &= am1 == am2 && memcmp(g_tree_logits, g_ref_logits, N_VOCAB * sizeof(float)) == 0;
        t = am1;
    }
    return ok;
}

/* One tree on session s (threads set) against the chains on ref; then a kept path. */
static void one_tree(es_session *s, es_session *ref, uint64_t *rng, int hist, const char *name, int nth) {
    int n = 1 + (int)(rng_next(rng) % MAX_N);
    int32_t tokens[MAX_N], parents[MAX_N], am[MAX_N], am_none[MAX_N], path[MAX_N], ptok[MAX_N];
    random_tree(rng, n, tokens, parents);
    prefill(s, hist);
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, n, am_none, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK_EQ_INT(es_session_n_past(s), hist);
    float last[N_VOCAB];
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, n, NULL, last, ES_LOGITS_LAST), ES_OK);
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, n, am, g_tree_logits, ES_LOGITS_ALL), ES_OK);
    CHECK_EQ_INT(es_session_n_past(s), hist);
    CHECK(memcmp(last, g_tree_logits + (size_t)(n - 1) * N_VOCAB, sizeof last) == 0);
    int bad = 0;
    prefill(ref, hist);
    for (int i = 0; i < n; i++) {
        int len = path_of(parents, tokens, i, path, ptok);
        int32_t ram[MAX_N];
        CHECK_EQ_INT(es_session_rollback(ref, hist), ES_OK);
        CHECK_EQ_INT(es_forward(ref, ptok, len, ram, g_ref_logits, ES_LOGITS_ALL), ES_OK);
        if (am[i] != ram[len - 1] || am_none[i] != am[i] ||
            memcmp(g_tree_logits + (size_t)i * N_VOCAB, g_ref_logits + (size_t)(len - 1) * N_VOCAB,
                   N_VOCAB * sizeof(float)) != 0) {
            if (!bad) fprintf(stderr, "  %s hist %d threads %d: node %d (depth %d) of %d differs from its chain\n",
                              name, hist, nth, i, len - 1, n);
            bad = 1;
        }
    }
    CHECK(!bad);
    /* keep the path of a random node; the KV cache and what follows == the chain's */
    int len = path_of(parents, tokens, (int)(rng_next(rng) % n), path, ptok);
    CHECK_EQ_INT(es_session_keep_path(s, path, len), ES_OK);
    CHECK_EQ_INT(es_session_n_past(s), hist + len);
    CHECK_EQ_INT(es_session_rollback(ref, hist), ES_OK);
    CHECK_EQ_INT(es_forward(ref, ptok, len, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK(kv_equal(s, ref, hist + len));
    CHECK(same_decode(s, ref, am[path[len - 1]]));
    CHECK_EQ_INT(es_session_keep_path(s, path, len), ES_ERR_INVALID_ARG);   /* the tree is gone */
}

/* Bad input: status, a message, and the KV cache as it was (the next step == the reference). */
static void failures(es_session *s, es_session *ref) {
    int32_t tokens[ES_MAX_TREE_NODES + 1] = {0}, parents[ES_MAX_TREE_NODES + 1];
    for (int i = 0; i <= ES_MAX_TREE_NODES; i++) parents[i] = i - 1;
    int32_t am[ES_MAX_TREE_NODES + 1];
    prefill(s, 20);
    int32_t bad_par[3][4] = {{-1, 0, 2, 1}, {-1, -2, 0, 1}, {0, -1, 1, 2}};
    for (int k = 0; k < 3; k++) {
        CHECK_EQ_INT(es_forward_tree(s, tokens, bad_par[k], 4, am, NULL, 0), ES_ERR_INVALID_ARG);
        CHECK(strstr(es_session_last_error(s), "parents[") != NULL);
    }
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 0, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, ES_MAX_TREE_NODES + 1, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "n_nodes") != NULL);
    CHECK_EQ_INT(es_forward_tree(s, tokens, NULL, 3, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_tree(s, NULL, parents, 3, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 3, am, NULL, ES_LOGITS_ALL), ES_ERR_INVALID_ARG);
    tokens[1] = N_VOCAB;
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 3, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "vocabulary") != NULL);
    tokens[1] = 0;
    CHECK_EQ_INT(es_forward_tree(NULL, tokens, parents, 3, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_keep_path(s, parents, 0), ES_ERR_INVALID_ARG);   /* no tree */
    CHECK(strstr(es_session_last_error(s), "no tree") != NULL);
    CHECK_EQ_INT(es_session_n_past(s), 20);
    prefill(s, N_CTX - 10);   /* the tree needs a slot per node */
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 11, am, NULL, 0), ES_ERR_CAPACITY);
    CHECK_EQ_INT(es_session_n_past(s), N_CTX - 10);
    CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 10, am, NULL, 0), ES_OK);
    /* bad paths of a tree -1 <- 0 <- 1, -1 <- 2 (parents {-1, 0, -1}) */
    int32_t par2[3] = {-1, 0, -1};
    prefill(s, 20);
    CHECK_EQ_INT(es_forward_tree(s, tokens, par2, 3, am, NULL, 0), ES_OK);
    int32_t p_nonroot[1] = {1}, p_nonchild[2] = {0, 2}, p_out[2] = {0, 3}, p_ok[2] = {0, 1};
    CHECK_EQ_INT(es_session_keep_path(s, p_nonroot, 1), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "not a root") != NULL);
    CHECK_EQ_INT(es_session_keep_path(s, p_nonchild, 2), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_session_last_error(s), "not a child") != NULL);
    CHECK_EQ_INT(es_session_keep_path(s, p_out, 2), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, 4), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_keep_path(s, NULL, 2), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, -1), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_n_past(s), 20);
    /* the tree survives bad paths; the good one then matches the chain */
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, 2), ES_OK);
    prefill(ref, 20);
    CHECK_EQ_INT(es_forward(ref, tokens, 2, NULL, NULL, ES_LOGITS_NONE), ES_OK);
    CHECK(kv_equal(s, ref, 22));
    CHECK(same_decode(s, ref, 7));
    /* a path after another forward call, or after a rollback, is refused */
    prefill(s, 20);
    CHECK_EQ_INT(es_forward_tree(s, tokens, par2, 3, am, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_forward(s, tokens, 1, NULL, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, 2), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_tree(s, tokens, par2, 3, am, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_rollback(s, 15), ES_OK);
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, 2), ES_ERR_INVALID_ARG);
    /* a failed tree call drops the tree before it; an empty path keeps nothing */
    CHECK_EQ_INT(es_forward_tree(s, tokens, par2, 3, am, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_forward_tree(s, tokens, bad_par[0], 4, am, NULL, 0), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_session_keep_path(s, p_ok, 2), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_forward_tree(s, tokens, par2, 3, am, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_keep_path(s, NULL, 0), ES_OK);
    CHECK_EQ_INT(es_session_n_past(s), 15);
    prefill(ref, 15);
    CHECK(same_decode(s, ref, 9));
}

static char g_dir[256];

static void tree_model(int which) {
    es_model *m = tm_load(g_dir, which);
    if (!m) return;
    es_session *s = tm_session(m, 3, N_CTX), *ref = tm_session(m, 1, N_CTX);
    if (s && ref) {
        uint64_t rng = 0x7265657425ull + (uint64_t)which;
        for (int nth = 1; nth <= 3; nth++) {
            CHECK_EQ_INT(es_session_set_threads(s, nth), ES_OK);
            for (int h = 0; h < 4; h++)
                for (int k = 0; k < TREES / 2; k++) one_tree(s, ref, &rng, HISTS[h], MODELS[which].name, nth);
        }
        failures(s, ref);
    }
    es_session_free(s);
    es_session_free(ref);
    es_model_free(m);
}

TEST(tree_llama_q4_1) { tree_model(0); }
TEST(tree_qwen3_mixed_kquants) { tree_model(1); }
TEST(tree_qwen2_f32) { tree_model(2); }
TEST(tree_qwen3moe_experts) { tree_model(3); }
TEST(tree_qwen3vl_sections) { tree_model(4); }

/* What the tree refuses: a sliding-window model, KV eviction, sparse attention, a Q8_0 KV cache. */
TEST(tree_unsupported) {
    int32_t tokens[2] = {1, 2}, parents[2] = {-1, 0};
    es_model *g = tm_load(g_dir, 5), *m = tm_load(g_dir, 0);
    if (g && m) {
        es_session *s = tm_session(g, 1, N_CTX);
        if (s) {
            CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 2, NULL, NULL, 0), ES_ERR_UNSUPPORTED);
            CHECK(strstr(es_session_last_error(s), "sliding-window") != NULL);
            CHECK_EQ_INT(es_session_n_past(s), 0);
        }
        es_session_free(s);
        es_session_params sp = es_session_default_params();
        sp.n_ctx = N_CTX;
        sp.n_threads = 1;
        sp.kv_sinks = 4;
        sp.kv_window = 32;
        s = tm_session_params(m, &sp);
        if (s) {
            CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 2, NULL, NULL, 0), ES_ERR_UNSUPPORTED);
            CHECK(strstr(es_session_last_error(s), "eviction") != NULL);
        }
        es_session_free(s);
        sp = es_session_default_params();
        sp.n_ctx = N_CTX;
        sp.n_threads = 1;
        sp.sparse_topk = 1;
        s = tm_session_params(m, &sp);
        if (s) {
            CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 2, NULL, NULL, 0), ES_ERR_UNSUPPORTED);
            CHECK(strstr(es_session_last_error(s), "sparse") != NULL);
        }
        es_session_free(s);
        sp = es_session_default_params();
        sp.n_ctx = N_CTX;
        sp.n_threads = 1;
        sp.kv_type = ES_KV_Q8_0;
        s = tm_session_params(m, &sp);
        if (s) {
            CHECK_EQ_INT(es_forward_tree(s, tokens, parents, 2, NULL, NULL, 0), ES_ERR_UNSUPPORTED);
            CHECK(strstr(es_session_last_error(s), "Q8_0 KV cache") != NULL);
            CHECK_EQ_INT(es_session_n_past(s), 0);
        }
        es_session_free(s);
    }
    es_model_free(g);
    es_model_free(m);
}

int main(void) {
    const char *tmp = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/es_tree_XXXXXX", tmp && *tmp ? tmp : "/tmp");
    if (!mkdtemp(g_dir)) { perror("mkdtemp"); return 2; }
    RUN(tree_llama_q4_1);
    RUN(tree_qwen3_mixed_kquants);
    RUN(tree_qwen2_f32);
    RUN(tree_qwen3moe_experts);
    RUN(tree_qwen3vl_sections);
    RUN(tree_unsupported);
    rmdir(g_dir);
    return harness_report();
}
