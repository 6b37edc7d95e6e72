/* harness.h - a tiny test harness for the engine's C tests.
 *
 *   TEST(name) { CHECK(cond); CHECK_EQ_INT(a, b); }
 *   int main(void) { RUN(name); ...; return harness_report(); }
 *
 * Prints one line per failed check and a closing "N passed, N failed" line.
 */
#ifndef ES_TEST_HARNESS_H
#define ES_TEST_HARNESS_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int harness_failed_checks = 0, harness_passed = 0, harness_failed = 0;
static int harness_cur_failed = 0;

#define TEST(name) static void name(void)
#define CHECK(cond) do { if (!(cond)) { harness_cur_failed = 1; harness_failed_checks++; \
    fprintf(stderr, "  FAIL %s:%d: %s\n", __FILE__, __LINE__, #cond); } } while (0)
#define CHECK_EQ_INT(a, b) do { long long _a = (long long)(a), _b = (long long)(b); if (_a != _b) { \
    harness_cur_failed = 1; harness_failed_checks++; \
    fprintf(stderr, "  FAIL %s:%d: %s == %s (%lld != %lld)\n", __FILE__, __LINE__, #a, #b, _a, _b); } } while (0)
#define RUN(name) do { harness_cur_failed = 0; name(); \
    if (harness_cur_failed) { harness_failed++; fprintf(stderr, "FAILED %s\n", #name); } \
    else { harness_passed++; printf("ok %s\n", #name); } } while (0)

static int harness_report(void) {
    printf("%d passed, %d failed\n", harness_passed, harness_failed);
    return harness_failed ? 1 : 0;
}
#endif
