/*
 * forward_ab.c - compare builds of the engine on one host at the same time.
 *
 * The host drifts by 15 % and more within minutes, so two builds timed one
 * after the other can not be compared. This loads each build (a shared
 * library) with dlopen, one model and session per build, and alternates
 * them: per round, each build runs T (one decode step, N = 1) and V(4) (a
 * forward over 5 tokens) at depth 64, with a rollback after each, twice, the
 * second pair timed; the order of the builds flips every round. It prints
 * per build the median T and V(4) in ms and the median of the per-round
 * V(4)/T ratios. `-d DEPTH` (before the libraries) sets the depth, the
 * number of cached positions each timed forward follows (default 64); the
 * session's n_ctx is DEPTH + 64.
 *
 *   make -C tools/perf forward_ab                       (tools/perf/Makefile)
 *   make -C tools/perf lib SIMD=avx2                    build/engine-avx2.so
 *   make -C tools/perf lib SIMD=avx512                  build/engine-avx512.so
 *   cd tools/perf/build
 *   ./forward_ab MODEL.gguf 150 ./engine-avx2.so ./engine-avx512.so
 *   ./forward_ab MODEL.gguf 40 -d 2048 ./engine-avx2.so ./engine-avx512.so
 *
 * Two settings of one path, each in its own OUT (EXTRA_CFLAGS reaches engine_c's
 * Makefile too):
 *   make -C tools/perf lib OUT=$PWD/pf4096 EXTRA_CFLAGS=-DES_PF_BYTES=4096
 *   make -C tools/perf lib OUT=$PWD/pf8192 EXTRA_CFLAGS=-DES_PF_BYTES=8192
 *
 * MODEL.gguf: e.g. the default model, whose path `.venv/bin/python
 * scripts/fetch_model.py` prints (it fetches the file on first use).
 * A build given as LIB.so@OTHER.gguf runs OTHER.gguf instead (one build
 * may appear several times): two files, for instance a Q4_1 and a Q4_K_M
 * file of one shape, compared on one host at the same time.
 *
 * At most 8 builds; 2 threads each; about 100 MB of memory per build plus
 * its KV cache.
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "echospec_engine.h"

#define MAX_LIBS 8
#define MAX_ROUNDS 100000
#define DEFAULT_DEPTH 64
#define MAX_DEPTH (1 << 20)

typedef es_status (*load_fn)(const char *, const es_model_params *, es_model **, char *, size_t);
typedef es_session_params (*params_fn)(void);
typedef es_status (*session_fn)(const es_model *, const es_session_params *, es_session **, char *, size_t);
typedef es_status (*forward_fn)(es_session *, const int32_t *, int32_t, int32_t *, float *, int32_t);
typedef es_status (*rollback_fn)(es_session *, int32_t);
typedef es_status (*info_fn)(const es_model *, es_model_info *);

typedef struct {
    forward_fn forward;
    rollback_fn rollback;
    es_session *s;
} build;

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Load the model and a session with build `lib`; prefill `depth` tokens
 * (toks: depth + 8 of them, filled here). */
