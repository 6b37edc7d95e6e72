/*
 * attention.c - the attention of the forward pass: softmax(q . K^T /
 * sqrt(head_dim)) . V over each session's own KV cache (kv_cache.c),
 * shared out across the pool in work units (es_attn_shape, es_attn_worker;
 * attention.h). forward.c calls it once per layer, between the q/k/v matmul
 * and the output projection.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attention.h"
#include "internal.h"
#include "quant.h"
#include "rowops.h"

#ifndef KV_PF_AHEAD
#define KV_PF_AHEAD 2       /* attention: a unit asks for the block this many ahead of the one it computes */
#endif
#define KS_UNITS_PER_THREAD 8   /* key split: chunks of blocks aim at about this many units a thread */

/*
 * Attention, softmax(q . K^T / sqrt(head_dim)) . V (GQA), as an online
 * softmax over the KV blocks of ES_KV_BLOCK (B) positions, which are fixed by
 * absolute position. The query of token i of a call (position p = n_past + i,
 * query head h, KV head h / (n_head / n_head_kv)) attends positions [w, p],
 * w = 0, or on a sliding-window layer (gemma3's local layers) w = max(0,
 * p - n_swa + 1): blocks w / B .. p / B, the first and last ones in part.
 * Per query:
 *   block b, its positions t in [bB, min(bB + B, p + 1)):
 *     s_t = z * scale, z = +0 then z = fma(q[d], k_t[d], z) for d = 0, 1, ...
 *           (scale = 1 / sqrt(head_dim), or the model's attn_scale)
 *     m_b = max of s_t over t >= w;  e_t = exp(s_t - m_b)  (exp_cephes, its
 *           lanes in expv) for t >= w, e_t = +0 for t < w
 *     l_b = sum8 of the e_t (lane j adds e of the block's positions j, j + 8,
 *           ... in order, then the fixed tree of dot8)
 *     o_b[d] = +0 then o_b[d] = fma(e_t, v_t[d], o_b[d]) for t in order
 *           (a position before w adds +0 * v: o_b unchanged for finite v)
 *   fold, blocks in order: (M, L, O) = block w / B's (m, l, o); for the next ones
 *     M' = max(M, m_b), a = exp(M - M'), c = exp(m_b - M'),
 *     L = L * a + l_b * c,  O[d] = O[d] * a + o_b[d] * c,  M = M'
 *   out[d] = O[d] * (1 / L)
 * (fma: a * b + c with one rounding, fmaf's; one instruction where a multiply
 * and an add would be two, in the loops that bound a long context's prefill.)
 * KV eviction (es_session_params kv_sinks S, kv_window W): every layer's
 * query at p attends [0, S) U [w, p], w = max(0, p - W + 1): the sink
 * blocks 0 .. (S - 1) / B first (in a block holding both sinks and the
 * window's start, its positions in [S, w) get e_t = +0 as those before w
 * above, and m_b is the max over the kept ones), then the window's blocks
 * from max(w / B, the first block after the sinks), folded in that order.
 * A sliding-window layer's ring (kv_cache.c) keeps block b at ring block
 * b % nb: the blocks and the order above are the same, and the positions
 * [w, p] of every query are in the ring (es_kv_rollback and the forward's
 * pieces see to it). Its other slots in the first and last blocks may hold
 * other positions (later ones, or ones rolled back): their scores are
 * dropped or their weight is +0, as for the positions before w above, so
 * for finite V the results are bitwise those of the full layout.
 * Every step is a fixed sequence of float operations on the query's own
 * inputs and positions. So neither N, nor which queries share a work unit,
 * nor which thread computes which block, nor the vector width changes a bit:
 * a query computed in a 5-token verify is bitwise the query of a 1-token step.
 * (Sparse attention, sparse.c, is the exception: a key-split call attends
 * the blocks chosen for the whole call, per KV head, the same blocks and
 * the same fold in ascending block order for each of its queries, so a
 * query there depends on its call; attn_task.sel holds the choice.)
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

/* Queries of one score slice: up to SCORE_Q side by side, each K vector
 * loaded once for all (2 * SCORE_Q accumulators). */
#if defined(__AVX512F__)
#define SCORE_Q 6
#else
#define SCORE_Q 4
#endif

