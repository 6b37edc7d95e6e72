/*
 * threadpool.c - a persistent pool of n_threads - 1 workers plus the caller,
 * of which a run uses the first `active` (es_pool_set_active; all of them by
 * default).
 *
 * Dispatch: each worker has its own generation counter. es_pool_run stores
 * the task, bumps the counter of each worker the run uses (release) and runs
 * ith = 0 itself; a worker that sees its counter move runs its share and
 * decrements `pending`; the caller spins until pending is 0. Workers the run
 * does not use see nothing and keep sleeping. Between es_pool_begin and
 * es_pool_end (one forward call) the workers of that call spin on their
 * counter with a pause instruction, so a run costs about a microsecond of
 * synchronisation. Outside that window, and always for a worker the call
 * does not use, an idle worker spins for a short while after its task and
 * then sleeps on its condition variable; es_pool_run wakes the sleepers it
 * needs. C11 atomics and pthreads only; no global state.
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
 * variable: long inside begin/end for a worker of the call (the gaps between
 * the runs of one forward call are short), short otherwise. A pause is
 * ~20-140 cycles. Every YIELD_EVERY spins the thread yields, so that an
 * oversubscribed pool (more threads than free cores) still makes progress. */
#define SPIN_ACTIVE 50000
#define SPIN_IDLE 2000
#define YIELD_EVERY 256

/* One worker's state, on its own cache line (the caller writes `gen` of
 * every worker it uses, each worker spins on its own). */
typedef struct {
    _Alignas(64) _Atomic unsigned gen;  /* bumped once per run that uses this worker */
    _Atomic int asleep;                 /* 1 while in (or entering) pthread_cond_wait */
    pthread_cond_t cv;
    es_pool *pool;
    int ith;
} worker;

struct es_pool {
    int n;                      /* threads incl. the caller */
    int active;                 /* threads a run uses, in [1, n]; set between runs by the owner */
    pthread_t *threads;         /* [n - 1] */
    worker *w;                  /* [n - 1]: worker ith is w[ith - 1] */
    int n_started;
    int n_cv;                   /* condition variables initialised in w */
    _Atomic int pending;        /* workers still running the current task */
    _Atomic int spin;           /* between es_pool_begin and es_pool_end: the threads of the call, else 0 */
    _Atomic int stop;
    es_task_fn fn;              /* valid for the current run */
    void *ctx;
    int nth;                    /* threads of the current run */
    pthread_mutex_t mu;
};

