/*
 * quant.c - block layouts in use, the determinism contract of every matmul
 * kernel, the scalar reference kernels, row dequantizers, activation
 * quantization and weight packing. The driver that runs the kernels over
 * the pool is matmul.c.
 *
 * DETERMINISM CONTRACT. Every output element Y[n][r] is computed by a
 * sequence of float operations that depends only on weight row r and
 * activation row n: never on N, on the thread split or on the SIMD path.
 * The scalar kernels below are the definition; quant_avx512.c, quant_avx2.c
 * and quant_neon.c compute bitwise the same values (checked by
 * tests/test_quant.c). All files are compiled with -ffp-contract=off: the
 * compiler never fuses a multiply and an add. The one fused step is fma(a, b, c) where the contract below
 * says so (step 3 of the 32-element block types): a single rounding of
 * a * b + c, the same on every path (fmaf in C, vfmadd on x86, fmla on
 * NEON; tests/test_engine_build.py allows FMA instructions only in the
 * matmul kernels).
 *
 * Quantized weight types of 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
 *   1. Each activation row is cut into blocks of 32; block j gets
 *        amax = max |x|, d = amax / 127, id = d != 0 ? 1 / d : 0,
 *        q[i] = round-to-nearest-even(x[i] * id)   (int8 in [-127, 127]),
 *        qsum = sum of q[i]                          (int32)
 *      (es_quantize_row_q8; done once per call, shared by all paths).
 *   2. For every activation block j the weight row gives float factors a,
 *      b and exact int32 sums
 *        I = sum_i wq[i] * q[i]     wq = the block's integer weights
 *        J = qsum
 *      with, per type:
 *        Q4_0  a = d_w, wq = q - 8                  Q5_0  a = d_w, wq = q - 16
 *        Q8_0  a = d_w, wq = q
 *        Q4_1  a = d_w, wq = q, b = m_w             Q5_1  likewise
 *   3. Sequential and fused: y = +0, then for j = 0, 1, 2, ... in order
 *        every type:  y = fma(a * d, (float)I, y)
 *        then Q5_1:   y = fma(b * d, (float)J, y)
 *             Q4_1:   y = fma(b, dq, y)   (dq = d * (float)qsum, made with
 *                                          the activation row)
 *      and Y = y. A fused step is one instruction where a multiply and an
 *      add would be two; the per-block float steps are a large part of a
 *      packed kernel's work once the integer dot products are cheap (VNNI,
 *      sdot), and the rounding is as good.
 * K types (Q4_K, Q5_K, Q6_K; n_in a multiple of 256):
 *   1K. Each activation row is cut into super-blocks of 256 (es_q8k_block);
 *      super-block s gets amax, d, id and q[i] as in step 1 but over its 256
 *      elements, and the exact sums s16 (per 16 elements) and s32 (per 32)
 *      (es_quantize_row_q8k).
 *   2K. For every super-block s the weight row gives float factors a, b and
 *      exact int32 sums over the whole super-block
 *        Q4_K, Q5_K  I = sum_j sc[j] * (sum_i q[j][i] * x[j][i])
 *                    J = sum_j m[j] * s32[j]
 *                    (j the 32-element sub-block, q its unsigned 4- / 5-bit
 *                    weights, sc, m its 6-bit scale and min (ggml's
 *                    get_scale_min_k4), x the activation's int8 values)
 *                    a = d, b = -dmin
 *                    c = (a * d_x) * (float)I + (b * d_x) * (float)J
 *        Q6_K        I = sum_h sc[h] * (sum_i (q[h][i] - 32) * x[h][i])
 *                    (h the 16-element half-block, sc its int8 scale)
 *                    a = d
 *                    c = (a * d_x) * (float)I
 *      |I| <= 8 * 63 * 32 * 31 * 127 < 2^26 (Q5_K; Q6_K: 16 * 128 * 16 *
 *      32 * 127 < 2^27), |J| <= 8 * 63 * 4064 < 2^21: int32 is exact;
 *      (float)I rounds to nearest even like every path's int -> float
 *      conversion.
 *   3K. Sequential: y = +0, then y += c for s = 0, 1, 2, ... in order; Y = y.
 *   The float steps run once per super-block and row: the cost of a K
 *   weight is mostly its integer dot products.
 * Integer sums are exact, so their summation order is free (SIMD uses
 * dot-product instructions in any order); only the float steps are fixed.
 * The SIMD kernels of the quantized types run on packed weights (quant.h:
 * es_tensor_pack) with 16 weight rows in the lanes of a vector, so one step
 * is one block (one super-block) of 16 rows and needs neither a transpose
 * nor a lane tree. Unpacked tensors of these types use the scalar kernel.
 * Float weight types (F32, F16, BF16): activations stay float32; weights are
 * widened exactly to float32; lane[i % 16] += w[i] * x[i] (a product, then a
 * sum) for i = 0, 1, ... in order (lanes start at +0), then Y = the fixed
 * tree es_lane_sum (quant.h). A lane starting at +0 never becomes -0, so
 * SIMD paths may add +0 for padding elements.
 *
 * Bitwise equality holds for finite inputs; with NaN weights or activations
 * the results are NaN on every path but NaN payloads may differ.
 *
 * SIMD coverage: AVX-512 VNNI, AVX2 and NEON dotprod have packed kernels
 * for every quantized type (NEON without dotprod: none; the weights then
 * stay unpacked and use the scalar kernels). Every path has lane kernels
 * for F32, F16 and BF16.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "quant.h"

/* ---- dequantization ---------------------------------------------------- */

