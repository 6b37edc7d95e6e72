/*
 * quant_neon.c - NEON (dotprod) matmul kernels for aarch64. Same contract
 * and results (bitwise) as the scalar kernels in quant.c.
 *
 * Quantized types (dotprod builds only): packed kernels, see "packed
 * kernels" below. Without dotprod they use the scalar kernels
 * (es_neon_packed_kernel returns NULL, so they stay unpacked). Float types:
 * lane kernels.
 */
#include "quant.h"

#if !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#define ES_NEON 1
#endif

#ifdef ES_NEON
#include <arm_neon.h>
#include <stddef.h>
#include <string.h>

#define NT 32   /* activation rows per pass */
#define ES_AI __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* The fixed 16-lane tree (es_lane_sum in quant.h) over 4 quad vectors. */
static inline ES_AI float lane_sum16(const float32x4_t *a) {
    float32x4_t p01 = vpaddq_f32(a[0], a[1]);   /* l0+l1, l2+l3, l4+l5, l6+l7 */
    float32x4_t p23 = vpaddq_f32(a[2], a[3]);
    float32x4_t s = vpaddq_f32(p01, p23);       /* a0, a1, a2, a3 of es_lane_sum */
    float32x4_t t = vpaddq_f32(s, s);           /* a0+a1, a2+a3, ... */
    return vgetq_lane_f32(t, 0) + vgetq_lane_f32(t, 1);
}

/* Float weights: lane i % 16 += w[i] * x[i], 4 vectors of 4 lanes; the
 * ragged end goes through a zero-padded copy (adds +0). */
static inline ES_AI float32x4_t load_w4(uint32_t type, const uint8_t *p) {
    if (type == ES_TYPE_F32) return vld1q_f32((const float *)(const void *)p);
    uint16x4_t h = vld1_u16((const uint16_t *)(const void *)p);
    if (type == ES_TYPE_F16) return vcvt_f32_f16(vreinterpret_f16_u16(h));
    return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}

static inline ES_AI void float_kernel(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t r0,
                                      int64_t r1, int64_t n_in, const void *xv, size_t x_stride, int N,
                                      float *Y, int64_t ldy) {
    const uint8_t *x = xv;
    size_t esz = type == ES_TYPE_F32 ? 4 : 2;
    int64_t n16 = n_in / 16 * 16;
    float32x4_t acc[NT * 4];
    for (int n0 = 0; n0 < N; n0 += NT) {
        int nt = N - n0 < NT ? N - n0 : NT;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            for (int i = 0; i < nt * 4; i++) acc[i] = vdupq_n_f32(0.0f);
            for (int64_t i = 0; i < n_in; i += 16) {
                uint8_t wbuf[64];
                float xbuf[16];
                const uint8_t *wp = row + (size_t)i * esz;
                if (i >= n16) {
                    memset(wbuf, 0, sizeof wbuf);
                    memcpy(wbuf, wp, (size_t)(n_in - i) * esz);
                    wp = wbuf;
                }
                float32x4_t wv[4];
                UNROLL
                for (int q = 0; q < 4; q++) wv[q] = load_w4(type, wp + 4 * q * esz);
                for (int n = 0; n < nt; n++) {
                    const float *xr = (const float *)(const void *)(x + (size_t)(n0 + n) * x_stride) + i;
                    if (i >= n16) {
                        memset(xbuf, 0, sizeof xbuf);
                        memcpy(xbuf, xr, (size_t)(n_in - i) * sizeof(float));
                        xr = xbuf;
                    }
                    UNROLL
                    for (int q = 0; q < 4; q++)
                        acc[n * 4 + q] = vaddq_f32(acc[n * 4 + q], vmulq_f32(wv[q], vld1q_f32(xr + 4 * q)));
                }
            }
            for (int n = 0; n < nt; n++) Y[(int64_t)(n0 + n) * ldy + r] = lane_sum16(acc + 4 * n);
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

#ifdef __ARM_FEATURE_DOTPROD
/* ---- packed kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): 16 weight rows in the lanes ----
 * A packed record (quant.h) is one block of 16 rows; an int32x4 holds 4 of
 * them, so a record is 4 quarters (quarter q = rows 4q..4q+3 = bytes
 * 16q..16q+15 of each 64-byte chunk). The 8 weight vectors of one quarter
 * (vector k, lane i = elements 4k..4k+3 of row 4q+i; Q4 nibbles 0..15,
 * Q5 5-bit values 0..31, Q8_0 as stored) stay in registers while every
 * activation row of a tile takes 8 sdot by element with its dword k of the
 * block (an 8-byte load, lane 0): the 4 rows' exact I (Q4_0: minus
 * 8 * qsum, Q5_0: minus 16 * qsum, both in the chain's start value). Then
 * the contract's float steps run on the 4 rows and add to the row's
 * accumulator, blocks in order (the sequential contract). The quarters run
 * one after the other over a segment of PSEG records, so the later ones
 * re-read it from L1; the accumulators carry over between segments in
 * memory (exact). */

#define PTILE 6    /* most activation rows per register tile (7 and 8 spill for Q4_0) */
#define PSEG 64    /* records per segment: 18 KB (Q4_0) to 34 KB (Q8_0), in the A76's 64 KB L1 */

typedef struct {
    int8x16_t w[8];
    float32x4_t a, b;   /* d and (Q4_1) m of the 4 rows */
} pquarter;

static inline ES_AI float32x4_t f16x4(const uint8_t *p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)(const void *)p)));
}

