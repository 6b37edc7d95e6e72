/* test_threadpool.c - every ith runs exactly once per es_pool_run, with and
 * without es_pool_begin/end, for several pool sizes; results are visible to
 * the caller when es_pool_run returns. */
#include <stdatomic.h>

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

TEST(test_pool_null_and_bad) {
    ctx_t c = {0};
    atomic_init(&c.calls, 0);
    es_pool_run(NULL, task, &c);           /* NULL pool runs inline */
    es_pool_begin(NULL);
    es_pool_end(NULL);
    CHECK_EQ_INT(atomic_load(&c.calls), 1);
    CHECK_EQ_INT(c.nth_seen[0], 1);
    CHECK_EQ_INT(es_pool_size(NULL), 1);
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
    RUN(test_pool_null_and_bad);
    RUN(test_pool_free_while_spinning);
    return harness_report();
}
