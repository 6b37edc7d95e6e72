/*
 * quant_avx2.c - AVX2 matmul kernels for x86-64. Same contract and results
 * (bitwise) as the scalar kernels in quant.c.
 *
 * Compiled in when the build enables AVX2 and F16C but not the AVX-512 set
 * of quant_avx512.c (ES_X86_AVX2, quant.h). Without either, this file
 * provides the es_x86_* getters, which then report no x86 SIMD path.
 */
#include "quant.h"

#ifdef ES_X86_AVX2
/*
 * AVX2 path. Quantized types: packed kernels ("packed kernels" below);
 * float types: lanes 0..7 and 8..15 of the accumulator in two ymm.
 */
#include <immintrin.h>
#include <stddef.h>
#include <string.h>

#define NT 32
#define ES_AI __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

static inline ES_AI float lane_sum2x8(__m256 lo, __m256 hi) {
    float l[16];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(l + 8, hi);
    return es_lane_sum(l);
}

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

/* The block scale of the contract's step 1 from the lane maxima m of |x|
 * (never NaN: max keeps the running maximum when |x| is NaN): d = amax /
 * 127 and *id = 1 / d (0 when d is 0). The maximum of the 8 lanes in any
 * order is the same value. */
static inline float act_scale8(__m256 m, float *id) {
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    v = _mm_max_ss(v, _mm_movehdup_ps(v));
    float amax = _mm_cvtss_f32(v);
    float d = amax / 127.0f;
    *id = d != 0.0f ? 1.0f / d : 0.0f;
    return d;
}

/* The low byte of each int32 of q0..q3 (a truncation, like (int8_t) and
 * AVX-512's vpmovdb), the 32 bytes in order. */
static inline __m256i low_bytes32(__m256i q0, __m256i q1, __m256i q2, __m256i q3) {
    const __m256i lo = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    /* per 128-bit lane: dword 0 = bytes of q0, dword 1 of q1 (shifted), ... */
    __m256i b = _mm256_or_si256(
        _mm256_or_si256(_mm256_shuffle_epi8(q0, lo), _mm256_slli_si256(_mm256_shuffle_epi8(q1, lo), 4)),
        _mm256_or_si256(_mm256_slli_si256(_mm256_shuffle_epi8(q2, lo), 8), _mm256_slli_si256(_mm256_shuffle_epi8(q3, lo), 12)));
    /* dwords (q0 lo, q1 lo, q2 lo, q3 lo, q0 hi, q1 hi, q2 hi, q3 hi) to (q0 lo, q0 hi, q1 lo, ...) */
    return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static inline int32_t hsum8(__m256i v) {
    __m128i w = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    w = _mm_add_epi32(w, _mm_shuffle_epi32(w, 0x4E));
    w = _mm_add_epi32(w, _mm_shuffle_epi32(w, 0xB1));
    return _mm_cvtsi128_si32(w);
}

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
        float id, d = act_scale8(m, &id);
        __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(xv[i], vid));
        /* integer sums are exact, so any order */
        int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
        uint32_t w[8];
        _mm256_storeu_si256((__m256i *)(void *)w, low_bytes32(q[0], q[1], q[2], q[3]));
        for (int k = 0; k < 8; k++) memcpy(g->qs + 64 * k + 4 * jj, &w[k], 4);
        es_q8_set_block(g, jj, d, sum);
    }
    return 1;
}