/* int32 -> float for |v| < 2^22 without a conversion instruction (on the
 * A76 a 4-lane scvtf is two uops on one of the two ASIMD pipes): an sdot
 * chain that starts at MAGIC_I (the bits of 1.5 * 2^23) ends at the bits of
 * the float 1.5 * 2^23 + v (the exponent stays that of [2^23, 2^24), the
 * mantissa holds 2^22 + v), and from_magic subtracts 1.5 * 2^23, which is
 * exact: the result is bitwise vcvtq_f32_s32(v), +0 for v = 0. */
#define MAGIC_I 0x4B400000
static inline ES_AI float32x4_t from_magic(int32x4_t m) {
    return vsubq_f32(vreinterpretq_f32_s32(m), vdupq_n_f32(12582912.0f));
}
static inline ES_AI float32x4_t small_to_f32(int32x4_t v) { return from_magic(vaddq_s32(v, vdupq_n_s32(MAGIC_I))); }

/* Quarter q of the record at p. */
static inline ES_AI void punpack(const int type, const uint8_t *p, int q, pquarter *u) {
    const uint8_t *s = p + 16 * q;
    if (type == ES_TYPE_Q8_0) {
        UNROLL
        for (int k = 0; k < 8; k++) u->w[k] = vld1q_s8((const int8_t *)(const void *)(s + 64 * k));
        u->a = f16x4(p + 512 + 8 * q);
        return;
    }
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    if (type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1) {
        /* nibble | (bit c of each byte of qh[r] at bit 4): 0..31, exact as int8 */
        const uint8x16_t qh = vld1q_u8(p + ES_PK_Q5_QH + 16 * q), m10 = vdupq_n_u8(0x10);
        uint8x16_t hb[8] = {vshlq_n_u8(qh, 4), vshlq_n_u8(qh, 3), vshlq_n_u8(qh, 2), vshlq_n_u8(qh, 1),
                            qh, vshrq_n_u8(qh, 1), vshrq_n_u8(qh, 2), vshrq_n_u8(qh, 3)};
        UNROLL
        for (int k = 0; k < 4; k++) {
            uint8x16_t v = vld1q_u8(s + 64 * k);
            u->w[k] = vreinterpretq_s8_u8(vbslq_u8(m10, hb[k], vandq_u8(v, m4)));
            u->w[k + 4] = vreinterpretq_s8_u8(vbslq_u8(m10, hb[k + 4], vshrq_n_u8(v, 4)));
        }
        u->a = f16x4(p + ES_PK_Q5_D + 8 * q);
        if (type == ES_TYPE_Q5_1) u->b = f16x4(p + ES_PK_Q5_M + 8 * q);
        return;
    }
    UNROLL
    for (int k = 0; k < 4; k++) {
        uint8x16_t v = vld1q_u8(s + 64 * k);
        u->w[k] = vreinterpretq_s8_u8(vandq_u8(v, m4));
        u->w[k + 4] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
    }
    u->a = f16x4(p + 256 + 8 * q);
    if (type == ES_TYPE_Q4_1) u->b = f16x4(p + 288 + 8 * q);
}

