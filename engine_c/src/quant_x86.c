/*
 * quant_x86.c - AVX-512 (VNNI) and AVX2 matmul kernels for x86-64. Same
 * contract and results (bitwise) as the scalar kernels in quant.c.
 *
 * Sequential types (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) run on packed
 * weights, 16 rows in the lanes (see "packed kernels" in each path).
 * Lane types (Q5_0, Q5_1): a weight row is processed 16 blocks (one
 * es_q8_group of activations) at a time. The 16 blocks are loaded and
 * transposed once into 8 vectors of unsigned bytes, vector k holding
 * elements 4k..4k+3 of block j in 32-bit lane j, which is the layout of the
 * activation group, so 8 vpdpbusd give the 16 exact int32 block sums I at
 * once, for each of the N activation rows, and the float steps of the
 * contract run on 16 lanes that are the 16 accumulator lanes. Signed
 * weights are offset to unsigned (Q5_0: wq + 16, the raw 5-bit value) and
 * the offset times the activation block sum is subtracted again in int32
 * (exact).
 */
#include "quant.h"

#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define ES_X86_AVX512 1
#elif !defined(ES_FORCE_SCALAR) && defined(__AVX2__) && defined(__F16C__)
#define ES_X86_AVX2 1
#endif

#ifdef ES_X86_AVX512
#include <immintrin.h>
#include <string.h>

#define NT 32   /* activation rows per pass */
#define ES_AI __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* One group of 16 weight blocks, unpacked. */
typedef struct {
    __m512i w[8];   /* unsigned bytes, layout of es_q8_group.qs */
    __m512 a, b;    /* per-block float factors (b: two-term types) */
} wgroup;

/* The fixed 16-lane tree (es_lane_sum in quant.h). */
static inline ES_AI float lane_sum16(__m512 v) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    return _mm512_cvtss_f32(v);
}

static inline ES_AI __m128i ld128(const uint8_t *p, int j, int nv, size_t stride) {
    return j < nv ? _mm_loadu_si128((const __m128i *)(const void *)(p + (size_t)j * stride))
                  : _mm_setzero_si128();
}

/* 16 bytes at p + j * stride for j = 0..15 (zero for j >= nv), transposed:
 * out[k] lane j = dword k of block j. */
static inline ES_AI void load_t16(const uint8_t *p, size_t stride, int nv, __m512i out[4]) {
    __m512i z[4];
    UNROLL
    for (int i = 0; i < 4; i++) {
        __m512i v = _mm512_castsi128_si512(ld128(p, i, nv, stride));
        v = _mm512_inserti32x4(v, ld128(p, i + 4, nv, stride), 1);
        v = _mm512_inserti32x4(v, ld128(p, i + 8, nv, stride), 2);
        z[i] = _mm512_inserti32x4(v, ld128(p, i + 12, nv, stride), 3);
    }
    __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The 32-bit word at p + j * stride for j < nv (0 otherwise). */
static inline ES_AI __m512i gather32(const uint8_t *p, size_t stride, int nv) {
    uint32_t v[16];
    UNROLL
    for (int j = 0; j < 16; j++) {
        v[j] = 0;
        if (j < nv) memcpy(&v[j], p + (size_t)j * stride, 4);
    }
    return _mm512_loadu_si512(v);
}

static inline ES_AI __m512 half_lo(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
static inline ES_AI __m512 half_hi(__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))); }

static inline ES_AI void nibbles(const __m512i d[4], __m512i w[8]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    UNROLL
    for (int k = 0; k < 4; k++) {
        w[k] = _mm512_and_si512(d[k], m4);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(d[k], 4), m4);
    }
}

/* The 5th bits of Q5_0 / Q5_1: qh holds bit i for element i of each block
 * (32-bit lane j = block j); chunk k gets bits 4k..4k+3, one per byte, as
 * bit 4. (t * 0x00204081 puts bit e of a 4-bit t at bit 8e, without carries.) */
static inline ES_AI __m512i q5_hi(__m512i qh, int k) {
    __m512i t = _mm512_and_si512(_mm512_srli_epi32(qh, (unsigned)(4 * k)), _mm512_set1_epi32(0xF));
    t = _mm512_and_si512(_mm512_mullo_epi32(t, _mm512_set1_epi32(0x00204081)), _mm512_set1_epi32(0x01010101));
    return _mm512_slli_epi32(t, 4);
}

static inline ES_AI void unpack_q5_0(const uint8_t *p, int nv, wgroup *g) {
    __m512i d[4];
    load_t16(p + 6, 22, nv, d);
    nibbles(d, g->w);
    __m512i qh = gather32(p + 2, 22, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm512_or_si512(g->w[k], q5_hi(qh, k));
    g->a = half_lo(_mm512_and_si512(gather32(p, 22, nv), _mm512_set1_epi32(0xFFFF)));
}

static inline ES_AI void unpack_q5_1(const uint8_t *p, int nv, wgroup *g) {
    __m512i d[4];
    load_t16(p + 8, 24, nv, d);
    nibbles(d, g->w);
    __m512i qh = gather32(p + 4, 24, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm512_or_si512(g->w[k], q5_hi(qh, k));
    __m512i dm = gather32(p, 24, nv);
    g->a = half_lo(dm);
    g->b = half_hi(dm);
}

/* Multiply one unpacked weight group into activation rows [0, nt).
 * off: the unsigned offset of the weights (I -= off * qsum), two: two-term
 * type (c += (b * d) * (float)qsum). */
static inline ES_AI void group_rows(const wgroup *g, const uint8_t *x, size_t x_stride, int nt,
                              __m512 *acc, int off_shift, int two) {
    UNROLL
    for (int n = 0; n < nt; n++) {
        const es_q8_group *xg = (const void *)(x + (size_t)n * x_stride);
        const __m512i *xq = (const __m512i *)(const void *)xg->qs;
        __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g->w[0], _mm512_load_si512(xq + 0));
        __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), g->w[1], _mm512_load_si512(xq + 1));
        i0 = _mm512_dpbusd_epi32(i0, g->w[2], _mm512_load_si512(xq + 2));
        i1 = _mm512_dpbusd_epi32(i1, g->w[3], _mm512_load_si512(xq + 3));
        i0 = _mm512_dpbusd_epi32(i0, g->w[4], _mm512_load_si512(xq + 4));
        i1 = _mm512_dpbusd_epi32(i1, g->w[5], _mm512_load_si512(xq + 5));
        i0 = _mm512_dpbusd_epi32(i0, g->w[6], _mm512_load_si512(xq + 6));
        i1 = _mm512_dpbusd_epi32(i1, g->w[7], _mm512_load_si512(xq + 7));
        __m512i I = _mm512_add_epi32(i0, i1);
        __m512i qsum = _mm512_load_si512((const void *)xg->qsum);
        if (off_shift) I = _mm512_sub_epi32(I, _mm512_slli_epi32(qsum, (unsigned)off_shift));
        __m512 dx = _mm512_load_ps(xg->d);
        __m512 c = _mm512_mul_ps(_mm512_mul_ps(g->a, dx), _mm512_cvtepi32_ps(I));
        if (two) c = _mm512_add_ps(c, _mm512_mul_ps(_mm512_mul_ps(g->b, dx), _mm512_load_ps(xg->fq)));
        acc[n] = _mm512_add_ps(acc[n], c);
    }
}

/* group_rows for a group of at most 8 blocks (lanes 8..15 of the unpacked
 * group are zero): 256-bit ops, half the work; adds +0 to lanes 8..15. */
static inline ES_AI void group_rows8(const wgroup *g, const uint8_t *x, size_t x_stride, int nt,
                                     __m512 *acc, int off_shift, int two) {
    __m256i w[8];
    UNROLL
    for (int k = 0; k < 8; k++) w[k] = _mm512_castsi512_si256(g->w[k]);
    __m256 a = _mm512_castps512_ps256(g->a), b = _mm512_castps512_ps256(g->b);
    UNROLL
    for (int n = 0; n < nt; n++) {
        const es_q8_group *xg = (const void *)(x + (size_t)n * x_stride);
        const int8_t *xq = xg->qs;
#define XQ(k) _mm256_load_si256((const __m256i *)(const void *)(xq + 64 * (k)))
        __m256i i0 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[0], XQ(0));
        __m256i i1 = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w[1], XQ(1));
        i0 = _mm256_dpbusd_epi32(i0, w[2], XQ(2));
        i1 = _mm256_dpbusd_epi32(i1, w[3], XQ(3));
        i0 = _mm256_dpbusd_epi32(i0, w[4], XQ(4));
        i1 = _mm256_dpbusd_epi32(i1, w[5], XQ(5));
        i0 = _mm256_dpbusd_epi32(i0, w[6], XQ(6));
        i1 = _mm256_dpbusd_epi32(i1, w[7], XQ(7));
#undef XQ
        __m256i I = _mm256_add_epi32(i0, i1);
        __m256i qsum = _mm256_load_si256((const void *)xg->qsum);
        if (off_shift) I = _mm256_sub_epi32(I, _mm256_slli_epi32(qsum, off_shift));
        __m256 dx = _mm256_load_ps(xg->d);
        __m256 c = _mm256_mul_ps(_mm256_mul_ps(a, dx), _mm256_cvtepi32_ps(I));
        if (two) c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(b, dx), _mm256_load_ps(xg->fq)));
        acc[n] = _mm512_add_ps(acc[n], _mm512_zextps256_ps512(c));
    }
}

/* ---- quads: a ragged end of at most 4 blocks, in 128-bit vectors ---- */

typedef struct {
    __m128i w[8];
    __m128 a, b;
} wquad;