/* K-type activation quantization (contract step 1K), one super-block per step. */
int es_x86_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t s = s0; s < s1; s++) {
        es_q8k_block *b = &out[s];
        const float *xb = x + s * QK_K;
        __m256 m = _mm256_setzero_ps();
        for (int i = 0; i < 32; i++) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + 8 * i), absmask), m);   /* keeps m when NaN */
        float id, d = act_scale8(m, &id);
        const __m256 vid = _mm256_set1_ps(id);
        for (int h = 0; h < 16; h++) {
            __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h), vid));
            __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16 * h + 8), vid));
            __m256i p16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), 0xD8);   /* the 16 values in order */
            _mm_storeu_si128((__m128i *)(void *)(b->qs + 16 * h),
                             _mm_packs_epi16(_mm256_castsi256_si128(p16), _mm256_extracti128_si256(p16, 1)));
            b->s16[h] = (int16_t)hsum8(_mm256_add_epi32(q0, q1));
        }
        for (int j = 0; j < 8; j++) b->s32[j] = (int16_t)(b->s16[2 * j] + b->s16[2 * j + 1]);
        b->d = d;
        memset(b->pad, 0, sizeof b->pad);
    }
    return 1;
}

/* ---- packed kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; K types below): 16 weight rows in the lanes ----
 * A packed record (quant.h) is one block of 16 rows; a ymm holds 8 of them,
 * so a record is two halves (half h = rows 8h..8h+7 = bytes 32h..32h+31 of
 * each 64-byte chunk). Weight vector k of a half (lane i = elements
 * 4k..4k+3 of row 8h+i) is made once and every activation row of a tile
 * multiplies its dword k of the block, broadcast, into it before vector
 * k + 1 is made (chunk-major: per row only an int sum and the accumulator
 * stay in registers, Q5 also the first run's int32 sum, so tiles of 6
 * rows fit in 16 ymm):
 *   Q4_0, Q4_1  unsigned nibbles x int8 with maddubs; the 8 chunk products
 *               add up in int16 (at most 8 * 2 * 15 * 127 = 30480), one madd
 *               with ones makes the 8 rows' I; Q4_0 subtracts 8 * qsum
 *   Q5_0, Q5_1  unsigned 5-bit values (nibble | the 5th bit from qh) x
 *               int8 with maddubs; a pair is at most 2 * 31 * 127 = 7874,
 *               so 4 chunk products add up in int16 (at most 31496), and
 *               the two runs of 4 are widened by a madd each; Q5_0
 *               subtracts 16 * qsum
 *   Q8_0        |w| x sign(x, w) with maddubs (at most 2 * 128 * 127 =
 *               32512), widened by a madd per chunk
 * all exact. Then the contract's float steps run on the 8 rows and add to
 * the row's accumulator, blocks in order (the sequential contract). A group
 * of 16 rows takes both halves at once (prows2: one broadcast of each
 * activation dword for 16 weight rows); a last group of 8 rows or fewer
 * runs one half (prows) over segments of PSEG records, the accumulators
 * carried over between segments in memory (exact). The first tile of a group prefetches the weight stream
 * into L2 like the AVX-512 kernel (same distance; not measured separately). */

#define PTILE 5    /* most activation rows per tile (16 ymm: prows2 keeps two int sums per row) */
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

/* The float steps of the contract for half h of the record at p: the rows'
 * exact int sums S (Q8_0: int32; Q4_0, Q4_1: int16 pairs; Q5: int16 pairs
 * of the second run, I5 the first run's int32) times the scales, added to
 * the rows' acc. */