/* One quarter of block jj into the nt rows' acc; xr[n] = row n's
 * es_q8_group of the block. One sdot chain per row (the rows of the tile
 * are the independent chains); the 8-byte loads stay inside the group (at
 * most byte 516 of 768). */
static inline ES_AI void prows(const int nt, const int type, const pquarter *u, const uint8_t *const *xr, int jj,
                               float32x4_t *acc) {
    UNROLL
    for (int n = 0; n < nt; n++) {
        const uint8_t *b = xr[n] + 4 * jj;   /* qs[4 jj]; d, qsum, dq [jj] at their offsets from it */
        float d, dq;
        int32_t qsum;
        memcpy(&d, b + offsetof(es_q8_group, d), 4);
        /* |I| <= 32 * 128 * 127 < 2^22 (Q8_0; Q4_0, Q4_1 less; Q5_0 at most
         * 32 * 31 * 127 + 16 * 32 * 127): from_magic is (float)I */
        int32x4_t I = vdupq_n_s32(MAGIC_I);
        if (type == ES_TYPE_Q4_0 || type == ES_TYPE_Q5_0) {
            memcpy(&qsum, b + offsetof(es_q8_group, qsum), 4);
            int32_t st = MAGIC_I - (type == ES_TYPE_Q5_0 ? 16 : 8) * qsum;
            __asm__("" : "+r"(st));   /* computed in a general register (GCC would use vector ones) */
            I = vdupq_n_s32(st);
        }
        UNROLL
        for (int k = 0; k < 8; k++) I = vdotq_lane_s32(I, u->w[k], vld1_s8((const int8_t *)(b + 64 * k)), 0);
        acc[n] = vfmaq_f32(acc[n], vmulq_n_f32(u->a, d), from_magic(I));
        if (type == ES_TYPE_Q4_1) {
            memcpy(&dq, b + offsetof(es_q8_group, dq), 4);
            acc[n] = vfmaq_n_f32(acc[n], u->b, dq);
        }
        if (type == ES_TYPE_Q5_1) {
            float fq;
            memcpy(&fq, b + offsetof(es_q8_group, fq), 4);
            acc[n] = vfmaq_n_f32(acc[n], vmulq_n_f32(u->b, d), fq);
        }
    }
}

/* Quarter q of records [s0, s1) (s0 a multiple of 16) into acc. */
static inline ES_AI void pquarter_run(const int nt, const int type, const uint8_t *g, int64_t s0, int64_t s1, int q,
                                      const uint8_t *x, size_t xs, float32x4_t *acc) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    for (int64_t j0 = s0; j0 < s1; j0 += ES_GROUP_BLOCKS) {
        const uint8_t *xr[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) xr[n] = x + (size_t)n * xs + (size_t)(j0 / ES_GROUP_BLOCKS) * sizeof(es_q8_group);
        int nj = s1 - j0 < ES_GROUP_BLOCKS ? (int)(s1 - j0) : ES_GROUP_BLOCKS;
        const uint8_t *p = g + (size_t)j0 * rec;
        for (int jj = 0; jj < nj; jj++, p += rec) {
            pquarter u;
            punpack(type, p, q, &u);
            prows(nt, type, &u, xr, jj, acc);
        }
    }
}