static inline ES_AI void load_t4(const uint8_t *p, size_t stride, int nv, __m128i out[4]) {
    __m128i z[4];
    UNROLL
    for (int i = 0; i < 4; i++) z[i] = ld128(p, i, nv, stride);
    __m128i t0 = _mm_unpacklo_epi32(z[0], z[1]), t1 = _mm_unpackhi_epi32(z[0], z[1]);
    __m128i t2 = _mm_unpacklo_epi32(z[2], z[3]), t3 = _mm_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm_unpacklo_epi64(t0, t2);
    out[1] = _mm_unpackhi_epi64(t0, t2);
    out[2] = _mm_unpacklo_epi64(t1, t3);
    out[3] = _mm_unpackhi_epi64(t1, t3);
}

static inline ES_AI __m128i words4(const uint8_t *p, size_t stride, int nv) {
    const __m128i idx = _mm_setr_epi32(0, (int)stride, 2 * (int)stride, 3 * (int)stride);
    __mmask8 m = nv >= 4 ? (__mmask8)0xF : (__mmask8)((1u << nv) - 1);
    return _mm_mmask_i32gather_epi32(_mm_setzero_si128(), m, idx, p, 1);
}

static inline ES_AI void nibbles4(const __m128i d[4], __m128i w[8]) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    UNROLL
    for (int k = 0; k < 4; k++) {
        w[k] = _mm_and_si128(d[k], m4);
        w[k + 4] = _mm_and_si128(_mm_srli_epi16(d[k], 4), m4);
    }
}

static inline ES_AI __m128 half4_lo(__m128i v) { return _mm_cvtph_ps(_mm_cvtepi32_epi16(v)); }
static inline ES_AI __m128 half4_hi(__m128i v) { return _mm_cvtph_ps(_mm_cvtepi32_epi16(_mm_srli_epi32(v, 16))); }

static inline ES_AI __m128i q5_hi4(__m128i qh, int k) {
    __m128i t = _mm_and_si128(_mm_srli_epi32(qh, 4 * k), _mm_set1_epi32(0xF));
    t = _mm_and_si128(_mm_mullo_epi32(t, _mm_set1_epi32(0x00204081)), _mm_set1_epi32(0x01010101));
    return _mm_slli_epi32(t, 4);
}

static inline ES_AI void unpack4_q5_0(const uint8_t *p, int nv, wquad *g) {
    __m128i d[4];
    load_t4(p + 6, 22, nv, d);
    nibbles4(d, g->w);
    __m128i qh = words4(p + 2, 22, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm_or_si128(g->w[k], q5_hi4(qh, k));
    g->a = half4_lo(_mm_and_si128(words4(p, 22, nv), _mm_set1_epi32(0xFFFF)));
}

static inline ES_AI void unpack4_q5_1(const uint8_t *p, int nv, wquad *g) {
    __m128i d[4];
    load_t4(p + 8, 24, nv, d);
    nibbles4(d, g->w);
    __m128i qh = words4(p + 4, 24, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm_or_si128(g->w[k], q5_hi4(qh, k));
    __m128i dm = words4(p, 24, nv);
    g->a = half4_lo(dm);
    g->b = half4_hi(dm);
}

/* Quad at lanes 0..3 of a group into rows [0, nt) (adds +0 to lanes 4..15). */
static inline ES_AI void quad_rows(const wquad *g, const uint8_t *x, size_t x_stride, int nt,
                                   __m512 *acc, int off_shift, int two) {
    UNROLL
    for (int n = 0; n < nt; n++) {
        const es_q8_group *xg = (const void *)(x + (size_t)n * x_stride);
        const int8_t *xq = xg->qs;
#define XQ(k) _mm_load_si128((const __m128i *)(const void *)(xq + 64 * (k)))
        __m128i i0 = _mm_dpbusd_epi32(_mm_setzero_si128(), g->w[0], XQ(0));
        __m128i i1 = _mm_dpbusd_epi32(_mm_setzero_si128(), g->w[1], XQ(1));
        i0 = _mm_dpbusd_epi32(i0, g->w[2], XQ(2));
        i1 = _mm_dpbusd_epi32(i1, g->w[3], XQ(3));
        i0 = _mm_dpbusd_epi32(i0, g->w[4], XQ(4));
        i1 = _mm_dpbusd_epi32(i1, g->w[5], XQ(5));
        i0 = _mm_dpbusd_epi32(i0, g->w[6], XQ(6));
        i1 = _mm_dpbusd_epi32(i1, g->w[7], XQ(7));
#undef XQ
        __m128i I = _mm_add_epi32(i0, i1);
        if (off_shift) I = _mm_sub_epi32(I, _mm_slli_epi32(_mm_load_si128((const void *)xg->qsum), off_shift));
        __m128 dx = _mm_load_ps(xg->d);
        __m128 c = _mm_mul_ps(_mm_mul_ps(g->a, dx), _mm_cvtepi32_ps(I));
        if (two) c = _mm_add_ps(c, _mm_mul_ps(_mm_mul_ps(g->b, dx), _mm_load_ps(xg->fq)));
        acc[n] = _mm512_add_ps(acc[n], _mm512_zextps128_ps512(c));
    }
}

/* ---- small register tiles over the activation rows ---- */

#define TILE 8   /* most activation rows per register tile */

/* The quad tail (at most 4 blocks, lanes 0..3) of up to TILE activation rows,
 * packed once per kernel call so that one 512-bit vector serves 4 rows:
 * 128-bit lane i of q[t][k] is bytes 64k..64k+15 of row 4t+i's tail group
 * (blocks 0..3), likewise d, fq and qsum (their first 4 entries). Rows past
 * the tile are zero. */
typedef struct {
    int8_t q[TILE / 4][8][64];
    float d[TILE / 4][16], fq[TILE / 4][16];
    int32_t qsum[TILE / 4][16];
} xquads;

static inline ES_AI void pack_quads(const uint8_t *xg, size_t x_stride, int nt, xquads *xp) {
    memset(xp, 0, sizeof *xp);
    for (int n = 0; n < nt; n++) {
        const es_q8_group *g = (const void *)(xg + (size_t)n * x_stride);
        int t = n / 4, i = n % 4;
        for (int k = 0; k < 8; k++) memcpy(&xp->q[t][k][16 * i], g->qs + 64 * k, 16);
        memcpy(&xp->d[t][4 * i], g->d, 16);
        memcpy(&xp->fq[t][4 * i], g->fq, 16);
        memcpy(&xp->qsum[t][4 * i], g->qsum, 16);
    }
}

/* quad_rows on packed activations: 4 rows per 512-bit step; row 4t+i's
 * contribution (128-bit lane i) is moved to lanes 0..3 and added to its
 * accumulator (+0 to lanes 4..15), the same values as quad_rows. */
static inline ES_AI void quad_rows_packed(const wquad *g, const xquads *xp, int nt, __m512 *acc,
                                          int off_shift, int two) {
    __m512i w[8];
    UNROLL
    for (int k = 0; k < 8; k++) w[k] = _mm512_broadcast_i32x4(g->w[k]);
    __m512 a = _mm512_broadcast_f32x4(g->a), b = _mm512_broadcast_f32x4(g->b);
    UNROLL
    for (int t = 0; t < (nt + 3) / 4; t++) {
#define XQ(k) _mm512_load_si512((const void *)xp->q[t][k])
        __m512i i0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], XQ(0));
        __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], XQ(1));
        i0 = _mm512_dpbusd_epi32(i0, w[2], XQ(2));
        i1 = _mm512_dpbusd_epi32(i1, w[3], XQ(3));
        i0 = _mm512_dpbusd_epi32(i0, w[4], XQ(4));
        i1 = _mm512_dpbusd_epi32(i1, w[5], XQ(5));
        i0 = _mm512_dpbusd_epi32(i0, w[6], XQ(6));
        i1 = _mm512_dpbusd_epi32(i1, w[7], XQ(7));
#undef XQ
        __m512i I = _mm512_add_epi32(i0, i1);
        if (off_shift) I = _mm512_sub_epi32(I, _mm512_slli_epi32(_mm512_load_si512((const void *)xp->qsum[t]),
                                                                 (unsigned)off_shift));
        __m512 dx = _mm512_load_ps(xp->d[t]);
        __m512 c = _mm512_mul_ps(_mm512_mul_ps(a, dx), _mm512_cvtepi32_ps(I));
        if (two) c = _mm512_add_ps(c, _mm512_mul_ps(_mm512_mul_ps(b, dx), _mm512_load_ps(xp->fq[t])));
        UNROLL
        for (int i = 0; i < 4; i++)
            if (4 * t + i < nt) acc[4 * t + i] = _mm512_add_ps(acc[4 * t + i], _mm512_maskz_shuffle_f32x4((__mmask16)0x000F, c, c, i));
    }
}

/* es_lane_sum of nt accumulators at once, Y[n * ldy] = sum of acc[n]: the
 * same tree, with the pairs of several accumulators added in one vector. */
