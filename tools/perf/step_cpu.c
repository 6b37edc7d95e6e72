/*
 * step_cpu.c - the CPU time of one forward step, per build and depth, on a
 * 1-thread session: a figure a busy host distorts less than wall clock.
 *
 * Every build (a shared library, loaded with dlopen; the same file under
 * two names loads twice) loads the model; then per DEPTH each build gets a
 * session of n_ctx DEPTH + 64 and the given thread count and runs
 * es_forward_last over DEPTH tokens, then REPS rounds in which every build
 * makes one forward call of N tokens (the builds alternate, their order
 * flipping each round), each followed by a rollback to DEPTH, each timed with
 * clock_gettime(CLOCK_THREAD_CPUTIME_ID) on the calling thread. Prints the
 * median and the minimum per build and depth, the CPU time of the prefill,
 * and per later build the median over the rounds of its time minus the
 * first build's in the same round. With THREADS > 1 the figure
 * includes the calling thread's spinning and is not the step's cost; use 1.
 * Time a neighbour takes the core is not counted; its cache and memory
 * traffic are.
 *
 *   make -C tools/perf step_cpu          (and `make -C tools/perf lib` for a build to load)
 *   tools/perf/build/step_cpu MODEL.gguf 1 21 1 64 512 2048 -- old.so new.so
 *
 * Usage: step_cpu MODEL.gguf THREADS REPS N DEPTH [DEPTH ...] -- LIB.so [LIB.so ...]
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "echospec_engine.h"

#define MAX_DEPTHS 16

typedef es_status (*load_fn)(const char *, const es_model_params *, es_model **, char *, size_t);
typedef es_status (*info_fn)(const es_model *, es_model_info *);
typedef es_session_params (*params_fn)(void);
typedef es_status (*session_fn)(const es_model *, const es_session_params *, es_session **, char *, size_t);
typedef es_status (*forward_fn)(es_session *, const int32_t *, int32_t, int32_t *, float *, int32_t);
typedef es_status (*last_fn)(es_session *, const int32_t *, int32_t, int32_t *, float *);
typedef es_status (*rollback_fn)(es_session *, int32_t);
typedef void (*sfree_fn)(es_session *);

static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

#define MAX_LIBS 16

/* One build: its library, entry points, model and the current depth's session. */
typedef struct {
    const char *path;
    void *h;
    forward_fn fw;
    last_fn fl;
    rollback_fn rb;
    params_fn params;
    session_fn snew;
    sfree_fn sfree;
    es_model *m;
    es_model_info info;
    es_session *s;
    double *v, tp;
} build;

static int load(build *b, const char *model) {
    b->h = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
    if (!b->h) {
        fprintf(stderr, "%s\n", dlerror());
        return 1;
    }
    const char *need[] = {"es_model_load", "es_model_get_info", "es_session_default_params", "es_session_new",
                          "es_forward", "es_forward_last", "es_session_rollback", "es_session_free"};
    for (size_t i = 0; i < sizeof need / sizeof *need; i++)
        if (!dlsym(b->h, need[i])) {
            fprintf(stderr, "%s: not an echospec engine build (no %s)\n", b->path, need[i]);
            return 1;
        }
    char err[256];
    if (((load_fn)dlsym(b->h, "es_model_load"))(model, NULL, &b->m, err, sizeof err) != ES_OK) {
        fprintf(stderr, "%s: %s\n", b->path, err);
        return 1;
    }
    ((info_fn)dlsym(b->h, "es_model_get_info"))(b->m, &b->info);
    b->fw = (forward_fn)dlsym(b->h, "es_forward");
    b->fl = (last_fn)dlsym(b->h, "es_forward_last");
    b->rb = (rollback_fn)dlsym(b->h, "es_session_rollback");
    b->params = (params_fn)dlsym(b->h, "es_session_default_params");
    b->snew = (session_fn)dlsym(b->h, "es_session_new");
    b->sfree = (sfree_fn)dlsym(b->h, "es_session_free");
    return 0;
}

/* Every build at one depth: a session each and its prefill, then REPS rounds
 * in which each build makes one timed call (the order of the builds flips
 * every round), so a change of the host's load hits them alike. */
