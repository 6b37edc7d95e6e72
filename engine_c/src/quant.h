/*
 * quant.h - private interface between the matmul driver (matmul.c), the
 * scalar kernels (quant.c) and the SIMD kernel files (quant_avx512.c,
 * quant_avx2.c, quant_neon.c). See the determinism
 * contract at the top of quant.c: every kernel here computes each output
 * element with exactly the same float operations as the scalar reference.
 */
#ifndef ES_QUANT_H
#define ES_QUANT_H

#include <stddef.h>
#include <stdint.h>

#include "internal.h"

/* ggml block layouts (little-endian, packed, no padding). */
#define QK 32      /* elements per block of the simple types and per activation block */
#define QK_K 256   /* elements per K-quant super-block */

typedef struct { uint16_t d; uint8_t qs[16]; } es_block_q4_0;                     /* 18 B */
typedef struct { uint16_t d, m; uint8_t qs[16]; } es_block_q4_1;                  /* 20 B */
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[16]; } es_block_q5_0;      /* 22 B */
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[16]; } es_block_q5_1;   /* 24 B */
typedef struct { uint16_t d; int8_t qs[32]; } es_block_q8_0;                      /* 34 B */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[128]; } es_block_q4_K;  /* 144 B */
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; } es_block_q5_K; /* 176 B */
typedef struct { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; } es_block_q6_K; /* 210 B */

_Static_assert(sizeof(es_block_q4_0) == 18 && sizeof(es_block_q4_1) == 20 &&
               sizeof(es_block_q5_0) == 22 && sizeof(es_block_q5_1) == 24 &&
               sizeof(es_block_q8_0) == 34 && sizeof(es_block_q4_K) == 144 &&
               sizeof(es_block_q5_K) == 176 && sizeof(es_block_q6_K) == 210,
               "ggml block sizes");

/*
 * Quantized activations, 16 blocks of 32 elements per group ("transposed"
 * so that one 64-byte load holds 4 consecutive elements of each of the 16
 * blocks): element e of block j of the group is qs[(e / 4) * 64 + j * 4 + e % 4].
 *   d[j]     block scale (float32): x ~= d * q
 *   qsum[j]  sum of the block's 32 int8 values
 *   fq[j]    (float)qsum[j]
 *   dq[j]    d[j] * fq[j]
 * Blocks past the end of the row are all zero (d = 0, qsum = 0, fq = 0).
 * One activation row of n_in elements is ceil(n_in / 512) groups.
 */
#define ES_GROUP_BLOCKS 16
typedef struct {
    int8_t qs[ES_GROUP_BLOCKS * QK];   /* 512 */
    float d[ES_GROUP_BLOCKS];
    int32_t qsum[ES_GROUP_BLOCKS];
    float fq[ES_GROUP_BLOCKS];
    float dq[ES_GROUP_BLOCKS];          /* d[j] * fq[j] (one float multiply) */
} es_q8_group;                          /* 768 B, a multiple of 64 */

/* The per-block fields of activation block jj of group g, from its scale d
 * and its int8 sum (every quantizer). */
static inline void es_q8_set_block(es_q8_group *g, int jj, float d, int32_t sum) {
    g->d[jj] = d;
    g->qsum[jj] = sum;
    g->fq[jj] = (float)sum;
    g->dq[jj] = d * (float)sum;
}

/*
 * Quantized activations for the K types (Q4_K, Q5_K, Q6_K): one record per
 * 256-element super-block (the contract's step 1K in quant.c):
 *   qs[e]    the int8 value of element e (0..255), in order
 *   s16[i]   sum of qs[16i .. 16i + 15] (|s16| <= 16 * 127 = 2032)
 *   s32[j]   sum of qs[32j .. 32j + 31] = s16[2j] + s16[2j + 1] (|s32| <= 4064)
 *   d        the super-block's scale (float32): x ~= d * q
 * so that dword t of s16 (of s32) is the int16 pair of half-blocks 2t, 2t + 1
 * (of sub-blocks 2t, 2t + 1), as multiply-add-pairs instructions take it.
 * A row of n elements (a multiple of 256) is n / 256 records.
 */