static inline ES_AI void lane_sums(const __m512 *acc, int nt, float *Y, int64_t ldy) {
    if (nt == 1) {
        Y[0] = lane_sum16(acc[0]);
        return;
    }
    __m512 z = _mm512_setzero_ps(), p[TILE / 2], q[TILE / 4];
    UNROLL
    for (int i = 0; i < (nt + 1) / 2; i++) {   /* l0+l1, l2+l3 of two accumulators */
        __m512 u = acc[2 * i], v = 2 * i + 1 < nt ? acc[2 * i + 1] : z;
        p[i] = _mm512_add_ps(_mm512_shuffle_ps(u, v, 0x88), _mm512_shuffle_ps(u, v, 0xDD));
    }
    UNROLL
    for (int i = 0; i < (nt + 3) / 4; i++) {   /* (l0+l1)+(l2+l3) of four */
        __m512 u = p[2 * i], v = 2 * i + 1 < (nt + 1) / 2 ? p[2 * i + 1] : z;
        q[i] = _mm512_add_ps(_mm512_shuffle_ps(u, v, 0x88), _mm512_shuffle_ps(u, v, 0xDD));
    }
    __m512 u = q[0], v = nt > 4 ? q[1] : z;    /* a0+a1, a2+a3 of eight */
    __m512 s = _mm512_add_ps(_mm512_shuffle_f32x4(u, v, 0x88), _mm512_shuffle_f32x4(u, v, 0xDD));
    s = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, 0xB1));
    float out[16] __attribute__((aligned(64)));
    _mm512_store_ps(out, s);
    UNROLL
    for (int n = 0; n < nt; n++) Y[(int64_t)n * ldy] = out[n < 4 ? n : n + 4];
}

/* Rows [r0, r1) of the weights times a tile of nt (a constant after
 * inlining, 1..TILE) activation rows xt: accumulators stay in registers.
 * name##_row does one weight row: its groups are unpacked here (gb NULL) or
 * were unpacked before (gb[0..nfull], g4b for a quad tail); xp holds the
 * tile's packed quad tail when nt > 1. */
#define QTILE(name, unpack, unpack4, bbytes, off_shift, two)                                          \
    static inline ES_AI void name##_row(const int nt, const uint8_t *row, const wgroup *gb,           \
                                        const wquad *g4b, int64_t nfull, int tail, const uint8_t *xt, \
                                        size_t x_stride, const xquads *xp, float *Y, int64_t ldy) {   \
        const uint8_t *xtail = xt + (size_t)nfull * sizeof(es_q8_group);                            \
        __m512 acc[TILE];                                                                           \
        UNROLL                                                                                      \
        for (int n = 0; n < nt; n++) acc[n] = _mm512_setzero_ps();                                  \
        for (int64_t gi = 0; gi < nfull; gi++) {                                                    \
            wgroup g;                                                                               \
            if (gb) g = gb[gi];                                                                     \
            else {                                                                                  \
                g.b = _mm512_setzero_ps();                                                          \
                unpack(row + (size_t)gi * 16 * (bbytes), 16, &g);                                   \
            }                                                                                       \
            group_rows(&g, xt + (size_t)gi * sizeof(es_q8_group), x_stride, nt, acc, off_shift, two); \
        }                                                                                           \
        const uint8_t *p = row + (size_t)nfull * 16 * (bbytes);                                     \
        if (tail && tail <= 4) {                                                                    \
            wquad g4;                                                                               \
            if (g4b) g4 = *g4b;                                                                     \
            else {                                                                                  \
                g4.b = _mm_setzero_ps();                                                            \
                unpack4(p, tail, &g4);                                                              \
            }                                                                                       \
            if (nt == 1) quad_rows(&g4, xtail, x_stride, 1, acc, off_shift, two);                   \
            else quad_rows_packed(&g4, xp, nt, acc, off_shift, two);                                \
        } else if (tail) {                                                                          \
            wgroup g;                                                                               \
            if (gb) g = gb[nfull];                                                                  \
            else {                                                                                  \
                g.b = _mm512_setzero_ps();                                                          \
                unpack(p, tail, &g);                                                                \
            }                                                                                       \
            if (tail <= 8) group_rows8(&g, xtail, x_stride, nt, acc, off_shift, two);               \
            else group_rows(&g, xtail, x_stride, nt, acc, off_shift, two);                          \
        }                                                                                           \
        lane_sums(acc, nt, Y, ldy);                                                                 \
    }                                                                                               \
    static inline ES_AI void name##_tile(const int nt, const uint8_t *w, size_t row_bytes, int64_t r0, \
                                         int64_t r1, int64_t nfull, int tail, const uint8_t *xt,      \
                                         size_t x_stride, const xquads *xp, float *Y, int64_t ldy) {  \
        for (int64_t r = r0; r < r1; r++) {                                                         \
            const uint8_t *row = w + (size_t)r * row_bytes;                                         \
            if (r + 1 < r1) _mm_prefetch((const char *)(row + row_bytes), _MM_HINT_T0);             \
            name##_row(nt, row, NULL, NULL, nfull, tail, xt, x_stride, xp, Y + r, ldy);             \
        }                                                                                           \
    }

/* fn(nt, ...) with nt a constant 1..TILE. */
#define QSWITCH(nt, fn, ...)                                                                        \
    switch (nt) {                                                                                   \
    case 1: fn(1, __VA_ARGS__); break;                                                              \
    case 2: fn(2, __VA_ARGS__); break;                                                              \
    case 3: fn(3, __VA_ARGS__); break;                                                              \
    case 4: fn(4, __VA_ARGS__); break;                                                              \
    case 5: fn(5, __VA_ARGS__); break;                                                              \
    case 6: fn(6, __VA_ARGS__); break;                                                              \
    case 7: fn(7, __VA_ARGS__); break;                                                              \
    default: fn(8, __VA_ARGS__); break;                                                             \
    }

#define PASS 32          /* activation rows per pass: up to 4 tiles */
#define BUF_GROUPS 16    /* rows of at most this many groups are unpacked once per pass */

/* The kernel: each pass of up to PASS activation rows is cut into tiles of
 * at most TILE rows of near-equal size, each run by a variant compiled for
 * its row count. With one tile, a weight row is unpacked while it is
 * multiplied; with several, it is unpacked once into a buffer that every
 * tile then reads. */