/* Wait until w's generation moves past `seen` or the pool stops. */
static unsigned wait_gen(worker *w, unsigned seen) {
    es_pool *pool = w->pool;
    for (int spins = 0;; spins++) {
        unsigned g = atomic_load(&w->gen);
        if (g != seen || atomic_load(&pool->stop)) return g;
        int limit = w->ith < atomic_load_explicit(&pool->spin, memory_order_relaxed) ? SPIN_ACTIVE : SPIN_IDLE;
        if (spins < limit) {
            cpu_relax();
            if (spins % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
            continue;
        }
        /* asleep = 1 then re-check gen (seq_cst); es_pool_run bumps gen then
         * reads asleep (seq_cst): one of the two sees the other. The full
         * fence between the store and the load says so to every translator
         * of the code, not only to the hardware: an AArch64 STLR followed by
         * LDAR is ordered on the A76, but qemu-user on an x86 host emits no
         * barrier between them, so the store could sit in the store buffer
         * while the load read the old gen, both sides would miss each other,
         * and the worker would sleep through the run (a rare hang of the
         * emulated tests). The fence costs nothing on the spinning path. */
        pthread_mutex_lock(&pool->mu);
        atomic_store(&w->asleep, 1);
        atomic_thread_fence(memory_order_seq_cst);
        while (atomic_load(&w->gen) == seen && !atomic_load(&pool->stop))
            pthread_cond_wait(&w->cv, &pool->mu);
        atomic_store(&w->asleep, 0);
        pthread_mutex_unlock(&pool->mu);
        spins = 0;
    }
}

static void *worker_main(void *p) {
    worker *w = p;
    es_pool *pool = w->pool;
    unsigned seen = 0;
    for (;;) {
        unsigned g = wait_gen(w, seen);
        if (atomic_load(&pool->stop)) break;
        seen = g;
        pool->fn(pool->ctx, w->ith, pool->nth);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

static void stop_workers(es_pool *pool) {
    pthread_mutex_lock(&pool->mu);
    atomic_store_explicit(&pool->stop, 1, memory_order_release);
    for (int i = 0; i < pool->n_cv; i++) pthread_cond_signal(&pool->w[i].cv);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
}

es_pool *es_pool_new(int n_threads) {
    if (n_threads < 1 || n_threads > 1024) return NULL;
    es_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads;
    pool->active = n_threads;
    atomic_init(&pool->pending, 0);
    atomic_init(&pool->spin, 0);
    atomic_init(&pool->stop, 0);
    if (pthread_mutex_init(&pool->mu, NULL) != 0) {
        free(pool);
        return NULL;
    }
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        pool->w = aligned_alloc(64, (size_t)(n_threads - 1) * sizeof *pool->w);
        if (!pool->threads || !pool->w) {
            es_pool_free(pool);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            worker *w = &pool->w[i];
            atomic_init(&w->gen, 0);
            atomic_init(&w->asleep, 0);
            w->pool = pool;
            w->ith = i + 1;
            if (pthread_cond_init(&w->cv, NULL) != 0) {
                es_pool_free(pool);
                return NULL;
            }
            pool->n_cv++;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            if (pthread_create(&pool->threads[i], NULL, worker_main, &pool->w[i]) != 0) {
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
    for (int i = 0; i < pool->n_cv; i++) pthread_cond_destroy(&pool->w[i].cv);
    pthread_mutex_destroy(&pool->mu);
    free(pool->threads);
    free(pool->w);
    free(pool);
}

int es_pool_size(const es_pool *pool) { return pool ? pool->active : 1; }

int es_pool_capacity(const es_pool *pool) { return pool ? pool->n : 1; }

int es_pool_asleep(const es_pool *pool, int ith) {
    if (!pool || ith < 1 || ith >= pool->n) return 0;
    return atomic_load(&pool->w[ith - 1].asleep);
}

int es_pool_set_active(es_pool *pool, int n) {
    if (!pool) return n == 1 ? 0 : -1;
    if (n < 1 || n > pool->n) return -1;
    pool->active = n;
    return 0;
}

void es_pool_run(es_pool *pool, es_task_fn fn, void *ctx) {
    if (!pool || pool->active == 1) {
        fn(ctx, 0, 1);
        return;
    }
    int nth = pool->active;
    pool->fn = fn;
    pool->ctx = ctx;
    pool->nth = nth;
    atomic_store_explicit(&pool->pending, nth - 1, memory_order_relaxed);
    int wake = 0;
    for (int i = 0; i < nth - 1; i++) atomic_fetch_add(&pool->w[i].gen, 1);
    for (int i = 0; i < nth - 1; i++) wake |= atomic_load(&pool->w[i].asleep);
    if (wake) {
        pthread_mutex_lock(&pool->mu);
        for (int i = 0; i < nth - 1; i++)
            if (atomic_load(&pool->w[i].asleep)) pthread_cond_signal(&pool->w[i].cv);
        pthread_mutex_unlock(&pool->mu);
    }
    fn(ctx, 0, nth);
    for (int spins = 0; atomic_load_explicit(&pool->pending, memory_order_acquire) != 0; spins++) {
        cpu_relax();
        if (spins % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
    }
}

/* The workers of the next runs (the active ones) keep spinning between runs
 * until es_pool_end (up to SPIN_ACTIVE); the others sleep. */
void es_pool_begin(es_pool *pool) {
    if (pool) atomic_store_explicit(&pool->spin, pool->active, memory_order_relaxed);
}

void es_pool_end(es_pool *pool) {
    if (pool) atomic_store_explicit(&pool->spin, 0, memory_order_relaxed);
}
