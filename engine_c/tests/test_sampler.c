/* test_sampler.c - es_sample's greedy path and its refusals of bad logits.
 *
 * Greedy (temperature <= 0) is the first index of the largest logit; a NaN
 * logit anywhere is refused (-1) at every temperature, since no order puts
 * a NaN above or below the others. Greedy leaves the RNG state unchanged.
 */
#include <math.h>
#include <stdint.h>

#include "echospec_engine.h"
#include "harness.h"

static int32_t draw(const float *x, int32_t n, float temperature, uint64_t *rng) {
    es_sampler_params p = {.temperature = temperature, .top_k = 0, .top_p = 1.0f, .min_p = 0.0f};
    return es_sample(x, n, &p, rng);
}

TEST(greedy_is_first_largest) {
    float x[5] = {0.5f, 2.0f, -1.0f, 2.0f, 1.0f};
    uint64_t rng = 77;
    CHECK_EQ_INT(draw(x, 5, 0.0f, &rng), 1);
    CHECK_EQ_INT(draw(x, 5, -1.0f, &rng), 1);
    CHECK(rng == 77);
    CHECK_EQ_INT(es_sample(x, 5, NULL, &rng), 1);   /* NULL params: greedy */
    x[4] = INFINITY;
    CHECK_EQ_INT(draw(x, 5, 0.0f, &rng), 4);
}

TEST(greedy_refuses_nan_anywhere) {
    for (int at = 0; at < 5; at++) {
        float x[5] = {0.5f, 2.0f, -1.0f, 3.0f, 1.0f};
        x[at] = NAN;
        uint64_t rng = 77;
        CHECK_EQ_INT(draw(x, 5, 0.0f, &rng), -1);   /* was: 0 when x[0] is NaN */
        CHECK_EQ_INT(es_sample(x, 5, NULL, &rng), -1);
        CHECK_EQ_INT(draw(x, 5, 0.7f, &rng), -1);
        CHECK(rng == 77);
    }
    float all_nan[3] = {NAN, NAN, NAN};
    uint64_t rng = 1;
    CHECK_EQ_INT(draw(all_nan, 3, 0.0f, &rng), -1);
}

TEST(sampling_with_one_finite_logit_draws_it) {
    float x[4] = {-INFINITY, -INFINITY, 0.25f, -INFINITY};
    uint64_t rng = 5;
    CHECK_EQ_INT(draw(x, 4, 1.0f, &rng), 2);
    CHECK(rng != 5);
}

TEST(bad_arguments_are_refused) {
    float x[2] = {0.0f, 1.0f};
    uint64_t rng = 1;
    CHECK_EQ_INT(draw(NULL, 2, 0.0f, &rng), -1);
    CHECK_EQ_INT(draw(x, 0, 0.0f, &rng), -1);
    CHECK_EQ_INT(draw(x, 2, 0.0f, NULL), -1);
    CHECK_EQ_INT(draw(x, 2, NAN, &rng), -1);
}

int main(void) {
    RUN(greedy_is_first_largest);
    RUN(greedy_refuses_nan_anywhere);
    RUN(sampling_with_one_finite_logit_draws_it);
    RUN(bad_arguments_are_refused);
    return harness_report();
}
