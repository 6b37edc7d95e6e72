/*
 * forward.c - sessions, attention and the forward pass.
 *
 * A session owns one KV sequence (kv_cache.c: F16, blocks of ES_KV_BLOCK
 * positions; the layout is described in internal.h), a thread pool and the
 * scratch of one call. es_forward_batch runs the rows of several sessions
 * as one call on the first one's pool and scratch (fwd_seg, fwd_call).
 *
 * Determinism: every per-row operation here (RMSNorm, RoPE, attention for one
 * (position, head), SwiGLU, residual adds, argmax) reads only its own row and
 * the KV positions before it, in a fixed order, so results do not depend on
 * N or on the thread split (the attention's own contract is above
 * attend_unit). es_matmul keeps the same contract.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if !defined(ES_FORCE_SCALAR) && (defined(__AVX512F__) || (defined(__F16C__) && defined(__AVX__)))
#include <immintrin.h>
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "internal.h"
#include "quant.h"

#define EARLY_KV_PREFETCH (64 * 1024)   /* a layer's K or V up to this many bytes is prefetched whole */
#ifndef KV_PF_AHEAD
#define KV_PF_AHEAD 2       /* attention: a unit asks for the block this many ahead of the one it computes */
#endif
#define KS_UNITS_PER_THREAD 8   /* key split: chunks of blocks aim at about this many units a thread */

/* ---- small row kernels (fixed 8-lane accumulation order) ---------------- */

/* 8 float lanes as a GCC vector (lowered to AVX, SSE or NEON as the target has). */
typedef float v8f __attribute__((vector_size(32)));
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

/* a * b + c on AW lanes with one rounding (fmaf's): the attention's fused
 * steps (see the contract above attend_unit), the same bits on every target. */
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
static void rmsnorm(float *y, const float *x, const float *w, int n, float eps) {
    float ss = dot8(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ss + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] * inv) * w[i];
}

/* Rotate one head in place. cs = [rope_dim/2] (cos, sin) pairs for this position.
 * The rotated pairs are gathered first and the two outputs computed in
 * separate loops: GCC 12 turns the interleaved form into vfmaddsub even under
 * -ffp-contract=off, which would break bitwise equality with the scalar build
 * (tests/test_engine_build.py allows FMA instructions only where a contract
 * has them). */