static inline float h2f(uint16_t h) { return es_fp16_to_fp32(h); }

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }

/* The 32 integer weights q (not centered) of a Q5_0 / Q5_1 block. */
static void unpack_q5(const uint8_t *qh4, const uint8_t *qs, int *q) {
    uint32_t qh = (uint32_t)qh4[0] | ((uint32_t)qh4[1] << 8) | ((uint32_t)qh4[2] << 16) |
                  ((uint32_t)qh4[3] << 24);
    for (int i = 0; i < 16; i++) {
        q[i] = (qs[i] & 0xF) | (int)(((qh >> i) & 1u) << 4);
        q[i + 16] = (qs[i] >> 4) | (int)(((qh >> (i + 16)) & 1u) << 4);
    }
}

/* Integer weights of sub-block sb (0..7) of a Q4_K / Q5_K super-block. */
static void unpack_k4(const uint8_t *qs, const uint8_t *qh, int sb, int *q) {
    const uint8_t *ql = qs + 32 * (sb / 2);
    int shift = (sb & 1) ? 4 : 0;
    for (int l = 0; l < 32; l++) {
        q[l] = (ql[l] >> shift) & 0xF;
        if (qh) q[l] |= ((qh[l] >> sb) & 1) << 4;
    }
}

/* Centered (q - 32) weights of sub-block sb (0..7, 32 elements) of a Q6_K super-block. */
static void unpack_q6k(const es_block_q6_K *b, int sb, int *q) {
    int h = sb / 4, k = sb % 4;
    const uint8_t *ql = b->ql + 64 * h + ((k & 1) ? 32 : 0);
    const uint8_t *qh = b->qh + 32 * h;
    int shift = (k >= 2) ? 4 : 0;
    for (int l = 0; l < 32; l++)
        q[l] = (((ql[l] >> shift) & 0xF) | (((qh[l] >> (2 * k)) & 3) << 4)) - 32;
}

