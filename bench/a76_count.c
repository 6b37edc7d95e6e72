/*
 * a76_count.c - the forward calls whose instructions bench/a76_estimate.py
 * counts under qemu-aarch64 with bench/a76_insn_plugin.c.
 *
 *   a76_count MODEL.gguf DEPTH N REPS
 *
 * Loads the model, makes a one-thread session (so the count has no pool
 * spinning and no race on the plugin's counter), prefills DEPTH tokens
 * (es_forward_last), then REPS times: a forward over N tokens (N = 1: a
 * decode step, N = 5: a verify of 4 drafts) and a rollback to DEPTH.
 * Runs with REPS = 0 and REPS = 2 differ by exactly two forwards (and two
 * rollbacks, a few instructions), so the estimate takes half the
 * difference. Exit status 0, or 1 with a message on stderr.
 */
#include <stdio.h>
#include <stdlib.h>

#include "echospec_engine.h"

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s MODEL.gguf DEPTH N REPS\n", argv[0]);
        return 1;
    }
    int depth = atoi(argv[2]), n = atoi(argv[3]), reps = atoi(argv[4]);
    if (depth < 1 || depth > 512 || n < 1 || n > 32 || reps < 0) {
        fprintf(stderr, "DEPTH 1..512, N 1..32, REPS >= 0\n");
        return 1;
    }
    char err[256];
    es_model *m;
    if (es_model_load(argv[1], NULL, &m, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    es_model_info info;
    es_model_get_info(m, &info);
    es_session_params p = es_session_default_params();
    p.n_ctx = depth + 40;   /* the same for every N, so the REPS = 0 run is shared */
    p.n_threads = 1;
    es_session *s;
    if (es_session_new(m, &p, &s, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int32_t toks[512 + 32], am[32];
    for (int i = 0; i < depth + n; i++) toks[i] = (int32_t)((i * 7919) % info.n_vocab);
    if (es_forward_last(s, toks, depth, am, NULL) != ES_OK) {
        fprintf(stderr, "the prefill failed\n");
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        if (es_forward(s, toks + depth, n, am, NULL, 0) != ES_OK || es_session_rollback(s, depth) != ES_OK) {
            fprintf(stderr, "a forward over %d tokens failed\n", n);
            return 1;
        }
    }
    printf("%s: weight bytes per step %lld, argmax %d\n", argv[1], (long long)info.weight_bytes, (int)am[0]);
    es_session_free(s);
    es_model_free(m);
    return 0;
}
