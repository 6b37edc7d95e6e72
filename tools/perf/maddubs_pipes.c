/*
 * maddubs_pipes.c - what the AVX2 packed kernels' inner step costs on this
 * core: the throughput of vpmaddubsw, of vpaddw, of the two together (the
 * int16 chunk sums of a Q4_0/Q4_1 record) and of the same with each
 * activation dword broadcast from memory (vpbroadcastd) as the kernels do,
 * against a pre-broadcast 32-byte activation read as a memory operand.
 *
 * Each loop is one record's integer work at a tile of 5 activation rows,
 * both halves (prows2 in engine_c/src/quant_x86.c): 8 chunks x 5 rows x 2
 * halves = 80 vpmaddubsw, and 80 vpaddw into 10 accumulators. Prints ns per
 * record for each variant; the ratio of two variants is the figure (the
 * clock is not known in a VM without counters).
 *
 *   make -C tools/perf maddubs_pipes && taskset -c 0 tools/perf/build/maddubs_pipes
 */
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#define S(x) #x
#define XS(x) S(x)
/* one row n of chunk k: broadcast, two products, two int16 sums */
#define ROW_B(k, n, a, b)                                                                        \
    "vpbroadcastd " XS(4 * n + 64 * k) "(%[x]), %%ymm12\n"                                       \
    "vpmaddubsw %%ymm12, %%ymm0, %%ymm13\n vpmaddubsw %%ymm12, %%ymm1, %%ymm14\n"                 \
    "vpaddw %%ymm13, %%ymm" #a ", %%ymm" #a "\n vpaddw %%ymm14, %%ymm" #b ", %%ymm" #b "\n"
/* the same with the activation pre-broadcast (32 bytes) as a memory operand */
#define ROW_M(k, n, a, b)                                                                        \
    "vpmaddubsw " XS(32 * n + 160 * k) "(%[y]), %%ymm0, %%ymm13\n"                               \
    "vpmaddubsw " XS(32 * n + 160 * k) "(%[y]), %%ymm1, %%ymm14\n"                               \
    "vpaddw %%ymm13, %%ymm" #a ", %%ymm" #a "\n vpaddw %%ymm14, %%ymm" #b ", %%ymm" #b "\n"
/* products only (independent), and int16 sums only */
#define ROW_P(k, n, a, b)                                                                        \
    "vpmaddubsw " XS(32 * n + 160 * k) "(%[y]), %%ymm0, %%ymm" #a "\n"                           \
    "vpmaddubsw " XS(32 * n + 160 * k) "(%[y]), %%ymm1, %%ymm" #b "\n"
#define ROW_A(k, n, a, b) "vpaddw %%ymm0, %%ymm" #a ", %%ymm" #a "\n vpaddw %%ymm1, %%ymm" #b ", %%ymm" #b "\n"
#define CHUNK(R, k) R(k, 0, 2, 7) R(k, 1, 3, 8) R(k, 2, 4, 9) R(k, 3, 5, 10) R(k, 4, 6, 11)
#define RECORD(R) CHUNK(R, 0) CHUNK(R, 1) CHUNK(R, 2) CHUNK(R, 3) CHUNK(R, 4) CHUNK(R, 5) CHUNK(R, 6) CHUNK(R, 7)
#define CLOBBER "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", \
                "ymm11", "ymm12", "ymm13", "ymm14", "memory"
#define LOOP(name, R)                                                                            \
    static void name(const uint8_t *x, const uint8_t *y, long n) {                               \
        __asm__ volatile("vpxor %%ymm0, %%ymm0, %%ymm0\n vpcmpeqb %%ymm1, %%ymm1, %%ymm1\n"      \
                         "1:\n" RECORD(R) "dec %[n]\n jnz 1b\n vzeroupper\n"                     \
                         : [n] "+r"(n) : [x] "r"(x), [y] "r"(y) : CLOBBER);                      \
    }
LOOP(loop_bcast, ROW_B)
LOOP(loop_memop, ROW_M)
LOOP(loop_products, ROW_P)
LOOP(loop_sums, ROW_A)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static _Alignas(64) uint8_t xa[1024], ya[2048];

int main(void) {
    const long n = 20000000;
    static void (*const fn[4])(const uint8_t *, const uint8_t *, long) = {loop_bcast, loop_memop, loop_products,
                                                                          loop_sums};
    static const char *const name[4] = {"80 products + 80 sums, 40 broadcasts", "80 products + 80 sums, memory operand",
                                        "80 products only", "80 int16 sums only"};
    double best[4] = {1e9, 1e9, 1e9, 1e9};
    for (int round = 0; round < 5; round++)   /* alternated; the best of 5 each */
        for (int v = 0; v < 4; v++) {
            double t0 = now();
            fn[v](xa, ya, n);
            double ns = (now() - t0) / (double)n * 1e9;
            if (ns < best[v]) best[v] = ns;
        }
    for (int v = 0; v < 4; v++) printf("%-40s %6.2f ns per record (%.2f x the products only)\n", name[v], best[v], best[v] / best[2]);
    return 0;
}
