/*
 * rowops.h - small row kernels shared by the forward pass (forward.c), the
 * attention (attention.c) and any later stage that needs them: the lane
 * types (v8f, vaf of AW lanes), F16 loads, the fused multiply-add of the
 * attention's contract, dot8 / RMSNorm, exp (exp_cephes and its lane form
 * expv), SwiGLU, and max / argmax of a row. Private to the engine.
 *
 * Every function is static inline and computes a fixed sequence of float
 * operations on its own inputs, the same bits on every target (the
 * determinism contract in internal.h); each including file gets its own
 * copy, so where a function is compiled changes no result.
 */
#ifndef ES_ROWOPS_H
#define ES_ROWOPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if !defined(ES_FORCE_SCALAR) && (defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX__)))
#include <immintrin.h>
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "internal.h"

/* ---- small row kernels (fixed 8-lane accumulation order) ---------------- */

/* 8 float lanes as a GCC vector (lowered to AVX, SSE or NEON as the target has). */
typedef float v8f __attribute__((vector_size(32)));

/* Sum of x[0..n) with lane j of 8 adding x[j], x[j + 8], ... in order, then
 * ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)): the same bits on every target. */
static inline float sum8(const float *x, int64_t n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f v;
        memcpy(&v, x + i, sizeof v);
        acc += v;
    }
    float l[8];
    memcpy(l, &acc, sizeof l);
    for (; i < n; i++) l[i & 7] += x[i];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}
/* AW lanes, for loops whose lanes are independent elements (attention over
 * positions or dimensions): the width changes no element's operations, so
 * it follows the registers of the target: 16 on AVX-512, 8 on AVX2 (where
 * 16-lane accumulators would spill), 4 on aarch64 (one NEON register; GCC
 * keeps 8-lane vectors, two registers each, on the stack in these loops). */
#if defined(__AVX512F__)
#define AW 16
#elif defined(__aarch64__)
#define AW 4
#else
#define AW 8
#endif
typedef float vaf __attribute__((vector_size(AW * 4)));

/* Keep a loaded vector in a register. Where one K or V vector feeds the
 * products of several queries, GCC folds the load into each multiply as a
 * memory operand, one 64-byte load per product, and the loads, not the
 * arithmetic, bound the loop (AVX-512: 12 loads per position for 3 queries). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__AVX__)   /* vaf is one ymm or zmm register */
#define IN_REG(v) __asm__("" : "+v"(v))
#else   /* other targets (NEON: one q register): left to the compiler */
#define IN_REG(v) ((void)0)
#endif

/* AW floats from AW F16 values of the KV cache, converted in registers. The
 * conversion is exact (every F16 is a float32), so every target reads the
 * same floats. */
static inline __attribute__((always_inline)) vaf ld_h(const uint16_t *p) {
    vaf v;
#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__)
    __m512 x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
    memcpy(&v, &x, sizeof v);
#elif !defined(ES_FORCE_SCALAR) && defined(__F16C__) && defined(__AVX__)
    __m256 x = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
    memcpy(&v, &x, sizeof v);
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
    float32x4_t lo = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
    memcpy(&v, &lo, sizeof lo);
#else
    for (int i = 0; i < AW; i++) v[i] = es_fp16_to_fp32(p[i]);
#endif
    return v;
}

/* AW floats q[i] * s[i] from AW int8 values of a Q8_0 KV block (es_kv_type)
 * and their scales s (F16 values as float32). Each product is exact in
 * float32 (7 by 11 significant bits), so every target reads the same floats
 * as the scalar q * d. */
static inline __attribute__((always_inline)) vaf ld_q8(const int8_t *q, vaf s) {
    vaf v;
#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__)
    __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)q)));
    memcpy(&v, &x, sizeof v);
