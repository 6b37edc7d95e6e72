/*
 * a76_count.c - the forward calls whose instructions a76_estimate.py
 * counts under qemu-aarch64 with a76_insn_plugin.c (`make -C tools/perf a76_count`
 * cross-builds it).
 *
 *   a76_count MODEL.gguf DEPTH REPS N [N ...]
 *
 * Loads the model, makes a one-thread session (so the count has no pool
 * spinning and no race on the plugin's counter), prefills DEPTH tokens
 * (es_forward_last), then for each N: REPS times a forward over N tokens
 * (N = 1: a decode step, N = 5: a verify of 4 drafts) and a rollback to
 * DEPTH. Around each N's loop it makes a marker system call, write(-1,
 * NULL, N) (fails with EBADF, touches nothing), at which the plugin prints
 * its running count ("mark N insns C"), so instructions per forward =
 * (count at the marker after the loop - count at the one before) / REPS;
 * the prefill is outside every interval. Exit status 0, or 1 with a
 * message on stderr.
 */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "echospec_engine.h"

#define MAX_N 32

static void mark(int n) { (void)!write(-1, NULL, (size_t)n); }

int main(int argc, char **argv) {
    if (argc < 5) {
        fprintf(stderr, "usage: %s MODEL.gguf DEPTH REPS N [N ...]\n", argv[0]);
        return 1;
    }
    int depth = atoi(argv[2]), reps = atoi(argv[3]), nmax = 0;
    for (int a = 4; a < argc; a++) {
        int n = atoi(argv[a]);
        if (n < 1 || n > MAX_N) {
            fprintf(stderr, "N 1..%d\n", MAX_N);
            return 1;
        }
        nmax = n > nmax ? n : nmax;
    }
    if (depth < 1 || depth > 65536 || reps < 1) {
        fprintf(stderr, "DEPTH 1..65536, REPS >= 1\n");
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
    p.n_ctx = depth + nmax;
    p.n_threads = 1;
    es_session *s;
    if (es_session_new(m, &p, &s, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(depth + nmax)), am[MAX_N];
    if (!toks) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int i = 0; i < depth + nmax; i++) toks[i] = (int32_t)((i * 7919) % info.n_vocab);
    if (es_forward_last(s, toks, depth, am, NULL) != ES_OK) {
        fprintf(stderr, "the prefill failed\n");
        return 1;
    }
    for (int a = 4; a < argc; a++) {
        int n = atoi(argv[a]);
        mark(n);
        for (int r = 0; r < reps; r++) {
            if (es_forward(s, toks + depth, n, am, NULL, 0) != ES_OK || es_session_rollback(s, depth) != ES_OK) {
                fprintf(stderr, "a forward over %d tokens failed\n", n);
                return 1;
            }
        }
        mark(n);
    }
    printf("%s: depth %d, weight bytes per step %lld, argmax %d\n", argv[1], depth, (long long)info.weight_bytes,
           (int)am[0]);
    free(toks);
    es_session_free(s);
    es_model_free(m);
    return 0;
}