static inline ES_AI void pepi(const int nt, const int type, const uint8_t *p, int h, const uint8_t *const *xr,
                              int jj, const __m256i *S, const __m256i *I5, __m256 *acc) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int q5 = type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1;
    const size_t dof = type == ES_TYPE_Q8_0 ? 512 : q5 ? ES_PK_Q5_D : 256;
    const __m256 a = f16x8(p + dof + 16 * h);
    UNROLL
    for (int n = 0; n < nt; n++) {
        const uint8_t *b = xr[n] + 4 * jj;   /* qs[4 jj]; d, qsum, dq [jj] at their offsets from it */
        float d, dq, fq;
        int32_t qsum;
        memcpy(&d, b + offsetof(es_q8_group, d), 4);
        __m256i I = type == ES_TYPE_Q8_0 ? S[n] : _mm256_madd_epi16(S[n], ones);
        if (q5) I = _mm256_add_epi32(I5[n], I);
        if (type == ES_TYPE_Q4_0 || type == ES_TYPE_Q5_0) {
            memcpy(&qsum, b + offsetof(es_q8_group, qsum), 4);
            I = _mm256_sub_epi32(I, _mm256_set1_epi32((type == ES_TYPE_Q5_0 ? 16 : 8) * qsum));
        }
        const __m256 dx = _mm256_set1_ps(d);
        acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(a, dx), _mm256_cvtepi32_ps(I), acc[n]);
        if (type == ES_TYPE_Q4_1) {
            memcpy(&dq, b + offsetof(es_q8_group, dq), 4);
            acc[n] = _mm256_fmadd_ps(f16x8(p + 288 + 16 * h), _mm256_set1_ps(dq), acc[n]);
        }
        if (type == ES_TYPE_Q5_1) {
            memcpy(&fq, b + offsetof(es_q8_group, fq), 4);
            acc[n] = _mm256_fmadd_ps(_mm256_mul_ps(f16x8(p + ES_PK_Q5_M + 16 * h), dx), _mm256_set1_ps(fq), acc[n]);
        }
    }
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
    const int q5 = type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1;
    __m256i S[PTILE];    /* Q8_0: int32 sums; Q4_0, Q4_1: int16 sums; Q5: int16 sums of a run of 4 */
    __m256i I5[PTILE];   /* Q5: the int32 sum of the first run */
    __m256i qh = _mm256_setzero_si256();
    if (q5) qh = _mm256_loadu_si256((const __m256i *)(const void *)(p + ES_PK_Q5_QH + 32 * h));
    UNROLL
    for (int k = 0; k < 8; k++) {
        __m256i w, ws = _mm256_setzero_si256();
        if (type == ES_TYPE_Q8_0) {
            ws = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64 * k));
            w = _mm256_abs_epi8(ws);
        } else {
            __m256i v = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64 * (k % 4)));
            w = _mm256_and_si256(k < 4 ? v : _mm256_srli_epi16(v, 4), m4);
            if (q5) {   /* bit k of each byte of qh to bit 4 */
                __m256i hb = k <= 4 ? _mm256_slli_epi32(qh, 4 - k) : _mm256_srli_epi32(qh, k - 4);
                w = _mm256_or_si256(w, _mm256_and_si256(hb, _mm256_set1_epi8(0x10)));
            }
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            __m256i bx = bcast32(xr[n] + 4 * jj + 64 * k);
            if (type == ES_TYPE_Q8_0) {
                __m256i t = _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_sign_epi8(bx, ws)), ones);
                S[n] = k == 0 ? t : _mm256_add_epi32(S[n], t);
            } else {
                __m256i t = _mm256_maddubs_epi16(w, bx);
                S[n] = k == 0 || (q5 && k == 4) ? t : _mm256_add_epi16(S[n], t);
            }
            /* an empty asm on the sum: the compiler would otherwise regroup
             * the (associative) integer adds into a tree over all 8 chunks
             * and keep every product live, spilling them */
            __asm__("" : "+x"(S[n]));
            if (q5 && k == 3) {
                I5[n] = _mm256_madd_epi16(S[n], ones);
                __asm__("" : "+x"(I5[n]));
            }
        }
    }
    pepi(nt, type, p, h, xr, jj, S, I5, acc);
}

/* Both halves of the record at p into the nt rows' acc0 (rows 0..7 of the
 * record) and acc1 (rows 8..15): as prows, but each activation dword is
 * broadcast once for the 16 weight rows (per chunk and row one broadcast
 * and two products instead of two of each). Per row two int sums stay in
 * registers (10 ymm for 5 rows); Q5's first-run sums and the float
 * accumulators are touched once per record and may live in memory. */