#define QKERNEL(name, unpack, unpack4, bbytes, off_shift, two)                                      \
    QTILE(name, unpack, unpack4, bbytes, off_shift, two)                                            \
    static void name(const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1, int64_t n_in,      \
                     const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {               \
        int64_t nb = n_in / QK, nfull = nb / 16;                                                    \
        int tail = (int)(nb % 16);                                                                  \
        const uint8_t *x = xv;                                                                      \
        for (int n0 = 0; n0 < N; n0 += PASS) {                                                      \
            int np = N - n0 < PASS ? N - n0 : PASS, nti = 0, t0[PASS / TILE], tn[PASS / TILE];     \
            for (int n = 0; n < np; nti++) {                                                        \
                int left = (np - n + TILE - 1) / TILE;                                              \
                t0[nti] = n0 + n;                                                                   \
                tn[nti] = (np - n + left - 1) / left;                                               \
                n += tn[nti];                                                                       \
            }                                                                                       \
            xquads xp[PASS / TILE];                                                                 \
            if (tail && tail <= 4)                                                                  \
                for (int i = 0; i < nti; i++)                                                       \
                    if (tn[i] > 1)                                                                  \
                        pack_quads(x + (size_t)t0[i] * x_stride + (size_t)nfull * sizeof(es_q8_group), \
                                   x_stride, tn[i], &xp[i]);                                        \
            if (nti == 1 || nfull + (tail > 4) > BUF_GROUPS) {                                      \
                for (int i = 0; i < nti; i++) {                                                     \
                    const uint8_t *xt = x + (size_t)t0[i] * x_stride;                               \
                    float *Yt = Y + (int64_t)t0[i] * ldy;                                           \
                    QSWITCH(tn[i], name##_tile, w, row_bytes, r0, r1, nfull, tail, xt, x_stride, &xp[i], Yt, ldy) \
                }                                                                                   \
                continue;                                                                           \
            }                                                                                       \
            for (int64_t r = r0; r < r1; r++) {                                                     \
                const uint8_t *row = w + (size_t)r * row_bytes;                                     \
                if (r + 1 < r1) _mm_prefetch((const char *)(row + row_bytes), _MM_HINT_T0);         \
                wgroup gb[BUF_GROUPS];                                                              \
                wquad g4;                                                                           \
                for (int64_t gi = 0; gi < nfull; gi++) {                                            \
                    gb[gi].b = _mm512_setzero_ps();                                                 \
                    unpack(row + (size_t)gi * 16 * (bbytes), 16, &gb[gi]);                          \
                }                                                                                   \
                const uint8_t *p = row + (size_t)nfull * 16 * (bbytes);                             \
                if (tail && tail <= 4) {                                                            \
                    g4.b = _mm_setzero_ps();                                                        \
                    unpack4(p, tail, &g4);                                                          \
                } else if (tail) {                                                                  \
                    gb[nfull].b = _mm512_setzero_ps();                                              \
                    unpack(p, tail, &gb[nfull]);                                                    \
                }                                                                                   \
                for (int i = 0; i < nti; i++) {                                                     \
                    const uint8_t *xt = x + (size_t)t0[i] * x_stride;                               \
                    float *Yt = Y + (int64_t)t0[i] * ldy + r;                                       \
                    QSWITCH(tn[i], name##_row, row, gb, &g4, nfull, tail, xt, x_stride, &xp[i], Yt, ldy) \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    }

QKERNEL(k_q5_0, unpack_q5_0, unpack4_q5_0, 22, 4, 0)
QKERNEL(k_q5_1, unpack_q5_1, unpack4_q5_1, 24, 0, 1)

/* Float weights: lane i % 16 += w[i] * x[i]; masked loads give +0 past the end. */
static inline ES_AI __m512 load_w16(uint32_t type, const uint8_t *row, int64_t i, __mmask16 m) {
    if (type == ES_TYPE_F32) return _mm512_maskz_loadu_ps(m, row + 4 * i);
    __m256i h = _mm256_maskz_loadu_epi16(m, row + 2 * i);
    if (type == ES_TYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline ES_AI void float_kernel(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1,
                                int64_t n_in, const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {
    const uint8_t *x = xv;
    for (int n0 = 0; n0 < N; n0 += NT) {
        int nt = N - n0 < NT ? N - n0 : NT;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            __m512 acc[NT];
            for (int n = 0; n < nt; n++) acc[n] = _mm512_setzero_ps();
            for (int64_t i = 0; i < n_in; i += 16) {
                __mmask16 m = n_in - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n_in - i)) - 1u);
                __m512 wv = load_w16(type, row, i, m);
                for (int n = 0; n < nt; n++) {
                    const float *xr = (const float *)(const void *)(x + (size_t)(n0 + n) * x_stride);
                    acc[n] = _mm512_add_ps(acc[n], _mm512_mul_ps(wv, _mm512_maskz_loadu_ps(m, xr + i)));
                }
            }
            for (int n = 0; n < nt; n++) Y[(int64_t)(n0 + n) * ldy + r] = lane_sum16(acc[n]);
        }
    }
}

#define FKERNEL(name, t)                                                                  \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n_in,   \
                     const void *x, size_t xs, int N, float *Y, int64_t ldy) {            \
        float_kernel(t, w, rb, r0, r1, n_in, x, xs, N, Y, ldy);                           \
    }
FKERNEL(k_f32, ES_TYPE_F32)
FKERNEL(k_f16, ES_TYPE_F16)
FKERNEL(k_bf16, ES_TYPE_BF16)

/* Activation quantization (contract step 1), 32 elements per step. */
int es_x86_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) {
    if (n % QK != 0) return 0;
    for (int64_t j = j0; j < j1; j++) {
        es_q8_group *g = &out[j / ES_GROUP_BLOCKS];
        int jj = (int)(j % ES_GROUP_BLOCKS);
        __m512 x0 = _mm512_loadu_ps(x + j * QK), x1 = _mm512_loadu_ps(x + j * QK + 16);
        /* max(a, m) keeps m when a is NaN, like the scalar loop */
        __m512 m = _mm512_max_ps(_mm512_abs_ps(x1), _mm512_max_ps(_mm512_abs_ps(x0), _mm512_setzero_ps()));
        float amax = _mm512_reduce_max_ps(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        __m512 vid = _mm512_set1_ps(id);
        __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, vid)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, vid));
        int32_t lo = _mm512_reduce_add_epi32(q0), sum = lo + _mm512_reduce_add_epi32(q1);
        uint32_t w[8];
        _mm_storeu_si128((__m128i *)(void *)w, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(void *)(w + 4), _mm512_cvtepi32_epi8(q1));
        for (int k = 0; k < 8; k++) memcpy(g->qs + 64 * k + 4 * jj, &w[k], 4);
        es_q8_set_block(g, jj, d, sum, lo);
    }
    return 1;
}

/* ---- packed kernels (Q4_0, Q4_1, Q8_0; K types below): 16 weight rows in the lanes ----
 * One step multiplies one block of 16 rows (a packed record, quant.h) into
 * each activation row of a tile: 8 vpdpbusd with the activation's dword k
 * broadcast give the 16 rows' exact int32 sums I, then the contract's float
 * steps run on the 16 rows at once and add to the tile row's accumulator
 * (the sequential contract: one accumulator per output, blocks in order). */

#define PTILE 8   /* most activation rows per register tile */
/* Software prefetch of the weight stream, this many bytes ahead, into L2
 * (T1). At N = 5 a record takes long enough to compute that the hardware
 * prefetcher alone leaves the stream behind; into L1 (T0) it did not help
 * at any distance. Forward passes of SmolLM2 (bench/forward_ab.c, builds
 * with 2, 4, 8 and 16 KB alternated in one process, 2 threads, twice):
 * 8 KB gave the lowest T (4.09 / 4.38 ms) and V(4) (5.52 / 6.05 ms); 4 KB
 * was 6-10 % slower on both, 2 KB slower still, 16 KB no better. */
#ifndef ES_PF_BYTES
#define ES_PF_BYTES 8192
#endif

typedef struct {
    __m512i w[8];   /* unsigned bytes; w[k] lane r = elements 4k..4k+3 of row r */
    __m512 a, b;
} prec;

static inline ES_AI void punpack(const int type, const uint8_t *p, prec *u) {
    if (type == ES_TYPE_Q8_0) {
        const __m512i x80 = _mm512_set1_epi8((char)0x80);
        UNROLL
        for (int k = 0; k < 8; k++) u->w[k] = _mm512_xor_si512(_mm512_loadu_si512(p + 64 * k), x80);
        u->a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + 512)));
        return;
    }
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    UNROLL
    for (int k = 0; k < 4; k++) {
        __m512i v = _mm512_loadu_si512(p + 64 * k);
        u->w[k] = _mm512_and_si512(v, m4);
        u->w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    }
    u->a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + 256)));
    if (type == ES_TYPE_Q4_1) u->b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + 288)));
}

/* acc + vpdpbusd(w, the 4 bytes at q in every lane), the broadcast folded
 * into the instruction's memory operand ({1to16}): for _mm512_set1_epi32
 * GCC emits a vpbroadcastd of its own, 40 more instructions a record at
 * N = 5 (the gate/up matmuls of SmolLM2 on one thread, this kernel against
 * the intrinsic one in one process: 0-3 % faster at N = 5, 0-6 % at N = 1). */
static inline ES_AI __m512i dpbusd_b(__m512i acc, __m512i w, const int8_t *q) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(const void *)q));
    return acc;
}

/* ---- packed K types: one record = one super-block of 16 rows ----
 * Sub-block j (0..7) of the record is activation block 8 (s % 2) + j of
 * group s / 2 (s the super-block). Its 8 weight vectors (unsigned: Q4_K
 * nibbles, Q5_K 5-bit, Q6_K 6-bit values) are made from the record with a
 * shift and a mask (vpternlogd merges the high bits), then each row of the
 * tile takes 8 vpdpbusd with its activation dwords broadcast:
 *   Q4_K, Q5_K  I = sc * (the dot), vpmulld (exact: |I| < 2^24)
 *   Q6_K        lo, hi = the dots over elements 0..15 and 16..31 minus
 *               32 * (their activation sums), started at that value in
 *               the vpdpbusd chains; I = sl * lo + sh * hi (vpmulld)
 * and the contract's float steps run on 16 rows. The two-term part
 * (b * d) * (float)J takes (float)J as (float)m * fq, a float product that
 * is exact (|m * qsum| <= 63 * 4064 < 2^24) and so equal to (float)(m *
 * qsum), except that it is -0 where J is +0 (m = 0, qsum < 0); a zero c
 * only ever adds to y, which starts at +0 and so is never -0, and
 * y + (+0) == y + (-0) for every such y: the stored bits are the same. */

/* The 6-bit sub-block scales (S) and mins (M) of a Q4_K / Q5_K record:
 * byte j % 4 of lane r of s[j / 4] / m[j / 4] is sub-block j's (ggml's
 * get_scale_min_k4 on the 12 bytes at sc[0..2][r]). */
static inline ES_AI void pk_scales(const uint8_t *p, __m512i s[2], __m512i m[2]) {
    const __m512i u0 = _mm512_loadu_si512(p), u1 = _mm512_loadu_si512(p + 64), u2 = _mm512_loadu_si512(p + 128);
    const __m512i m6 = _mm512_set1_epi8(0x3F), m4 = _mm512_set1_epi8(0x0F), h2 = _mm512_set1_epi8(0x30);
    s[0] = _mm512_and_si512(u0, m6);
    m[0] = _mm512_and_si512(u1, m6);
    /* (low 4 bits) | (top 2 bits of byte j - 4) << 4: ternlog 0xCA is A ? B : C, A the mask 0x30 */
    s[1] = _mm512_ternarylogic_epi32(h2, _mm512_srli_epi32(u0, 2), _mm512_and_si512(u2, m4), 0xCA);
    m[1] = _mm512_ternarylogic_epi32(h2, _mm512_srli_epi32(u1, 2), _mm512_and_si512(_mm512_srli_epi32(u2, 4), m4), 0xCA);
}

/* Byte j % 4 of every lane of v as int32. */
static inline ES_AI __m512i pk_byte(__m512i v, int j) {
    j &= 3;
    if (j == 3) return _mm512_srli_epi32(v, 24);
    if (j) v = _mm512_srli_epi32(v, (unsigned)(8 * j));
    return _mm512_and_si512(v, _mm512_set1_epi32(0xFF));
}

/* Chunk k of sub-block j's unsigned weights, 16 rows (record p). */
static inline ES_AI __m512i pk_weights(const int type, const uint8_t *p, int j, int k) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    if (type == ES_TYPE_Q6_K) {
        int h = j / 4, s = j % 4;
        __m512i l = _mm512_loadu_si512(p + (2 * h + (s & 1)) * 512 + 64 * k);
        __m512i q = _mm512_and_si512(s >= 2 ? _mm512_srli_epi16(l, 4) : l, m4);
        __m512i hb = _mm512_loadu_si512(p + ES_PK_Q6K_QH + 512 * h + 64 * k);
        /* bits 2s, 2s + 1 of each byte to bits 4, 5 (within the byte after the mask) */
        hb = s < 2 ? _mm512_slli_epi16(hb, (unsigned)(4 - 2 * s)) : s == 2 ? hb : _mm512_srli_epi16(hb, 2);
        return _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x30), hb, q, 0xEA);   /* q | (hb & 0x30) */
    }
    __m512i v = _mm512_loadu_si512(p + (j / 2) * 512 + 64 * k);
    __m512i q = _mm512_and_si512((j & 1) ? _mm512_srli_epi16(v, 4) : v, m4);
    if (type == ES_TYPE_Q5_K) {
        __m512i hb = _mm512_loadu_si512(p + ES_PK_Q5K_QH + 64 * k);
        /* bit j of each byte to bit 4 */
        hb = j <= 4 ? _mm512_slli_epi16(hb, (unsigned)(4 - j)) : _mm512_srli_epi16(hb, (unsigned)(j - 4));
        q = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x10), hb, q, 0xEA);   /* q | (hb & 0x10) */
    }
    return q;
}

