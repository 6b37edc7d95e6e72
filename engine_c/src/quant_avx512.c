/*
 * quant_avx512.c - AVX-512 (VNNI) matmul kernels for x86-64. Same contract
 * and results (bitwise) as the scalar kernels in quant.c.
 *
 * Quantized types run on packed weights, 16 rows in the lanes (see
 * "packed kernels" below); float types on the rows as stored. Compiles to
 * nothing unless the build enables AVX-512 F/BW/VL/VNNI and F16C
 * (ES_X86_AVX512, quant.h); quant_avx2.c provides the es_x86_* getters
 * otherwise.
 */
#include "quant.h"

#ifdef ES_X86_AVX512
#include <immintrin.h>
#include <string.h>

#define NT 32   /* activation rows per pass */
#define ES_AI __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* The fixed 16-lane tree (es_lane_sum in quant.h). */
/* Sum of v's 16 int32 lanes modulo 2^32, by vector adds (GCC's _mm512_reduce_add_epi32 adds as
 * signed int in C, undefined where a NaN input's INT_MIN lanes overflow). */
static inline ES_AI int32_t lane_isum16(__m512i v) {
    __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0x4E));
    b = _mm_add_epi32(b, _mm_shuffle_epi32(b, 0xB1));
    return _mm_cvtsi128_si32(b);
}

static inline ES_AI float lane_sum16(__m512 v) {
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
    v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
    v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
    return _mm512_cvtss_f32(v);
}

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
        int32_t sum = lane_isum16(_mm512_add_epi32(q0, q1));
        uint32_t w[8];
        _mm_storeu_si128((__m128i *)(void *)w, _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i *)(void *)(w + 4), _mm512_cvtepi32_epi8(q1));
        for (int k = 0; k < 8; k++) memcpy(g->qs + 64 * k + 4 * jj, &w[k], 4);
        es_q8_set_block(g, jj, d, sum);
    }
    return 1;
}

/* K-type activation quantization (contract step 1K), one super-block per step. */
int es_x86_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) {
    for (int64_t s = s0; s < s1; s++) {
        es_q8k_block *b = &out[s];
        const float *xb = x + s * QK_K;
        __m512 m = _mm512_setzero_ps();
        for (int i = 0; i < 16; i++) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + 16 * i)), m);   /* keeps m when NaN */
        float d = _mm512_reduce_max_ps(m) / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        const __m512 vid = _mm512_set1_ps(id);
        for (int i = 0; i < 16; i++) {
            __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * i), vid));
            _mm_storeu_si128((__m128i *)(void *)(b->qs + 16 * i), _mm512_cvtepi32_epi8(q));
            b->s16[i] = (int16_t)lane_isum16(q);
        }
        for (int j = 0; j < 8; j++) b->s32[j] = (int16_t)(b->s16[2 * j] + b->s16[2 * j + 1]);
        b->d = d;
        memset(b->pad, 0, sizeof b->pad);
    }
    return 1;
}

/* ---- packed kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; K types below): 16 weight rows in the lanes ----
 * One step multiplies one block of 16 rows (a packed record, quant.h) into
 * each activation row of a tile: 8 vpdpbusd with the activation's dword k
 * broadcast give the 16 rows' exact int32 sums I, then the contract's float
 * steps run on the 16 rows at once and add to the tile row's accumulator
 * (the sequential contract: one accumulator per output, blocks in order). */