typedef struct {
    int8_t qs[QK_K];
    int16_t s16[16];
    int16_t s32[8];
    float d;
    uint8_t pad[12];
} es_q8k_block;   /* 320 B, a multiple of 64 */
_Static_assert(sizeof(es_q8k_block) == 320, "es_q8k_block size");

/* Elements per activation scale for weight type t: 256 for the K types, whose
 * activations are es_q8k_block rows, else 32 (es_q8_group rows). */
static inline int64_t es_act_block_elems(uint32_t t) {
    return t == ES_TYPE_Q4_K || t == ES_TYPE_Q5_K || t == ES_TYPE_Q6_K ? QK_K : QK;
}

/* Accumulator lanes of one output element (the sum is split lane[b % 16]). */
#define ES_LANES 16

/*
 * A kernel computes Y[n][r] for r in [r0, r1), n in [0, N).
 *   w, row_bytes   weight rows (row r at w + r * row_bytes)
 *   n_in           elements per row
 *   x, x_stride    K types: es_q8k_block rows, other quantized types:
 *                  es_q8_group rows, x_stride bytes apart;
 *                  float types: float32 rows of n_in elements, x_stride bytes apart
 *   Y, ldy         output rows ldy floats apart
 */
typedef void (*es_mm_kernel)(const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1,
                             int64_t n_in, const void *x, size_t x_stride, int N,
                             float *Y, int64_t ldy);

/*
 * Packed weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): rows in SIMD lanes.
 * The rows are cut into groups of ES_PACK_ROWS = 16 (the last group padded
 * with zero rows); group g holds, for each block j = 0 .. nb - 1 in order
 * (nb = n_in / es_pack_block_elems(type): blocks of 32, super-blocks of 256
 * for the K types), one record of es_pack_record_bytes(type) = 16 x the
 * block size bytes. Below, r is the row in the group (0..15), b a byte of a
 * 4-byte chunk (0..3), and every array is stored in the order its indices
 * are written, with no padding:
 *   Q4_0, Q4_1: qs[kk][r][b] = byte 4 * kk + b of row (16 g + r)'s block j
 *               (kk 0..3; 256 B), then d[r] (f16, 32 B), then for Q4_1
 *               m[r] (f16, 32 B)
 *   Q5_0, Q5_1: qs[kk][r][b] as Q4_0 (256 B: the low 4 bits), then qh[r]
 *               (a little-endian uint32 per row, 64 B) whose bit 8b + c is
 *               the 5th bit of element 4c + b (c 0..7, b 0..3; ggml's qh
 *               bit 4c + b, regrouped so that byte b of the dword serves
 *               byte b of every chunk: bit c of it to bit 4 is one shift
 *               and a mask, as for Q5_K), then d[r] (f16, 32 B), then for
 *               Q5_1 m[r] (f16, 32 B). 352 B, 384 B.
 *   Q8_0:       qs[k][r][b] = qs[4 * k + b] (k 0..7; 512 B), then d[r]
 *   Q4_K:       qs[p][k][r][b] = qs[32 * p + 4 * k + b] (p 0..3, k 0..7;
 *               2048 B): low nibbles are elements 4k..4k+3 of sub-block
 *               2p, high nibbles those of sub-block 2p + 1; then
 *               sc[w][r] = bytes 4w..4w+3 of the row's 12-byte scales as
 *               a little-endian uint32 (w 0..2; 192 B: the 6-bit
 *               sub-block scales and mins as ggml packs them); then d[r],
 *               dmin[r] (f16, 2 x 32 B). 2304 B.
 *   Q5_K:       as Q4_K, with qh[k][r][b] = qh[4 * k + b] (k 0..7; 512 B:
 *               bit s is the 5th bit of element 4k+b of sub-block s) after
 *               qs: qs, qh, sc, d, dmin. 2816 B.
 *   Q6_K:       ql[h][c][k][r][b] = ql[64 * h + 32 * c + 4 * k + b] (h, c
 *               0..1, k 0..7; 2048 B): low nibbles are the low 4 bits of
 *               elements 4k..4k+3 of sub-block 4h + c, high nibbles of
 *               sub-block 4h + c + 2; then qh[h][k][r][b] = qh[32 * h + 4 *
 *               k + b] (1024 B: bits 2s, 2s + 1 are the high 2 bits of
 *               sub-block 4h + s); then scales[i][r] (int8, the scale of
 *               16-element half-block i = 0..15; 256 B); then d[r] (f16,
 *               32 B). 3360 B.
 * so that one 64-byte load gives 4 consecutive bytes (4 consecutive
 * elements of a block or sub-block, the layout of one dword of the
 * activation group) of 16 rows, and 16 rows x 1 block is one step of a
 * kernel. A packed kernel takes w = the packed data, row_bytes = bytes per
 * group (nb records), rows r0 and r1 multiples of 16 (r1 may be n_out), and
 * computes exactly the values of the scalar kernel on the original rows.
 */