static int open_build(const char *lib, const char *model, build *b, int32_t *toks, int depth) {
    void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "%s\n", dlerror());
        return -1;
    }
    const char *need[] = {"es_model_load", "es_model_get_info", "es_session_default_params", "es_session_new",
                          "es_forward", "es_session_rollback"};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        if (!dlsym(h, need[i])) {
            fprintf(stderr, "%s: not an echospec engine build (no %s)\n", lib, need[i]);
            return -1;
        }
    char err[256];
    es_model *m;
    if (((load_fn)dlsym(h, "es_model_load"))(model, NULL, &m, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s: %s\n", lib, err);
        return -1;
    }
    es_model_info info;
    ((info_fn)dlsym(h, "es_model_get_info"))(m, &info);
    for (int i = 0; i < depth + 8; i++) toks[i] = (int32_t)(((int64_t)i * 7919) % info.n_vocab);
    es_session_params p = ((params_fn)dlsym(h, "es_session_default_params"))();
    p.n_ctx = depth + 64;
    p.n_threads = 2;
    if (((session_fn)dlsym(h, "es_session_new"))(m, &p, &b->s, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s: %s\n", lib, err);
        return -1;
    }
    b->forward = (forward_fn)dlsym(h, "es_forward");
    b->rollback = (rollback_fn)dlsym(h, "es_session_rollback");
    int32_t *am = malloc(sizeof(int32_t) * (size_t)depth);
    es_status st = am ? b->forward(b->s, toks, depth, am, NULL, 0) : ES_ERR_NOMEM;
    free(am);
    if (st != ES_OK) {
        fprintf(stderr, "%s: the prefill of %d tokens failed\n", lib, depth);
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    char *end;
    int depth = DEFAULT_DEPTH, first = 3;
    if (argc > 4 && argv[3][0] == '-' && argv[3][1] == 'd' && !argv[3][2]) {
        errno = 0;
        long d = strtol(argv[4], &end, 10);
        if (errno || end == argv[4] || *end || d < 1 || d > MAX_DEPTH) {
            fprintf(stderr, "DEPTH must be a whole number in [1, %d], not '%s'\n", MAX_DEPTH, argv[4]);
            return 2;
        }
        depth = (int)d;
        first = 5;
    }
    int nl = argc - first;
    if (nl < 1 || nl > MAX_LIBS) {
        fprintf(stderr, "usage: %s MODEL.gguf ROUNDS [-d DEPTH] LIB.so[@OTHER.gguf] [LIB.so[@OTHER.gguf] ...] (at most %d)\n",
                argv[0], MAX_LIBS);
        return 2;
    }
    errno = 0;
    long rl = strtol(argv[2], &end, 10);
    if (errno || end == argv[2] || *end || rl < 1 || rl > MAX_ROUNDS) {
        fprintf(stderr, "ROUNDS must be a whole number in [1, %d], not '%s'\n", MAX_ROUNDS, argv[2]);
        return 2;
    }
    int rounds = (int)rl;
    int32_t am[8];
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(depth + 8));
    if (!toks) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    build b[MAX_LIBS];
    for (int i = 0; i < nl; i++) {
        char lib[4096];
        const char *arg = argv[first + i];
        const char *at = strchr(arg, '@');
        size_t n = at ? (size_t)(at - arg) : strlen(arg);
        if (n >= sizeof lib) {
            fprintf(stderr, "library path too long: %s\n", arg);
            return 2;
        }
        memcpy(lib, arg, n);
        lib[n] = 0;
        if (open_build(lib, at ? at + 1 : argv[1], &b[i], toks, depth) != 0) return 1;
    }
    double *t1 = malloc(sizeof(double) * (size_t)(rounds * nl));
    double *t5 = malloc(sizeof(double) * (size_t)(rounds * nl));
    double *ratio = malloc(sizeof(double) * (size_t)(rounds * nl));
    if (!t1 || !t5 || !ratio) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    for (int k = -3; k < rounds; k++)   /* 3 warm-up rounds */
        for (int j = 0; j < nl; j++) {
            int i = k % 2 ? nl - 1 - j : j;   /* the order flips every round */
            double a = 0, c = 0, d = 0, e = 0;
            es_status st1 = ES_OK, st5 = ES_OK;
            /* twice, the second timed: the first lets the worker threads of
             * the build that ran before go back to sleep (they spin for a
             * while after a call and would share the cores with this one) */
            for (int rep = 0; rep < 2 && st1 == ES_OK && st5 == ES_OK; rep++) {
                a = now_ms();
                st1 = b[i].forward(b[i].s, toks + depth, 1, am, NULL, 0);
                c = now_ms();
                b[i].rollback(b[i].s, depth);
                d = now_ms();
                st5 = b[i].forward(b[i].s, toks + depth, 5, am, NULL, 0);
                e = now_ms();
                b[i].rollback(b[i].s, depth);
            }
            if (st1 != ES_OK || st5 != ES_OK) {
                fprintf(stderr, "%s: a timed forward failed (status %d, %d)\n", argv[first + i], st1, st5);
                return 1;
            }
            if (k >= 0) {
                t1[i * rounds + k] = c - a;
                t5[i * rounds + k] = e - d;
                ratio[i * rounds + k] = (e - d) / (c - a);
            }
        }
    for (int i = 0; i < nl; i++) {
        qsort(t1 + i * rounds, (size_t)rounds, sizeof(double), cmp);
        qsort(t5 + i * rounds, (size_t)rounds, sizeof(double), cmp);
        qsort(ratio + i * rounds, (size_t)rounds, sizeof(double), cmp);
        printf("%-24s depth %d  T %.3f ms  V(4) %.3f ms  V(4)/T %.3f\n", argv[first + i], depth, t1[i * rounds + rounds / 2],
               t5[i * rounds + rounds / 2], ratio[i * rounds + rounds / 2]);
    }
    free(t1);
    free(t5);
    free(ratio);
    free(toks);
    return 0;
}