#define PTILE 8   /* most activation rows per register tile */
/* Software prefetch of the weight stream, this many bytes ahead, into L2
 * (T1). At N = 5 a record takes long enough to compute that the hardware
 * prefetcher alone leaves the stream behind; into L1 (T0) it did not help
 * at any distance. Forward passes of SmolLM2 (tools/perf/forward_ab.c, builds
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
    if (type == ES_TYPE_Q5_0 || type == ES_TYPE_Q5_1) {
        /* bit c of each byte of qh[r] to bit 4 (the 5th bit of chunk c), merged: q | (hb & 0x10) */
        const __m512i qh = _mm512_loadu_si512(p + ES_PK_Q5_QH);
        UNROLL
        for (int c = 0; c < 8; c++) {
            __m512i hb = c <= 4 ? _mm512_slli_epi32(qh, (unsigned)(4 - c)) : _mm512_srli_epi32(qh, (unsigned)(c - 4));
            u->w[c] = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x10), hb, u->w[c], 0xEA);
        }
        u->a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + ES_PK_Q5_D)));
        if (type == ES_TYPE_Q5_1)
            u->b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + ES_PK_Q5_M)));
        return;
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
 * The activation row's K record of super-block s (es_q8k_block) holds the
 * int8 values of its 8 sub-blocks in order. Per sub-block j the 8 weight
 * vectors (unsigned: Q4_K nibbles, Q5_K 5-bit, Q6_K 6-bit values) are made
 * from the record with a shift and a mask (vpternlogd merges the high
 * bits) and every row of the tile takes 8 vpdpbusd with its activation
 * dwords broadcast; the integer sums of the contract (step 2K), all exact:
 *   Q4_K, Q5_K  I += sc * D (vpmulld), D the sub-block's dot;
 *               J = 4 vpdpwssd of the rows' (m[2t], m[2t + 1]) int16 pairs
 *               with the activation's s32 pairs
 *   Q6_K        I += sl * lo + sh * hi (lo, hi: the dots of the 16-element
 *               halves with the unsigned weights), and the - 32 * sum_h
 *               sc[h] * s16[h] of q - 32 as 8 vpdpwssd of the (-32 sl,
 *               -32 sh) int16 pairs (|32 * sc| <= 4096) with the s16 pairs
 * then the contract's float steps run once per super-block on 16 rows. */

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

/* Bytes 2h, 2h + 1 (h 0, 1) of every lane of v as an int16 pair. */
static inline ES_AI __m512i pk_pair(__m512i v, int h) {
    const __m128i c = h ? _mm_setr_epi8(2, -1, 3, -1, 6, -1, 7, -1, 10, -1, 11, -1, 14, -1, 15, -1)
                        : _mm_setr_epi8(0, -1, 1, -1, 4, -1, 5, -1, 8, -1, 9, -1, 12, -1, 13, -1);
    return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(c));
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

/* acc + vpdpwssd(w, the int16 pair at q in every lane), broadcast from memory. */
static inline ES_AI __m512i dpwssd_b(__m512i acc, __m512i w, const int16_t *q) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)(const void *)q));
    return acc;
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
        const es_q8k_block *xb = (const es_q8k_block *)(const void *)x + sb;   /* row n's: + n * xs bytes */