static inline ES_AI void pgroup_k(const int nt, const int type, const uint8_t *g, int64_t nsb, const uint8_t *x,
                                  size_t xs, float *Y, int64_t ldy, int nr, int pf) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    const int q6 = type == ES_TYPE_Q6_K;
    const size_t sco = type == ES_TYPE_Q4_K ? ES_PK_Q4K_SC : ES_PK_Q5K_SC;
    const size_t dof = q6 ? ES_PK_Q6K_D : type == ES_TYPE_Q4_K ? ES_PK_Q4K_D : ES_PK_Q5K_D;
    const size_t mof = type == ES_TYPE_Q4_K ? ES_PK_Q4K_DMIN : ES_PK_Q5K_DMIN;
    __m512 acc[PTILE];
    UNROLL
    for (int n = 0; n < nt; n++) acc[n] = _mm512_setzero_ps();
    if (pf == 2)
        for (size_t o = 0; o < ES_PF_BYTES; o += 64) _mm_prefetch((const char *)(g + o), _MM_HINT_T1);
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *p = g + (size_t)sb * rec;
        if (pf)
            for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)(p + ES_PF_BYTES + o), _MM_HINT_T1);
        const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + dof)));
        __m512 b = _mm512_setzero_ps();
        __m512i S[2], M[2];
        if (!q6) {
            /* b = -dmin: the sign bit flipped, exact */
            b = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + mof)))),
                _mm512_set1_epi32((int)0x80000000u)));
            pk_scales(p + sco, S, M);
        }
        const uint8_t *xb = x + (size_t)(sb / 2) * sizeof(es_q8_group);
        const int j0 = 8 * (int)(sb % 2);
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m512i w[8];
            UNROLL
            for (int k = 0; k < 8; k++) w[k] = pk_weights(type, p, j, k);
            __m512i sl, sh = _mm512_setzero_si512();
            __m512 fm = _mm512_setzero_ps();
            if (q6) {
                sl = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p + ES_PK_Q6K_SC + 32 * j)));
                sh = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p + ES_PK_Q6K_SC + 32 * j + 16)));
            } else {
                sl = pk_byte(S[j / 4], j);
                fm = _mm512_cvtepi32_ps(pk_byte(M[j / 4], j));
            }
            const int jj = j0 + j;
            UNROLL
            for (int n = 0; n < nt; n++) {
                const es_q8_group *xg = (const void *)(xb + (size_t)n * xs);
                const int8_t *q = xg->qs + 4 * jj;
                __m512i i0, i1;
                if (q6) {
                    int32_t lo = xg->qlo[jj], hi = xg->qsum[jj] - lo;
                    i0 = dpbusd_b(_mm512_set1_epi32(-32 * lo), w[0], q);
                    i1 = dpbusd_b(_mm512_set1_epi32(-32 * hi), w[4], q + 256);
                } else {
                    i0 = dpbusd_b(_mm512_setzero_si512(), w[0], q);
                    i1 = dpbusd_b(_mm512_setzero_si512(), w[4], q + 256);
                }
                UNROLL
                for (int k = 1; k < 4; k++) {
                    i0 = dpbusd_b(i0, w[k], q + 64 * k);
                    i1 = dpbusd_b(i1, w[k + 4], q + 64 * (k + 4));
                }
                __m512i I = q6 ? _mm512_add_epi32(_mm512_mullo_epi32(sl, i0), _mm512_mullo_epi32(sh, i1))
                               : _mm512_mullo_epi32(sl, _mm512_add_epi32(i0, i1));
                const __m512 dx = _mm512_set1_ps(xg->d[jj]);
                __m512 c = _mm512_mul_ps(_mm512_mul_ps(a, dx), _mm512_cvtepi32_ps(I));
                if (!q6)
                    c = _mm512_add_ps(c, _mm512_mul_ps(_mm512_mul_ps(b, dx), _mm512_mul_ps(fm, _mm512_set1_ps(xg->fq[jj]))));
                acc[n] = _mm512_add_ps(acc[n], c);
            }
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    UNROLL
    for (int n = 0; n < nt; n++) _mm512_mask_storeu_ps(Y + (int64_t)n * ldy, m, acc[n]);
}

/* One group of 16 weight rows (nb records at g) times a tile of nt (a
 * constant 1..PTILE) activation rows x; stores nr (1..16) outputs per row.
 * pf: 0 no prefetch (a later tile), 1 the rolling prefetch ES_PF_BYTES
 * ahead, 2 also the first ES_PF_BYTES. 2 is used for the first group of a
 * chunk, and for every group when N = 1: measured with bench/forward_ab.c,
 * the repeated head prefetch made T (N = 1, memory-bound) faster but cost
 * V(4) (N = 5, compute-bound) 4-10 %, where its 128 extra instructions per
 * group are not free. */
static inline ES_AI void pgroup(const int nt, const int type, const uint8_t *g, int64_t nb, const uint8_t *x,
                                size_t xs, float *Y, int64_t ldy, int nr, int pf) {
    if (type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K || type == ES_TYPE_Q6_K) {
        pgroup_k(nt, type, g, nb, x, xs, Y, ldy, nr, pf);
        return;
    }
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    const unsigned off = type == ES_TYPE_Q8_0 ? 7 : 3;   /* I -= qsum << off (unsigned weights) */
    __m512 acc[PTILE];
    UNROLL
    for (int n = 0; n < nt; n++) acc[n] = _mm512_setzero_ps();
    if (pf == 2)   /* the first group of a chunk: the head of the stream */
        for (size_t o = 0; o < ES_PF_BYTES; o += 64) _mm_prefetch((const char *)(g + o), _MM_HINT_T1);
    for (int64_t j = 0; j < nb; j++) {
        const uint8_t *p = g + (size_t)j * rec;
        if (pf)
            for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)(p + ES_PF_BYTES + o), _MM_HINT_T1);
        prec u;
        punpack(type, p, &u);
        const uint8_t *xb = x + (size_t)(j / ES_GROUP_BLOCKS) * sizeof(es_q8_group);
        const int jj = (int)(j % ES_GROUP_BLOCKS);
        UNROLL
        for (int n = 0; n < nt; n++) {
            const es_q8_group *xg = (const void *)(xb + (size_t)n * xs);
            const int8_t *q = xg->qs + 4 * jj;
            __m512i i0, i1;
            if (type == ES_TYPE_Q4_1) {
                i0 = dpbusd_b(_mm512_setzero_si512(), u.w[0], q);
            } else {
                i0 = dpbusd_b(_mm512_set1_epi32(-(xg->qsum[jj] * (1 << off))), u.w[0], q);
            }
            i1 = dpbusd_b(_mm512_setzero_si512(), u.w[1], q + 64);
            UNROLL
            for (int k = 2; k < 8; k += 2) {
                i0 = dpbusd_b(i0, u.w[k], q + 64 * k);
                i1 = dpbusd_b(i1, u.w[k + 1], q + 64 * (k + 1));
            }
            __m512 c = _mm512_mul_ps(_mm512_mul_ps(u.a, _mm512_set1_ps(xg->d[jj])),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)));
            if (type == ES_TYPE_Q4_1) c = _mm512_add_ps(c, _mm512_mul_ps(u.b, _mm512_set1_ps(xg->dq[jj])));
            acc[n] = _mm512_add_ps(acc[n], c);
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    UNROLL
    for (int n = 0; n < nt; n++) _mm512_mask_storeu_ps(Y + (int64_t)n * ldy, m, acc[n]);
}

ES_PACKED_KERNELS_K(es_x86_packed_kernel)

es_mm_kernel es_x86_kernel(uint32_t type) {
    switch (type) {
    case ES_TYPE_F32: return k_f32;
    case ES_TYPE_F16: return k_f16;
    case ES_TYPE_BF16: return k_bf16;
    case ES_TYPE_Q5_0: return k_q5_0;
    case ES_TYPE_Q5_1: return k_q5_1;
    default: return NULL;
    }
}
const char *es_x86_simd_name(void) { return "avx512"; }

#elif defined(ES_X86_AVX2)
/*
 * AVX2 path. Lane types (Q5_0, Q5_1): the same transposed layout, a group
 * of 16 blocks handled as two octets of 8 (ymm lanes 0..7 and 8..15 of the
 * accumulator). Packed types (Q4_0, Q4_1, Q8_0, K types): see "packed
 * kernels" below. Int8 dots use maddubs (u8 x s8 -> s16 pairs) + madd: for 4-bit
 * weights all 8 chunk products fit one int16 sum (8 * 2 * 15 * 127 = 30480),
 * for 5-bit ones 4 (4 * 2 * 31 * 127 = 31496); Q8_0 uses |w| x sign(x, w)
 * and widens every chunk. Exact int32 either way.
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define NT 32
#define ES_AI __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

typedef struct {
    __m256i w[8];     /* unsigned 5-bit weights */
    __m256 a, b;
} woct;