#define ES_PACK_ROWS 16
/* 0 when the type is not packed; inline, so that the kernels' record size
 * folds to a constant for their constant type. */
static inline size_t es_pack_record_bytes(uint32_t type) {
    switch (type) {
    case ES_TYPE_Q4_0: return ES_PACK_ROWS * sizeof(es_block_q4_0);
    case ES_TYPE_Q4_1: return ES_PACK_ROWS * sizeof(es_block_q4_1);
    case ES_TYPE_Q5_0: return ES_PACK_ROWS * sizeof(es_block_q5_0);
    case ES_TYPE_Q5_1: return ES_PACK_ROWS * sizeof(es_block_q5_1);
    case ES_TYPE_Q8_0: return ES_PACK_ROWS * sizeof(es_block_q8_0);
    case ES_TYPE_Q4_K: return ES_PACK_ROWS * sizeof(es_block_q4_K);
    case ES_TYPE_Q5_K: return ES_PACK_ROWS * sizeof(es_block_q5_K);
    case ES_TYPE_Q6_K: return ES_PACK_ROWS * sizeof(es_block_q6_K);
    default: return 0;
    }
}
/* Elements per block (per packed record) of a type: QK_K for the K types,
 * else QK. */
static inline int64_t es_pack_block_elems(uint32_t type) {
    return type == ES_TYPE_Q4_K || type == ES_TYPE_Q5_K || type == ES_TYPE_Q6_K ? QK_K : QK;
}
/* Byte offsets of the parts of a Q5_0 / Q5_1 and a K-type record (see above). */
#define ES_PK_Q5_QH 256
#define ES_PK_Q5_D 320
#define ES_PK_Q5_M 352
#define ES_PK_Q4K_SC 2048
#define ES_PK_Q4K_D 2240
#define ES_PK_Q4K_DMIN 2272
#define ES_PK_Q5K_QH 2048
#define ES_PK_Q5K_SC 2560
#define ES_PK_Q5K_D 2752
#define ES_PK_Q5K_DMIN 2784
#define ES_PK_Q6K_QH 2048
#define ES_PK_Q6K_SC 3072
#define ES_PK_Q6K_D 3328
/* Repack rows [0, n_out) of a matrix of type (row r at src + r * row_bytes,
 * n_in elements, a multiple of es_pack_block_elems(type)) into dst as above
 * (ceil(n_out / 16) * nb records; dst zeroed first). type must have
 * es_pack_record_bytes(type) != 0. Builds without a packed kernel for the
 * type never use the result; tests check the layout with it. */
void es_pack_rows(uint32_t type, const uint8_t *src, size_t row_bytes, int64_t n_in, int64_t n_out, uint8_t *dst);
/* Build t->packed (malloc'd, 64-byte aligned) when this build has a packed
 * kernel for t's type; returns 1 when packed, 0 when not applicable,
 * -1 when out of memory (t unchanged). es_tensor_unpack frees it. */
int es_tensor_pack(es_tensor *t);
void es_tensor_unpack(es_tensor *t);
/* Bytes of t's packed copy; 0 when t is not packed in this build (or is
 * already). */