static void dequant_block(uint32_t type, const uint8_t *p, float *y) {
    int q[32];
    switch (type) {
    case ES_TYPE_Q4_0: {
        const es_block_q4_0 *b = (const void *)p;
        float d = h2f(b->d);
        for (int i = 0; i < 16; i++) {
            y[i] = (float)((b->qs[i] & 0xF) - 8) * d;
            y[i + 16] = (float)((b->qs[i] >> 4) - 8) * d;
        }
        break;
    }
    case ES_TYPE_Q4_1: {
        const es_block_q4_1 *b = (const void *)p;
        float d = h2f(b->d), m = h2f(b->m);
        for (int i = 0; i < 16; i++) {
            y[i] = (float)(b->qs[i] & 0xF) * d + m;
            y[i + 16] = (float)(b->qs[i] >> 4) * d + m;
        }
        break;
    }
    case ES_TYPE_Q5_0: {
        const es_block_q5_0 *b = (const void *)p;
        float d = h2f(b->d);
        unpack_q5(b->qh, b->qs, q);
        for (int i = 0; i < 32; i++) y[i] = (float)(q[i] - 16) * d;
        break;
    }
    case ES_TYPE_Q5_1: {
        const es_block_q5_1 *b = (const void *)p;
        float d = h2f(b->d), m = h2f(b->m);
        unpack_q5(b->qh, b->qs, q);
        for (int i = 0; i < 32; i++) y[i] = (float)q[i] * d + m;
        break;
    }
    case ES_TYPE_Q8_0: {
        const es_block_q8_0 *b = (const void *)p;
        float d = h2f(b->d);
        for (int i = 0; i < 32; i++) y[i] = (float)b->qs[i] * d;
        break;
    }
    case ES_TYPE_Q4_K:
    case ES_TYPE_Q5_K: {
        const es_block_q4_K *b = (const void *)p;
        const uint8_t *qh = NULL, *qs = b->qs;
        if (type == ES_TYPE_Q5_K) {
            const es_block_q5_K *b5 = (const void *)p;
            qh = b5->qh;
            qs = b5->qs;
        }
        float d = h2f(b->d), dmin = h2f(b->dmin);
        for (int sb = 0; sb < 8; sb++) {
            int sc, m;
            es_scale_min_k4(sb, b->scales, &sc, &m);
            float d1 = d * (float)sc, m1 = dmin * (float)m;
            unpack_k4(qs, qh, sb, q);
            for (int l = 0; l < 32; l++) y[32 * sb + l] = d1 * (float)q[l] - m1;
        }
        break;
    }
    case ES_TYPE_Q6_K: {
        const es_block_q6_K *b = (const void *)p;
        float d = h2f(b->d);
        for (int sb = 0; sb < 8; sb++) {
            unpack_q6k(b, sb, q);
            for (int l = 0; l < 32; l++) {
                int is = 8 * (sb / 4) + (sb % 4) * 2 + l / 16;
                y[32 * sb + l] = d * (float)b->scales[is] * (float)q[l];
            }
        }
        break;
    }
    default:
        break;
    }
}

/* Bytes per block of the supported quantized types, 0 for others. */
static size_t qblock_bytes(uint32_t type) {
    switch (type) {
    case ES_TYPE_Q4_0: return sizeof(es_block_q4_0);
    case ES_TYPE_Q4_1: return sizeof(es_block_q4_1);
    case ES_TYPE_Q5_0: return sizeof(es_block_q5_0);
    case ES_TYPE_Q5_1: return sizeof(es_block_q5_1);
    case ES_TYPE_Q8_0: return sizeof(es_block_q8_0);
    case ES_TYPE_Q4_K: return sizeof(es_block_q4_K);
    case ES_TYPE_Q5_K: return sizeof(es_block_q5_K);
    case ES_TYPE_Q6_K: return sizeof(es_block_q6_K);
    default: return 0;
    }
}

void es_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n) {
    const uint8_t *p = src;
    switch (type) {
    case ES_TYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case ES_TYPE_F16:
        for (int64_t i = 0; i < n; i++) dst[i] = es_fp16_to_fp32(rd16(p + 2 * i));
        return;
    case ES_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) dst[i] = es_bf16_to_fp32(rd16(p + 2 * i));
        return;
    default:
        break;
    }
    size_t bb = qblock_bytes(type);
    int64_t be = (type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K || type == ES_TYPE_Q6_K) ? QK_K : QK;
    if (bb == 0) {
        for (int64_t i = 0; i < n; i++) dst[i] = NAN;
        return;
    }
    for (int64_t i = 0; i < n / be; i++) dequant_block(type, p + (size_t)i * bb, dst + i * be);
}

/* ---- activation quantization ------------------------------------------ */

static void quantize_blocks_ref(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out);

void es_quantize_blocks_q8(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) {
    if (es_x86_quantize_blocks(x, n, j0, j1, out) || es_neon_quantize_blocks(x, n, j0, j1, out)) return;
    quantize_blocks_ref(x, n, j0, j1, out);
}