/* ---- packed K types (Q4_K, Q5_K, Q6_K): one record = one super-block of
 * 16 rows = 8 sub-blocks of 32 elements ----
 * The activation row's K record of super-block s (es_q8k_block) holds its
 * 256 int8 values in order. As above, a record is handled in quarters of 4
 * rows over a segment of PSEG_K records; per quarter and record the d (and
 * dmin) of the 4 rows and their sub-block scales and mins are unpacked
 * once, then per sub-block the 8 weight vectors (vector k, lane i =
 * elements 4k..4k+3 of row 4q+i), and every activation row of the tile
 * loads its sub-block's 32 values (two 16-byte loads) and takes 8 sdot by
 * lane; the integer sums of the contract (step 2K), all exact:
 *   Q4_K, Q5_K  unsigned 4- / 5-bit weights (0..31: exact as int8);
 *               I += sc * D (mla), D the sub-block's dot;
 *               J = sum_j m[j] * s32[j] (8 mlal by lane of the int16 s32)
 *   Q6_K        q - 32 (-32..31: exact as int8, no offset term);
 *               I += sl * lo + sh * hi (lo, hi: the halves' dots)
 * then the contract's float steps run once per super-block on 4 rows. */

#define PSEG_K 8   /* K records per segment: 18 KB (Q4_K) to 27 KB (Q6_K), in the A76's 64 KB L1 */

/* One quarter of a K record: the per-row factors and sub-block scales. */
typedef struct {
    float32x4_t a, b;   /* d, -dmin (Q6_K: d only) */
    uint8x16_t s[2], m[2];   /* Q4_K / Q5_K: byte j % 4 of lane i of s[j / 4] / m[j / 4] = sub-block j's
                                6-bit scale / min of row 4q+i (ggml's get_scale_min_k4) */
} pkquarter;

static inline ES_AI void pk_setup(const int type, const uint8_t *p, int q, pkquarter *u) {
    if (type == ES_TYPE_Q6_K) {
        u->a = f16x4(p + ES_PK_Q6K_D + 8 * q);
        return;
    }
    const size_t sco = type == ES_TYPE_Q4_K ? ES_PK_Q4K_SC : ES_PK_Q5K_SC;
    const size_t dof = type == ES_TYPE_Q4_K ? ES_PK_Q4K_D : ES_PK_Q5K_D;
    const size_t mof = type == ES_TYPE_Q4_K ? ES_PK_Q4K_DMIN : ES_PK_Q5K_DMIN;
    u->a = f16x4(p + dof + 8 * q);
    u->b = vnegq_f32(f16x4(p + mof + 8 * q));   /* b = -dmin: the sign flipped, exact */
    const uint8x16_t u0 = vld1q_u8(p + sco + 16 * q), u1 = vld1q_u8(p + sco + 64 + 16 * q);
    const uint8x16_t u2 = vld1q_u8(p + sco + 128 + 16 * q);
    const uint8x16_t m6 = vdupq_n_u8(0x3F), h2 = vdupq_n_u8(0x30);
    u->s[0] = vandq_u8(u0, m6);
    u->m[0] = vandq_u8(u1, m6);
    /* sub-blocks 4..7: low 4 bits from byte j + 4, top 2 from the top of byte j - 4 */
    u->s[1] = vbslq_u8(h2, vshrq_n_u8(u0, 2), vandq_u8(u2, vdupq_n_u8(0x0F)));
    u->m[1] = vbslq_u8(h2, vshrq_n_u8(u1, 2), vshrq_n_u8(u2, 4));
}

/* Byte j % 4 of every 32-bit lane of v, as int32. */
static inline ES_AI int32x4_t pk_byte(uint8x16_t v, int j) {
    uint32x4_t w = vreinterpretq_u32_u8(v);
    j &= 3;
    if (j == 3) return vreinterpretq_s32_u32(vshrq_n_u32(w, 24));
    if (j == 1) w = vshrq_n_u32(w, 8);
    if (j == 2) w = vshrq_n_u32(w, 16);
    return vreinterpretq_s32_u32(vandq_u32(w, vdupq_n_u32(0xFF)));
}