size_t es_tensor_pack_size(const es_tensor *t);
/* The same as es_tensor_pack into dst (es_tensor_pack_size(t) bytes,
 * 64-byte aligned, owned by the caller, which must outlive every use of t).
 * Returns 1, or 0 when not applicable. */
int es_tensor_pack_into(es_tensor *t, uint8_t *dst);
es_mm_kernel es_x86_packed_kernel(uint32_t type);
es_mm_kernel es_neon_packed_kernel(uint32_t type);
/* The packed kernel of this build for a type (x86's, else NEON's), NULL
 * when none (quant.c; the driver in matmul.c runs it on packed tensors). */
es_mm_kernel es_packed_kernel(uint32_t type);

/*
 * The driver of every backend's packed kernels: 16-row groups from r0 to r1
 * (the last may be partial: nr rows), each run over the activation rows in
 * tiles of at most PTILE_OF(type) (1..PTILE, PTILE at most 8) rows of
 * near-equal size, so that the group's records stay in cache between
 * tiles. PTILE_OF(type) is PTILE unless the backend redefines it (after
 * including this header). The backend defines PTILE and
 *   static inline void pgroup(const int nt, const int type, const uint8_t *g,
 *       int64_t nb, const uint8_t *x, size_t xs, float *Y, int64_t ldy, int nr, int pf)
 * for one group g (nb records: blocks, or super-blocks for the K types) and a tile of nt (a constant) activation rows
 * x, storing nr outputs per row. pf, a prefetch hint: 0 a later tile of the
 * group, 2 the first group of a chunk or any group when N = 1, else 1.
 */
#define PTILE_OF(type) PTILE
#define ES_PTILE_CASE(k, type, ...)                                                                 \
    case k:                                                                                         \
        if ((k) <= PTILE_OF(type)) pgroup((k) <= PTILE_OF(type) ? (k) : 1, type, __VA_ARGS__);     \
        break;