static inline ES_AI __m128i ld128(const uint8_t *p, int j, int nv, size_t stride) {
    return j < nv ? _mm_loadu_si128((const __m128i *)(const void *)(p + (size_t)j * stride))
                  : _mm_setzero_si128();
}

/* 16 bytes at p + j * stride, j = 0..7 (zero for j >= nv), transposed. */
static inline ES_AI void load_t8(const uint8_t *p, size_t stride, int nv, __m256i out[4]) {
    __m256i z[4];
    UNROLL
    for (int i = 0; i < 4; i++)
        z[i] = _mm256_inserti128_si256(_mm256_castsi128_si256(ld128(p, i, nv, stride)), ld128(p, i + 4, nv, stride), 1);
    __m256i t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    __m256i t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm256_unpacklo_epi64(t0, t2);
    out[1] = _mm256_unpackhi_epi64(t0, t2);
    out[2] = _mm256_unpacklo_epi64(t1, t3);
    out[3] = _mm256_unpackhi_epi64(t1, t3);
}

/* fp16 at p + j * stride + off (j < nv), as 8 floats. */
static inline ES_AI __m256 halves8(const uint8_t *p, size_t stride, size_t off, int nv) {
    uint16_t h[8] = {0};
    for (int j = 0; j < nv && j < 8; j++) memcpy(&h[j], p + (size_t)j * stride + off, 2);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)h));
}

static inline ES_AI void nibbles8(const __m256i d[4], __m256i w[8]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    UNROLL
    for (int k = 0; k < 4; k++) {
        w[k] = _mm256_and_si256(d[k], m4);
        w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(d[k], 4), m4);
    }
}

static inline ES_AI __m256i words8(const uint8_t *p, size_t stride, int nv) {
    uint32_t v[8] = {0};
    for (int j = 0; j < nv && j < 8; j++) memcpy(&v[j], p + (size_t)j * stride, 4);
    return _mm256_loadu_si256((const __m256i *)(const void *)v);
}

/* The 5th bits of Q5_0 / Q5_1 for chunk k (see the AVX-512 q5_hi). */
static inline ES_AI __m256i q5_hi8(__m256i qh, int k) {
    __m256i t = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * k), _mm256_set1_epi32(0xF));
    t = _mm256_and_si256(_mm256_mullo_epi32(t, _mm256_set1_epi32(0x00204081)), _mm256_set1_epi32(0x01010101));
    return _mm256_slli_epi32(t, 4);
}

static inline ES_AI void unpack_q5_0(const uint8_t *p, int nv, woct *g) {
    __m256i d[4];
    load_t8(p + 6, 22, nv, d);
    nibbles8(d, g->w);
    __m256i qh = words8(p + 2, 22, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm256_or_si256(g->w[k], q5_hi8(qh, k));
    g->a = halves8(p, 22, 0, nv);
}

static inline ES_AI void unpack_q5_1(const uint8_t *p, int nv, woct *g) {
    __m256i d[4];
    load_t8(p + 8, 24, nv, d);
    nibbles8(d, g->w);
    __m256i qh = words8(p + 4, 24, nv);
    UNROLL
    for (int k = 0; k < 8; k++) g->w[k] = _mm256_or_si256(g->w[k], q5_hi8(qh, k));
    g->a = halves8(p, 24, 0, nv);
    g->b = halves8(p, 24, 2, nv);
}

/* Octet h (lanes 8h..8h+7) of 5-bit weights into rows [0, nt):
 * acc[2n + h] += c (4 + 4 chunk products per int16 sum). */
static inline ES_AI void oct_rows(const woct *g, const uint8_t *x, size_t x_stride, int nt, int h,
                                  __m256 *acc, int off_shift, int two) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int n = 0; n < nt; n++) {
        const es_q8_group *xg = (const void *)(x + (size_t)n * x_stride);
        const int8_t *xq = xg->qs + 32 * h;
#define XQ(k) _mm256_load_si256((const __m256i *)(const void *)(xq + 64 * (k)))
        __m256i s0 = _mm256_maddubs_epi16(g->w[0], XQ(0)), s1 = _mm256_maddubs_epi16(g->w[4], XQ(4));
        UNROLL
        for (int k = 1; k < 4; k++) {
            s0 = _mm256_add_epi16(s0, _mm256_maddubs_epi16(g->w[k], XQ(k)));
            s1 = _mm256_add_epi16(s1, _mm256_maddubs_epi16(g->w[k + 4], XQ(k + 4)));
        }
        __m256i I = _mm256_add_epi32(_mm256_madd_epi16(s0, ones), _mm256_madd_epi16(s1, ones));
#undef XQ
        if (off_shift)
            I = _mm256_sub_epi32(I, _mm256_slli_epi32(_mm256_load_si256((const void *)(xg->qsum + 8 * h)), off_shift));
        __m256 dx = _mm256_load_ps(xg->d + 8 * h);
        __m256 c = _mm256_mul_ps(_mm256_mul_ps(g->a, dx), _mm256_cvtepi32_ps(I));
        if (two) c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(g->b, dx), _mm256_load_ps(xg->fq + 8 * h)));
        acc[2 * n + h] = _mm256_add_ps(acc[2 * n + h], c);
    }
}

static inline ES_AI float lane_sum2x8(__m256 lo, __m256 hi) {
    float l[16];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(l + 8, hi);
    return es_lane_sum(l);
}

#define QKERNEL(name, unpack, bbytes, off_shift, two)                                               \
    static void name(const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1, int64_t n_in,      \
                     const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {               \
        int64_t nb = n_in / QK, ng = (nb + ES_GROUP_BLOCKS - 1) / ES_GROUP_BLOCKS;                  \
        const uint8_t *x = xv;                                                                      \
        __m256 acc[2 * NT];                                                                         \
        for (int n0 = 0; n0 < N; n0 += NT) {                                                        \
            int nt = N - n0 < NT ? N - n0 : NT;                                                     \
            const uint8_t *xt = x + (size_t)n0 * x_stride;                                          \
            for (int64_t r = r0; r < r1; r++) {                                                     \
                const uint8_t *row = w + (size_t)r * row_bytes;                                     \
                for (int i = 0; i < 2 * nt; i++) acc[i] = _mm256_setzero_ps();                      \
                for (int64_t gi = 0; gi < ng; gi++) {                                               \
                    const uint8_t *xg = xt + (size_t)gi * sizeof(es_q8_group);                      \
                    for (int h = 0; h < 2; h++) {                                                   \
                        int64_t b0 = gi * 16 + h * 8;                                               \
                        if (b0 >= nb) break;                                                        \
                        woct g;                                                                     \
                        g.b = _mm256_setzero_ps();                                                  \
                        const uint8_t *p = row + (size_t)b0 * (bbytes);                             \
                        if (nb - b0 >= 8) unpack(p, 8, &g);                                         \
                        else unpack(p, (int)(nb - b0), &g);                                         \
                        oct_rows(&g, xg, x_stride, nt, h, acc, off_shift, two);                     \
                    }                                                                               \
                }                                                                                   \
                for (int n = 0; n < nt; n++)                                                        \
                    Y[(int64_t)(n0 + n) * ldy + r] = lane_sum2x8(acc[2 * n], acc[2 * n + 1]);       \
            }                                                                                       \
        }                                                                                           \
    }

QKERNEL(k_q5_0, unpack_q5_0, 22, 4, 0)
QKERNEL(k_q5_1, unpack_q5_1, 24, 0, 1)

/* Float weights: lanes 0..7 and 8..15 in two ymm; the ragged end goes
 * through a zero-padded copy (adds +0). */
static inline ES_AI __m256 load_w8(uint32_t type, const uint8_t *p) {
    if (type == ES_TYPE_F32) return _mm256_loadu_ps((const float *)(const void *)p);
    __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    if (type == ES_TYPE_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

static inline ES_AI void float_kernel(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t r0,
                                      int64_t r1, int64_t n_in, const void *xv, size_t x_stride, int N,
                                      float *Y, int64_t ldy) {
    const uint8_t *x = xv;
    size_t esz = type == ES_TYPE_F32 ? 4 : 2;
    int64_t n16 = n_in / 16 * 16;
    __m256 acc[2 * NT];
    for (int n0 = 0; n0 < N; n0 += NT) {
        int nt = N - n0 < NT ? N - n0 : NT;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            for (int i = 0; i < 2 * nt; i++) acc[i] = _mm256_setzero_ps();
            for (int64_t i = 0; i < n_in; i += 16) {
                uint8_t wbuf[64];
                float xbuf[16];
                const uint8_t *wp = row + (size_t)i * esz;
                if (i >= n16) {
                    memset(wbuf, 0, sizeof wbuf);
                    memcpy(wbuf, wp, (size_t)(n_in - i) * esz);
                    wp = wbuf;
                }
                __m256 w0 = load_w8(type, wp), w1 = load_w8(type, wp + 8 * esz);
                for (int n = 0; n < nt; n++) {
                    const float *xr = (const float *)(const void *)(x + (size_t)(n0 + n) * x_stride) + i;
                    if (i >= n16) {
                        memset(xbuf, 0, sizeof xbuf);
                        memcpy(xbuf, xr, (size_t)(n_in - i) * sizeof(float));
                        xr = xbuf;
                    }
                    acc[2 * n] = _mm256_add_ps(acc[2 * n], _mm256_mul_ps(w0, _mm256_loadu_ps(xr)));
                    acc[2 * n + 1] = _mm256_add_ps(acc[2 * n + 1], _mm256_mul_ps(w1, _mm256_loadu_ps(xr + 8)));
                }
            }
            for (int n = 0; n < nt; n++) Y[(int64_t)(n0 + n) * ldy + r] = lane_sum2x8(acc[2 * n], acc[2 * n + 1]);
        }
    }
}

#define FKERNEL(name, t)                                                                  \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n_in,   \
                     const void *x, size_t xs, int N, float *Y, int64_t ldy) {            \
        float_kernel(t, w, rb, r0, r1, n_in, x, xs, N, Y, ldy);                           \
    }
FKERNEL(k_f32, ES_TYPE_F32)
FKERNEL(k_f16, ES_TYPE_F16)
FKERNEL(k_bf16, ES_TYPE_BF16)

/* Activation quantization (contract step 1), 32 elements per step. */
int es_x86_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) {
    if (n % QK != 0) return 0;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t j = j0; j < j1; j++) {
        es_q8_group *g = &out[j / ES_GROUP_BLOCKS];
        int jj = (int)(j % ES_GROUP_BLOCKS);
        __m256 xv[4], m = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            xv[i] = _mm256_loadu_ps(x + j * QK + 8 * i);
            m = _mm256_max_ps(_mm256_and_ps(xv[i], absmask), m);   /* keeps m when NaN */
        }
        float t[8];
        _mm256_storeu_ps(t, m);
        float amax = 0.0f;
        for (int i = 0; i < 8; i++)
            if (t[i] > amax) amax = t[i];
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        int32_t q[32];
        for (int i = 0; i < 4; i++)
            _mm256_storeu_si256((__m256i *)(void *)(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], vid)));
        int32_t sum = 0, lo = 0;
        for (int i = 0; i < 32; i++) {
            g->qs[(i / 4) * 64 + jj * 4 + i % 4] = (int8_t)q[i];
            sum += q[i];
            if (i == 15) lo = sum;
        }
        es_q8_set_block(g, jj, d, sum, lo);
    }
    return 1;
}