void es_quantize_row_q8(const float *x, int64_t n, es_q8_group *out) {
    int64_t nb = (n + QK - 1) / QK;
    memset(out, 0, (size_t)((nb + ES_GROUP_BLOCKS - 1) / ES_GROUP_BLOCKS) * sizeof *out);
    es_quantize_blocks_q8(x, n, 0, nb, out);
}

void es_quantize_row_q8_ref(const float *x, int64_t n, es_q8_group *out) {
    int64_t nb = (n + QK - 1) / QK;
    memset(out, 0, (size_t)((nb + ES_GROUP_BLOCKS - 1) / ES_GROUP_BLOCKS) * sizeof *out);
    quantize_blocks_ref(x, n, 0, nb, out);
}

static void quantize_blocks_ref(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out) {
    for (int64_t j = j0; j < j1; j++) {
        es_q8_group *g = &out[j / ES_GROUP_BLOCKS];
        int jj = (int)(j % ES_GROUP_BLOCKS);
        const float *xb = x + j * QK;
        int m = (int)((n - j * QK) < QK ? (n - j * QK) : QK);
        float amax = 0.0f;
        for (int i = 0; i < m; i++) {
            float a = fabsf(xb[i]);
            if (a > amax) amax = a;
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < m; i++) {
            int q = (int)nearbyintf(xb[i] * id);
            g->qs[(i / 4) * 64 + jj * 4 + i % 4] = (int8_t)q;
            sum += q;
        }
        es_q8_set_block(g, jj, d, sum);
    }
}

/* K-type activations (contract step 1K): super-blocks [s0, s1) of row x. */
static void quantize_blocks_k_ref(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) {
    for (int64_t s = s0; s < s1; s++) {
        es_q8k_block *b = &out[s];
        const float *xb = x + s * QK_K;
        float amax = 0.0f;
        for (int i = 0; i < QK_K; i++) {
            float a = fabsf(xb[i]);
            if (a > amax) amax = a;
        }
        float d = amax / 127.0f;
        float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int h = 0; h < 16; h++) {
            int32_t sum = 0;
            for (int i = 16 * h; i < 16 * h + 16; i++) {
                int q = (int)nearbyintf(xb[i] * id);
                b->qs[i] = (int8_t)q;
                sum += q;
            }
            b->s16[h] = (int16_t)sum;
        }
        for (int j = 0; j < 8; j++) b->s32[j] = (int16_t)(b->s16[2 * j] + b->s16[2 * j + 1]);
        b->d = d;
        memset(b->pad, 0, sizeof b->pad);
    }
}

void es_quantize_blocks_q8k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out) {
    if (es_x86_quantize_blocks_k(x, s0, s1, out) || es_neon_quantize_blocks_k(x, s0, s1, out)) return;
    quantize_blocks_k_ref(x, s0, s1, out);
}

void es_quantize_row_q8k(const float *x, int64_t n, es_q8k_block *out) { es_quantize_blocks_q8k(x, 0, n / QK_K, out); }

void es_quantize_row_q8k_ref(const float *x, int64_t n, es_q8k_block *out) { quantize_blocks_k_ref(x, 0, n / QK_K, out); }

void es_quantize_row_act(uint32_t type, const float *x, int64_t n, void *out) {
    if (es_act_block_elems(type) == QK_K) es_quantize_row_q8k(x, n, out);
    else es_quantize_row_q8(x, n, out);
}

void es_quantize_cols_act(uint32_t type, const float *x, int64_t n, int64_t e0, int64_t e1, void *out) {
    if (es_act_block_elems(type) == QK_K) es_quantize_blocks_q8k(x, e0 / QK_K, e1 / QK_K, out);
    else es_quantize_blocks_q8(x, n, e0 / QK, (e1 + QK - 1) / QK, out);
}

/* ---- scalar reference kernels ------------------------------------------ */

/* One activation block (32 elements) of weight row `row`: integer weights,
 * factors a, b and the min multiplier jm (see the contract). */
typedef void (*unpack_fn)(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm);