/* One K or V block of the cache as the kernels read it (es_kv_block_off):
 * F16 values h, or Q8_0 int8 values q with their F16 scales s; a V block's
 * scales also as float32 in vs [B][hd / 32] (converted once a block, exact). */
typedef struct {
    const uint16_t *h;      /* F16, else NULL */
    const int8_t *q;        /* Q8_0, else NULL */
    const uint16_t *s;      /* Q8_0: K [hd / 32][B], V [B][hd / 32] */
    const float *vs;        /* Q8_0 V: s as float32 */
    int hd;
} kv_view;

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
#if AXPY_D / AW == 4 && AXPY_Q <= 3
/* x86 (4 vectors of AW per query): the same sums with the accumulators and
 * the V vectors in named variables; as arrays GCC kept them on the stack
 * and stored each back at every position. */
#define AXPY_LD(k) (q8 ? ld_q8(vq + AW * (k), va_splat(sr[AW * (k) / 32])) : ld_h(vh + AW * (k)))
static inline __attribute__((always_inline)) void axpy_qd_t(const int nj, const int q8, float *const *o,
                                                             const float *const *a, int t0, int t1,
                                                             const kv_view *vw, int d0, int cont) {
    vaf x0 = {0}, x1 = {0}, x2 = {0}, x3 = {0}, y0 = {0}, y1 = {0}, y2 = {0}, y3 = {0};
    vaf z0 = {0}, z1 = {0}, z2 = {0}, z3 = {0};
    const float *a0 = a[0], *a1 = nj > 1 ? a[1] : a[0], *a2 = nj > 2 ? a[2] : a[0];
    if (cont) {
        memcpy(&x0, o[0], sizeof x0); memcpy(&x1, o[0] + AW, sizeof x1);
        memcpy(&x2, o[0] + 2 * AW, sizeof x2); memcpy(&x3, o[0] + 3 * AW, sizeof x3);
        if (nj > 1) {
            memcpy(&y0, o[1], sizeof y0); memcpy(&y1, o[1] + AW, sizeof y1);
            memcpy(&y2, o[1] + 2 * AW, sizeof y2); memcpy(&y3, o[1] + 3 * AW, sizeof y3);
        }
        if (nj > 2) {
            memcpy(&z0, o[2], sizeof z0); memcpy(&z1, o[2] + AW, sizeof z1);
            memcpy(&z2, o[2] + 2 * AW, sizeof z2); memcpy(&z3, o[2] + 3 * AW, sizeof z3);
        }
    }
    for (int t = t0; t < t1; t++) {
        const int8_t *vq = q8 ? vw->q + (size_t)t * vw->hd + d0 : NULL;
        const float *sr = q8 ? vw->vs + (size_t)t * (size_t)(vw->hd / 32) + d0 / 32 : NULL;
        const uint16_t *vh = q8 ? NULL : vw->h + (size_t)t * vw->hd + d0;
        vaf v0 = AXPY_LD(0), v1 = AXPY_LD(1), v2 = AXPY_LD(2), v3 = AXPY_LD(3);
        IN_REG(v0);
        IN_REG(v1);
        IN_REG(v2);
        IN_REG(v3);
        vaf s = va_splat(a0[t]);
        x0 = fma_a(s, v0, x0); x1 = fma_a(s, v1, x1); x2 = fma_a(s, v2, x2); x3 = fma_a(s, v3, x3);
        if (nj > 1) {
            s = va_splat(a1[t]);
            y0 = fma_a(s, v0, y0); y1 = fma_a(s, v1, y1); y2 = fma_a(s, v2, y2); y3 = fma_a(s, v3, y3);
        }
        if (nj > 2) {
            s = va_splat(a2[t]);
            z0 = fma_a(s, v0, z0); z1 = fma_a(s, v1, z1); z2 = fma_a(s, v2, z2); z3 = fma_a(s, v3, z3);
        }
    }
    memcpy(o[0], &x0, sizeof x0); memcpy(o[0] + AW, &x1, sizeof x1);
    memcpy(o[0] + 2 * AW, &x2, sizeof x2); memcpy(o[0] + 3 * AW, &x3, sizeof x3);
    if (nj > 1) {
        memcpy(o[1], &y0, sizeof y0); memcpy(o[1] + AW, &y1, sizeof y1);
        memcpy(o[1] + 2 * AW, &y2, sizeof y2); memcpy(o[1] + 3 * AW, &y3, sizeof y3);
    }
    if (nj > 2) {
        memcpy(o[2], &z0, sizeof z0); memcpy(o[2] + AW, &z1, sizeof z1);
        memcpy(o[2] + 2 * AW, &z2, sizeof z2); memcpy(o[2] + 3 * AW, &z3, sizeof z3);
    }
}
#undef AXPY_LD
/* The cache's value type chosen once, outside the loop over positions: with
 * the test inside it GCC kept the V vectors and the accumulators on the
 * stack (a store of each at every position). */