#elif !defined(ES_FORCE_SCALAR) && defined(__AVX2__)
    __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)q)));
    memcpy(&v, &x, sizeof v);
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
    int32_t w;
    memcpy(&w, q, sizeof w);   /* AW = 4 int8s */
    int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
    float32x4_t x = vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
    memcpy(&v, &x, sizeof v);
#else
    for (int i = 0; i < AW; i++) v[i] = (float)q[i];
#endif
    return v * s;
}

/* a * b + c on AW lanes with one rounding (fmaf's): the attention's fused
 * steps (see the contract above attend_unit in attention.c), the same bits on every target. */
static inline __attribute__((always_inline)) vaf fma_a(vaf a, vaf b, vaf c) {
#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__)
    return (vaf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif !defined(ES_FORCE_SCALAR) && defined(__FMA__) && defined(__AVX__)
    return (vaf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
    return (vaf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#else
    for (int i = 0; i < AW; i++) c[i] = fmaf(a[i], b[i], c[i]);
    return c;
#endif
}

/* Dot product with lane j accumulating elements j, j + 8, j + 16, ... in
 * order, then ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)): the same bits on every target. */
static inline float dot8(const float *a, const float *b, int n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        v8f x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    float l[8];
    memcpy(l, &acc, sizeof l);
    for (; i < n; i++) l[i & 7] += a[i] * b[i];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* y[i] = x[i] / sqrt(mean(x^2) + eps) * w[i]; x and y may alias. */
static inline void rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    float ss = dot8(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

/*
 * exp(x) for float32: Cephes' expf (range reduction by ln 2, a degree-6
 * polynomial, scaling by 2^n through the exponent bits); relative error about
 * 2e-7. expv (below) is the same sequence of IEEE operations on AW lanes
 * (floor is truncate-then-adjust in both, exact for the clamped range), so
 * the lane and scalar forms give the same bits on every target, with no
 * libm call.
 */

#define EXP_LO -87.0f
#define EXP_HI 88.0f

static inline float exp_cephes(float x) {
    x = x < EXP_LO ? EXP_LO : x;
    x = x > EXP_HI ? EXP_HI : x;
    float fx = x * 1.44269504088896341f + 0.5f;
    float n = (float)(int32_t)fx;
    n = n > fx ? n + -1.0f : n;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/* AW lanes of int32, and a lane-wise select m ? a : b (m from a vector
 * comparison: -1 or 0). */
typedef int32_t vai __attribute__((vector_size(AW * 4)));
static inline vaf va_splat(float a) { return (vaf){0} + a; }
static inline vaf va_sel(vai m, vaf a, vaf b) {
    vai ai, bi;
    memcpy(&ai, &a, sizeof ai);
    memcpy(&bi, &b, sizeof bi);
    vai r = (ai & m) | (bi & ~m);
    vaf out;
    memcpy(&out, &r, sizeof out);
    return out;
}

/* exp_cephes on AW lanes (16 on AVX-512: half the instructions of 8). */
static inline vaf expv(vaf x) {
    x = va_sel(x < va_splat(EXP_LO), va_splat(EXP_LO), x);
    x = va_sel(x > va_splat(EXP_HI), va_splat(EXP_HI), x);
    vaf fx = x * va_splat(1.44269504088896341f) + va_splat(0.5f);
    vaf n = __builtin_convertvector(__builtin_convertvector(fx, vai), vaf);
    n = va_sel(n > fx, n + va_splat(-1.0f), n);
    vaf r = x - n * va_splat(0.693359375f);
    r = r - n * va_splat(-2.12194440e-4f);
    vaf z = r * r;
    vaf y = va_splat(1.9875691500e-4f);
    y = y * r + va_splat(1.3981999507e-3f);
    y = y * r + va_splat(8.3334519073e-3f);
    y = y * r + va_splat(4.1665795894e-2f);
    y = y * r + va_splat(1.6666665459e-1f);
    y = y * r + va_splat(5.0000001201e-1f);
    y = y * z + r + va_splat(1.0f);
    vai e = (__builtin_convertvector(n, vai) + 127) << 23;
    vaf scale;
    memcpy(&scale, &e, sizeof scale);
    return y * scale;
}

/* x[i] = exp(x[i] - m) for i in [0, n). */
static inline void exp_sub_row(float *x, float m, int n) {
    int i = 0;
    for (; i + AW <= n; i += AW) {
        vaf v;
        memcpy(&v, x + i, sizeof v);
        v = expv(v - va_splat(m));
        memcpy(x + i, &v, sizeof v);
    }
    if (i < n) {   /* the tail as one vector (expv's lanes are exp_cephes) */
        vaf v = {0};
        memcpy(&v, x + i, (size_t)(n - i) * sizeof(float));
        v = expv(v - va_splat(m));
        memcpy(x + i, &v, (size_t)(n - i) * sizeof(float));
    }
}

/* g[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i] for i in [0, n). */
static inline void swiglu_row(float *g, const float *u, size_t n) {
    size_t i = 0;
    for (; i + AW <= n; i += AW) {
        vaf gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        gv = (gv / (va_splat(1.0f) + expv(-gv))) * uv;
        memcpy(g + i, &gv, sizeof gv);
    }
    for (; i < n; i++) g[i] = (g[i] / (1.0f + exp_cephes(-g[i]))) * u[i];
}

/* g[i] = gelu(g[i]) * u[i] for i in [0, n), GELU's tanh form (gelu_pytorch_tanh,
 * ggml's gelu): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), computed as
 * the equal x / (1 + exp(-z)), z = x (GELU_K0 + GELU_K1 x^2) (2 sqrt(2/pi) and
 * 2 sqrt(2/pi) 0.044715): tanh(u) = 2 / (1 + exp(-2u)) - 1. One fixed
 * sequence of operations on lanes and in the scalar tail (no libm tanh). */
#define GELU_K0 1.5957691216057308f
#define GELU_K1 0.07135481627159856f
static inline void gelu_row(float *g, const float *u, size_t n) {
    size_t i = 0;
    for (; i + AW <= n; i += AW) {
        vaf gv, uv;
        memcpy(&gv, g + i, sizeof gv);
        memcpy(&uv, u + i, sizeof uv);
        vaf z = gv * (va_splat(GELU_K0) + va_splat(GELU_K1) * (gv * gv));
        gv = (gv / (va_splat(1.0f) + expv(-z))) * uv;
        memcpy(g + i, &gv, sizeof gv);
    }
    for (; i < n; i++) {
        float x = g[i], z = x * (GELU_K0 + GELU_K1 * (x * x));
        g[i] = (x / (1.0f + exp_cephes(-z))) * u[i];
    }
}

/* The largest of x[0..n), n >= 1, as a scalar loop of "x[i] > best" from
 * best = x[0] finds it (NaNs after x[0] are passed over; NaN when x[0] is
 * NaN): by AW lanes, exact in any order. */
static inline float max_row(const float *x, int n) {
    int t = 0;
    float m = x[0];
    if (n >= AW) {
        vaf mv = va_splat(x[0]);
        for (; t + AW <= n; t += AW) {
            vaf v;
            memcpy(&v, x + t, sizeof v);
            mv = va_sel(v > mv, v, mv);
        }
        for (int l = 0; l < AW; l++) m = mv[l] > m ? mv[l] : m;
    }
    for (; t < n; t++) m = x[t] > m ? x[t] : m;
    return m;
}

/* The first index of the largest value (NaNs are never chosen; 0 when x[0]
 * is NaN): max_row, then the first element equal to it. */
static inline int32_t argmax_row(const float *x, int n) {
    float bv = max_row(x, n);
    if (bv != bv) return 0;   /* x[0] is NaN */
    for (int j = 0; j < n; j++)
        if (x[j] == bv) return j;
    return 0;
}

#endif /* ES_ROWOPS_H */