/* The 8 weight vectors of sub-block j (a constant), quarter q of record p. */
static inline ES_AI void pk_weights(const int type, const uint8_t *p, int q, const int j, int8x16_t w[8]) {
    const uint8x16_t m4 = vdupq_n_u8(0x0F);
    if (type == ES_TYPE_Q6_K) {
        const int h = j / 4, s = j % 4;
        const uint8_t *l = p + (2 * h + (s & 1)) * 512 + 16 * q, *hp = p + ES_PK_Q6K_QH + 512 * h + 16 * q;
        UNROLL
        for (int k = 0; k < 8; k++) {
            uint8x16_t v = vld1q_u8(l + 64 * k), hb = vld1q_u8(hp + 64 * k);
            v = s >= 2 ? vshrq_n_u8(v, 4) : vandq_u8(v, m4);
            /* bits 2s, 2s + 1 of each byte to bits 4, 5 */
            if (s == 0) hb = vshlq_n_u8(hb, 4);
            if (s == 1) hb = vshlq_n_u8(hb, 2);
            if (s == 3) hb = vshrq_n_u8(hb, 2);
            w[k] = vsubq_s8(vreinterpretq_s8_u8(vbslq_u8(vdupq_n_u8(0x30), hb, v)), vdupq_n_s8(32));
        }
        return;
    }
    const uint8_t *l = p + (j / 2) * 512 + 16 * q;
    UNROLL
    for (int k = 0; k < 8; k++) {
        uint8x16_t v = vld1q_u8(l + 64 * k);
        v = (j & 1) ? vshrq_n_u8(v, 4) : vandq_u8(v, m4);
        if (type == ES_TYPE_Q5_K) {
            uint8x16_t hb = vld1q_u8(p + ES_PK_Q5K_QH + 64 * k + 16 * q);
            /* bit j of each byte to bit 4 */
            if (j < 4) hb = vshlq_n_u8(hb, 4 - j);
            if (j > 4) hb = vshrq_n_u8(hb, j - 4);
            v = vbslq_u8(vdupq_n_u8(0x10), hb, v);
        }
        w[k] = vreinterpretq_s8_u8(v);
    }
}

/* Sub-block j's integer sums of a record's quarter into the nt rows' I;
 * xr[n] = row n's K record of the super-block. */
static inline ES_AI void pk_rows(const int nt, const int type, const pkquarter *u, const int8x16_t w[8], const int j,
                                 const es_q8k_block *const *xr, const uint8_t *p, int q, int32x4_t *I) {
    int32x4_t sl, sh = vdupq_n_s32(0);
    if (type == ES_TYPE_Q6_K) {
        int32_t t0, t1;
        memcpy(&t0, p + ES_PK_Q6K_SC + 32 * j + 4 * q, 4);
        memcpy(&t1, p + ES_PK_Q6K_SC + 32 * j + 16 + 4 * q, 4);
        int16x8_t h = vmovl_s8(vreinterpret_s8_s32(vset_lane_s32(t1, vdup_n_s32(t0), 1)));
        sl = vmovl_s16(vget_low_s16(h));
        sh = vmovl_high_s16(h);
    } else {
        sl = pk_byte(u->s[j / 4], j);
    }
    UNROLL
    for (int n = 0; n < nt; n++) {
        const int8x16_t x0 = vld1q_s8(xr[n]->qs + 32 * j), x1 = vld1q_s8(xr[n]->qs + 32 * j + 16);
        int32x4_t lo = vdupq_n_s32(0), hi = vdupq_n_s32(0);
        lo = vdotq_laneq_s32(lo, w[0], x0, 0);
        hi = vdotq_laneq_s32(hi, w[4], x1, 0);
        lo = vdotq_laneq_s32(lo, w[1], x0, 1);
        hi = vdotq_laneq_s32(hi, w[5], x1, 1);
        lo = vdotq_laneq_s32(lo, w[2], x0, 2);
        hi = vdotq_laneq_s32(hi, w[6], x1, 2);
        lo = vdotq_laneq_s32(lo, w[3], x0, 3);
        hi = vdotq_laneq_s32(hi, w[7], x1, 3);
        if (type == ES_TYPE_Q6_K) I[n] = vmlaq_s32(vmlaq_s32(I[n], sl, lo), sh, hi);
        else I[n] = vmlaq_s32(I[n], sl, vaddq_s32(lo, hi));
    }
}