static void rope_head(float *h, const float *cs, int rope_dim, int neox) {
    enum { MAXH = 256 };            /* head_dim <= 512 (checked at load) */
    float x0[MAXH], x1[MAXH], c[MAXH], sn[MAXH], y0[MAXH], y1[MAXH];
    int half = rope_dim / 2;
    for (int i = 0; i < half; i++) {
        x0[i] = h[neox ? i : 2 * i];
        x1[i] = h[neox ? i + half : 2 * i + 1];
        c[i] = cs[2 * i];
        sn[i] = cs[2 * i + 1];
    }
    for (int i = 0; i < half; i++) y0[i] = x0[i] * c[i] - x1[i] * sn[i];
    for (int i = 0; i < half; i++) y1[i] = x0[i] * sn[i] + x1[i] * c[i];
    for (int i = 0; i < half; i++) {
        h[neox ? i : 2 * i] = y0[i];
        h[neox ? i + half : 2 * i + 1] = y1[i];
    }
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
static void exp_sub_row(float *x, float m, int n) {
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
static void swiglu_row(float *g, const float *u, size_t n) {
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

/* The largest of x[0..n), n >= 1, as a scalar loop of "x[i] > best" from
 * best = x[0] finds it (NaNs after x[0] are passed over; NaN when x[0] is
 * NaN): by AW lanes, exact in any order. */
static float max_row(const float *x, int n) {
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
static int32_t argmax_row(const float *x, int n) {
    float bv = max_row(x, n);
    if (bv != bv) return 0;   /* x[0] is NaN */
    for (int j = 0; j < n; j++)
        if (x[j] == bv) return j;
    return 0;
}

/* ---- attention ----------------------------------------------------------- */

/*
 * Attention, softmax(q . K^T / sqrt(head_dim)) . V (GQA), as an online
 * softmax over the KV blocks of ES_KV_BLOCK (B) positions, which are fixed by
 * absolute position. The query of token i of a call (position p = n_past + i,
 * query head h, KV head h / (n_head / n_head_kv)) attends positions [0, p]:
 * blocks 0 .. p / B, the last one in part. Per query:
 *   block b, its positions t in [bB, min(bB + B, p + 1)):
 *     s_t = z * scale, z = +0 then z = fma(q[d], k_t[d], z) for d = 0, 1, ...
 *     m_b = max s_t;  e_t = exp(s_t - m_b)  (exp_cephes, its lanes in expv)
 *     l_b = sum8 of the e_t (lane j adds e of the block's positions j, j + 8,
 *           ... in order, then the fixed tree of dot8)
 *     o_b[d] = +0 then o_b[d] = fma(e_t, v_t[d], o_b[d]) for t in order
 *   fold, blocks in order: (M, L, O) = block 0's (m, l, o); for b = 1, 2, ...
 *     M' = max(M, m_b), a = exp(M - M'), c = exp(m_b - M'),
 *     L = L * a + l_b * c,  O[d] = O[d] * a + o_b[d] * c,  M = M'
 *   out[d] = O[d] * (1 / L)
 * (fma: a * b + c with one rounding, fmaf's; one instruction where a multiply
 * and an add would be two, in the loops that bound a long context's prefill.)
 * Every step is a fixed sequence of float operations on the query's own
 * inputs and positions. So neither N, nor which queries share a work unit,
 * nor which thread computes which block, nor the vector width changes a bit:
 * a query computed in a 5-token verify is bitwise the query of a 1-token step.
 * Two ways of sharing the work out compute exactly that:
 *   key split, calls of up to KS_MAX_TOKENS tokens (decode, verify): a unit
 *     is (KV head, its query heads or a part of them, a chunk of blocks) for
 *     every token of the call; each block's (m, l, o) goes to s->parts, and
 *     the unit that completes the last chunk of a head group folds them in
 *     order. A long context is read by all threads at once.
 *   query split, longer calls (prefill): a unit is (KV head, heads, a slice
 *     of tokens) over all the blocks they attend, folding as it goes.
 * A unit loads each block once into its thread's scratch as float32 (exact)
 * for all its queries, and the queries share each K and V vector load.
 */


typedef struct {
    es_session *s;      /* the call's scratch: q, att, att_ws, att_done, mm_scratch */
    es_session *seq;    /* the session these rows belong to: its KV cache, parts, grp_done */
    int row0;           /* its rows in the call's scratch: [row0, row0 + n) */
    int layer;
    int n;              /* its tokens in this call */
    int per, split;     /* query heads per unit, units per KV head group */
    int ts, nsl;        /* tokens per unit, token slices (query split) */
    int nch, bpc;       /* key split: chunks of blocks per head group (0: query split), blocks per chunk */
    int32_t nblk;       /* blocks attended by the call's last token */
    size_t rs;          /* > 0: the unit that completes the call's (key split) or a token slice's
                           (query split) attention quantizes those att rows into mm_scratch for
                           W_o (rows rs bytes apart) */
} attn_task;

/* One attention dispatch over the sessions of a call: the units of t[k] are
 * [end[k - 1], end[k]) of one counter. */
typedef struct {
    es_session *s;
    const attn_task *t;
    int nt;
    int end[ES_MAX_BATCH];
    _Atomic int next;   /* next work unit to take */
} attn_batch;

/* Queries of one score slice: up to SCORE_Q side by side, each K vector
 * loaded once for all (2 * SCORE_Q accumulators). */
#if defined(__AVX512F__)
#define SCORE_Q 6
#else
#define SCORE_Q 4
#endif

/* o[j][0..AXPY_D) = sum_t a[j][t] * V[t][0..AXPY_D) for t in [t0, t1), for
 * nj (a constant) queries side by side, each V row (vs floats apart) loaded
 * once for all; the accumulators start at 0 (cont = 0) or at o[j] (cont = 1,
 * continuing a sum over [0, t0) stored there: a float stored and reloaded is
 * the same float). The dimensions are independent lanes, so AXPY_D changes
 * no bit; it and AXPY_Q keep the accumulators and the V row in registers. */
#if defined(__AVX512F__)
#define AXPY_Q 3    /* 3 queries x 4 accumulators of 16 floats + 4 V vectors: 16 of the 32 registers */
#define AXPY_D 64
#else
#define AXPY_Q 2    /* 2 queries x 4 accumulators of 8 floats + 4 V vectors: 12 of 16 (AVX2) */
#define AXPY_D 32
#endif
static inline __attribute__((always_inline)) void axpy_qd(const int nj, float *const *o, const float *const *a,
                                                           int t0, int t1, const uint16_t *vc, size_t vs, int cont) {
    vaf acc[AXPY_Q][AXPY_D / AW];
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < AXPY_D / AW; k++) {
            if (cont) memcpy(&acc[j][k], o[j] + AW * k, sizeof acc[j][k]);
            else acc[j][k] = (vaf){0};
        }
    for (int t = t0; t < t1; t++) {
        const uint16_t *vr = vc + (size_t)t * vs;
        vaf v[AXPY_D / AW];
        for (int k = 0; k < AXPY_D / AW; k++) {
            v[k] = ld_h(vr + AW * k);
            IN_REG(v[k]);
        }
        for (int j = 0; j < nj; j++) {
            float av = a[j][t];
            for (int k = 0; k < AXPY_D / AW; k++) acc[j][k] = fma_a(va_splat(av), v[k], acc[j][k]);
        }
    }
    /* element by element: with one copy of the whole array GCC kept the
     * accumulators in memory, stored back at every position */
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < AXPY_D / AW; k++) memcpy(o[j] + AW * k, &acc[j][k], sizeof acc[j][k]);
}

/* The same for any head size, one query, positions [0, n). */
static void axpy_row(float *o, const float *a, const uint16_t *vc, size_t vs, int n, int hd) {
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int t = 0; t < n; t++) {
        const uint16_t *vr = vc + (size_t)t * vs;
        for (int d = 0; d < hd; d++) o[d] = fmaf(a[t], es_fp16_to_fp32(vr[d]), o[d]);
    }
}

/* Scores of nj (a constant 1..SCORE_Q after inlining) queries q[j] against
 * the n positions (a multiple of 2 * AW) of the transposed keys kt ([hd][nc]):
 * sc[j * ld + t] = (sum_d q[j][d] * k[d][t]) * scale, two vectors of AW
 * positions at a time (2 * nj independent sums). */
static inline __attribute__((always_inline)) void scores_v(const int nj, const float *const *q, int hd,
                                                        const uint16_t *kt, size_t nc, int n, float scale,
                                                        float *sc, size_t ld) {
    for (int t = 0; t + 2 * AW <= n; t += 2 * AW) {
        vaf acc[SCORE_Q], acc2[SCORE_Q];
        for (int j = 0; j < nj; j++) acc[j] = acc2[j] = (vaf){0};
        for (int d = 0; d < hd; d++) {
            vaf kv = ld_h(kt + (size_t)d * nc + t), kv2 = ld_h(kt + (size_t)d * nc + t + AW);
            IN_REG(kv);
            IN_REG(kv2);
            for (int j = 0; j < nj; j++) {
                float qv = q[j][d];
                acc[j] = fma_a(va_splat(qv), kv, acc[j]);
                acc2[j] = fma_a(va_splat(qv), kv2, acc2[j]);
            }
        }
        for (int j = 0; j < nj; j++) {
            vaf sv = acc[j] * scale, sv2 = acc2[j] * scale;
            memcpy(sc + (size_t)j * ld + t, &sv, sizeof sv);
            memcpy(sc + (size_t)j * ld + t + AW, &sv2, sizeof sv2);
        }
    }
}

/* Sum of x[0..n) with lane j of 8 adding x[j], x[j + 8], ... in order, then
 * ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)): the same bits on every target. */
static inline float sum8(const float *x, int n) {
    v8f acc = {0, 0, 0, 0, 0, 0, 0, 0};
    int i = 0;
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

/* Floats of a block's (or a running) result: o [hd] padded to 16 floats, then m and l. */
int es_attn_part_floats(int hd) { return ((hd + 15) & ~15) + 16; }

/* One block of nq queries: qp[j] attends the block's first nv[j] >= 1
 * positions (nv ascending); kb [hd][B] and vb [B][hd] are the block in the
 * cache (F16, read as float32 in registers); the scores are computed for
 * its first ncols positions (a multiple of 2 * AW, >= nv[nq - 1]); sc
 * [nq][B] scratch. dst[j]: o_b, then m_b at [hdr], l_b at [hdr + 1]. A
 * score lane depends only on its query and position, so the scores of
 * positions past every nv (computed, then dropped) change no kept bit. */
static void block_partial(int nq, const float *const *qp, const int *nv, float *const *dst, int hd,
                          const uint16_t *kb, const uint16_t *vb, float *sc, int ncols) {
    float scale = 1.0f / sqrtf((float)hd);
    int hdr = es_attn_part_floats(hd) - 16;
    for (int k0 = 0; k0 < nq; k0 += SCORE_Q) {
        int nj = nq - k0 < SCORE_Q ? nq - k0 : SCORE_Q;
        float *sk = sc + (size_t)k0 * ES_KV_BLOCK;
        switch (nj) {
        case 1: scores_v(1, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
        case 2: scores_v(2, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
        case 3: scores_v(3, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
#if SCORE_Q > 4
        case 4: scores_v(4, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
        case 5: scores_v(5, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
#endif
        default: scores_v(SCORE_Q, qp + k0, hd, kb, ES_KV_BLOCK, ncols, scale, sk, ES_KV_BLOCK); break;
        }
    }
    const float *ap[ES_MAX_UNIT_Q];
    for (int j = 0; j < nq; j++) {
        float *row = sc + (size_t)j * ES_KV_BLOCK;
        float m = max_row(row, nv[j]);
        exp_sub_row(row, m, nv[j]);
        dst[j][hdr] = m;
        dst[j][hdr + 1] = sum8(row, nv[j]);
        ap[j] = row;
    }
    if (hd % AXPY_D != 0) {
        for (int j = 0; j < nq; j++) axpy_row(dst[j], ap[j], vb, (size_t)hd, nv[j], hd);
        return;
    }
    /* AXPY_D dimensions at a time; queries side by side over the positions
     * they all attend, then each query's own last positions */
    float *op[ES_MAX_UNIT_Q];
    for (int d0 = 0; d0 < hd; d0 += AXPY_D) {
        for (int j = 0; j < nq; j++) op[j] = dst[j] + d0;
        const uint16_t *vc = vb + d0;
        /* groups of AXPY_Q, the last one smaller (GQA groups of 2, as in
         * Qwen3, then read each V row once for both queries) */
        for (int k = 0; k < nq; k += AXPY_Q) {
            int nj = nq - k < AXPY_Q ? nq - k : AXPY_Q, lo = nv[k];
            switch (nj) {
            case 1: axpy_qd(1, op + k, ap + k, 0, lo, vc, (size_t)hd, 0); break;
#if AXPY_Q > 2
            case 2: axpy_qd(2, op + k, ap + k, 0, lo, vc, (size_t)hd, 0); break;
#endif
            default: axpy_qd(AXPY_Q, op + k, ap + k, 0, lo, vc, (size_t)hd, 0); break;
            }
            for (int j = k + 1; j < k + nj; j++)
                if (nv[j] > lo) axpy_qd(1, op + j, ap + j, lo, nv[j], vc, (size_t)hd, 1);
        }
    }
}

/* Fold block result p into the running result st (first: st = p). */
static void fold_part(float *st, const float *p, int hd, int first) {
    int hdr = es_attn_part_floats(hd) - 16;
    if (first) {
        memcpy(st, p, (size_t)(hdr + 2) * sizeof(float));
        return;
    }
    float M = st[hdr], m = p[hdr], M2 = m > M ? m : M;
    float a = exp_cephes(M - M2), c = exp_cephes(m - M2);
    st[hdr + 1] = st[hdr + 1] * a + p[hdr + 1] * c;
    for (int d = 0; d < hd; d++) st[d] = st[d] * a + p[d] * c;
    st[hdr] = M2;
}

static void finish_part(float *out, const float *st, int hd) {
    float inv = 1.0f / st[es_attn_part_floats(hd) - 16 + 1];
    for (int d = 0; d < hd; d++) out[d] = st[d] * inv;
}

/* A thread's attention scratch (ws_floats each): sc [q_cap][B],
 * st [q_cap][part], bp [q_cap][part]. */
size_t es_attn_ws_floats(int hd, int q_cap) {
    return (size_t)q_cap * ES_KV_BLOCK + 2 * (size_t)q_cap * es_attn_part_floats(hd);
}

/* Block (i, h, b)'s result in s->parts (key split). */
static float *part_at(const es_session *s, int i, int h, int32_t b) {
    const es_model_info *in = &s->model->info;
    return s->parts + (((size_t)i * in->n_head + (size_t)h) * (size_t)s->kv.n_blk + (size_t)b) * es_attn_part_floats(in->head_dim);
}

/* The queries of tokens [i0, i1) times heads [h0, h1) (of KV head g) over
 * blocks [b0, b1): key split (t->nch > 0) stores each block's result in
 * s->parts; query split (b0 = 0, all blocks) folds them and writes att. */
static void attend_unit(es_session *s, const attn_task *t, int g, int h0, int h1, int i0, int i1, int32_t b0,
                        int32_t b1, float *ws) {
    const es_model_info *in = &s->model->info;
    int hd = in->head_dim, pf = es_attn_part_floats(hd);
    size_t q_dim = (size_t)in->n_head * hd;
    int nh = h1 - h0, nq = (i1 - i0) * nh;
    float *sc = ws;
    float *st = sc + (size_t)s->q_cap * ES_KV_BLOCK, *bp = st + (size_t)s->q_cap * pf;
    const es_kv *kv = &t->seq->kv;
    const float *qp[ES_MAX_UNIT_Q];
    float *dst[ES_MAX_UNIT_Q];
    int32_t pos[ES_MAX_UNIT_Q];
    int nv[ES_MAX_UNIT_Q];
    for (int k = 0; k < nq; k++) {   /* queries by token, then head: positions ascend */
        int i = i0 + k / nh, h = h0 + k % nh;
        qp[k] = s->q + (size_t)(t->row0 + i) * q_dim + (size_t)h * hd;
        pos[k] = kv->n_past + i;
        if (!t->nch) dst[k] = bp + (size_t)k * pf;
    }
    for (int32_t b = b0; b < b1; b++) {
        int32_t p0 = b * ES_KV_BLOCK;
        int ka = 0;
        while (ka < nq && pos[ka] < p0) ka++;
        if (ka == nq) continue;
        for (int k = ka; k < nq; k++) {
            int32_t c = pos[k] + 1 - p0;
            nv[k] = c < ES_KV_BLOCK ? (int)c : ES_KV_BLOCK;
            if (t->nch) dst[k] = part_at(t->seq, i0 + k / nh, h0 + k % nh, b);
        }
        /* ask for the blocks up to KV_PF_AHEAD ahead (all of them at the
         * first): the hardware's streams stop at 4 KiB pages, a block is 8 */
        for (int32_t bp2 = b == b0 ? b : b + KV_PF_AHEAD; bp2 <= b + KV_PF_AHEAD && bp2 < b1; bp2++)
            es_kv_prefetch_block(kv, t->layer, g, bp2);
        /* the block's last positions no query attends (the cache's end) are not scored */
        int ncols = (nv[nq - 1] + 2 * AW - 1) / (2 * AW) * (2 * AW);
        block_partial(nq - ka, qp + ka, nv + ka, dst + ka, hd, es_kv_k_block(kv, t->layer, g, b),
                      es_kv_v_block(kv, t->layer, g, b), sc, ncols);
        if (!t->nch)
            for (int k = ka; k < nq; k++) fold_part(st + (size_t)k * pf, dst[k], hd, b == 0);
    }
    if (!t->nch)
        for (int k = 0; k < nq; k++)
            finish_part(s->att + (size_t)(t->row0 + i0 + k / nh) * q_dim + (size_t)(h0 + k % nh) * hd, st + (size_t)k * pf, hd);
}

/* Key split: fold the stored block results of t's tokens [0, n) times heads
 * [h0, h1), blocks in order, into att. st: es_attn_part_floats(hd) floats. */
static void fold_group(es_session *s, const attn_task *t, int h0, int h1, float *st) {
    const es_model_info *in = &s->model->info;
    int hd = in->head_dim;
    size_t q_dim = (size_t)in->n_head * hd;
    for (int i = 0; i < t->n; i++)
        for (int h = h0; h < h1; h++) {
            int32_t last = (t->seq->kv.n_past + i) / ES_KV_BLOCK;
            for (int32_t b = 0; b <= last; b++) fold_part(st, part_at(t->seq, i, h, b), hd, b == 0);
            finish_part(s->att + (size_t)(t->row0 + i) * q_dim + (size_t)h * hd, st, hd);
        }
}

/* t's att rows [i0, i1) quantized for W_o into mm_scratch. */
static void quantize_att_rows(es_session *s, const attn_task *t, int i0, int i1) {
    const es_model_info *in = &s->model->info;
    int64_t q_dim = (int64_t)in->n_head * in->head_dim;
    uint32_t wt = s->model->layers[t->layer].wo->type;
    for (int i = t->row0 + i0; i < t->row0 + i1; i++)
        es_quantize_row_act(wt, s->att + (size_t)i * (size_t)q_dim, q_dim, (uint8_t *)s->mm_scratch + (size_t)i * t->rs);
}

/* Work unit u of task t (the shape is chosen in attn_shape), with the
 * thread's scratch ws. */
static void attn_unit(const attn_task *t, int u, float *ws) {
    es_session *s = t->s;
    const es_model_info *in = &s->model->info;
    int grp = in->n_head / in->n_head_kv, groups = in->n_head_kv * t->split;
    int c = t->nch ? u % t->nch : 0, gp = t->nch ? u / t->nch : u % groups;
    int g = gp / t->split, part = gp % t->split;
    int h0 = g * grp + part * t->per;
    int h1 = h0 + t->per < (g + 1) * grp ? h0 + t->per : (g + 1) * grp;
    if (t->nch) {
        int32_t b0 = c * t->bpc, b1 = b0 + t->bpc < t->nblk ? b0 + t->bpc : t->nblk;
        if (h0 < h1) attend_unit(s, t, g, h0, h1, 0, t->n, b0, b1, ws);
        /* the unit that completes a head group's last chunk (acq_rel: it
         * sees the other chunks' results) folds them; the last group to be
         * folded quantizes the att rows for W_o, instead of a dispatch */
        if (atomic_fetch_add_explicit(&t->seq->grp_done[gp], 1, memory_order_acq_rel) == t->nch - 1) {
            if (h0 < h1) fold_group(s, t, h0, h1, ws);
            if (t->rs && atomic_fetch_add_explicit(&s->att_done[t->row0], 1, memory_order_acq_rel) == groups - 1)
                quantize_att_rows(s, t, 0, t->n);
        }
    } else {
        int sl = u / groups;
        int i0 = sl * t->ts, i1 = i0 + t->ts < t->n ? i0 + t->ts : t->n;
        if (h0 < h1 && i0 < i1)
            attend_unit(s, t, g, h0, h1, i0, i1, 0, (t->seq->kv.n_past + i1 - 1) / ES_KV_BLOCK + 1, ws);
        /* the last unit of a token slice (acq_rel: it sees the others' att
         * writes) quantizes the slice's rows for W_o */
        if (t->rs && atomic_fetch_add_explicit(&s->att_done[t->row0 + sl], 1, memory_order_acq_rel) == groups - 1)
            quantize_att_rows(s, t, i0, i1);
    }
}

/* The units of every session of the call, taken in turn from one counter (a
 * thread that was preempted on a busy host does fewer; the split changes no
 * bit). A thread's units ascend, so its task index only moves forward. */
static void attn_worker(void *ctx, int ith, int nth) {
    attn_batch *ab = ctx;
    float *ws = ab->s->att_ws + (size_t)ith * ab->s->ws_floats;
    (void)nth;
    int k = 0;
    for (int u; (u = atomic_fetch_add_explicit(&ab->next, 1, memory_order_relaxed)) < ab->end[ab->nt - 1];) {
        while (u >= ab->end[k]) k++;
        attn_unit(&ab->t[k], k ? u - ab->end[k - 1] : u, ws);
    }
}

/* The unit shape for n tokens. Heads of a KV group are split in two only
 * when the context is short (under about one block per unit; a split reads
 * K and V once per part) and more when a group exceeds ES_MAX_GROUP. Key
 * split (n <= KS_MAX_TOKENS): chunks of blocks, about KS_UNITS_PER_THREAD
 * units a thread. Query split: as many tokens per unit as keep about
 * ATT_Q_TARGET queries, in balanced slices, at least two units per thread
 * where the tokens allow. Also resets the counters the workers use.
 * Returns the number of units. */
static int attn_shape(const es_session *s, attn_task *t) {
    const es_model_info *in = &s->model->info;
    int nth = es_pool_size(s->pool), grp = in->n_head / in->n_head_kv, n = t->n, units_min = 2 * nth;
    int64_t span = (int64_t)t->seq->kv.n_past + n;
    int split = (in->n_head_kv * span < (int64_t)units_min * ES_KV_BLOCK && grp > 1) ? 2 : 1;
    while ((grp + split - 1) / split > s->group_cap) split++;
    int per = (grp + split - 1) / split, groups = in->n_head_kv * split;
    t->per = per;
    t->split = split;
    t->nblk = (int32_t)((span - 1) / ES_KV_BLOCK + 1);
    if (n <= KS_MAX_TOKENS) {
        int want = (KS_UNITS_PER_THREAD * nth + groups - 1) / groups;
        int nch = want < t->nblk ? want : t->nblk;
        t->bpc = (t->nblk + nch - 1) / nch;
        t->nch = (t->nblk + t->bpc - 1) / t->bpc;
        t->ts = n;
        t->nsl = 1;
        for (int i = 0; i < groups; i++) atomic_store_explicit(&t->seq->grp_done[i], 0, memory_order_relaxed);
        atomic_store_explicit(&s->att_done[t->row0], 0, memory_order_relaxed);
        return groups * t->nch;
    }
    int ts = ATT_Q_TARGET / per;
    ts = ts < 1 ? 1 : ts > n ? n : ts;
    int nsl = (n + ts - 1) / ts;
    while (nsl < n && nsl * groups < units_min) nsl++;
    ts = (n + nsl - 1) / nsl;
    t->nch = 0;
    t->ts = ts;
    t->nsl = (n + ts - 1) / ts;
    for (int i = 0; i < t->nsl; i++) atomic_store_explicit(&s->att_done[t->row0 + i], 0, memory_order_relaxed);
    return groups * t->nsl;
}

/* ---- the forward pass ---------------------------------------------------- */

/* One session's rows in a forward call (es_forward: one; es_forward_batch:
 * one per session that runs): its tokens are rows [row0, row0 + n) of the
 * call's scratch, and the output head reads its last head_n rows into head
 * rows [head0, head0 + head_n). */
typedef struct {
    es_session *seq;        /* its KV cache: positions seq->kv.n_past + (row - row0) */
    const int32_t *tokens;  /* [n] */
    int row0, n;
    int head0, head_n;
    int32_t *argmax_out;    /* [head_n] or NULL */
    float *logits_out;      /* per logits_mode (es_forward), over the head rows */
    int32_t logits_mode;
} fwd_seg;

/* The state of one forward call that passes from stage to stage. */
typedef struct {
    es_session *s;          /* its thread pool and scratch */
    int n;                  /* rows in the call: the tokens of every session */
    const fwd_seg *seg;     /* [nseg] in row order, covering rows [0, n) */
    int nseg;
    int pending_out;        /* x += out is still to be done (by the next norm, per token) */
} fwd_call;

/* RoPE (cos, sin) table of every row, at its session's position. */
static void fill_rope_table(const fwd_call *c) {
    es_session *s = c->s;
    const es_model_info *in = &s->model->info;
    int half = in->rope_dim / 2;
    for (int k = 0; k < c->nseg; k++) {
        const fwd_seg *g = &c->seg[k];
        for (int i = g->row0; i < g->row0 + g->n; i++) {
            double pos = (double)(g->seq->kv.n_past + (i - g->row0));
            for (int j = 0; j < half; j++) {
                double theta = pos * pow((double)in->rope_freq_base, -2.0 * j / (double)in->rope_dim);
                s->rope[(size_t)i * in->rope_dim + 2 * j] = (float)cos(theta);
                s->rope[(size_t)i * in->rope_dim + 2 * j + 1] = (float)sin(theta);
            }
        }
    }
}

/* The row that head row i reads: the last head_n rows of its session. */
static int head_row(const fwd_call *c, int i) {
    const fwd_seg *g = c->seg;
    while (i >= g->head0 + g->head_n) g++;
    return g->row0 + g->n - g->head_n + (i - g->head0);
}

/* ---- per-token row work, shared out by token when there are several ---- */

enum { ROWS_NORM_ATTN, ROWS_NORM_FFN, ROWS_NORM_OUT };

/* One run_rows dispatch. */
typedef struct {
    const fwd_call *c;
    int l, n, op;
    size_t q8_rs;           /* also quantize each row written into mm_scratch, rows this many bytes apart (0: no) */
    uint32_t q8_type;       /* for this weight type (es_quantize_row_act) */
    _Atomic int next;
} rows_task;

/* Row i of a step of layer l (each token's row reads and writes only its own
 * data, so the split changes no bit):
 *   ROWS_NORM_ATTN / ROWS_NORM_FFN  x[i] += out[i] when a residual is
 *       pending, then xb[i] = rmsnorm(x[i]) with the layer's norm
 *   ROWS_NORM_OUT  the same residual, then xb[i] = output_norm(x[head_row(i)])
 * With t->q8_rs set, the row written (xb[i]) is also quantized into
 * row i of mm_scratch for es_matmul_many_pre: in the same task, on the same
 * thread, instead of a dispatch of its own. */
static void token_row(const rows_task *t, int i) {
    es_session *s = t->c->s;
    int l = t->l, op = t->op;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    size_t e = (size_t)in->n_embd;
    const es_tensor *wt = op == ROWS_NORM_ATTN ? L->attn_norm : op == ROWS_NORM_FFN ? L->ffn_norm : m->output_norm;
    int row = op == ROWS_NORM_OUT ? head_row(t->c, i) : i;
    float *x = s->x + (size_t)row * e;
    if (t->c->pending_out) {
        const float *o = s->out + (size_t)row * e;
        for (size_t k = 0; k < e; k++) x[k] += o[k];
    }
    rmsnorm(s->xb + (size_t)i * e, x, es_model_vec(m, wt), in->n_embd, in->norm_eps);
    if (t->q8_rs)
        es_quantize_row_act(t->q8_type, s->xb + (size_t)i * e, in->n_embd, (uint8_t *)s->mm_scratch + (size_t)i * t->q8_rs);
}

/* The q/k/v matmul's epilogue (es_matmul_many_epi, chunks of whole heads),
 * for rows [r0, r1) of matrix mat (0 q, 1 k, 2 v) of every token i, by the
 * thread that computed them: the bias, the head's RMSNorm (qwen3, q and k),
 * RoPE at the row's position (q and k); k and v then go to its session's KV
 * cache (rounded to F16 there). The same operations per element as one
 * token's row at a time. */
/* What an epilogue of a step's matmul needs: the session, the layer, the
 * tokens of the step and (glu_epi) the bytes of a quantized row. */
typedef struct {
    es_session *s;
    int l, n;
    size_t rs;
    const fwd_call *c;      /* qkv_epi: the sessions of the rows */
} epi_task;

static void qkv_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    es_session *s = t->s;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[t->l];
    int hd = in->head_dim;
    size_t q_dim = (size_t)in->n_head * hd, kv_dim = (size_t)in->n_head_kv * hd;
    size_t dim = mat == 0 ? q_dim : kv_dim;
    float *base = mat == 0 ? s->q : mat == 1 ? s->k : s->v;
    const es_tensor *bt = mat == 0 ? L->bq : mat == 1 ? L->bk : L->bv;
    const es_tensor *nt = mat == 0 ? L->q_norm : mat == 1 ? L->k_norm : NULL;
    const float *b = bt ? es_model_vec(m, bt) : NULL, *hn = nt ? es_model_vec(m, nt) : NULL;
    const fwd_seg *g = t->c->seg;
    for (int i = 0; i < t->n; i++) {
        while (i >= g->row0 + g->n) g++;
        es_kv *kv = &g->seq->kv;
        float *y = base + (size_t)i * dim;
        if (b)
            for (int64_t r = r0; r < r1; r++) y[r] += b[r];
        if (mat < 2) {
            const float *cs = s->rope + (size_t)i * in->rope_dim;
            for (int64_t h = r0 / hd; h < (r1 + hd - 1) / hd; h++) {
                float *yh = y + (size_t)h * hd;
                if (hn) rmsnorm(yh, yh, hn, hd, in->norm_eps);
                rope_head(yh, cs, in->rope_dim, in->rope_neox);
            }
        }
        if (mat == 1) es_kv_put_k(kv, t->l, kv->n_past + (i - g->row0), r0, r1, y);
        else if (mat == 2) es_kv_put_v(kv, t->l, kv->n_past + (i - g->row0), r0, r1, y);
    }
}

static void rows_worker(void *ctx, int ith, int nth) {
    rows_task *t = ctx;
    for (int i; (i = atomic_fetch_add_explicit(&t->next, 1, memory_order_relaxed)) < t->n;) token_row(t, i);
}

/* token_row for i in [0, n) (rows quantized for weight type q8_type, q8_rs
 * bytes apart, 0: not): on the calling thread for one token, on the pool for
 * several. Clears the pending residual after a norm. */
static void run_rows(fwd_call *c, int l, int n, int op, size_t q8_rs, uint32_t q8_type) {
    rows_task t = {.c = c, .l = l, .n = n, .op = op, .q8_rs = q8_rs, .q8_type = q8_type};
    if (n > 1) es_pool_run(c->s->pool, rows_worker, &t);
    else rows_worker(&t, 0, 1);
    c->pending_out = 0;
}

/* Bytes of a quantized row of n_in for the matrices w[0..nw) when the rows
 * of a step (n > 1, run on the pool) are to be quantized by run_rows, and in
 * *type the weight type whose activation format they take; 0 when one token
 * (run on the calling thread, nothing to save), all float, or the quantized
 * matrices need both formats (32-element and K-type activations: the matmul
 * then quantizes per format). */
static size_t pre_q8_rs(int n, int nw, const es_tensor *const *w, uint32_t *type) {
    size_t rs = 0;
    for (int i = 0; i < nw && n >= 2; i++) {
        size_t r = es_matmul_q8_row_bytes(w[i]->type, w[i]->ne[0]);
        if (r == 0) continue;
        if (rs && es_act_block_elems(w[i]->type) != es_act_block_elems(*type)) return 0;
        rs = r;
        *type = w[i]->type;
    }
    return rs;
}


/* Attention sublayer of one block: x += Wo . attn(norm(x)). */
static void attention_block(fwd_call *c, int l) {
    es_session *s = c->s;
    int n = c->n;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    int hd = in->head_dim, q_dim = in->n_head * hd, kv_dim = in->n_head_kv * hd;
    const es_tensor *wqkv[3] = {L->wq, L->wk, L->wv};
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(n, 3, wqkv, &qt8);
    run_rows(c, l, n, ROWS_NORM_ATTN, rs, qt8);
    /* Ask for this layer's cached K and V rows now: they arrive in cache while
     * the q/k/v matmul streams its weights, instead of one memory latency at
     * a time in the attention (the weight stream of the last step pushed
     * them out of every cache). */
    for (int k = 0; k < c->nseg; k++) {
        const es_kv *kv = &c->seg[k].seq->kv;
        int32_t used = (kv->n_past + ES_KV_BLOCK - 1) / ES_KV_BLOCK;
        if ((size_t)used * ES_KV_BLOCK * (size_t)kv_dim * sizeof(uint16_t) <= EARLY_KV_PREFETCH)
            es_kv_prefetch(kv, l, used);   /* longer contexts: sequential streams, left to the hardware */
    }
    /* q [n][q_dim], k [n][kv_dim], v [n][kv_dim] in one dispatch */
    float *yqkv[3] = {s->q, s->k, s->v};
    int64_t ldqkv[3] = {q_dim, kv_dim, kv_dim};
    /* biases, q/k norms, RoPE, and k and v into the caches in the epilogue */
    epi_task qt = {s, l, n, 0, c};
    es_mm_epi epi = {.fn = qkv_epi, .ctx = &qt, .joint = 0, .gran = hd};
    es_matmul_many_epi(s->pool, 3, wqkv, s->xb, n, yqkv, ldqkv, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wo[1] = {L->wo};
    float *yo[1] = {s->out};
    int64_t ldo[1] = {in->n_embd};
    /* each session's attention over its own KV cache, all in one dispatch */
    size_t wo_rs = es_matmul_q8_row_bytes(L->wo->type, L->wo->ne[0]);
    attn_task at[ES_MAX_BATCH];
    attn_batch ab = {.s = s, .t = at, .nt = c->nseg};
    for (int k = 0; k < c->nseg; k++) {
        const fwd_seg *g = &c->seg[k];
        at[k] = (attn_task){.s = s, .seq = g->seq, .row0 = g->row0, .layer = l, .n = g->n, .rs = wo_rs};
        ab.end[k] = (k ? ab.end[k - 1] : 0) + attn_shape(s, &at[k]);
    }
    atomic_store_explicit(&ab.next, 0, memory_order_relaxed);
    es_pool_run(s->pool, attn_worker, &ab);
    if (wo_rs) es_matmul_many_pre(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    else es_matmul_many(s->pool, 1, wo, s->att, n, yo, ldo, s->mm_scratch);
    c->pending_out = 1;            /* x += out: done by the next norm, per token */
}

/* The epilogue of the gate/up matmul (es_matmul_many_epi), for the
 * columns [r0, r1) of every token's row, by the thread that computed them:
 * gate = silu(gate) * up, then its blocks quantized for W_down into glu_q8
 * when W_down is quantized (rs bytes a row). */
static void glu_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t n_ff = s->model->info.n_ff;
    for (int i = 0; i < t->n; i++) {
        float *g = s->gate + (size_t)i * (size_t)n_ff;
        swiglu_row(g + r0, s->up + (size_t)i * (size_t)n_ff + r0, (size_t)(r1 - r0));
        if (t->rs)
            es_quantize_cols_act(s->model->layers[t->l].w_down->type, g, n_ff, r0, r1,
                                 (uint8_t *)s->glu_q8 + (size_t)i * t->rs);
    }
}

/* FFN sublayer: x += W_down . (silu(W_gate . norm(x)) * (W_up . norm(x))). */
static void ffn_block(fwd_call *c, int l) {
    es_session *s = c->s;
    int n = c->n;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    const es_layer *L = &m->layers[l];
    const es_tensor *wgu[2] = {L->w_gate, L->w_up};              /* gate, up [n][n_ff] */
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(n, 2, wgu, &qt8);
    run_rows(c, l, n, ROWS_NORM_FFN, rs, qt8);
    float *ygu[2] = {s->gate, s->up};
    int64_t ldgu[2] = {in->n_ff, in->n_ff};
    /* SwiGLU and its quantization for W_down in the matmul's epilogue, by
     * the thread that computed those columns, while they are in its cache;
     * chunks of whole activation blocks of W_down's format (K types: 256) */
    epi_task g = {s, l, n, es_matmul_q8_row_bytes(L->w_down->type, in->n_ff), c};
    int64_t gran = es_act_block_elems(L->w_down->type) > ES_EPI_ROWS ? es_act_block_elems(L->w_down->type) : ES_EPI_ROWS;
    es_mm_epi epi = {.fn = glu_epi, .ctx = &g, .joint = 1, .gran = g.rs ? gran : ES_EPI_ROWS};
    es_matmul_many_epi(s->pool, 2, wgu, s->xb, n, ygu, ldgu, s->mm_scratch, rs != 0, &epi);
    const es_tensor *wd[1] = {L->w_down};
    int64_t ldd[1] = {in->n_embd};
    float *yd[1] = {s->out};
    if (g.rs) es_matmul_many_pre(s->pool, 1, wd, s->gate, n, yd, ldd, s->glu_q8);
    else es_matmul_many(s->pool, 1, wd, s->gate, n, yd, ldd, s->mm_scratch);
    c->pending_out = 1;
}

/* Output-matmul epilogue, local form (es_mm_epi.local_fn): for logits
 * columns [r0, r1) of every head row i, at y[i * ldl + (r - r0)], the value
 * and index of the first largest non-NaN logit in slot r0 / ES_EPI_ROWS:
 * index -1 when all are NaN, and in the chunk at r0 = 0 when the row's
 * first logit is NaN (argmax_row's result is then 0 whatever follows). */
static void am_local(void *ctx, int mat, int64_t r0, int64_t r1, const float *y, int64_t ldl) {
    const epi_task *t = ctx;
    (void)mat;
    es_session *s = t->s;
    int64_t len = r1 - r0;
    for (int i = 0; i < t->n; i++) {
        const float *row = y + (size_t)i * (size_t)ldl;   /* logit r at row[r - r0] */
        size_t slot = (size_t)i * (size_t)s->am_slots + (size_t)(r0 / ES_EPI_ROWS);
        int64_t k = 0;
        if (r0 != 0 || row[0] == row[0])
            while (k < len && row[k] != row[k]) k++;   /* argmax_row needs a first value that is not NaN */
        else
            k = len;
        int32_t idx = k < len ? (int32_t)(k + argmax_row(row + k, (int)(len - k))) : -1;
        s->am_idx[slot] = idx < 0 ? -1 : (int32_t)r0 + idx;
        s->am_val[slot] = idx >= 0 ? row[idx] : 0.0f;
    }
}

/* The same over the logits written to s->logits (es_mm_epi.fn). */
static void am_epi(void *ctx, int mat, int64_t r0, int64_t r1) {
    const epi_task *t = ctx;
    const es_session *s = t->s;
    am_local(ctx, mat, r0, r1, s->logits + r0, s->model->info.n_vocab);
}

/* argmax_row of logits row i from the chunks' results: 0 when the first
 * logit is NaN (the first chunk's index -1), else the first index of the
 * largest non-NaN logit (chunks in order, a later chunk only when strictly
 * larger). */
static int32_t am_combine(const es_session *s, int i) {
    if (s->am_idx[(size_t)i * (size_t)s->am_slots] == -1) return 0;
    int32_t best = -1;
    float bv = 0.0f;
    for (int32_t c = 0; c < s->am_slots; c++) {
        size_t slot = (size_t)i * (size_t)s->am_slots + (size_t)c;
        int32_t idx = s->am_idx[slot];
        if (idx < 0) continue;
        if (best < 0 || s->am_val[slot] > bv) {
            best = idx;
            bv = s->am_val[slot];
        }
    }
    return best < 0 ? 0 : best;
}

static es_status check_forward_args(es_session *s, const int32_t *tokens, int32_t n,
                                    float *logits_out, int32_t mode) {
    const es_model_info *in = &s->model->info;
    if (!tokens || n <= 0) {
        es_set_err(s->err, sizeof s->err, "forward needs n_tokens >= 1 (got %d)", (int)n);
        return ES_ERR_INVALID_ARG;
    }
    if (mode < 0 || mode > 2 || (mode != 0 && !logits_out)) {
        es_set_err(s->err, sizeof s->err, "logits_mode %d invalid or logits_out NULL", (int)mode);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] >= in->n_vocab) {
            es_set_err(s->err, sizeof s->err, "token %d at index %d outside the vocabulary [0, %d)",
                       (int)tokens[i], (int)i, (int)in->n_vocab);
            return ES_ERR_INVALID_ARG;
        }
    }
    if ((int64_t)s->kv.n_past + n > s->kv.n_ctx) {
        es_set_err(s->err, sizeof s->err, "KV cache full: n_past %d + %d tokens > n_ctx %d",
                   (int)s->kv.n_past, (int)n, (int)s->kv.n_ctx);
        return ES_ERR_CAPACITY;
    }
    return ES_OK;
}

/* The output head over the call's out_rows head rows (head_row): the pending
 * residual and the output norm (run_rows ROWS_NORM_OUT, which quantizes
 * the rows for the head), then logits [out_rows][n_vocab] = W_out . xb in
 * one matmul over all the head rows (a verify's K + 1 rows read each weight
 * group once), whose epilogue takes the argmax of each chunk of logits on
 * the thread that computed it (am_combine then picks the first largest).
 * When no session wants logits (want_logits 0), the chunks go to the
 * thread's buffer in s->head_tmp instead of s->logits (am_local): no logits
 * row is written. */
static void output_head(fwd_call *c, int out_rows, int want_logits) {
    es_session *s = c->s;
    const es_model *m = s->model;
    const es_tensor *wout[1] = {m->output};
    float *ylog[1] = {s->logits};
    int64_t ldlog[1] = {m->info.n_vocab};
    uint32_t qt8 = 0;
    size_t rs = pre_q8_rs(out_rows, 1, wout, &qt8);
    run_rows(c, 0, out_rows, ROWS_NORM_OUT, rs, qt8);
    memset(s->am_idx, 0xFE, (size_t)out_rows * (size_t)s->am_slots * sizeof(int32_t));
    epi_task at = {s, 0, out_rows, 0, c};
    es_mm_epi epi = {.fn = am_epi, .ctx = &at, .joint = 1, .gran = ES_EPI_ROWS};
    if (!want_logits)
        epi = (es_mm_epi){.ctx = &at, .gran = ES_EPI_ROWS, .local_fn = am_local, .local = s->head_tmp,
                          .local_floats = s->head_tmp_floats};
    es_matmul_many_epi(s->pool, 1, wout, s->xb, out_rows, ylog, ldlog, s->mm_scratch, rs != 0, &epi);
}

/*
 * The forward pass over the rows of the sessions seg[0..nseg) (in row order,
 * covering [0, n) with n their total tokens; the output head runs on each
 * one's last head_n rows), on the pool and scratch of s. Arguments are
 * checked by the callers; on failure every KV cache is unchanged.
 *
 * Stages, and which function or matmul epilogue does each (an epilogue runs
 * on the thread that computed those matmul columns, while they are in its
 * cache, instead of a dispatch of its own). Every matmul runs over the rows
 * of all the sessions; RoPE, the KV append and the attention use each row's
 * own session:
 *   embedding      x[i] = tok_embd[tokens[i]]; the RoPE table of the positions
 *   per layer:
 *     norm         run_rows ROWS_NORM_ATTN: x += out (the last sublayer's
 *                  output, pending), xb = rmsnorm(x), quantized for Wq/Wk/Wv
 *     q, k, v      one matmul over Wq, Wk, Wv; epilogue qkv_epi: biases, q/k
 *                  norms (qwen3), RoPE, k and v appended to the KV cache
 *     attention    attn_worker (online softmax over KV blocks, each session
 *                  over its own); the unit that completes a token slice
 *                  quantizes its rows for W_o
 *     output proj. out = W_o . att (added to x by the next norm)
 *     FFN          run_rows ROWS_NORM_FFN (x += out, norm); a matmul over
 *                  W_gate, W_up with epilogue glu_epi (SwiGLU, quantized for
 *                  W_down); out = W_down . glu
 *   head           output_head: x += out, output norm, logits with epilogue
 *                  am_epi (argmax per chunk; am_local on per-thread chunks
 *                  when no logits are wanted)
 *   results        per session: argmax and logits of its head rows, n_past
 */
static es_status forward_impl(es_session *s, const fwd_seg *seg, int nseg) {
    int n = seg[nseg - 1].row0 + seg[nseg - 1].n, out_rows = seg[nseg - 1].head0 + seg[nseg - 1].head_n;
    es_status st;
    if ((st = es_session_ensure_scratch(s, n)) != ES_OK) return st;
    const es_model *m = s->model;
    const es_model_info *in = &m->info;
    fwd_call c = {.s = s, .n = n, .seg = seg, .nseg = nseg};

    for (int k = 0; k < nseg; k++)   /* embedding */
        for (int i = 0; i < seg[k].n; i++) {
            const uint8_t *row = (const uint8_t *)m->tok_embd->data + (size_t)seg[k].tokens[i] * m->tok_embd->row_bytes;
            es_dequantize_row(m->tok_embd->type, row, s->x + (size_t)(seg[k].row0 + i) * in->n_embd, in->n_embd);
        }
    fill_rope_table(&c);
    es_pool_begin(s->pool);
    for (int l = 0; l < in->n_layer; l++) {
        attention_block(&c, l);     /* norm, q/k/v + RoPE + KV append, attention, output projection */
        ffn_block(&c, l);           /* norm, gate/up + SwiGLU, down projection */
    }
    int want_logits = 0;
    for (int k = 0; k < nseg; k++) want_logits |= seg[k].logits_mode != 0;
    output_head(&c, out_rows, want_logits);
    es_pool_end(s->pool);

    for (int k = 0; k < nseg; k++) {
        const fwd_seg *g = &seg[k];
        if (g->argmax_out)
            for (int i = 0; i < g->head_n; i++) g->argmax_out[i] = am_combine(s, g->head0 + i);
        if (g->logits_mode == 1)
            memcpy(g->logits_out, s->logits + (size_t)(g->head0 + g->head_n - 1) * in->n_vocab,
                   (size_t)in->n_vocab * sizeof(float));
        else if (g->logits_mode == 2)
            memcpy(g->logits_out, s->logits + (size_t)g->head0 * in->n_vocab,
                   (size_t)g->head_n * in->n_vocab * sizeof(float));
        g->seq->kv.n_past += g->n;
        g->seq->err[0] = '\0';
    }
    return ES_OK;
}

es_status es_forward(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_out,
                     float *logits_out, int32_t logits_mode) {
    if (!s) return ES_ERR_INVALID_ARG;
    es_status st = check_forward_args(s, tokens, n, logits_out, logits_mode);
    if (st != ES_OK) return st;
    fwd_seg g = {s, tokens, 0, n, 0, n, argmax_out, logits_out, logits_mode};
    return forward_impl(s, &g, 1);
}

es_status es_forward_last(es_session *s, const int32_t *tokens, int32_t n, int32_t *argmax_last,
                          float *logits_last) {
    if (!s) return ES_ERR_INVALID_ARG;
    int32_t mode = logits_last ? 1 : 0;
    es_status st = check_forward_args(s, tokens, n, logits_last, mode);
    if (st != ES_OK) return st;
    fwd_seg g = {s, tokens, 0, n, 0, 1, argmax_last, logits_last, mode};
    return forward_impl(s, &g, 1);
}

/* Item i's own checks (es_forward_batch's contract), with m the batch's model;
 * the message goes on its session. */
static es_status check_batch_item(const es_batch_item *items, int32_t n_items, int32_t i, const es_model *m) {
    const es_batch_item *it = &items[i];
    es_session *q = it->session;
    if (!q) return ES_ERR_INVALID_ARG;
    if (q->model != m) {
        es_set_err(q->err, sizeof q->err, "batch item %d: its session is on another model than the batch's",
                   (int)i);
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t j = 0; j < n_items; j++)
        if (j != i && items[j].session == q) {
            es_set_err(q->err, sizeof q->err, "batch items %d and %d have the same session", (int)i, (int)j);
            return ES_ERR_INVALID_ARG;
        }
    if (it->head != ES_HEAD_ALL && it->head != ES_HEAD_LAST) {
        es_set_err(q->err, sizeof q->err, "batch item %d: head %d is not ES_HEAD_ALL or ES_HEAD_LAST",
                   (int)i, (int)it->head);
        return ES_ERR_INVALID_ARG;
    }
    return check_forward_args(q, it->tokens, it->n_tokens, it->logits_out, it->logits_mode);
}

es_status es_forward_batch(es_batch_item *items, int32_t n_items) {
    if (!items || n_items < 1 || n_items > ES_MAX_BATCH) return ES_ERR_INVALID_ARG;
    const es_model *m = NULL;
    for (int32_t i = 0; i < n_items && !m; i++)
        if (items[i].session) m = items[i].session->model;
    fwd_seg seg[ES_MAX_BATCH];
    int nseg = 0, rows = 0, heads = 0;
    for (int32_t i = 0; i < n_items; i++) {
        es_batch_item *it = &items[i];
        it->status = check_batch_item(items, n_items, i, m);
        if (it->status != ES_OK) continue;
        int head_n = it->head == ES_HEAD_LAST ? 1 : it->n_tokens;
        seg[nseg++] = (fwd_seg){it->session, it->tokens, rows, it->n_tokens, heads, head_n,
                                it->argmax_out, it->logits_out, it->logits_mode};
        rows += it->n_tokens;
        heads += head_n;
    }
    if (nseg > 0) {
        es_session *run = seg[0].seq;
        es_status st = forward_impl(run, seg, nseg);
        if (st != ES_OK)   /* the scratch: nothing ran */
            for (int32_t i = 0; i < n_items; i++)
                if (items[i].status == ES_OK) {
                    items[i].status = st;
                    if (items[i].session != run) es_set_err(items[i].session->err, sizeof items[i].session->err, "%s", run->err);
                }
    }
    for (int32_t i = 0; i < n_items; i++)
        if (items[i].status != ES_OK) return items[i].status;
    return ES_OK;
}

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec * 1e-6;
}

/* Item i's own checks (es_decode_batch's contract); the message goes on its session. */
static es_status check_decode_item(const es_decode_item *items, int32_t n_items, int32_t i) {
    const es_decode_item *it = &items[i];
    es_session *q = it->session;
    if (!q) return ES_ERR_INVALID_ARG;
    if (!it->tokens_out || it->max_steps < 1 || it->n_stop < 0 || (it->n_stop > 0 && !it->stop_ids)) {
        es_set_err(q->err, sizeof q->err, "decode needs max_steps >= 1 (got %d), n_stop >= 0 (got %d)%s",
                   (int)it->max_steps, (int)it->n_stop,
                   !it->tokens_out ? " and tokens_out" : it->n_stop > 0 && !it->stop_ids ? " and stop_ids" : "");
        return ES_ERR_INVALID_ARG;
    }
    for (int32_t j = 0; j < i; j++)
        if (items[j].session == q) {
            es_set_err(q->err, sizeof q->err, "decode items %d and %d have the same session", (int)j, (int)i);
            return ES_ERR_INVALID_ARG;
        }
    es_status st = check_forward_args(q, &it->token, 1, NULL, 0);
    if (st != ES_OK) return st;
    if ((int64_t)q->kv.n_past + it->max_steps > q->kv.n_ctx) {   /* the whole run's room up front */
        es_set_err(q->err, sizeof q->err, "KV cache full: n_past %d + %d decode steps > n_ctx %d",
                   (int)q->kv.n_past, (int)it->max_steps, (int)q->kv.n_ctx);
        return ES_ERR_CAPACITY;
    }
    return ES_OK;
}

es_status es_decode_batch(es_decode_item *items, int32_t n_items, const int32_t *interrupt, float *ms_out,
                          int32_t *n_steps) {
    if (n_steps) *n_steps = 0;
    if (!items || n_items < 1 || n_items > ES_MAX_BATCH) return ES_ERR_INVALID_ARG;
    int32_t cur[ES_MAX_BATCH], live[ES_MAX_BATCH], n_live = 0;
    for (int32_t i = 0; i < n_items; i++) {
        items[i].n_out = 0;
        items[i].status = check_decode_item(items, n_items, i);
        if (items[i].status == ES_OK) {
            cur[i] = items[i].token;
            live[n_live++] = i;
        }
    }
    es_batch_item b[ES_MAX_BATCH];
    for (int32_t step = 0; n_live > 0; step++) {
        for (int32_t k = 0; k < n_live; k++) {
            es_decode_item *it = &items[live[k]];
            b[k] = (es_batch_item){.session = it->session, .tokens = &cur[live[k]], .n_tokens = 1,
                                   .head = ES_HEAD_ALL, .argmax_out = &it->tokens_out[step]};
        }
        double t0 = ms_out ? now_ms() : 0.0;
        es_forward_batch(b, n_live);
        if (ms_out) ms_out[step] = (float)(now_ms() - t0);
        if (n_steps) *n_steps = step + 1;
        int32_t kept = 0;
        for (int32_t k = 0; k < n_live; k++) {
            int32_t i = live[k];
            es_decode_item *it = &items[i];
            if (b[k].status != ES_OK) {   /* its KV cache as after its last step done */
                it->status = b[k].status;
                continue;
            }
            it->n_out = step + 1;
            cur[i] = it->tokens_out[step];
            int stop = it->n_out == it->max_steps;
            for (int32_t j = 0; j < it->n_stop && !stop; j++) stop = it->stop_ids[j] == cur[i];
            if (!stop) live[kept++] = i;
        }
        n_live = kept;
        if (interrupt && __atomic_load_n(interrupt, __ATOMIC_ACQUIRE)) break;
    }
    for (int32_t i = 0; i < n_items; i++)
        if (items[i].status != ES_OK) return items[i].status;
    return ES_OK;
}

es_status es_decode(es_session *s, int32_t token, int32_t max_steps, const int32_t *stop_ids, int32_t n_stop,
                    const int32_t *interrupt, int32_t *tokens_out, float *ms_out, int32_t *n_out) {
    if (!s) return ES_ERR_INVALID_ARG;
    if (n_out) *n_out = 0;
    if (!n_out) {
        es_set_err(s->err, sizeof s->err, "decode needs n_out");
        return ES_ERR_INVALID_ARG;
    }
    es_decode_item it = {s, token, max_steps, stop_ids, n_stop, tokens_out, 0, ES_OK};
    es_status st = es_decode_batch(&it, 1, interrupt, ms_out, NULL);
    *n_out = it.n_out;
    return st;
}

const char *es_simd_name(void) { return es_quant_simd_name(); }
