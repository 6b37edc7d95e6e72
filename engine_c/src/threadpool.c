/*
 * threadpool.c - a persistent pool of n_threads - 1 workers plus the caller.
 *
 * Dispatch is a generation counter: es_pool_run stores the task, bumps
 * `gen` (release) and runs ith = 0 itself; each worker that sees a new
 * generation runs its share and decrements `pending`; the caller spins until
 * pending is 0. Between es_pool_begin and es_pool_end (one forward call)
 * workers spin on `gen` with a pause instruction, so a run costs about a
 * microsecond of synchronisation. Outside that window an idle worker spins
 * for a short while after each task and then sleeps on a condition variable
 * (inside the window too, after a long gap); es_pool_run wakes sleepers.
 * C11 atomics and pthreads only; no global state.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "internal.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#elif defined(__aarch64__)
#define cpu_relax() __asm__ __volatile__("yield" ::: "memory")
#else
#define cpu_relax() ((void)0)
#endif

/* Pause iterations a worker spins before it sleeps on the condition
 * variable: long inside begin/end (the gaps between the runs of one forward
 * call are short), short outside. A pause is ~20-140 cycles. Every
 * YIELD_EVERY spins the thread yields, so that an oversubscribed pool
 * (more threads than free cores) still makes progress. */
#define SPIN_ACTIVE 50000
#define SPIN_IDLE 2000
#define YIELD_EVERY 256

typedef struct {
    es_pool *pool;
    int ith;
} worker_arg;

struct es_pool {
    int n;                      /* threads incl. the caller */
    pthread_t *threads;         /* [n - 1] */
    worker_arg *args;           /* [n - 1] */
    int n_started;
    _Atomic unsigned gen;       /* bumped once per run */
    _Atomic int pending;        /* workers still running the current task */
    _Atomic int spin;           /* 1 between es_pool_begin and es_pool_end */
    _Atomic int stop;
    _Atomic int sleepers;       /* workers in (or entering) pthread_cond_wait */
    es_task_fn fn;              /* valid for the current generation */
    void *ctx;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

/* Wait until the generation moves past `seen` or the pool stops. */
static unsigned wait_gen(es_pool *pool, unsigned seen) {
    for (int spins = 0;; spins++) {
        unsigned g = atomic_load(&pool->gen);
        if (g != seen || atomic_load(&pool->stop)) return g;
        int limit = atomic_load_explicit(&pool->spin, memory_order_relaxed) ? SPIN_ACTIVE : SPIN_IDLE;
        if (spins < limit) {
            cpu_relax();
            if (spins % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
            continue;
        }
        /* sleepers++ then re-check gen (seq_cst); es_pool_run bumps gen then
         * reads sleepers (seq_cst): one of the two sees the other. */
        pthread_mutex_lock(&pool->mu);
        atomic_fetch_add(&pool->sleepers, 1);
        while (atomic_load(&pool->gen) == seen && !atomic_load(&pool->stop))
            pthread_cond_wait(&pool->cv, &pool->mu);
        atomic_fetch_sub(&pool->sleepers, 1);
        pthread_mutex_unlock(&pool->mu);
        spins = 0;
    }
}

static void *worker_main(void *p) {
    worker_arg *a = p;
    es_pool *pool = a->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = wait_gen(pool, seen);
        if (atomic_load(&pool->stop)) break;
        seen = g;
        pool->fn(pool->ctx, a->ith, pool->n);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void stop_workers(es_pool *pool) {
    pthread_mutex_lock(&pool->mu);
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
}

es_pool *es_pool_new(int n_threads) {
    if (n_threads < 1 || n_threads > 1024) return NULL;
    es_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    atomic_init(&pool->gen, 0);
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->spin, 0);
    atomic_init(&pool->stop, 0);
    atomic_init(&pool->sleepers, 0);
    if (pthread_mutex_init(&pool->mu, NULL) != 0) {
        free(pool);
        return NULL;
    }
    if (pthread_cond_init(&pool->cv, NULL) != 0) {
        pthread_mutex_destroy(&pool->mu);
        free(pool);
        return NULL;
    }
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        pool->args = calloc((size_t)n_threads - 1, sizeof *pool->args);
        if (!pool->threads || !pool->args) {
            es_pool_free(pool);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            pool->args[i].pool = pool;
            pool->args[i].ith = i + 1;
            if (pthread_create(&pool->threads[i], NULL, worker_main, &pool->args[i]) != 0) {
                es_pool_free(pool);
                return NULL;
            }
            pool->n_started++;
        }
    }
    return pool;
}

void es_pool_free(es_pool *pool) {
    if (!pool) return;
    stop_workers(pool);
    pthread_cond_destroy(&pool->cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool->args);
    free(pool);
}

int es_pool_size(const es_pool *pool) { return pool ? pool->n : 1; }

void es_pool_run(es_pool *pool, es_task_fn fn, void *ctx) {
    if (!pool || pool->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    atomic_store_explicit(&pool->pending, pool->n - 1, memory_order_relaxed);
    atomic_fetch_add(&pool->gen, 1);
    if (atomic_load(&pool->sleepers) > 0) {
        pthread_mutex_lock(&pool->mu);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
    }
    fn(ctx, 0, pool->n);
    for (int spins = 0; atomic_load_explicit(&pool->pending, memory_order_acquire) != 0; spins++) {
        cpu_relax();
        if (spins % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
    }
}

/* Workers keep spinning between runs until es_pool_end (up to SPIN_ACTIVE). */
void es_pool_begin(es_pool *pool) {
    if (pool) atomic_store_explicit(&pool->spin, 1, memory_order_relaxed);
}

void es_pool_end(es_pool *pool) {
    if (pool) atomic_store_explicit(&pool->spin, 0, memory_order_relaxed);
}