/* ---- packed kernels (Q4_0, Q4_1, Q8_0; K types below): 16 weight rows in the lanes ----
 * A packed record (quant.h) is one block of 16 rows; a ymm holds 8 of them,
 * so a record is two halves (half h = rows 8h..8h+7 = bytes 32h..32h+31 of
 * each 64-byte chunk). Weight vector k of a half (lane i = elements
 * 4k..4k+3 of row 8h+i) is made once and every activation row of a tile
 * multiplies its dword k of the block, broadcast, into it before vector
 * k + 1 is made (chunk-major: per row only an int sum and the accumulator
 * stay in registers, so tiles of 6 rows fit in 16 ymm):
 *   Q4_0, Q4_1  unsigned nibbles x int8 with maddubs; the 8 chunk products
 *               add up in int16 (at most 8 * 2 * 15 * 127 = 30480), one madd
 *               with ones makes the 8 rows' I; Q4_0 subtracts 8 * qsum
 *   Q8_0        |w| x sign(x, w) with maddubs (at most 2 * 128 * 127 =
 *               32512), widened by a madd per chunk
 * all exact. Then the contract's float steps run on the 8 rows and add to
 * the row's accumulator, blocks in order (the sequential contract). The
 * halves run one after the other over a segment of PSEG records, so the
 * second re-reads it from L1; the accumulators carry over between segments
 * in memory (exact). The first tile of a group prefetches the weight stream
 * into L2 like the AVX-512 kernel (same distance; not measured separately). */

#define PTILE 6    /* most activation rows per tile (16 ymm: per row an int sum and an accumulator) */
#define PSEG 64    /* records per segment: 18 KB (Q4_0) to 34 KB (Q8_0) */
#ifndef ES_PF_BYTES
#define ES_PF_BYTES 8192
#endif

static inline ES_AI __m256 f16x8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

static inline ES_AI __m256i bcast32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* Half h of the record at p (block jj of the activation groups xr[n]) into
 * the nt rows' acc. Chunk-major: weight vector k is made once and taken by
 * every row before the next, so only one weight vector and the rows'
 * partial sums are live (the 8 weight vectors of a half and the rows'
 * accumulators do not fit in 16 ymm together). */
static inline ES_AI void prows(const int nt, const int type, const uint8_t *p, int h,
                               const uint8_t *const *xr, int jj, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    const uint8_t *s = p + 32 * h;
    __m256i S[PTILE];   /* Q8_0: int32 sums; Q4_0, Q4_1: int16 sums */
    UNROLL
    for (int k = 0; k < 8; k++) {
        __m256i w, ws = _mm256_setzero_si256();
        if (type == ES_TYPE_Q8_0) {
            ws = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64 * k));
            w = _mm256_abs_epi8(ws);
        } else {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64 * (k % 4)));
            w = _mm256_and_si256(k < 4 ? v : _mm256_srli_epi16(v, 4), m4);
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            __m256i bx = bcast32(xr[n] + 4 * jj + 64 * k);
            if (type == ES_TYPE_Q8_0) {
                __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(bx, ws)), ones);
                S[n] = k == 0 ? t : _mm256_add_epi32(S[n], t);
            } else {
                __m256i t = _mm256_maddubs_epi16(w, bx);
                S[n] = k == 0 ? t : _mm256_add_epi16(S[n], t);
            }
            /* an empty asm on the sum: the compiler would otherwise regroup
             * the (associative) integer adds into a tree over all 8 chunks
             * and keep every product live, spilling them */
            __asm__("" : "+x"(S[n]));
        }
    }
    const __m256 a = f16x8(p + (type == ES_TYPE_Q8_0 ? 512 : 256) + 16 * h);
    UNROLL
    for (int n = 0; n < nt; n++) {
        const uint8_t *b = xr[n] + 4 * jj;   /* qs[4 jj]; d, qsum, dq [jj] at their offsets from it */
        float d, dq;
        int32_t qsum;
        memcpy(&d, b + offsetof(es_q8_group, d), 4);
        __m256i I = type == ES_TYPE_Q8_0 ? S[n] : _mm256_madd_epi16(S[n], ones);
        if (type == ES_TYPE_Q4_0) {
            memcpy(&qsum, b + offsetof(es_q8_group, qsum), 4);
            I = _mm256_sub_epi32(I, _mm256_set1_epi32(8 * qsum));
        }
        __m256 c = _mm256_mul_ps(_mm256_mul_ps(a, _mm256_set1_ps(d)), _mm256_cvtepi32_ps(I));
        if (type == ES_TYPE_Q4_1) {
            memcpy(&dq, b + offsetof(es_q8_group, dq), 4);
            c = _mm256_add_ps(c, _mm256_mul_ps(f16x8(p + 288 + 16 * h), _mm256_set1_ps(dq)));
        }
        acc[n] = _mm256_add_ps(acc[n], c);
    }
}

/* Half h of records [s0, s1) (s0 a multiple of 16) into acc; pf: prefetch. */
static inline ES_AI void phalf_run(const int nt, const int type, const uint8_t *g, int64_t s0, int64_t s1, int h,
                                   const uint8_t *x, size_t xs, __m256 *acc, int pf) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    for (int64_t j0 = s0; j0 < s1; j0 += ES_GROUP_BLOCKS) {
        const uint8_t *xr[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) xr[n] = x + (size_t)n * xs + (size_t)(j0 / ES_GROUP_BLOCKS) * sizeof(es_q8_group);
        int nj = s1 - j0 < ES_GROUP_BLOCKS ? (int)(s1 - j0) : ES_GROUP_BLOCKS;
        const uint8_t *p = g + (size_t)j0 * rec;
        for (int jj = 0; jj < nj; jj++, p += rec) {
            if (pf)
                for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)(p + ES_PF_BYTES + o), _MM_HINT_T1);
            prows(nt, type, p, h, xr, jj, acc);
        }
    }
}

/* Packed K types (quant.h layouts; the float steps and the exact integer
 * sums as in the AVX-512 kernel, whose comment explains the (float)m * fq
 * term): half h of a super-block record is bytes 32h..32h+31 of each 64-byte
 * chunk. Per sub-block j, the 8 weight vectors of the half stay in
 * registers while every row of the tile takes its activation dwords
 * broadcast. int16 sums before the madd with ones (all exact):
 *   Q4_K  all 8 chunk products, at most 8 * 2 * 15 * 127 = 30480
 *   Q5_K  4 + 4, at most 4 * 2 * 31 * 127 = 31496
 *   Q6_K  2 + 2 + 2 + 2, at most 2 * 2 * 63 * 127 = 32004 (elements 0..15
 *         and 16..31 stay apart for their two scales) */
#define PSEG_K 8   /* super-block records per segment: 18 KB (Q4_K) to 27 KB (Q6_K) */
/* Most activation rows per tile of the K types (an int16 and an int32 sum
 * and the accumulator of each row in registers): the driver's tiles. Two
 * sub-tiles of a 6-row tile instead were slower at N = 9 (kernel_bench
 * types, Q6_K): each pass re-makes the weight vectors. */
#define KTILE 3
#undef PTILE_OF
#define PTILE_OF(type) ((type) == ES_TYPE_Q4_K || (type) == ES_TYPE_Q5_K || (type) == ES_TYPE_Q6_K ? KTILE : PTILE)