static int run_depth(build *bs, int nb, int nth, int reps, int ntok, int depth) {
    int32_t *toks = malloc(sizeof(int32_t) * (size_t)(depth + ntok)), am[64], last;
    if (!toks) return 1;
    for (int k = 0; k < depth + ntok; k++) toks[k] = (int32_t)(((int64_t)k * 7919) % bs[0].info.n_vocab);
    for (int i = 0; i < nb; i++) {
        build *b = &bs[i];
        es_session_params p = b->params();
        p.n_ctx = depth + 64;
        p.n_threads = nth;
        char err[256];
        b->v = malloc(sizeof(double) * (size_t)reps);
        if (!b->v || b->snew(b->m, &p, &b->s, err, sizeof err) != ES_OK) {
            fprintf(stderr, "%s: %s\n", b->path, b->v ? err : "out of memory");
            return 1;
        }
        double t0 = cpu_ms();
        if (b->fl(b->s, toks, depth, &last, NULL) != ES_OK) {
            fprintf(stderr, "%s: the prefill of %d tokens failed\n", b->path, depth);
            return 1;
        }
        b->tp = cpu_ms() - t0;
    }
    for (int r = 0; r < reps; r++)
        for (int j = 0; j < nb; j++) {
            build *b = &bs[r % 2 ? nb - 1 - j : j];
            double a = cpu_ms();
            if (b->fw(b->s, toks + depth, ntok, am, NULL, 0) != ES_OK) {
                fprintf(stderr, "%s: a timed forward failed\n", b->path);
                return 1;
            }
            b->v[r] = cpu_ms() - a;
            b->rb(b->s, depth);
        }
    /* per round, each build's time minus the first build's: their median is
       steadier than the difference of the medians on a drifting host */
    double *d = malloc(sizeof(double) * (size_t)reps);
    for (int i = 1; i < nb && d; i++) {
        for (int r = 0; r < reps; r++) d[r] = bs[i].v[r] - bs[0].v[r];
        qsort(d, (size_t)reps, sizeof(double), cmp);
        printf("%-28s depth %5d  N %d: minus %s, median of the rounds %+.3f ms\n", bs[i].path, depth, ntok,
               bs[0].path, d[reps / 2]);
    }
    free(d);
    for (int i = 0; i < nb; i++) {
        build *b = &bs[i];
        qsort(b->v, (size_t)reps, sizeof(double), cmp);
        printf("%-28s depth %5d  N %d  threads %d: step cpu %.3f ms (min %.3f)  prefill cpu %.1f ms\n", b->path,
               depth, ntok, nth, b->v[reps / 2], b->v[0], b->tp);
        b->sfree(b->s);
        free(b->v);
    }
    free(toks);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s MODEL.gguf THREADS REPS N DEPTH [DEPTH ...] -- LIB.so [LIB.so ...]\n", argv[0]);
        return 2;
    }
    int nth = atoi(argv[2]), reps = atoi(argv[3]), ntok = atoi(argv[4]);
    if (nth < 1 || nth > 256 || reps < 1 || reps > 100000 || ntok < 1 || ntok > 64) {
        fprintf(stderr, "THREADS in [1, 256], REPS in [1, 100000], N in [1, 64]\n");
        return 2;
    }
    int depths[MAX_DEPTHS], nd = 0, i = 5;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        int d = atoi(argv[i]);
        if (nd == MAX_DEPTHS || d < 1 || d > (1 << 20) - 64) {
            fprintf(stderr, "at most %d depths, each in [1, %d]\n", MAX_DEPTHS, (1 << 20) - 64);
            return 2;
        }
        depths[nd++] = d;
    }
    if (nd == 0 || i + 1 >= argc) {
        fprintf(stderr, "give at least one DEPTH, then --, then at least one LIB.so\n");
        return 2;
    }
    static build bs[MAX_LIBS];
    int nb = 0;
    for (i++; i < argc; i++) {
        if (nb == MAX_LIBS) {
            fprintf(stderr, "at most %d libraries\n", MAX_LIBS);
            return 2;
        }
        bs[nb].path = argv[i];
        if (load(&bs[nb++], argv[1]) != 0) return 1;
    }
    for (int di = 0; di < nd; di++)
        if (run_depth(bs, nb, nth, reps, ntok, depths[di]) != 0) return 1;
    return 0;
}