/* Quarter q of K records [s0, s1) into acc. */
static inline ES_AI void pk_run(const int nt, const int type, const uint8_t *g, int64_t s0, int64_t s1, int q,
                                const uint8_t *x, size_t xs, float32x4_t *acc) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    const uint8_t *p = g + (size_t)s0 * rec;
    for (int64_t s = s0; s < s1; s++, p += rec) {
        const es_q8k_block *xr[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) xr[n] = (const es_q8k_block *)(const void *)(x + (size_t)n * xs) + s;
        pkquarter u;
        pk_setup(type, p, q, &u);
        int32x4_t I[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) I[n] = vdupq_n_s32(0);
        UNROLL
        for (int j = 0; j < 8; j++) {
            int8x16_t w[8];
            pk_weights(type, p, q, j, w);
            pk_rows(nt, type, &u, w, j, xr, p, q, I);
            /* Empty asm statements that take the sums and may touch memory:
               each sub-block's sums are then complete here, before the next
               sub-block's loads. Without them GCC hoists the loads of all 8
               sub-blocks, and spills registers. */
            UNROLL
            for (int n = 0; n < nt; n++) __asm__ volatile("" : "+w"(I[n]) : : "memory");
        }
        int16x4_t m16[8];
        if (type != ES_TYPE_Q6_K) {
            UNROLL
            for (int j = 0; j < 8; j++) m16[j] = vmovn_s32(pk_byte(u.m[j / 4], j));
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            const float dx = xr[n]->d;
            float32x4_t c = vmulq_f32(vmulq_n_f32(u.a, dx), vcvtq_f32_s32(I[n]));
            if (type != ES_TYPE_Q6_K) {
                const int16x8_t s32 = vld1q_s16(xr[n]->s32);
                int32x4_t J = vmull_laneq_s16(m16[0], s32, 0);
                J = vmlal_laneq_s16(J, m16[1], s32, 1);
                J = vmlal_laneq_s16(J, m16[2], s32, 2);
                J = vmlal_laneq_s16(J, m16[3], s32, 3);
                J = vmlal_laneq_s16(J, m16[4], s32, 4);
                J = vmlal_laneq_s16(J, m16[5], s32, 5);
                J = vmlal_laneq_s16(J, m16[6], s32, 6);
                J = vmlal_laneq_s16(J, m16[7], s32, 7);
                c = vaddq_f32(c, vmulq_f32(vmulq_n_f32(u.b, dx), vcvtq_f32_s32(J)));
            }
            acc[n] = vaddq_f32(acc[n], c);
        }
    }
}

/* One group of 16 weight rows (nb records at g: blocks, or super-blocks
 * for the K types) times a tile of nt (a constant 1..PTILE) activation
 * rows x; stores nr (1..16) outputs per row. Quarters wholly past nr are
 * skipped. */
static inline ES_AI void pgroup(const int nt, const int type, const uint8_t *g, int64_t nb, const uint8_t *x,
                                size_t xs, float *Y, int64_t ldy, int nr, int pf) {
    (void)pf;   /* no software prefetch here: not measured on an A76 yet */
    const int nq = (nr + 3) / 4;
    const int kt = type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K || type == ES_TYPE_Q6_K;
    const int64_t seg = kt ? PSEG_K : PSEG;
    float32x4_t part[4][PTILE];
    for (int64_t s0 = 0; s0 < nb; s0 += seg) {
        int64_t s1 = nb - s0 < seg ? nb : s0 + seg;
        for (int q = 0; q < nq; q++) {
            float32x4_t acc[PTILE];
            UNROLL
            for (int n = 0; n < nt; n++) acc[n] = s0 == 0 ? vdupq_n_f32(0.0f) : part[q][n];
            if (kt) pk_run(nt, type, g, s0, s1, q, x, xs, acc);
            else pquarter_run(nt, type, g, s0, s1, q, x, xs, acc);
            UNROLL
            for (int n = 0; n < nt; n++) part[q][n] = acc[n];
        }
    }
    for (int q = 0; q < nq; q++)
        for (int n = 0; n < nt; n++) {
            float *y = Y + (int64_t)n * ldy + 4 * q;
            if (4 * q + 4 <= nr) {
                vst1q_f32(y, part[q][n]);
            } else {
                float t[4];
                vst1q_f32(t, part[q][n]);
                memcpy(y, t, sizeof(float) * (size_t)(nr - 4 * q));
            }
        }
}

