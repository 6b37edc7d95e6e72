/* sampler.c - es_sample: top_k, top_p, min_p and temperature sampling. */
#include <math.h>
#include <stdlib.h>

#include "internal.h"

typedef struct {
    float logit;
    int32_t id;
} cand;

/* Descending by logit, ties by ascending id: a total order, so the result
 * does not depend on the sort algorithm. */
static int cand_cmp(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->logit > y->logit) return -1;
    if (x->logit < y->logit) return 1;
    return (x->id > y->id) - (x->id < y->id);
}

/* xorshift64* (Vigna 2016); returns a uniform float in [0, 1). */
static float next_uniform(uint64_t *state) {
    uint64_t x = *state;
    if (x == 0) x = 0x9E3779B97F4A7C15ull;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    uint64_t r = x * 0x2545F4914F6CDD1Dull;
    return (float)(r >> 40) * (1.0f / 16777216.0f);
}

/* The first index of the largest logit, or -1 when a logit is NaN (no order
 * puts a NaN above or below the others, so no argmax is right). */
static int32_t greedy(const float *logits, int32_t n) {
    if (isnan(logits[0])) return -1;
    int32_t best = 0;
    for (int32_t i = 1; i < n; i++) {
        if (isnan(logits[i])) return -1;
        if (logits[i] > logits[best]) best = i;
    }
    return best;
}

int32_t es_sample(const float *logits, int32_t n_vocab, const es_sampler_params *p, uint64_t *rng) {
    if (!logits || !rng || n_vocab <= 0) return -1;
    if (p && (isnan(p->temperature) || isnan(p->top_p) || isnan(p->min_p))) return -1;
    if (!p || !(p->temperature > 0.0f)) return greedy(logits, n_vocab);
    for (int32_t i = 0; i < n_vocab; i++)   /* +inf would make every softmax weight NaN */
        if (isnan(logits[i]) || logits[i] == INFINITY) return -1;
    cand *c = malloc((size_t)n_vocab * sizeof *c);
    if (!c) return greedy(logits, n_vocab);   /* no NaN (checked above), so never -1 here */
    for (int32_t i = 0; i < n_vocab; i++) { c[i].logit = logits[i]; c[i].id = i; }
    qsort(c, (size_t)n_vocab, sizeof *c, cand_cmp);
    if (c[0].logit == -INFINITY) {   /* no finite logit: every softmax weight would be NaN */
        free(c);
        return -1;
    }
    int32_t n = n_vocab;
    if (p->top_k > 0 && p->top_k < n) n = p->top_k;
    /* softmax of the raw logits over the kept candidates (c[0] is the max) */
    double sum = 0.0;
    for (int32_t i = 0; i < n; i++) sum += exp((double)c[i].logit - (double)c[0].logit);
    if (p->top_p < 1.0f) {
        double acc = 0.0;
        int32_t keep = n;
        for (int32_t i = 0; i < n; i++) {
            acc += exp((double)c[i].logit - (double)c[0].logit) / sum;
            if (acc >= (double)p->top_p) { keep = i + 1; break; }
        }
        n = keep;
    }
    if (p->min_p > 0.0f) {
        /* keep tokens whose probability >= min_p * p(max), i.e. logit >= max + log(min_p) */
        double floor_logit = (double)c[0].logit + log((double)p->min_p);
        int32_t keep = 1;
        while (keep < n && (double)c[keep].logit >= floor_logit) keep++;
        n = keep;
    }
    double inv_t = 1.0 / (double)p->temperature, tot = 0.0;
    for (int32_t i = 0; i < n; i++) tot += exp(((double)c[i].logit - (double)c[0].logit) * inv_t);
    double u = (double)next_uniform(rng) * tot, acc = 0.0;
    int32_t tok = c[n - 1].id;
    for (int32_t i = 0; i < n; i++) {
        acc += exp(((double)c[i].logit - (double)c[0].logit) * inv_t);
        if (u < acc) { tok = c[i].id; break; }
    }
    free(c);
    return tok;
}