static inline ES_AI void prows2(const int nt, const int type, const uint8_t *p, const uint8_t *const *xr, int jj,
                                __m256 *acc0, __m256 *acc1) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    const int q5 = type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1;
    __m256i S0[PTILE], S1[PTILE];
    __m256i I0[PTILE], I1[PTILE];   /* Q5: the first run's int32 sums (left to memory) */
    UNROLL
    for (int k = 0; k < 8; k++) {
        __m256i w0, w1, ws0 = _mm256_setzero_si256(), ws1 = _mm256_setzero_si256();
        if (type == ES_TYPE_Q8_0) {
            ws0 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * k));
            ws1 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * k + 32));
            w0 = _mm256_abs_epi8(ws0);
            w1 = _mm256_abs_epi8(ws1);
        } else {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * (k % 4)));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(const void *)(p + 64 * (k % 4) + 32));
            w0 = _mm256_and_si256(k < 4 ? v0 : _mm256_srli_epi16(v0, 4), m4);
            w1 = _mm256_and_si256(k < 4 ? v1 : _mm256_srli_epi16(v1, 4), m4);
            if (q5) {   /* bit k of each byte of qh to bit 4 */
                const __m256i b4 = _mm256_set1_epi8(0x10);
                __m256i h0 = _mm256_loadu_si256((const __m256i *)(const void *)(p + ES_PK_Q5_QH));
                __m256i h1 = _mm256_loadu_si256((const __m256i *)(const void *)(p + ES_PK_Q5_QH + 32));
                h0 = k <= 4 ? _mm256_slli_epi32(h0, 4 - k) : _mm256_srli_epi32(h0, k - 4);
                h1 = k <= 4 ? _mm256_slli_epi32(h1, 4 - k) : _mm256_srli_epi32(h1, k - 4);
                w0 = _mm256_or_si256(w0, _mm256_and_si256(h0, b4));
                w1 = _mm256_or_si256(w1, _mm256_and_si256(h1, b4));
            }
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            __m256i bx = bcast32(xr[n] + 4 * jj + 64 * k);
            if (type == ES_TYPE_Q8_0) {
                __m256i t0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w0, _mm256_sign_epi8(bx, ws0)), ones);
                __m256i t1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w1, _mm256_sign_epi8(bx, ws1)), ones);
                S0[n] = k == 0 ? t0 : _mm256_add_epi32(S0[n], t0);
                S1[n] = k == 0 ? t1 : _mm256_add_epi32(S1[n], t1);
            } else {
                __m256i t0 = _mm256_maddubs_epi16(w0, bx), t1 = _mm256_maddubs_epi16(w1, bx);
                S0[n] = k == 0 || (q5 && k == 4) ? t0 : _mm256_add_epi16(S0[n], t0);
                S1[n] = k == 0 || (q5 && k == 4) ? t1 : _mm256_add_epi16(S1[n], t1);
            }
            __asm__("" : "+x"(S0[n]), "+x"(S1[n]));   /* keeps the adds in this order (see prows) */
            if (q5 && k == 3) {
                I0[n] = _mm256_madd_epi16(S0[n], ones);
                I1[n] = _mm256_madd_epi16(S1[n], ones);
            }
        }
    }
    pepi(nt, type, p, 0, xr, jj, S0, I0, acc0);
    pepi(nt, type, p, 1, xr, jj, S1, I1, acc1);
}

/* Halves h0 .. h0 + nh - 1 (nh a constant 1 or 2) of records [s0, s1) (s0
 * a multiple of 16) into acc[hh][n] (prows, or prows2 for both); pf:
 * prefetch. */
static inline ES_AI void prun(const int nt, const int type, const int nh, const uint8_t *g, int64_t s0, int64_t s1,
                              int h0, const uint8_t *x, size_t xs, __m256 (*acc)[PTILE], int pf) {
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
            if (nh == 2) prows2(nt, type, p, xr, jj, acc[0], acc[1]);
            else prows(nt, type, p, h0, xr, jj, acc[0]);
        }
    }
}