static inline __attribute__((always_inline)) void axpy_qd(const int nj, float *const *o, const float *const *a,
                                                           int t0, int t1, const kv_view *vw, int d0, int cont) {
    if (vw->q) axpy_qd_t(nj, 1, o, a, t0, t1, vw, d0, cont);
    else axpy_qd_t(nj, 0, o, a, t0, t1, vw, d0, cont);
}
#else
static inline __attribute__((always_inline)) void axpy_qd(const int nj, float *const *o, const float *const *a,
                                                           int t0, int t1, const kv_view *vw, int d0, int cont) {
    vaf acc[AXPY_Q][AXPY_D / AW];
    for (int j = 0; j < nj; j++)
        for (int k = 0; k < AXPY_D / AW; k++) {
            if (cont) memcpy(&acc[j][k], o[j] + AW * k, sizeof acc[j][k]);
            else acc[j][k] = (vaf){0};
        }
    for (int t = t0; t < t1; t++) {
        vaf v[AXPY_D / AW];
        if (vw->q) {   /* Q8_0: AW values of a run of 32 share its scale */
            const int8_t *vr = vw->q + (size_t)t * vw->hd + d0;
            const float *sr = vw->vs + (size_t)t * (size_t)(vw->hd / 32) + d0 / 32;
            for (int k = 0; k < AXPY_D / AW; k++) {
                v[k] = ld_q8(vr + AW * k, va_splat(sr[AW * k / 32]));
                IN_REG(v[k]);
            }
        } else {
            const uint16_t *vr = vw->h + (size_t)t * vw->hd + d0;
            for (int k = 0; k < AXPY_D / AW; k++) {
                v[k] = ld_h(vr + AW * k);
                IN_REG(v[k]);
            }
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
#endif

/* The same for any head size, one query, positions [0, n). */
static void axpy_row(float *o, const float *a, const kv_view *vw, int n, int hd) {
    for (int d = 0; d < hd; d++) o[d] = 0.0f;
    for (int t = 0; t < n; t++) {
        if (vw->q) {
            const int8_t *vr = vw->q + (size_t)t * (size_t)hd;
            const float *sr = vw->vs + (size_t)t * (size_t)(hd / 32);
            for (int d = 0; d < hd; d++) o[d] = fmaf(a[t], (float)vr[d] * sr[d / 32], o[d]);
            continue;
        }
        const uint16_t *vr = vw->h + (size_t)t * (size_t)hd;
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

/* scores_v over a Q8_0 block: kq [hd][nc] int8, ks [hd / 32][nc] F16 scales;
 * key element (d, t) is kq * ks of d's run of 32, the exact float32 the
 * scalar dequantization gives, then the same sums in the same order. */
static inline __attribute__((always_inline)) void scores_q8(const int nj, const float *const *q, int hd,
                                                         const int8_t *kq, const uint16_t *ks, size_t nc, int n,
                                                         float scale, float *sc, size_t ld) {
    for (int t = 0; t + 2 * AW <= n; t += 2 * AW) {
        vaf acc[SCORE_Q], acc2[SCORE_Q];
        for (int j = 0; j < nj; j++) acc[j] = acc2[j] = (vaf){0};
        for (int d0 = 0; d0 < hd; d0 += 32) {
            vaf s1 = ld_h(ks + (size_t)(d0 / 32) * nc + t), s2 = ld_h(ks + (size_t)(d0 / 32) * nc + t + AW);
            IN_REG(s1);
            IN_REG(s2);
            for (int d = d0; d < d0 + 32; d++) {
                vaf kv = ld_q8(kq + (size_t)d * nc + t, s1), kv2 = ld_q8(kq + (size_t)d * nc + t + AW, s2);
                IN_REG(kv);
                IN_REG(kv2);
                for (int j = 0; j < nj; j++) {
                    float qv = q[j][d];
                    acc[j] = fma_a(va_splat(qv), kv, acc[j]);
                    acc2[j] = fma_a(va_splat(qv), kv2, acc2[j]);
                }
            }
        }
        for (int j = 0; j < nj; j++) {
            vaf sv = acc[j] * scale, sv2 = acc2[j] * scale;
            memcpy(sc + (size_t)j * ld + t, &sv, sizeof sv);
            memcpy(sc + (size_t)j * ld + t + AW, &sv2, sizeof sv2);
        }
    }
}

/* The scores of nj queries against block kb (F16 or Q8_0, as vw says). */
static inline __attribute__((always_inline)) void scores_blk(const int nj, const float *const *q, int hd,
                                                          const kv_view *kw, int n, float scale, float *sc) {
    if (kw->q) scores_q8(nj, q, hd, kw->q, kw->s, ES_KV_BLOCK, n, scale, sc, ES_KV_BLOCK);
    else scores_v(nj, q, hd, kw->h, ES_KV_BLOCK, n, scale, sc, ES_KV_BLOCK);
}

/* Floats of a block's (or a running) result: o [hd] padded to 16 floats, then m and l. */
int es_attn_part_floats(int hd) { return ((hd + 15) & ~15) + 16; }

/* One block of nq queries: qp[j] attends the block's positions [0, se[j])
 * and [lo[j], nv[j]), se[j] <= lo[j] <= nv[j], not both empty (nv
 * ascending; lo = 0 but for a sliding window; se = 0 but in an eviction's
 * sink block);
 * kb [hd][B] and vb [B][hd] are the block in the cache (F16, read as
 * float32 in registers); the scores are computed for its first ncols
 * positions (a multiple of 2 * AW, >= nv[nq - 1]), times scale; sc
 * [nq][B] scratch. dst[j]: o_b, then m_b at [hdr], l_b at [hdr + 1]. A
 * score lane depends only on its query and position, so the scores of
 * positions past every nv (computed, then dropped) change no kept bit, and
 * those before lo[j] get the weight +0. kv_type Q8_0 (q8): the blocks'
 * values are q * d, exact float32s, read by the same sums in the same order.
 */
static void block_partial(int nq, const float *const *qp, const int *se, const int *lo, const int *nv,
                          float *const *dst, int hd, int q8,
                          const uint8_t *kb, const uint8_t *vb, float *sc, int ncols, float scale) {
    int hdr = es_attn_part_floats(hd) - 16;
    size_t nval = (size_t)hd * ES_KV_BLOCK;
    float vsc[ES_MAX_HEAD_DIM / 32 * ES_KV_BLOCK];
    kv_view kw = {NULL, NULL, NULL, NULL, hd}, vw = kw;
    if (q8) {
        kw.q = (const int8_t *)kb;
        kw.s = (const uint16_t *)(const void *)(kb + nval);
        vw.q = (const int8_t *)vb;
        vw.s = (const uint16_t *)(const void *)(vb + nval);
        /* the rows read (nv ascends), AW at a time; the block's hd / 32 * B is a multiple of AW */
        int ns = (nv[nq - 1] * (hd / 32) + AW - 1) / AW * AW, all = hd / 32 * ES_KV_BLOCK;
        for (int i = 0; i < (ns < all ? ns : all); i += AW) {
            vaf f = ld_h(vw.s + i);
            memcpy(vsc + i, &f, sizeof f);
        }
        vw.vs = vsc;
    } else {
        kw.h = (const uint16_t *)(const void *)kb;
        vw.h = (const uint16_t *)(const void *)vb;
    }
    for (int k0 = 0; k0 < nq; k0 += SCORE_Q) {
        int nj = nq - k0 < SCORE_Q ? nq - k0 : SCORE_Q;
        float *sk = sc + (size_t)k0 * ES_KV_BLOCK;
        switch (nj) {
        case 1: scores_blk(1, qp + k0, hd, &kw, ncols, scale, sk); break;
        case 2: scores_blk(2, qp + k0, hd, &kw, ncols, scale, sk); break;
        case 3: scores_blk(3, qp + k0, hd, &kw, ncols, scale, sk); break;
#if SCORE_Q > 4
        case 4: scores_blk(4, qp + k0, hd, &kw, ncols, scale, sk); break;
        case 5: scores_blk(5, qp + k0, hd, &kw, ncols, scale, sk); break;
#endif
        default: scores_blk(SCORE_Q, qp + k0, hd, &kw, ncols, scale, sk); break;
        }
    }
    const float *ap[ES_MAX_UNIT_Q];
    for (int j = 0; j < nq; j++) {
        float *row = sc + (size_t)j * ES_KV_BLOCK;
        float m = lo[j] < nv[j] ? max_row(row + lo[j], nv[j] - lo[j]) : max_row(row, se[j]);
        if (se[j] > 0 && lo[j] < nv[j]) {   /* a sink block: the max over both ranges (exact) */
            float ms = max_row(row, se[j]);
            m = ms > m ? ms : m;
        }
        exp_sub_row(row, m, nv[j]);
        for (int t = se[j]; t < lo[j]; t++) row[t] = 0.0f;
        dst[j][hdr] = m;
        dst[j][hdr + 1] = sum8(row, nv[j]);
        ap[j] = row;
    }
    if (hd % AXPY_D != 0) {
        for (int j = 0; j < nq; j++) axpy_row(dst[j], ap[j], &vw, nv[j], hd);
        return;
    }
    /* AXPY_D dimensions at a time; queries side by side over the positions
     * they all attend, then each query's own last positions */
    float *op[ES_MAX_UNIT_Q];
    for (int d0 = 0; d0 < hd; d0 += AXPY_D) {
        for (int j = 0; j < nq; j++) op[j] = dst[j] + d0;
        /* groups of AXPY_Q, the last one smaller (GQA groups of 2, as in
         * Qwen3, then read each V row once for both queries) */
        for (int k = 0; k < nq; k += AXPY_Q) {
            int nj = nq - k < AXPY_Q ? nq - k : AXPY_Q, lo = nv[k];
            switch (nj) {
            case 1: axpy_qd(1, op + k, ap + k, 0, lo, &vw, d0, 0); break;
#if AXPY_Q > 2
            case 2: axpy_qd(2, op + k, ap + k, 0, lo, &vw, d0, 0); break;
#endif
            default: axpy_qd(AXPY_Q, op + k, ap + k, 0, lo, &vw, d0, 0); break;
            }
            for (int j = k + 1; j < k + nj; j++)
                if (nv[j] > lo) axpy_qd(1, op + j, ap + j, lo, nv[j], &vw, d0, 1);
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

/* The result of block v of the call (es_attn_vblock) for (i, h) in s->parts (key split). */
static float *part_at(const es_session *s, int i, int h, int32_t b) {
    const es_model_info *in = &s->model->info;
    return s->parts + (((size_t)i * in->n_head + (size_t)h) * (size_t)s->kv.n_blk + (size_t)b) * es_attn_part_floats(in->head_dim);
}

/* The queries of tokens [i0, i1) times heads [h0, h1) (of KV head g) over
 * the call's blocks [v0, v1) (es_attn_vblock): key split (t->nch > 0) stores
 * each block's result in s->parts; query split (all the blocks its queries
 * attend) folds them and writes att. */
static void attend_unit(es_session *s, const attn_task *t, int g, int h0, int h1, int i0, int i1, int32_t v0,
                        int32_t v1, float *ws) {
    const es_model_info *in = &s->model->info;
    int hd = in->head_dim, pf = es_attn_part_floats(hd);
    size_t q_dim = (size_t)in->n_head * hd;
    int nh = h1 - h0, nq = (i1 - i0) * nh;
    float *sc = ws;
    float *st = sc + (size_t)s->q_cap * ES_KV_BLOCK, *bp = st + (size_t)s->q_cap * pf;
    const es_kv *kv = &t->seq->kv;
    const float *qp[ES_MAX_UNIT_Q];
    float *dst[ES_MAX_UNIT_Q];
    int32_t pos[ES_MAX_UNIT_Q], wlo[ES_MAX_UNIT_Q];
    int nv[ES_MAX_UNIT_Q], lo[ES_MAX_UNIT_Q], se[ES_MAX_UNIT_Q];
    int32_t sb = kv->sink_blk;
    for (int k = 0; k < nq; k++) {   /* queries by token, then head: positions ascend */
        int i = i0 + k / nh, h = h0 + k % nh;
        qp[k] = s->q + (size_t)(t->row0 + i) * q_dim + (size_t)h * hd;
        pos[k] = kv->n_past + i;
        wlo[k] = es_attn_window_lo(kv, s->model, t->layer, pos[k]);
        if (!t->nch) dst[k] = bp + (size_t)k * pf;
    }
    for (int32_t v = v0; v < v1; v++) {
        int32_t b = es_attn_vblock(t, g, v), p0 = b * ES_KV_BLOCK;
        /* the queries that attend this block: [ka, kb) (positions and
         * window starts ascend with k; a sink block, all that reach it) */
        int ka = 0, kb = nq;
        while (ka < nq && pos[ka] < p0) ka++;
        while (b >= sb && kb > ka && wlo[kb - 1] >= p0 + ES_KV_BLOCK) kb--;
        if (ka == kb) continue;
        for (int k = ka; k < kb; k++) {
            int32_t c = pos[k] + 1 - p0;
            nv[k] = c < ES_KV_BLOCK ? (int)c : ES_KV_BLOCK;
            int32_t wl = wlo[k] > p0 ? wlo[k] - p0 : 0, send = kv->sinks - p0;
            se[k] = 0;
            lo[k] = (int)(wl < nv[k] ? wl : nv[k]);
            if (b < sb) {   /* sinks [0, send), then the window from wl: one range when they meet */
                if (wl <= send) lo[k] = 0;
                else se[k] = (int)(send < nv[k] ? send : nv[k]);
            }
            if (t->nch) dst[k] = part_at(t->seq, i0 + k / nh, h0 + k % nh, v);
        }
        /* ask for the blocks up to KV_PF_AHEAD ahead (all of them at the
         * first): the hardware's streams stop at 4 KiB pages, a block is 8 */
        for (int32_t vp = v == v0 ? v : v + KV_PF_AHEAD; vp <= v + KV_PF_AHEAD && vp < v1; vp++)
            es_kv_prefetch_block(kv, t->layer, g, es_attn_vblock(t, g, vp));
        /* the block's last positions no query attends (the cache's end) are not scored */
        int ncols = (nv[kb - 1] + 2 * AW - 1) / (2 * AW) * (2 * AW);
        block_partial(kb - ka, qp + ka, se + ka, lo + ka, nv + ka, dst + ka, hd, kv->type == ES_KV_Q8_0,
                      es_kv_k_block(kv, t->layer, g, b),
                      es_kv_v_block(kv, t->layer, g, b), sc, ncols, s->model->attn_scale);
        if (!t->nch)
            for (int k = ka; k < kb; k++)   /* the query's first block: 0 with sinks, else its window's */
                fold_part(st + (size_t)k * pf, dst[k], hd, b == (sb > 0 ? 0 : wlo[k] / ES_KV_BLOCK));
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
            const es_kv *kv = &t->seq->kv;
            int32_t p = kv->n_past + i, last = p / ES_KV_BLOCK, nf = 0;
            int32_t first = es_attn_window_lo(kv, s->model, t->layer, p) / ES_KV_BLOCK;
            if (t->sel) {   /* sparse: the selected blocks up to the query's own, ascending */
                int g = h / (in->n_head / in->n_head_kv);
                for (int32_t v = 0; v < t->nvb && es_attn_vblock(t, g, v) <= last; v++)
                    fold_part(st, part_at(t->seq, i, h, v), hd, nf++ == 0);
                finish_part(s->att + (size_t)(t->row0 + i) * q_dim + (size_t)h * hd, st, hd);
                continue;
            }
            for (int32_t b = 0; b < kv->sink_blk && b <= last; b++)   /* the sinks (eviction) */
                fold_part(st, part_at(t->seq, i, h, es_attn_vindex(t, b)), hd, nf++ == 0);
            for (int32_t b = first > kv->sink_blk ? first : kv->sink_blk; b <= last; b++)
                fold_part(st, part_at(t->seq, i, h, es_attn_vindex(t, b)), hd, nf++ == 0);
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

/* Work unit u of task t (the shape is chosen in es_attn_shape), with the
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
        int32_t v0 = c * t->bpc, v1 = v0 + t->bpc < t->nvb ? v0 + t->bpc : t->nvb;
        if (h0 < h1) attend_unit(s, t, g, h0, h1, 0, t->n, v0, v1, ws);
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
        const es_kv *kv = &t->seq->kv;
        int32_t wb = es_attn_window_lo(kv, s->model, t->layer, kv->n_past + i0) / ES_KV_BLOCK;
        if (h0 < h1 && i0 < i1)   /* with sinks from block 0 (the blocks no query attends are passed over) */
            attend_unit(s, t, g, h0, h1, i0, i1, t->sb > 0 ? 0 : es_attn_vindex(t, wb),
                        es_attn_vindex(t, (kv->n_past + i1 - 1) / ES_KV_BLOCK) + 1, ws);
        /* the last unit of a token slice (acq_rel: it sees the others' att
         * writes) quantizes the slice's rows for W_o */
        if (t->rs && atomic_fetch_add_explicit(&s->att_done[t->row0 + sl], 1, memory_order_acq_rel) == groups - 1)
            quantize_att_rows(s, t, i0, i1);
    }
}

/* The units of every session of the call, taken in turn from one counter (a
 * thread that was preempted on a busy host does fewer; the split changes no
 * bit). A thread's units ascend, so its task index only moves forward. */
void es_attn_worker(void *ctx, int ith, int nth) {
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
int es_attn_shape(const es_session *s, attn_task *t) {
    const es_model_info *in = &s->model->info;
    int nth = es_pool_size(s->pool), grp = in->n_head / in->n_head_kv, n = t->n, units_min = 2 * nth;
    int64_t span = (int64_t)t->seq->kv.n_past + n;
    int split = (in->n_head_kv * span < (int64_t)units_min * ES_KV_BLOCK && grp > 1) ? 2 : 1;
    while ((grp + split - 1) / split > s->group_cap) split++;
    int per = (grp + split - 1) / split, groups = in->n_head_kv * split;
    t->per = per;
    t->split = split;
    t->nblk = (int32_t)((span - 1) / ES_KV_BLOCK + 1);
    const es_kv *kv = &t->seq->kv;
    t->blo = es_attn_window_lo(kv, s->model, t->layer, kv->n_past) / ES_KV_BLOCK;
    t->sb = kv->sink_blk < t->nblk ? kv->sink_blk : t->nblk;
    if (t->blo < kv->sink_blk) t->blo = kv->sink_blk;
    t->nvb = t->sb + (t->nblk > t->blo ? t->nblk - t->blo : 0);
    t->sel = NULL;
    es_sparse_prepare(s, t);   /* sparse attention: may choose fewer blocks (key split only) */
    if (n <= KS_MAX_TOKENS) {
        int want = (KS_UNITS_PER_THREAD * nth + groups - 1) / groups;
        int32_t nb = t->nvb;
        int nch = want < nb ? want : nb;
        t->bpc = (nb + nch - 1) / nch;
        t->nch = (nb + t->bpc - 1) / t->bpc;
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

/* ---- the block and fold steps for tree rows (tree.c) ---- */

void es_attn_block_dense(int nq, const float *const *qp, const int *nv, float *const *dst, int hd,
                         const uint16_t *kb, const uint16_t *vb, float *sc, float scale) {
    int zero[ES_MAX_UNIT_Q] = {0}, mx = 0;
    for (int j = 0; j < nq; j++) mx = nv[j] > mx ? nv[j] : mx;
    int ncols = (mx + 2 * AW - 1) / (2 * AW) * (2 * AW);
    block_partial(nq, qp, zero, zero, nv, dst, hd, 0, (const uint8_t *)kb, (const uint8_t *)vb, sc, ncols, scale);  /* F16 only: tree.c refuses a Q8_0 cache */
}

void es_attn_fold(float *st, const float *p, int hd, int first) { fold_part(st, p, hd, first); }

void es_attn_finish(float *out, const float *st, int hd) { finish_part(out, st, hd); }