static void up_q4_0(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q4_0 *x = (const void *)(row + (size_t)j * sizeof *x);
    for (int i = 0; i < 16; i++) {
        wq[i] = (x->qs[i] & 0xF) - 8;
        wq[i + 16] = (x->qs[i] >> 4) - 8;
    }
    *a = h2f(x->d);
}

static void up_q4_1(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q4_1 *x = (const void *)(row + (size_t)j * sizeof *x);
    for (int i = 0; i < 16; i++) {
        wq[i] = x->qs[i] & 0xF;
        wq[i + 16] = x->qs[i] >> 4;
    }
    *a = h2f(x->d);
    *b = h2f(x->m);
    *jm = 1;
}

static void up_q5_0(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q5_0 *x = (const void *)(row + (size_t)j * sizeof *x);
    unpack_q5(x->qh, x->qs, wq);
    for (int i = 0; i < 32; i++) wq[i] -= 16;
    *a = h2f(x->d);
}

static void up_q5_1(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q5_1 *x = (const void *)(row + (size_t)j * sizeof *x);
    unpack_q5(x->qh, x->qs, wq);
    *a = h2f(x->d);
    *b = h2f(x->m);
    *jm = 1;
}

static void up_q8_0(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q8_0 *x = (const void *)(row + (size_t)j * sizeof *x);
    for (int i = 0; i < 32; i++) wq[i] = x->qs[i];
    *a = h2f(x->d);
}

static void up_qk(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm, int five) {
    const uint8_t *p = row + (size_t)(j / 8) * (five ? sizeof(es_block_q5_K) : sizeof(es_block_q4_K));
    const es_block_q4_K *x = (const void *)p;
    const uint8_t *qs = x->qs, *qh = NULL;
    if (five) {
        qh = ((const es_block_q5_K *)(const void *)p)->qh;
        qs = ((const es_block_q5_K *)(const void *)p)->qs;
    }
    int sb = (int)(j % 8), sc, m;
    es_scale_min_k4(sb, x->scales, &sc, &m);
    unpack_k4(qs, qh, sb, wq);
    for (int i = 0; i < 32; i++) wq[i] *= sc;
    *a = h2f(x->d);
    *b = -h2f(x->dmin);
    *jm = m;
}

static void up_q4_k(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    up_qk(row, j, wq, a, b, jm, 0);
}

static void up_q5_k(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    up_qk(row, j, wq, a, b, jm, 1);
}

static void up_q6_k(const uint8_t *row, int64_t j, int *wq, float *a, float *b, int32_t *jm) {
    const es_block_q6_K *x = (const void *)(row + (size_t)(j / 8) * sizeof *x);
    int sb = (int)(j % 8);
    unpack_q6k(x, sb, wq);
    int is = 8 * (sb / 4) + (sb % 4) * 2;
    for (int i = 0; i < 32; i++) wq[i] *= x->scales[is + i / 16];
    *a = h2f(x->d);
}

#define REF_NT 32   /* activation rows per pass */

/* Contract steps 2 and 3. two_term: 0 one-term, 1 Q5_1's (b * d, J), 2
 * Q4_1's (b, dq). */
static void ref_quant(unpack_fn up, int two_term, const uint8_t *w, size_t row_bytes,
                      int64_t r0, int64_t r1, int64_t n_in, const void *xv, size_t x_stride,
                      int N, float *Y, int64_t ldy) {
    int64_t nb = n_in / QK;
    for (int n0 = 0; n0 < N; n0 += REF_NT) {
        int nt = N - n0 < REF_NT ? N - n0 : REF_NT;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            float y[REF_NT];
            for (int n = 0; n < nt; n++) y[n] = 0.0f;
            for (int64_t j = 0; j < nb; j++) {
                int wq[32];
                float a = 0.0f, b = 0.0f;
                int32_t jm = 0;
                up(row, j, wq, &a, &b, &jm);
                size_t goff = (size_t)(j / ES_GROUP_BLOCKS) * sizeof(es_q8_group);
                int jj = (int)(j % ES_GROUP_BLOCKS);
                for (int n = 0; n < nt; n++) {
                    const es_q8_group *g =
                        (const void *)((const uint8_t *)xv + (size_t)(n0 + n) * x_stride + goff);
                    int32_t I = 0;
                    for (int i = 0; i < 32; i++) I += wq[i] * g->qs[(i / 4) * 64 + jj * 4 + i % 4];
                    float dx = g->d[jj];
                    y[n] = fmaf(a * dx, (float)I, y[n]);
                    if (two_term == 1) y[n] = fmaf(b * dx, (float)(jm * g->qsum[jj]), y[n]);
                    if (two_term == 2) y[n] = fmaf(b, g->dq[jj], y[n]);
                }
            }
            for (int n = 0; n < nt; n++) Y[(int64_t)(n0 + n) * ldy + r] = y[n];
        }
    }
}