/* Packed K types (quant.h layouts): half h of a super-block record is bytes
 * 32h..32h+31 of each 64-byte chunk. Per sub-block j, chunk-major: each
 * weight vector is made once and every row of the tile takes its
 * activation dword broadcast. int16 sums of a run of chunks before the
 * madd with the scale pair (all exact):
 *   Q4_K  all 8 chunk products, at most 8 * 2 * 15 * 127 = 30480
 *   Q5_K  4 + 4, at most 4 * 2 * 31 * 127 = 31496
 *   Q6_K  2 + 2 + 2 + 2, at most 2 * 2 * 63 * 127 = 32004 (elements 0..15
 *         and 16..31 stay apart for their two scales) */
#define PSEG_K 8   /* super-block records per segment: 18 KB (Q4_K) to 27 KB (Q6_K) */
/* Most rows of a K tile that takes both halves at once (krecord with nh =
 * 2). Larger tiles run the halves one after the other: with both, the
 * scale pairs and the weight vectors of two halves beside the rows' sums
 * spill out of 16 ymm, and a 3- or 5-row tile is slower than two passes. */
#define KBOTH 2
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

/* Halves h0 .. h0 + nh - 1 (nh a constant 1 or 2) of the K record at p
 * into acc[hh][n] (hh = h - h0). The integer sums of the contract (step
 * 2K), all exact: per sub-block j and run of chunks, the int16 sum S16 of
 * the maddubs products, then one madd of S16 with the sub-block's scale as
 * an int16 pair (sc, sc) (Q6_K: the half-block's) adds sc * (the run's dot)
 * to the row's int32 I (|sc * S16| <= 63 * 31496 or 128 * 32004, a pair sum
 * below 2^23). Q6_K adds - 32 * (sl * s16[2j] + sh * s16[2j + 1]) with a
 * madd of the (-32 sl, -32 sh) int16 pairs; Q4_K / Q5_K make J with 4 madds
 * of the (m[2t], m[2t + 1]) pairs and the activation's s32 pairs. The float
 * steps run once per super-block. With nh = 2 each activation dword is
 * broadcast once for the 16 weight rows, and per row the two int16 sums
 * stay in registers (10 ymm for 5 rows); the int32 sums may live in memory. */
static inline ES_AI void krecord(const int nt, const int type, const int nh, const uint8_t *p, int h0,
                                 const es_q8k_block *const *xr, __m256 (*acc)[PTILE]) {
    const int q6 = type == ES_TYPE_Q6_K;
    const size_t sco = type == ES_TYPE_Q4_K ? ES_PK_Q4K_SC : ES_PK_Q5K_SC;
    const size_t dof = q6 ? ES_PK_Q6K_D : type == ES_TYPE_Q4_K ? ES_PK_Q4K_D : ES_PK_Q5K_D;
    const size_t mof = type == ES_TYPE_Q4_K ? ES_PK_Q4K_DMIN : ES_PK_Q5K_DMIN;
    /* vpshufb controls: byte c of every dword as an int16 pair (c, c); bytes (c, c + 1) as (int16, int16) */
#define DUP(c) _mm256_setr_epi8(c, -1, c, -1, c + 4, -1, c + 4, -1, c + 8, -1, c + 8, -1, c + 12, -1, c + 12, -1, \
                                c, -1, c, -1, c + 4, -1, c + 4, -1, c + 8, -1, c + 8, -1, c + 12, -1, c + 12, -1)