#define XROW(n) ((const es_q8k_block *)(const void *)((const uint8_t *)xb + (size_t)(n) * xs))
        __m512i S[2], M[2], I[PTILE];
        if (!q6) pk_scales(p + sco, S, M);
        UNROLL
        for (int n = 0; n < nt; n++) I[n] = _mm512_setzero_si512();
        UNROLL
        for (int j = 0; j < 8; j++) {
            __m512i w[8];
            UNROLL
            for (int k = 0; k < 8; k++) w[k] = pk_weights(type, p, j, k);
            __m512i sl, sh = _mm512_setzero_si512(), po = _mm512_setzero_si512();
            if (q6) {
                sl = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p + ES_PK_Q6K_SC + 32 * j)));
                sh = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p + ES_PK_Q6K_SC + 32 * j + 16)));
                /* (-32 sl, -32 sh) as int16 pairs: (sl & 0xFFFF) | sh << 16, times -32 per int16 */
                po = _mm512_ternarylogic_epi32(_mm512_slli_epi32(sh, 16), sl, _mm512_set1_epi32(0xFFFF), 0xF8);
                po = _mm512_mullo_epi16(po, _mm512_set1_epi16(-32));
            } else {
                sl = pk_byte(S[j / 4], j);
            }
            UNROLL
            for (int n = 0; n < nt; n++) {
                const int8_t *q = XROW(n)->qs + 32 * j;
                if (q6) {
                    __m512i lo = dpbusd_b(_mm512_setzero_si512(), w[0], q);
                    __m512i hi = dpbusd_b(_mm512_setzero_si512(), w[4], q + 16);
                    UNROLL
                    for (int k = 1; k < 4; k++) {
                        lo = dpbusd_b(lo, w[k], q + 4 * k);
                        hi = dpbusd_b(hi, w[k + 4], q + 16 + 4 * k);
                    }
                    I[n] = dpwssd_b(I[n], po, XROW(n)->s16 + 2 * j);
                    I[n] = _mm512_add_epi32(I[n], _mm512_add_epi32(_mm512_mullo_epi32(sl, lo), _mm512_mullo_epi32(sh, hi)));
                } else {
                    __m512i D = dpbusd_b(_mm512_setzero_si512(), w[0], q);
                    UNROLL
                    for (int k = 1; k < 8; k++) D = dpbusd_b(D, w[k], q + 4 * k);
                    I[n] = _mm512_add_epi32(I[n], _mm512_mullo_epi32(sl, D));
                }
            }
        }
        const __m512 a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + dof)));
        __m512 b = _mm512_setzero_ps();
        __m512i mp[4];
        if (!q6) {
            /* b = -dmin: the sign bit flipped, exact */
            b = _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p + mof)))),
                _mm512_set1_epi32((int)0x80000000u)));
            UNROLL
            for (int t = 0; t < 4; t++) mp[t] = pk_pair(M[t / 2], t % 2);   /* (m[2t], m[2t + 1]) */
        }
        UNROLL
        for (int n = 0; n < nt; n++) {
            const __m512 dx = _mm512_set1_ps(XROW(n)->d);
            __m512 c = _mm512_mul_ps(_mm512_mul_ps(a, dx), _mm512_cvtepi32_ps(I[n]));
            if (!q6) {
                __m512i J = dpwssd_b(_mm512_setzero_si512(), mp[0], XROW(n)->s32);
                UNROLL
                for (int t = 1; t < 4; t++) J = dpwssd_b(J, mp[t], XROW(n)->s32 + 2 * t);
                c = _mm512_add_ps(c, _mm512_mul_ps(_mm512_mul_ps(b, dx), _mm512_cvtepi32_ps(J)));
            }
            acc[n] = _mm512_add_ps(acc[n], c);
        }
#undef XROW
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    UNROLL
    for (int n = 0; n < nt; n++) _mm512_mask_storeu_ps(Y + (int64_t)n * ldy, m, acc[n]);
}

/* One group of 16 weight rows (nb records at g) times a tile of nt (a
 * constant 1..PTILE) activation rows x; stores nr (1..16) outputs per row.
 * pf: 0 no prefetch (a later tile), 1 the rolling prefetch ES_PF_BYTES
 * ahead, 2 also the first ES_PF_BYTES. 2 is used for the first group of a
 * chunk, and for every group when N = 1: measured with tools/perf/forward_ab.c,
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
    /* I -= qsum << off: the weights as unsigned bytes (Q8_0 + 128, Q4_0 + 8, Q5_0 + 16) */
    const unsigned off = type == ES_TYPE_Q8_0 ? 7 : type == ES_TYPE_Q5_0 ? 4 : 3;
    const int unsigned_only = type == ES_TYPE_Q4_1 || type == ES_TYPE_Q5_1;   /* no offset */
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
            if (unsigned_only) {
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
            acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(u.a, _mm512_set1_ps(xg->d[jj])),
                                     _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1)), acc[n]);
            if (type == ES_TYPE_Q4_1) acc[n] = _mm512_fmadd_ps(u.b, _mm512_set1_ps(xg->dq[jj]), acc[n]);
            if (type == ES_TYPE_Q5_1)
                acc[n] = _mm512_fmadd_ps(_mm512_mul_ps(u.b, _mm512_set1_ps(xg->d[jj])), _mm512_set1_ps(xg->fq[jj]),
                                         acc[n]);
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
    default: return NULL;
    }
}
const char *es_x86_simd_name(void) { return "avx512"; }

#endif /* ES_X86_AVX512 */