static inline ES_AI __m256i pk_weights8(const int type, const uint8_t *p, int h, int j, int k) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t *s = p + 32 * h + 64 * k;
#define LD(q) _mm256_loadu_si256((const __m256i *)(const void *)(q))
    if (type == ES_TYPE_Q6_K) {
        int hh = j / 4, t = j % 4;
        __m256i l = LD(s + (2 * hh + (t & 1)) * 512);
        __m256i q = _mm256_and_si256(t >= 2 ? _mm256_srli_epi16(l, 4) : l, m4);
        __m256i hb = LD(s + ES_PK_Q6K_QH + 512 * hh);
        hb = t < 2 ? _mm256_slli_epi16(hb, 4 - 2 * t) : t == 2 ? hb : _mm256_srli_epi16(hb, 2);
        return _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x30)));
    }
    __m256i v = LD(s + (j / 2) * 512);
    __m256i q = _mm256_and_si256((j & 1) ? _mm256_srli_epi16(v, 4) : v, m4);
    if (type == ES_TYPE_Q5_K) {
        __m256i hb = LD(s + ES_PK_Q5K_QH);
        hb = j <= 4 ? _mm256_slli_epi16(hb, 4 - j) : _mm256_srli_epi16(hb, j - 4);
        q = _mm256_or_si256(q, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
    }
#undef LD
    return q;
}

/* Byte j % 4 of every lane of v as int32. */
static inline ES_AI __m256i pk_byte8(__m256i v, int j) {
    j &= 3;
    if (j == 3) return _mm256_srli_epi32(v, 24);
    if (j) v = _mm256_srli_epi32(v, 8 * j);
    return _mm256_and_si256(v, _mm256_set1_epi32(0xFF));
}

/* Half h of K records [s0, s1) into acc; pf: prefetch. */
static inline ES_AI void khalf_run(const int nt, const int type, const uint8_t *g, int64_t s0, int64_t s1, int h,
                                   const uint8_t *x, size_t xs, __m256 *acc, int pf) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    const int q6 = type == ES_TYPE_Q6_K;
    const size_t sco = type == ES_TYPE_Q4_K ? ES_PK_Q4K_SC : ES_PK_Q5K_SC;
    const size_t dof = q6 ? ES_PK_Q6K_D : type == ES_TYPE_Q4_K ? ES_PK_Q4K_D : ES_PK_Q5K_D;
    const size_t mof = type == ES_TYPE_Q4_K ? ES_PK_Q4K_DMIN : ES_PK_Q5K_DMIN;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t sb = s0; sb < s1; sb++) {
        const uint8_t *p = g + (size_t)sb * rec;
        if (pf)
            for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)(p + ES_PF_BYTES + o), _MM_HINT_T1);
        const __m256 a = f16x8(p + dof + 16 * h);
        __m256 b = _mm256_setzero_ps();
        __m256i S[2], M[2];
        if (!q6) {
            b = _mm256_xor_ps(f16x8(p + mof + 16 * h), _mm256_set1_ps(-0.0f));   /* -dmin, exact */
            const uint8_t *sp = p + sco + 32 * h;
            const __m256i u0 = _mm256_loadu_si256((const __m256i *)(const void *)sp);
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(const void *)(sp + 64));
            const __m256i u2 = _mm256_loadu_si256((const __m256i *)(const void *)(sp + 128));
            const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), h2 = _mm256_set1_epi8(0x30);
            S[0] = _mm256_and_si256(u0, m6);
            M[0] = _mm256_and_si256(u1, m6);
            S[1] = _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), h2));
            M[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(u1, 2), h2));
        }
        const uint8_t *xr[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) xr[n] = x + (size_t)n * xs + (size_t)(sb / 2) * sizeof(es_q8_group);
        const int j0 = 8 * (int)(sb % 2);
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m256i sl, sh = _mm256_setzero_si256();
            __m256 fm = _mm256_setzero_ps();
            if (q6) {
                const uint8_t *sp = p + ES_PK_Q6K_SC + 32 * j + 8 * h;
                sl = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)sp));
                sh = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(sp + 16)));
            } else {
                sl = pk_byte8(S[j / 4], j);
                fm = _mm256_cvtepi32_ps(pk_byte8(M[j / 4], j));
            }
            const int jj = j0 + j;
            /* chunk-major (see prows): S16[n] the int16 sum of the current
             * run of chunks, I[n] the int32 sum (Q6_K: the scaled sum) */
            __m256i S16[KTILE], I[KTILE];
            UNROLL
            for (int k = 0; k < 8; k++) {
                const __m256i w = pk_weights8(type, p, h, j, k);
                UNROLL
                for (int n = 0; n < nt; n++) {
                    const uint8_t *q = xr[n] + 4 * jj;   /* qs[4 jj]; d, qsum, ... [jj] at their offsets from it */
                    __m256i t = _mm256_maddubs_epi16(w, bcast32(q + 64 * k));
                    /* a run ends after 8 (Q4_K), 4 (Q5_K) or 2 (Q6_K) chunks */
                    const int run = type == ES_TYPE_Q4_K ? 8 : type == ES_TYPE_Q5_K ? 4 : 2;
                    S16[n] = k % run == 0 ? t : _mm256_add_epi16(S16[n], t);
                    __asm__("" : "+x"(S16[n]));   /* keeps the adds in this order (see prows) */
                    if (k % run != run - 1) continue;
                    __m256i t32 = _mm256_madd_epi16(S16[n], ones);
                    if (q6) {
                        int32_t qlo, qsum;
                        memcpy(&qlo, q + offsetof(es_q8_group, qlo), 4);
                        memcpy(&qsum, q + offsetof(es_q8_group, qsum), 4);
                        /* I = sl * (lo - 32 qlo) + sh * (hi - 32 (qsum - qlo)), exact in
                         * any grouping: lo = pairs 0, 1; hi = pairs 2, 3 */
                        if (k == 1) I[n] = t32;
                        else if (k == 3) I[n] = _mm256_mullo_epi32(sl, _mm256_sub_epi32(_mm256_add_epi32(I[n], t32), _mm256_set1_epi32(32 * qlo)));
                        else if (k == 5) I[n] = _mm256_add_epi32(I[n], _mm256_mullo_epi32(sh, _mm256_sub_epi32(t32, _mm256_set1_epi32(32 * (qsum - qlo)))));
                        else I[n] = _mm256_add_epi32(I[n], _mm256_mullo_epi32(sh, t32));
                    } else {
                        I[n] = k < run ? t32 : _mm256_add_epi32(I[n], t32);
                    }
                    __asm__("" : "+x"(I[n]));
                }
            }
            UNROLL
            for (int n = 0; n < nt; n++) {
                const uint8_t *q = xr[n] + 4 * jj;
                float d, fq;
                memcpy(&d, q + offsetof(es_q8_group, d), 4);
                const __m256i Iw = q6 ? I[n] : _mm256_mullo_epi32(sl, I[n]);
                const __m256 dx = _mm256_set1_ps(d);
                __m256 c = _mm256_mul_ps(_mm256_mul_ps(a, dx), _mm256_cvtepi32_ps(Iw));
                if (!q6) {
                    memcpy(&fq, q + offsetof(es_q8_group, fq), 4);
                    c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(b, dx), _mm256_mul_ps(fm, _mm256_set1_ps(fq))));
                }
                acc[n] = _mm256_add_ps(acc[n], c);
            }
        }
    }
}

/* One group of 16 weight rows (nb records at g) times a tile of nt (a
 * constant 1..PTILE) activation rows x; stores nr (1..16) outputs per row.
 * A half wholly past nr is skipped. pf: as in the AVX-512 kernel. */
static inline ES_AI void pgroup(const int nt, const int type, const uint8_t *g, int64_t nb, const uint8_t *x,
                                size_t xs, float *Y, int64_t ldy, int nr, int pf) {
    const int nh = nr > 8 ? 2 : 1;
    __m256 part[2][PTILE];
    if (pf == 2)   /* the first group of a chunk: the head of the stream */
        for (size_t o = 0; o < ES_PF_BYTES; o += 64) _mm_prefetch((const char *)(g + o), _MM_HINT_T1);
    const int kt = type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K || type == ES_TYPE_Q6_K;
    const int64_t seg = kt ? PSEG_K : PSEG;
    for (int64_t s0 = 0; s0 < nb; s0 += seg) {
        int64_t s1 = nb - s0 < seg ? nb : s0 + seg;
        for (int h = 0; h < nh; h++) {
            __m256 acc[PTILE];
            UNROLL
            for (int n = 0; n < nt; n++) acc[n] = s0 == 0 ? _mm256_setzero_ps() : part[h][n];
            if (kt) khalf_run(nt <= KTILE ? nt : 1, type, g, s0, s1, h, x, xs, acc, pf && h == 0);
            else phalf_run(nt, type, g, s0, s1, h, x, xs, acc, pf && h == 0);
            UNROLL
            for (int n = 0; n < nt; n++) part[h][n] = acc[n];
        }
    }
    for (int h = 0; h < nh; h++) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8 * h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        for (int n = 0; n < nt; n++) {
            float *y = Y + (int64_t)n * ldy + 8 * h;
            if (8 * h + 8 <= nr) _mm256_storeu_ps(y, part[h][n]);
            else _mm256_maskstore_ps(y, m, part[h][n]);
        }
    }
}

ES_PACKED_KERNELS_K(es_x86_packed_kernel)

es_mm_kernel es_x86_kernel(uint32_t type) {
    switch (type) {
    case ES_TYPE_F32: return k_f32;
    case ES_TYPE_F16: return k_f16;
    case ES_TYPE_BF16: return k_bf16;
    case ES_TYPE_Q5_0: return k_q5_0;
    case ES_TYPE_Q5_1: return k_q5_1;
    default: return NULL;
    }
}
const char *es_x86_simd_name(void) { return "avx2"; }

#else /* no x86 SIMD path in this build */

es_mm_kernel es_x86_kernel(uint32_t type) { return NULL; }
es_mm_kernel es_x86_packed_kernel(uint32_t type) { (void)type; return NULL; }
const char *es_x86_simd_name(void) { return NULL; }
int es_x86_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) { return 0; }

#endif
