/* test_threadpool.c - every ith runs exactly once per es_pool_run, with and
 * without es_pool_begin/end, for several pool sizes; results are visible to
 * the caller when es_pool_run returns. With fewer active threads
 * (es_pool_set_active) a run uses exactly those, the others never run and
 * stay asleep while the active ones spin; bad counts are refused. */
#include <stdatomic.h>
#include <time.h>

#include "harness.h"
#include "internal.h"

typedef struct {
    int nth_seen[8]; /* written only by thread ith */
    _Atomic int calls;
    int hits[8];     /* written only by thread ith */
    long sums[8];
} ctx_t;

static void task(void *p, int ith, int nth) {
    ctx_t *c = p;
    c->nth_seen[ith] = nth;
    c->hits[ith]++;
    long s = 0;
    for (int i = 0; i < 1000; i++) s += i * (ith + 1);
    c->sums[ith] += s;
    atomic_fetch_add(&c->calls, 1);
}

static void run_many(es_pool *p, int n, int runs, int spin) {
    ctx_t c = {0};
    atomic_init(&c.calls, 0);
    if (spin) es_pool_begin(p);
    for (int r = 0; r < runs; r++) es_pool_run(p, task, &c);
    if (spin) es_pool_end(p);
    CHECK_EQ_INT(atomic_load(&c.calls), n * runs);
    for (int i = 0; i < n; i++) {
        CHECK_EQ_INT(c.nth_seen[i], n);
        CHECK_EQ_INT(c.hits[i], runs);
        CHECK_EQ_INT(c.sums[i], (long)runs * 499500L * (i + 1));
    }
}

TEST(test_pool_sizes) {
    for (int n = 1; n <= 4; n++) {
        es_pool *p = es_pool_new(n);
        CHECK(p != NULL);
        if (!p) continue;
        CHECK_EQ_INT(es_pool_size(p), n);
        run_many(p, n, 200, 0);
        run_many(p, n, 2000, 1);
        run_many(p, n, 50, 0);       /* back to sleeping workers */
        es_pool_free(p);
    }
}

/* Runs with `active` of the pool's threads: ith < active run once per run
 * and see nth = active; the others never run. */
static void run_active(es_pool *p, int active, int runs, int spin) {
    ctx_t c = {0};
    atomic_init(&c.calls, 0);
    CHECK_EQ_INT(es_pool_set_active(p, active), 0);
    CHECK_EQ_INT(es_pool_size(p), active);
    if (spin) es_pool_begin(p);
    for (int r = 0; r < runs; r++) es_pool_run(p, task, &c);
    if (spin) es_pool_end(p);
    CHECK_EQ_INT(atomic_load(&c.calls), active * runs);
    for (int i = 0; i < 8; i++) {
        CHECK_EQ_INT(c.hits[i], i < active ? runs : 0);
        CHECK_EQ_INT(c.nth_seen[i], i < active ? active : 0);
    }
}

static void sleep_ms(int ms) {
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* Wait (up to 2 s) for worker ith to sleep. */
static int becomes_asleep(es_pool *p, int ith) {
    for (int i = 0; i < 200; i++) {
        if (es_pool_asleep(p, ith)) return 1;
        sleep_ms(10);
    }
    return 0;
}

TEST(test_pool_active_counts) {
    es_pool *p = es_pool_new(4);
    CHECK(p != NULL);
    if (!p) return;
    CHECK_EQ_INT(es_pool_capacity(p), 4);
    CHECK_EQ_INT(es_pool_size(p), 4);
    /* flip the count between runs, both with spinning and sleeping workers */
    const int counts[] = {1, 4, 2, 3, 1, 2, 4, 3};
    for (int i = 0; i < 8; i++) {
        run_active(p, counts[i], 300, i % 2);
        run_active(p, counts[i], 20, 0);
    }
    /* bad counts: refused, the count stays */
    CHECK_EQ_INT(es_pool_set_active(p, 2), 0);
    CHECK_EQ_INT(es_pool_set_active(p, 0), -1);
    CHECK_EQ_INT(es_pool_set_active(p, 5), -1);
    CHECK_EQ_INT(es_pool_set_active(p, -1), -1);
    CHECK_EQ_INT(es_pool_size(p), 2);
    CHECK_EQ_INT(es_pool_capacity(p), 4);
    CHECK_EQ_INT(es_pool_asleep(p, 0), 0);
    CHECK_EQ_INT(es_pool_asleep(p, 4), 0);
    es_pool_free(p);
}

TEST(test_pool_inactive_workers_sleep) {
    es_pool *p = es_pool_new(3);
    CHECK(p != NULL);
    if (!p) return;
    run_active(p, 3, 10, 0);
    CHECK(becomes_asleep(p, 1));
    CHECK(becomes_asleep(p, 2));
    /* inside a forward window on 2 of 3 threads: worker 2 is never woken */
    CHECK_EQ_INT(es_pool_set_active(p, 2), 0);
    ctx_t c = {0};
    atomic_init(&c.calls, 0);
    es_pool_begin(p);
    for (int r = 0; r < 200; r++) {
        es_pool_run(p, task, &c);
        CHECK_EQ_INT(es_pool_asleep(p, 2), 1);
    }
    es_pool_end(p);
    CHECK_EQ_INT(c.hits[1], 200);
    CHECK_EQ_INT(c.hits[2], 0);
    /* a lone thread's runs: nothing is woken */
    CHECK_EQ_INT(es_pool_set_active(p, 1), 0);
    CHECK(becomes_asleep(p, 1));
    es_pool_begin(p);
    for (int r = 0; r < 50; r++) es_pool_run(p, task, &c);
    CHECK_EQ_INT(es_pool_asleep(p, 1), 1);
    CHECK_EQ_INT(es_pool_asleep(p, 2), 1);
    es_pool_end(p);
    CHECK_EQ_INT(c.hits[0], 250);
    /* all three again */
    run_active(p, 3, 100, 1);
    es_pool_free(p);
}

TEST(test_pool_null_and_bad) {
    ctx_t c = {0};
    atomic_init(&c.calls, 0);
    es_pool_run(NULL, task, &c);           /* NULL pool runs inline */
    es_pool_begin(NULL);
    es_pool_end(NULL);
    CHECK_EQ_INT(atomic_load(&c.calls), 1);
    CHECK_EQ_INT(c.nth_seen[0], 1);
    CHECK_EQ_INT(es_pool_size(NULL), 1);
    CHECK_EQ_INT(es_pool_capacity(NULL), 1);
    CHECK_EQ_INT(es_pool_set_active(NULL, 1), 0);
    CHECK_EQ_INT(es_pool_set_active(NULL, 2), -1);
    CHECK_EQ_INT(es_pool_asleep(NULL, 1), 0);
    CHECK(es_pool_new(0) == NULL);
    CHECK(es_pool_new(-3) == NULL);
    es_pool_free(NULL);
}

TEST(test_pool_free_while_spinning) {
    es_pool *p = es_pool_new(3);
    CHECK(p != NULL);
    es_pool_begin(p);
    run_many(p, 3, 10, 0);
    es_pool_free(p);                       /* workers spinning: must still join */
}

int main(void) {
    RUN(test_pool_sizes);
    RUN(test_pool_active_counts);
    RUN(test_pool_inactive_workers_sleep);
    RUN(test_pool_null_and_bad);
    RUN(test_pool_free_while_spinning);
    return harness_report();
}