#define PAIR(c) _mm256_setr_epi8(c, -1, c + 1, -1, c + 4, -1, c + 5, -1, c + 8, -1, c + 9, -1, c + 12, -1, c + 13, -1, \
                                 c, -1, c + 1, -1, c + 4, -1, c + 5, -1, c + 8, -1, c + 9, -1, c + 12, -1, c + 13, -1)
    __m256i S[2][2], M[2][2];
    if (!q6) {
        UNROLL
        for (int hh = 0; hh < nh; hh++) {
            const uint8_t *sp = p + sco + 32 * (h0 + hh);
            const __m256i u0 = _mm256_loadu_si256((const __m256i *)(const void *)sp);
            const __m256i u1 = _mm256_loadu_si256((const __m256i *)(const void *)(sp + 64));
            const __m256i u2 = _mm256_loadu_si256((const __m256i *)(const void *)(sp + 128));
            const __m256i m6 = _mm256_set1_epi8(0x3F), m4 = _mm256_set1_epi8(0x0F), h2 = _mm256_set1_epi8(0x30);
            S[hh][0] = _mm256_and_si256(u0, m6);
            M[hh][0] = _mm256_and_si256(u1, m6);
            S[hh][1] = _mm256_or_si256(_mm256_and_si256(u2, m4), _mm256_and_si256(_mm256_srli_epi32(u0, 2), h2));
            M[hh][1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4), _mm256_and_si256(_mm256_srli_epi32(u1, 2), h2));
        }
    }
    __m256i I[2][PTILE];
    UNROLL
    for (int hh = 0; hh < nh; hh++)
        UNROLL
        for (int n = 0; n < nt; n++) I[hh][n] = _mm256_setzero_si256();
    UNROLL
    for (int j = 0; j < 8; j++) {
        __m256i scl[2], sch[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};   /* int16 pairs (sc, sc): chunks 0..3, 4..7 */
        UNROLL
        for (int hh = 0; hh < nh; hh++) {
            if (q6) {
                const uint8_t *sp = p + ES_PK_Q6K_SC + 32 * j + 8 * (h0 + hh);
                const __m256i sl = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)sp));
                const __m256i sh = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(sp + 16)));
                scl[hh] = _mm256_shuffle_epi8(sl, _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                                   0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
                sch[hh] = _mm256_shuffle_epi8(sh, _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                                   0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13));
                /* (-32 sl, -32 sh) int16 pairs: the low half of scl, the high half of sch, times -32 */
                const __m256i po = _mm256_mullo_epi16(_mm256_blend_epi16(scl[hh], sch[hh], 0xAA), _mm256_set1_epi16(-32));
                UNROLL
                for (int n = 0; n < nt; n++)
                    I[hh][n] = _mm256_add_epi32(I[hh][n], _mm256_madd_epi16(po, bcast32((const uint8_t *)(xr[n]->s16 + 2 * j))));
            } else {
                scl[hh] = _mm256_shuffle_epi8(S[hh][j / 4], DUP(j % 4));
            }
        }
        __m256i S16[2][PTILE];
        UNROLL
        for (int k = 0; k < 8; k++) {
            __m256i w[2];
            UNROLL
            for (int hh = 0; hh < nh; hh++) w[hh] = pk_weights8(type, p, h0 + hh, j, k);
            /* a run ends after 8 (Q4_K), 4 (Q5_K) or 2 (Q6_K) chunks */
            const int run = type == ES_TYPE_Q4_K ? 8 : type == ES_TYPE_Q5_K ? 4 : 2;
            UNROLL
            for (int n = 0; n < nt; n++) {
                const __m256i bx = bcast32((const uint8_t *)xr[n]->qs + 32 * j + 4 * k);
                UNROLL
                for (int hh = 0; hh < nh; hh++) {
                    __m256i t = _mm256_maddubs_epi16(w[hh], bx);
                    S16[hh][n] = k % run == 0 ? t : _mm256_add_epi16(S16[hh][n], t);
                    __asm__("" : "+x"(S16[hh][n]));   /* keeps the adds in this order (see prows) */
                    if (k % run != run - 1) continue;
                    I[hh][n] = _mm256_add_epi32(I[hh][n], _mm256_madd_epi16(S16[hh][n], q6 && k >= 4 ? sch[hh] : scl[hh]));
                    if (nh == 1) __asm__("" : "+x"(I[hh][n]));
                }
            }
        }
    }
    UNROLL
    for (int hh = 0; hh < nh; hh++) {
        const int h = h0 + hh;
        const __m256 a = f16x8(p + dof + 16 * h);
        __m256 b = _mm256_setzero_ps();
        __m256i mp[4];
        if (!q6) {
            b = _mm256_xor_ps(f16x8(p + mof + 16 * h), _mm256_set1_ps(-0.0f));   /* -dmin, exact */
            UNROLL
            for (int t = 0; t < 4; t++) mp[t] = _mm256_shuffle_epi8(M[hh][t / 2], PAIR(2 * (t % 2)));
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            const __m256 dx = _mm256_set1_ps(xr[n]->d);
            __m256 c = _mm256_mul_ps(_mm256_mul_ps(a, dx), _mm256_cvtepi32_ps(I[hh][n]));
            if (!q6) {
                __m256i J = _mm256_madd_epi16(mp[0], bcast32((const uint8_t *)xr[n]->s32));
                UNROLL
                for (int t = 1; t < 4; t++) J = _mm256_add_epi32(J, _mm256_madd_epi16(mp[t], bcast32((const uint8_t *)(xr[n]->s32 + 2 * t))));
                c = _mm256_add_ps(c, _mm256_mul_ps(_mm256_mul_ps(b, dx), _mm256_cvtepi32_ps(J)));
            }
            acc[hh][n] = _mm256_add_ps(acc[hh][n], c);
        }
    }