/* K types (contract steps 2K, 3K): one c per super-block; up gives
 * sub-block j's integer weights with the scales folded in (Q6_K: both
 * half-block scales) and, for two-term types, its min m as jm. */
static void ref_quant_k(unpack_fn up, int two_term, const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1,
                        int64_t n_in, const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {
    int64_t ns = n_in / QK_K;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + (size_t)r * row_bytes;
        for (int n = 0; n < N; n++) {
            const es_q8k_block *xb = (const void *)((const uint8_t *)xv + (size_t)n * x_stride);
            float y = 0.0f;
            for (int64_t s = 0; s < ns; s++) {
                int32_t I = 0, J = 0;
                float a = 0.0f, b = 0.0f;
                for (int j = 0; j < 8; j++) {
                    int wq[32];
                    int32_t jm = 0;
                    up(row, 8 * s + j, wq, &a, &b, &jm);
                    for (int i = 0; i < 32; i++) I += wq[i] * xb[s].qs[32 * j + i];
                    J += jm * xb[s].s32[j];
                }
                float dx = xb[s].d;
                float c = (a * dx) * (float)I;
                if (two_term) c = c + (b * dx) * (float)J;
                y += c;
            }
            Y[(int64_t)n * ldy + r] = y;
        }
    }
}

#define REF_QUANT_K(name, up, two)                                                        \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n_in,   \
                     const void *x, size_t xs, int N, float *Y, int64_t ldy) {            \
        ref_quant_k(up, two, w, rb, r0, r1, n_in, x, xs, N, Y, ldy);                      \
    }
REF_QUANT_K(ref_q4_k, up_q4_k, 1)
REF_QUANT_K(ref_q5_k, up_q5_k, 1)
REF_QUANT_K(ref_q6_k, up_q6_k, 0)

#define REF_QUANT(name, up, two)                                                          \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n_in,   \
                     const void *x, size_t xs, int N, float *Y, int64_t ldy) {            \
        ref_quant(up, two, w, rb, r0, r1, n_in, x, xs, N, Y, ldy);                        \
    }
REF_QUANT(ref_q4_0, up_q4_0, 0)
REF_QUANT(ref_q4_1, up_q4_1, 2)
REF_QUANT(ref_q5_0, up_q5_0, 0)
REF_QUANT(ref_q5_1, up_q5_1, 1)
REF_QUANT(ref_q8_0, up_q8_0, 0)