ES_PACKED_KERNELS_K(es_neon_packed_kernel)
#else
es_mm_kernel es_neon_packed_kernel(uint32_t type) { (void)type; return NULL; }
#endif

/* Activation quantization (contract step 1), 32 elements per step. */
int es_neon_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) {
    if (n % QK != 0) return 0;
    for (int64_t j = j0; j < j1; j++) {
        es_q8_group *g = &out[j / ES_GROUP_BLOCKS];
        int jj = (int)(j % ES_GROUP_BLOCKS);
        float32x4_t xv[8], m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 8; i++) {
            xv[i] = vld1q_f32(x + j * QK + 4 * i);
            m = vmaxnmq_f32(m, vabsq_f32(xv[i]));   /* NaN is ignored, like the scalar loop */
        }
        float amax = vmaxnmvq_f32(m);
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32x4_t s = vdupq_n_s32(0);
        for (int i = 0; i < 8; i++) {
            int32x4_t q = vcvtnq_s32_f32(vmulq_n_f32(xv[i], id));
            s = vaddq_s32(s, q);
            int8x8_t b = vmovn_s16(vcombine_s16(vmovn_s32(q), vdup_n_s16(0)));
            vst1_lane_s32((int32_t *)(void *)(g->qs + 64 * i + 4 * jj), vreinterpret_s32_s8(b), 0);
        }
        int32_t sum = vaddvq_s32(s);
        es_q8_set_block(g, jj, d, sum);
    }
    return 1;
}

/* K-type activation quantization (contract step 1K), one super-block per step. */
int es_neon_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) {
    for (int64_t s = s0; s < s1; s++) {
        es_q8k_block *b = &out[s];
        const float *xb = x + s * QK_K;
        float32x4_t m = vdupq_n_f32(0.0f);
        for (int i = 0; i < 64; i++) m = vmaxnmq_f32(m, vabsq_f32(vld1q_f32(xb + 4 * i)));   /* NaN is ignored */
        float d = vmaxnmvq_f32(m) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int h = 0; h < 16; h++) {
            int32x4_t q[4];
            for (int i = 0; i < 4; i++) q[i] = vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(xb + 16 * h + 4 * i), id));
            int16x8_t lo = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1])), hi = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
            vst1q_s8(b->qs + 16 * h, vcombine_s8(vmovn_s16(lo), vmovn_s16(hi)));
            b->s16[h] = (int16_t)vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
        }
        for (int j = 0; j < 8; j++) b->s32[j] = (int16_t)(b->s16[2 * j] + b->s16[2 * j + 1]);
        b->d = d;
        memset(b->pad, 0, sizeof b->pad);
    }
    return 1;
}

es_mm_kernel es_neon_kernel(uint32_t type) {
    switch (type) {
    case ES_TYPE_F32: return k_f32;
    case ES_TYPE_F16: return k_f16;
    case ES_TYPE_BF16: return k_bf16;
    default: return NULL;
    }
}

const char *es_neon_simd_name(void) {
#ifdef __ARM_FEATURE_DOTPROD
    return "neon-dotprod";
#else
    return "neon";
#endif
}

#else /* no NEON path in this build */

es_mm_kernel es_neon_kernel(uint32_t type) { return NULL; }
es_mm_kernel es_neon_packed_kernel(uint32_t type) { (void)type; return NULL; }
const char *es_neon_simd_name(void) { return NULL; }
int es_neon_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) { return 0; }
int es_neon_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) { return 0; }

#endif