#undef DUP
#undef PAIR
}

/* Halves h0 .. h0 + nh - 1 of K records [s0, s1) into acc; pf: prefetch. */
static inline ES_AI void krun(const int nt, const int type, const int nh, const uint8_t *g, int64_t s0, int64_t s1,
                              int h0, const uint8_t *x, size_t xs, __m256 (*acc)[PTILE], int pf) {
    const size_t rec = es_pack_record_bytes((uint32_t)type);
    for (int64_t sb = s0; sb < s1; sb++) {
        const uint8_t *p = g + (size_t)sb * rec;
        if (pf)
            for (size_t o = 0; o < rec; o += 64) _mm_prefetch((const char *)(p + ES_PF_BYTES + o), _MM_HINT_T1);
        const es_q8k_block *xr[PTILE];
        UNROLL
        for (int n = 0; n < nt; n++) xr[n] = (const es_q8k_block *)(const void *)(x + (size_t)n * xs) + sb;
        krecord(nt, type, nh, p, h0, xr, acc);
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
    UNROLL
    for (int n = 0; n < nt; n++) part[0][n] = part[1][n] = _mm256_setzero_ps();
    if (nh == 2 && !kt) {   /* both halves in one pass: prows2 */
        prun(nt, type, 2, g, 0, nb, 0, x, xs, part, pf);
    } else if (nh == 2 && nt <= KBOTH) {   /* K types, a small tile: both halves in one pass */
        krun(nt, type, 2, g, 0, nb, 0, x, xs, part, pf);
    } else {   /* one half, over segments */
        for (int64_t s0 = 0; s0 < nb; s0 += seg) {
            int64_t s1 = nb - s0 < seg ? nb : s0 + seg;
            for (int h = 0; h < nh; h++) {
                __m256 acc[PTILE];
                UNROLL
                for (int n = 0; n < nt; n++) acc[n] = part[h][n];
                if (kt) krun(nt, type, 1, g, s0, s1, h, x, xs, (__m256 (*)[PTILE])acc, pf && h == 0);
                else prun(nt, type, 1, g, s0, s1, h, x, xs, (__m256 (*)[PTILE])acc, pf && h == 0);
                UNROLL
                for (int n = 0; n < nt; n++) part[h][n] = acc[n];
            }
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
    default: return NULL;
    }
}
const char *es_x86_simd_name(void) { return "avx2"; }

#elif !defined(ES_X86_AVX512) /* no x86 SIMD path in this build */

es_mm_kernel es_x86_kernel(uint32_t type) { return NULL; }
es_mm_kernel es_x86_packed_kernel(uint32_t type) { (void)type; return NULL; }
const char *es_x86_simd_name(void) { return NULL; }
int es_x86_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) { return 0; }
int es_x86_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) { return 0; }

#endif