/* Float weights: lane[i % 16] += w[i] * x[i]. */
static void ref_float(uint32_t type, const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1,
                      int64_t n_in, const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {
    float wf[256];
    for (int n0 = 0; n0 < N; n0 += REF_NT) {
        int nt = N - n0 < REF_NT ? N - n0 : REF_NT;
        for (int64_t r = r0; r < r1; r++) {
            const uint8_t *row = w + (size_t)r * row_bytes;
            float lanes[REF_NT][ES_LANES];
            memset(lanes, 0, sizeof lanes);
            for (int64_t i0 = 0; i0 < n_in; i0 += 256) {
                int m = (int)(n_in - i0 < 256 ? n_in - i0 : 256);
                size_t esz = type == ES_TYPE_F32 ? 4 : 2;
                es_dequantize_row(type, row + (size_t)i0 * esz, wf, m);
                for (int n = 0; n < nt; n++) {
                    const float *x = (const void *)((const uint8_t *)xv + (size_t)(n0 + n) * x_stride);
                    for (int i = 0; i < m; i++) lanes[n][(i0 + i) % ES_LANES] += wf[i] * x[i0 + i];
                }
            }
            for (int n = 0; n < nt; n++) Y[(int64_t)(n0 + n) * ldy + r] = es_lane_sum(lanes[n]);
        }
    }
}

#define REF_FLOAT(name, t)                                                                \
    static void name(const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n_in,   \
                     const void *x, size_t xs, int N, float *Y, int64_t ldy) {            \
        ref_float(t, w, rb, r0, r1, n_in, x, xs, N, Y, ldy);                              \
    }
REF_FLOAT(ref_f32, ES_TYPE_F32)
REF_FLOAT(ref_f16, ES_TYPE_F16)
REF_FLOAT(ref_bf16, ES_TYPE_BF16)

es_mm_kernel es_ref_kernel(uint32_t type) {
    switch (type) {
    case ES_TYPE_F32: return ref_f32;
    case ES_TYPE_F16: return ref_f16;
    case ES_TYPE_BF16: return ref_bf16;
    case ES_TYPE_Q4_0: return ref_q4_0;
    case ES_TYPE_Q4_1: return ref_q4_1;
    case ES_TYPE_Q5_0: return ref_q5_0;
    case ES_TYPE_Q5_1: return ref_q5_1;
    case ES_TYPE_Q8_0: return ref_q8_0;
    case ES_TYPE_Q4_K: return ref_q4_k;
    case ES_TYPE_Q5_K: return ref_q5_k;
    case ES_TYPE_Q6_K: return ref_q6_k;
    default: return NULL;
    }
}

int es_matmul_supported(uint32_t type) { return es_ref_kernel(type) != NULL; }

const char *es_quant_simd_name(void) {
    const char *s = es_x86_simd_name();
    if (!s) s = es_neon_simd_name();
    return s ? s : "scalar";
}

/* ---- packed weights (quant.h) ------------------------------------------ */

/* The packed kernel of a type in this build (x86 or NEON), NULL when none. */
es_mm_kernel es_packed_kernel(uint32_t type) {
    es_mm_kernel k = es_x86_packed_kernel(type);
    return k ? k : es_neon_packed_kernel(type);
}

size_t es_tensor_pack_size(const es_tensor *t) {
    size_t rec = es_pack_record_bytes(t->type);
    int64_t be = es_pack_block_elems(t->type);
    if (t->packed != NULL || rec == 0 || es_packed_kernel(t->type) == NULL || t->ne[0] % be != 0 || t->ne[0] <= 0 ||
        t->ne[1] <= 0)
        return 0;
    int64_t nb = t->ne[0] / be, n_out = t->ne[1] * t->ne[2] * t->ne[3];
    int64_t ng = (n_out + ES_PACK_ROWS - 1) / ES_PACK_ROWS;
    return (size_t)ng * (size_t)nb * rec;
}

/* The 4-byte chunks of one block or super-block b (row r of its group) into
 * record out (quant.h: the packed layouts). */
static void pack_block(uint32_t type, const uint8_t *b, int r, uint8_t *out) {
#define CHUNKS(dst, src, n) for (int k = 0; k < (n); k++) memcpy((dst) + (size_t)(64 * k + 4 * r), (src) + 4 * k, 4)
    switch (type) {
    case ES_TYPE_Q4_0:
    case ES_TYPE_Q4_1:
    case ES_TYPE_Q8_0: {
        int nq = type == ES_TYPE_Q8_0 ? 8 : 4;   /* dwords of qs per block */
        CHUNKS(out, b + (type == ES_TYPE_Q4_1 ? 4 : 2), nq);
        memcpy(out + nq * 64 + 2 * r, b, 2);                                      /* d */
        if (type == ES_TYPE_Q4_1) memcpy(out + nq * 64 + 32 + 2 * r, b + 2, 2);  /* m */
        break;
    }
    case ES_TYPE_Q5_0:
    case ES_TYPE_Q5_1: {
        int one = type == ES_TYPE_Q5_1;
        const uint8_t *qh = b + (one ? 4 : 2);
        CHUNKS(out, qh + 4, 4);
        uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
        uint32_t t = 0;   /* bit 4c + b of ggml's qh to bit 8b + c */
        for (int c = 0; c < 8; c++)
            for (int e = 0; e < 4; e++) t |= ((h >> (4 * c + e)) & 1u) << (8 * e + c);
        for (int e = 0; e < 4; e++) out[ES_PK_Q5_QH + 4 * r + e] = (uint8_t)(t >> (8 * e));
        memcpy(out + ES_PK_Q5_D + 2 * r, b, 2);                  /* d */
        if (one) memcpy(out + ES_PK_Q5_M + 2 * r, b + 2, 2);    /* m */
        break;
    }
    case ES_TYPE_Q4_K:
    case ES_TYPE_Q5_K: {
        const es_block_q4_K *x = (const void *)b;
        const es_block_q5_K *x5 = (const void *)b;
        int five = type == ES_TYPE_Q5_K;
        const uint8_t *qs = five ? x5->qs : x->qs;
        size_t sc = five ? ES_PK_Q5K_SC : ES_PK_Q4K_SC, d = five ? ES_PK_Q5K_D : ES_PK_Q4K_D;
        size_t dmin = five ? ES_PK_Q5K_DMIN : ES_PK_Q4K_DMIN;
        CHUNKS(out, qs, 32);                    /* [p][k]: byte 32p + 4k */
        if (five) CHUNKS(out + ES_PK_Q5K_QH, x5->qh, 8);
        for (int w = 0; w < 3; w++) memcpy(out + sc + (size_t)(64 * w + 4 * r), x->scales + 4 * w, 4);
        memcpy(out + d + 2 * r, &x->d, 2);
        memcpy(out + dmin + 2 * r, &x->dmin, 2);
        break;
    }
    case ES_TYPE_Q6_K: {
        const es_block_q6_K *x = (const void *)b;
        CHUNKS(out, x->ql, 32);                 /* [h][c][k]: byte 64h + 32c + 4k */
        CHUNKS(out + ES_PK_Q6K_QH, x->qh, 16);  /* [h][k]: byte 32h + 4k */
        for (int i = 0; i < 16; i++) out[ES_PK_Q6K_SC + 16 * i + r] = (uint8_t)x->scales[i];
        memcpy(out + ES_PK_Q6K_D + 2 * r, &x->d, 2);
        break;
    }
    default:
        break;
    }
#undef CHUNKS
}

void es_pack_rows(uint32_t type, const uint8_t *src, size_t row_bytes, int64_t n_in, int64_t n_out, uint8_t *dst) {
    size_t rec = es_pack_record_bytes(type), bb = rec / ES_PACK_ROWS;
    int64_t nb = n_in / es_pack_block_elems(type), ng = (n_out + ES_PACK_ROWS - 1) / ES_PACK_ROWS;
    memset(dst, 0, (size_t)ng * (size_t)nb * rec);
    for (int64_t g = 0; g < ng; g++)
        for (int64_t j = 0; j < nb; j++) {
            uint8_t *out = dst + ((size_t)g * (size_t)nb + (size_t)j) * rec;
            for (int r = 0; r < ES_PACK_ROWS && g * ES_PACK_ROWS + r < n_out; r++)
                pack_block(type, src + (size_t)(g * ES_PACK_ROWS + r) * row_bytes + (size_t)j * bb, r, out);
        }
}

int es_tensor_pack_into(es_tensor *t, uint8_t *p) {
    size_t bytes = es_tensor_pack_size(t);
    if (bytes == 0) return 0;
    es_pack_rows(t->type, t->data, t->row_bytes, t->ne[0], t->ne[1] * t->ne[2] * t->ne[3], p);
    t->packed = p;
    t->packed_bytes = bytes;
    t->packed_owned = 0;
    return 1;
}

int es_tensor_pack(es_tensor *t) {
    if (t->packed != NULL) return 1;
    size_t bytes = es_tensor_pack_size(t);
    if (bytes == 0) return 0;
    uint8_t *p = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (p == NULL) return -1;
    es_tensor_pack_into(t, p);
    t->packed_owned = 1;
    return 1;
}

void es_tensor_unpack(es_tensor *t) {
    if (t->packed_owned) free(t->packed);
    t->packed = NULL;
    t->packed_bytes = 0;
    t->packed_owned = 0;
}