#define ES_PACKED_KERNEL(name, type)                                                                \
    static void name(const uint8_t *w, size_t gbytes, int64_t r0, int64_t r1, int64_t n_in,         \
                     const void *xv, size_t x_stride, int N, float *Y, int64_t ldy) {               \
        const uint8_t *x = xv;                                                                      \
        int64_t nb = n_in / es_pack_block_elems(type);                                              \
        for (int64_t r = r0; r < r1; r += ES_PACK_ROWS) {                                           \
            const uint8_t *g = w + (size_t)(r / ES_PACK_ROWS) * gbytes;                             \
            int nr = r1 - r < ES_PACK_ROWS ? (int)(r1 - r) : ES_PACK_ROWS;                          \
            for (int n0 = 0; n0 < N;) {                                                             \
                int left = (N - n0 + PTILE_OF(type) - 1) / PTILE_OF(type);                          \
                int nt = (N - n0 + left - 1) / left;                                                \
                const uint8_t *xt = x + (size_t)n0 * x_stride;                                      \
                float *Yt = Y + (int64_t)n0 * ldy + r;                                              \
                int pf = n0 > 0 ? 0 : r == r0 || N == 1 ? 2 : 1;                                    \
                switch (nt) {                                                                       \
                    ES_PTILE_CASE(1, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(2, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(3, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(4, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(5, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(6, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(7, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                    ES_PTILE_CASE(8, type, g, nb, xt, x_stride, Yt, ldy, nr, pf)                    \
                }                                                                                   \
                n0 += nt;                                                                           \
            }                                                                                       \
        }                                                                                           \
    }
/* The packed kernels of a backend and its getter (es_x86_packed_kernel,
 * ...): ES_PACKED_KERNELS for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
 * ES_PACKED_KERNELS_K also for Q4_K, Q5_K, Q6_K (the backend's pgroup then
 * handles those too). */
#define ES_PACKED_KERNELS_3                                                                         \
    ES_PACKED_KERNEL(p_q4_0, ES_TYPE_Q4_0)                                                          \
    ES_PACKED_KERNEL(p_q4_1, ES_TYPE_Q4_1)                                                          \
    ES_PACKED_KERNEL(p_q5_0, ES_TYPE_Q5_0)                                                          \
    ES_PACKED_KERNEL(p_q5_1, ES_TYPE_Q5_1)                                                          \
    ES_PACKED_KERNEL(p_q8_0, ES_TYPE_Q8_0)
#define ES_PACKED_KERNELS(getter)                                                                   \
    ES_PACKED_KERNELS_3                                                                             \
    es_mm_kernel getter(uint32_t type) {                                                            \
        switch (type) {                                                                             \
        case ES_TYPE_Q4_0: return p_q4_0;                                                           \
        case ES_TYPE_Q4_1: return p_q4_1;                                                           \
        case ES_TYPE_Q5_0: return p_q5_0;                                                           \
        case ES_TYPE_Q5_1: return p_q5_1;                                                           \
        case ES_TYPE_Q8_0: return p_q8_0;                                                           \
        default: return NULL;                                                                       \
        }                                                                                           \
    }
#define ES_PACKED_KERNELS_K(getter)                                                                 \
    ES_PACKED_KERNELS_3                                                                             \
    ES_PACKED_KERNEL(p_q4_k, ES_TYPE_Q4_K)                                                          \
    ES_PACKED_KERNEL(p_q5_k, ES_TYPE_Q5_K)                                                          \
    ES_PACKED_KERNEL(p_q6_k, ES_TYPE_Q6_K)                                                          \
    es_mm_kernel getter(uint32_t type) {                                                            \
        switch (type) {                                                                             \
        case ES_TYPE_Q4_0: return p_q4_0;                                                           \
        case ES_TYPE_Q4_1: return p_q4_1;                                                           \
        case ES_TYPE_Q5_0: return p_q5_0;                                                           \
        case ES_TYPE_Q5_1: return p_q5_1;                                                           \
        case ES_TYPE_Q8_0: return p_q8_0;                                                           \
        case ES_TYPE_Q4_K: return p_q4_k;                                                           \
        case ES_TYPE_Q5_K: return p_q5_k;                                                           \
        case ES_TYPE_Q6_K: return p_q6_k;                                                           \
        default: return NULL;                                                                       \
        }                                                                                           \
    }

/* The x86 path of this build, one at most: ES_X86_AVX512 (quant_avx512.c)
 * or ES_X86_AVX2 (quant_avx2.c, which also holds the es_x86_* getters of a
 * build with neither). */
#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define ES_X86_AVX512 1
#elif !defined(ES_FORCE_SCALAR) && defined(__AVX2__) && defined(__F16C__)
#define ES_X86_AVX2 1
#endif

/* The scalar reference kernel of a type, NULL when unsupported. */
es_mm_kernel es_ref_kernel(uint32_t type);
/* The SIMD kernel of a type for this build, NULL when the build has none
 * for it (the scalar one is used then). */
es_mm_kernel es_x86_kernel(uint32_t type);
es_mm_kernel es_neon_kernel(uint32_t type);
const char *es_x86_simd_name(void);    /* NULL when no x86 SIMD path is compiled */
const char *es_neon_simd_name(void);   /* NULL when no NEON path is compiled */

/* 1 when es_matmul supports the weight type. */
int es_matmul_supported(uint32_t type);

/* es_matmul with the scalar reference kernels forced on (force_scalar = 1)
 * or the build's best kernels (0). Tests compare the two bitwise. */
void es_matmul_path(es_pool *pool, const es_tensor *W, const float *X, int N,
                    float *Y, int64_t ldy, void *scratch, int force_scalar);

/*
 * Several matrices applied to the same activations in one dispatch (q, k, v;
 * gate, up): X is quantized once and the rows of all nw matrices are shared
 * out to the pool's threads together. Each Y[i] is bitwise what
 * es_matmul(pool, W[i], X, N, Y[i], ldy[i], scratch) gives.
 *   nw       1..ES_MATMUL_MAX (other values: nothing is done)
 *   W[i]     every ne[0] equal to W[0]->ne[0] (a matrix that differs, or has
 *            an unsupported type, gets NaN rows)
 *   scratch  es_matmul_scratch_bytes(<any quantized type>, n_in, N) bytes,
 *            64-byte aligned (unused when every W[i] is a float type)
 */
#define ES_MATMUL_MAX 8
void es_matmul_many(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                    float *const *Y, const int64_t *ldy, void *scratch);

/*
 * es_matmul_many with X already quantized: row n of X quantized by
 * es_quantize_row_act(W[0]->type, ...) into scratch + n *
 * es_matmul_q8_row_bytes(W[0]->type, n_in) for n in [0, N) (which lets the
 * caller quantize each row in the same pool task that writes it). Float
 * weight types read X as es_matmul_many does. When the quantized matrices
 * need both activation formats (es_act_block_elems 32 and 256), the
 * quantized rows are not used: X is quantized again per format, as
 * es_matmul_many does. The same bits as es_matmul_many.
 */
void es_matmul_many_pre(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                        float *const *Y, const int64_t *ldy, void *scratch);
/*
 * es_matmul_many (pre = 0) or es_matmul_many_pre (pre = 1) with an
 * epilogue: output rows are cut into chunks of a multiple of epi->gran rows
 * (a multiple of 16); the thread that takes a chunk computes it and then
 * calls epi->fn(epi->ctx, mat, r0, r1), when Y[mat][n][r0 .. r1) are final
 * for every n (the epilogue works on those columns while they are in that
 * thread's cache: RoPE and the KV cache append after q/k/v, SwiGLU and its
 * quantization after gate/up, the argmax of the logits).
 *   joint = 1: the matrices have one shape; a chunk is rows [r0, r1) of
 *              every matrix, and mat = -1.
 *   joint = 0: chunks of each matrix on their own; mat = its index in W.
 * Local output (local_fn set instead of fn; joint = 0): a chunk is not
 * written to Y but into its thread's buffer, local + ith * local_floats
 * (ith the pool thread, 0 .. es_pool_size(pool) - 1), with rows of the
 * chunk's width: the thread then calls local_fn(ctx, mat, r0, r1, y, ldl)
 * with y[n * ldl + (r - r0)] the value Y[mat][n][r] would have, for r in
 * [r0, r1), n in [0, N). Chunks are then at most local_floats / N rows
 * (a multiple of gran; local_floats >= N * gran), so a chunk's output stays
 * in that thread's cache and the full rows are never written to memory
 * (the argmax of the logits when the logits themselves are not wanted).
 * Matrices of other n_in, an unsupported type, a bad gran, or a local
 * buffer too small for one chunk (or local with joint): the plain dispatch
 * into Y, then the epilogue over whole matrices on the calling thread
 * (local_fn with y = Y[mat], ldl = ldy[mat]). The same bits as
 * es_matmul_many, in Y or in the y of the epilogue.
 */
#define ES_EPI_ROWS 32
typedef void (*es_mm_epilogue)(void *ctx, int mat, int64_t r0, int64_t r1);
typedef void (*es_mm_local_epilogue)(void *ctx, int mat, int64_t r0, int64_t r1, const float *y, int64_t ldl);
typedef struct {
    es_mm_epilogue fn;
    void *ctx;
    int joint;
    int64_t gran;
    es_mm_local_epilogue local_fn;   /* with local: replaces fn */
    float *local;                    /* [es_pool_size(pool)][local_floats] */
    size_t local_floats;
} es_mm_epi;
void es_matmul_many_epi(es_pool *pool, int nw, const es_tensor *const *W, const float *X, int N,
                        float *const *Y, const int64_t *ldy, void *scratch, int pre, const es_mm_epi *epi);

/*
 * Grouped matmul: ng matrices, each on activation rows of its own (the
 * experts of a mixture-of-experts layer, each on the rows routed to it), in
 * one dispatch whose chunks are (matrix, block of output rows): for each
 * group i, Y[n][r] = X[n] . W row r for n in [0, N), r in [0, n_out),
 * bitwise what es_matmul(pool, W, X, N, Y, ldy, ...) gives. The float rows
 * X are quantized in the same call (once when consecutive groups share X,
 * n_in and activation format: an expert's gate and up).
 *   scratch  es_matmul_grouped_scratch(ng, g) bytes, 64-byte aligned
 * A group whose matrix type is unsupported gets NaN rows.
 */
typedef struct {
    const es_tensor *W;     /* a matrix: ne[0] = n_in, ne[1] = n_out */
    const float *X;         /* [N][n_in] float rows */
    int N;                  /* >= 1 */
    float *Y;               /* [N][ldy] */
    int64_t ldy;
} es_mm_group;
size_t es_matmul_grouped_scratch(int ng, const es_mm_group *g);
void es_matmul_grouped(es_pool *pool, int ng, const es_mm_group *g, void *scratch);

/* Bytes of one quantized activation row of n_in elements for weight type
 * `type` (es_q8_group or es_q8k_block rows); 0 for float weight types, which
 * read float rows. Never more than es_matmul_scratch_bytes(t, n_in, 1) for
 * any quantized t. */
size_t es_matmul_q8_row_bytes(uint32_t type, int64_t n_in);

/* Quantize activation row x (n elements) for weight type `type` into out
 * (es_matmul_q8_row_bytes(type, n) bytes): es_quantize_row_q8k for the K
 * types, es_quantize_row_q8 for the other quantized types. */
void es_quantize_row_act(uint32_t type, const float *x, int64_t n, void *out);
/* The same for elements [e0, e1) only (multiples of es_act_block_elems(type),
 * or e1 = n), the bytes es_quantize_row_act writes for them; threads may
 * quantize disjoint ranges of one row. */
void es_quantize_cols_act(uint32_t type, const float *x, int64_t n, int64_t e0, int64_t e1, void *out);

/* Quantize one activation row of n elements (a multiple of 256) into n / 256
 * K records (the contract's step 1K); the SIMD version where the build has
 * one, the _ref one plain C; the same bytes. _blocks: super-blocks [s0, s1)
 * only. */
void es_quantize_row_q8k(const float *x, int64_t n, es_q8k_block *out);
void es_quantize_row_q8k_ref(const float *x, int64_t n, es_q8k_block *out);
void es_quantize_blocks_q8k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out);
/* SIMD versions: 1 when done, 0 when this build has none. */
int es_x86_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out);
int es_neon_quantize_blocks_k(const float *x, int64_t s0, int64_t s1, es_q8k_block *out);

/* Quantize one activation row of n elements into ceil(n / 512) groups
 * (the contract's step 1). es_quantize_row_q8 uses the build's SIMD version
 * when there is one (n a multiple of 32), the _ref one is plain C; both give
 * the same bytes. */
void es_quantize_row_q8(const float *x, int64_t n, es_q8_group *out);
void es_quantize_row_q8_ref(const float *x, int64_t n, es_q8_group *out);
/* Blocks [j0, j1) (32 elements each) of the row x of n elements into the
 * row's groups at out, the same bytes es_quantize_row_q8 writes for them;
 * nothing else of out is written (its padding stays as it was), so threads
 * may quantize disjoint blocks of one row. */
void es_quantize_blocks_q8(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out);
/* SIMD versions of it: return 1 when done, 0 when this build has none (or n
 * is not a multiple of 32). */
int es_x86_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out);
int es_neon_quantize_blocks(const float *x, int64_t n, int64_t j0, int64_t j1, es_q8_group *out);

/* The fixed reduction tree over the 16 lanes:
 * ((((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)))+(((l8+l9)+(l10+l11))+((l12+l13)+(l14+l15)))) */
static inline float es_lane_sum(const float *l) {
    float a0 = (l[0] + l[1]) + (l[2] + l[3]);
    float a1 = (l[4] + l[5]) + (l[6] + l[7]);
    float a2 = (l[8] + l[9]) + (l[10] + l[11]);
    float a3 = (l[12] + l[13]) + (l[14] + l[15]);
    return (a0 + a1) + (a2 + a3);
}

/* ggml's packing of the 6-bit Q4_K / Q5_K sub-block scale and min. */
static inline void es_scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#endif /* ES_QUANT_H */
