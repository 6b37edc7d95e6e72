/*
 * kv_cache.c - the KV cache of a session: allocation, layout (global
 * layers and sliding-window rings), append, rollback and prefetch (the
 * attention reads the F16 blocks in place). The layout and its invariants
 * are described above es_kv in internal.h.
 *
 * Why F16: a decode step at depth reads every cached position of every
 * layer, and at a few thousand positions those bytes, not the weights, bound
 * the step; F16 halves them against float32 (llama.cpp's default cache type
 * is F16 too). The rounding is done once, when a position is written
 * (es_fp32_to_fp16: round to nearest even), by the same scalar function on
 * every target, so what the cache holds does not depend on the SIMD path.
 *
 * Q8_0 (es_session_params kv_type ES_KV_Q8_0) halves those bytes again,
 * nearly: 34 bytes per 32 values. A position's key (and value) vector is
 * quantized per run of 32 dimensions when it is written, by the scalar
 * es_kv_quantize_q8_0 on every target, so here too the cache's bytes do not
 * depend on the SIMD path; nothing of one position's blocks depends on
 * another position, so a rollback and a rewrite leave the others untouched.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__)
#include <immintrin.h>
#define KV_LOAD_AVX512 1
#elif !defined(ES_FORCE_SCALAR) && defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define KV_LOAD_F16C 1
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define KV_LOAD_NEON 1
#endif

#ifndef KV_HUGE_RUN
#define KV_HUGE_RUN ((size_t)2 << 20)   /* bytes of a (layer, KV head) run from which the cache takes huge pages */
#endif

#ifndef KV_PF_LOCALITY
#define KV_PF_LOCALITY 2   /* __builtin_prefetch locality of es_kv_prefetch_block: 2 is T1 (into L2) on x86 */
#endif

/* Positions of a sliding-window layer's ring: the window plus the slack,
 * rounded up to whole blocks, or every position (full) when that is no
 * smaller or the model has no window. */
static int32_t ring_positions(const es_model *m, int32_t n_blk, int32_t slack, int full) {
    int64_t all = (int64_t)n_blk * ES_KV_BLOCK;
    if (full || m->info.n_swa <= 0 || m->info.n_swa_layers == 0) return (int32_t)all;
    int64_t ring = ((int64_t)m->info.n_swa + slack + ES_KV_BLOCK - 1) / ES_KV_BLOCK * ES_KV_BLOCK;
    return (int32_t)(ring < all ? ring : all);
}

/* madvise for one mapping whose (layer, KV head) runs are run_bytes long. */
static void advise_pages(void *p, size_t bytes, size_t run_bytes) {
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
    madvise(p, bytes, run_bytes >= KV_HUGE_RUN ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#else
    (void)p; (void)bytes; (void)run_bytes;
#endif
}

/* KV eviction (window > 0): every layer keeps sink blocks and a ring of the
 * window plus the slack, whatever n_ctx; its blocks are all in the first
 * group of es_kv_init. */
static void evict_layout(es_kv *kv, int32_t slack, int32_t sinks, int32_t window) {
    kv->evict = 1;
    kv->sinks = sinks;
    kv->sink_blk = (sinks + ES_KV_BLOCK - 1) / ES_KV_BLOCK;
    kv->n_swa = window;
    kv->ring = (int32_t)(((int64_t)window + slack + ES_KV_BLOCK - 1) / ES_KV_BLOCK * ES_KV_BLOCK);
    kv->piece = slack;
    kv->n_blk = kv->sink_blk + kv->ring / ES_KV_BLOCK + 1;
}

es_status es_kv_init(es_kv *kv, const es_model *m, int32_t n_ctx, int32_t slack, int full, int32_t sinks,
                     int32_t window, int32_t type, char *err, size_t err_len) {
    const es_model_info *in = &m->info;
    memset(kv, 0, sizeof *kv);
    kv->type = type;   /* es_session_new checked it and head_dim */
    kv->blk_bytes = es_kv_blk_bytes(type, in->head_dim);
    kv->n_ctx = n_ctx;
    kv->n_blk = (n_ctx + ES_KV_BLOCK - 1) / ES_KV_BLOCK;
    kv->n_layer = in->n_layer;
    kv->n_head_kv = in->n_head_kv;
    kv->head_dim = in->head_dim;
    kv->n_swa = in->n_swa;
    kv->ring = ring_positions(m, kv->n_blk, slack, full);
    int rings = kv->ring < kv->n_blk * ES_KV_BLOCK;
    kv->piece = rings ? slack : 0;
    if (window > 0) {   /* es_session_new refuses it beside sliding-window layers */
        evict_layout(kv, slack, sinks, window);
        rings = 0;
    }
    /* Two groups of layers, each a pair of mappings (k, v): the global layers
     * (every layer when there are no rings; with eviction, sinks then a ring)
     * and the rings. */
    int32_t n_in[2] = {0, 0};
    int32_t nb[2] = {kv->evict ? kv->sink_blk + kv->ring / ES_KV_BLOCK : kv->n_blk, kv->ring / ES_KV_BLOCK};
    for (int l = 0; l < in->n_layer; l++) n_in[rings && m->layers[l].swa]++;
    size_t run_bytes[2], total = 0;
    for (int grp = 0; grp < 2; grp++) {
        run_bytes[grp] = (size_t)nb[grp] * kv->blk_bytes;
        kv->map_bytes[2 * grp] = kv->map_bytes[2 * grp + 1] = (size_t)n_in[grp] * (size_t)in->n_head_kv * run_bytes[grp];
        total += 2 * kv->map_bytes[2 * grp];
    }
    /* Anonymous mappings: zeroed (a block's positions past n_past are read by
     * the score vectors, their lanes dropped, and zeros keep them finite) and
     * committed only when written. A step reads each (layer, KV head) as one
     * run of blocks; when a run fills a 2 MiB page or more, the mapping is
     * advised as huge pages (Linux), so the run crosses a page every 2 MiB
     * instead of every 4 KiB (fewer TLB misses; the hardware prefetchers stop
     * at page boundaries). Shorter runs stay on 4 KiB pages, even where
     * transparent huge pages are on for every mapping: a 2 MiB page then
     * holds the starts of several runs, and a new session's first token would
     * make the kernel zero every page of the cache (about 47 MB for SmolLM2
     * at n_ctx 2048) where 4 KiB pages zero what is used. The rings have a
     * mapping of their own for that reason: their runs are short whatever
     * n_ctx is. */
    {   /* refused before anything is mapped: the bytes this layout takes */
        char what[128];
        if (kv->evict)
            snprintf(what, sizeof what, "the KV cache of %d sinks and a window of %d (%d positions a layer)",
                     (int)sinks, (int)window, (int)(nb[0] * ES_KV_BLOCK));
        else if (rings)
            snprintf(what, sizeof what, "the KV cache of %d tokens (%d sliding-window layers keeping %d)",
                     (int)n_ctx, (int)n_in[1], (int)kv->ring);
        else
            snprintf(what, sizeof what, "the KV cache of %d tokens", (int)n_ctx);
        int rc = es_mem_check((int64_t)total, what, kv->evict ? "use a smaller kv_window" : "use a smaller n_ctx",
                              err, err_len);
        if (rc != ES_OK) return (es_status)rc;
    }
    kv->layer = calloc((size_t)in->n_layer, sizeof *kv->layer);
    int ok = kv->layer != NULL;
    for (int i = 0; i < 4 && ok; i++) {
        if (kv->map_bytes[i] == 0) continue;
        void *p = mmap(NULL, kv->map_bytes[i], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) { ok = 0; break; }
        advise_pages(p, kv->map_bytes[i], run_bytes[i / 2]);
        kv->map[i] = p;
    }
    if (!ok) {
        char sz[32];
        es_set_err(err, err_len, "out of memory for a KV cache of %d tokens (%s)", (int)n_ctx,
                   es_size_str((double)total, sz));
        es_kv_free(kv);
        return ES_ERR_NOMEM;
    }
    int32_t seen[2] = {0, 0};
    for (int l = 0; l < in->n_layer; l++) {
        int grp = rings && m->layers[l].swa;
        size_t off = (size_t)seen[grp]++ * (size_t)in->n_head_kv * run_bytes[grp];
        kv->layer[l].k = (uint8_t *)kv->map[2 * grp] + off;
        kv->layer[l].v = (uint8_t *)kv->map[2 * grp + 1] + off;
        kv->layer[l].nb = nb[grp];
    }
    return ES_OK;
}

void es_kv_free(es_kv *kv) {
    for (int i = 0; i < 4; i++) {
        if (kv->map[i]) munmap(kv->map[i], kv->map_bytes[i]);
        kv->map[i] = NULL;
    }
    free(kv->layer);
    kv->layer = NULL;
}

size_t es_kv_bytes(const es_kv *kv) {
    size_t b = 0;
    for (int i = 0; i < 4; i++) b += kv->map_bytes[i];
    return b;
}

/* The next token at position p attends [p - n_swa + 1, p] (with eviction
 * also the sinks, kept for good): the rings must still hold [p - n_swa + 1,
 * p), i.e. p >= ring_lo + n_swa - 1. */
int32_t es_kv_min_past(const es_kv *kv) {
    return kv->ring_lo > 0 ? kv->ring_lo + kv->n_swa - 1 : 0;
}

es_status es_kv_rollback(es_kv *kv, int32_t n_past, char *err, size_t err_len) {
    if (n_past < 0 || n_past > kv->n_past) {
        es_set_err(err, err_len, "rollback to n_past %d outside [0, %d]", (int)n_past, (int)kv->n_past);
        return ES_ERR_INVALID_ARG;
    }
    int32_t lo = es_kv_min_past(kv);
    if (n_past > 0 && n_past < lo) {
        es_set_err(err, err_len, "rollback to n_past %d is out of reach: the %s keep "
                   "%d positions and hold [%d, %d), so the session can go back to n_past >= %d, or to 0 "
                   "(a reset); %s", (int)n_past, kv->evict ? "layers' rings" : "sliding-window layers",
                   (int)kv->ring, (int)kv->ring_lo, (int)kv->n_past, (int)lo,
                   kv->evict ? "KV eviction dropped the positions before it" : "swa_full keeps every position");
        return ES_ERR_INVALID_ARG;
    }
    kv->n_past = n_past;
    if (n_past == 0) kv->ring_lo = 0;
    return ES_OK;
}

void es_kv_advance(es_kv *kv, int32_t n) {
    kv->n_past += n;
    int32_t lo = kv->n_past - kv->ring;   /* a ring (after the sinks) overwrote [.., lo) */
    if (kv->piece > 0 && lo > kv->ring_lo && lo > kv->sink_blk * ES_KV_BLOCK) kv->ring_lo = lo;
}

/* es_fp32_to_fp16_row: the vector conversions
 * round to nearest even as the scalar one does, and the scalar one writes a
 * NaN as the hardware does (quiet, payload truncated), so every target
 * stores the same bits. */
void es_fp32_to_fp16_row(uint16_t *dst, const float *src, int n) {
    int i = 0;
#if defined(KV_LOAD_AVX512)
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(void *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(KV_LOAD_F16C)
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(KV_LOAD_NEON)
    for (; i + 8 <= n; i += 8) {
        float16x8_t h = vcvt_high_f16_f32(vcvt_f16_f32(vld1q_f32(src + i)), vld1q_f32(src + i + 4));
        vst1q_u16(dst + i, vreinterpretq_u16_f16(h));
    }
#endif
    for (; i < n; i++) dst[i] = es_fp32_to_fp16(src[i]);
}

/* ggml's quantize_row_q8_0_ref for one block: d = amax / 127, id = 1 / d
 * (0 when d is 0), q = roundf(x * id), the scale stored as F16. The float
 * steps are IEEE operations in a fixed order (-ffp-contract=off), on every
 * target; q is clamped to [-127, 127] and a NaN gives 0 (roundf of it has no
 * int8), which leave every finite input as ggml quantizes it. */
void es_kv_quantize_q8_0(const float *x, uint16_t *d, int8_t *q) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) {
        float a = fabsf(x[j]);
        amax = a > amax ? a : amax;
    }
    float sd = amax / 127.0f, id = sd != 0.0f ? 1.0f / sd : 0.0f;
    *d = es_fp32_to_fp16(sd);
    for (int j = 0; j < 32; j++) {
        float r = roundf(x[j] * id);
        q[j] = (int8_t)(r > 127.0f ? 127 : r < -127.0f ? -127 : r == r ? (int)r : 0);
    }
}

/* Rows [r0, r1) of one position's K (or V) vector, whole heads (the q/k/v
 * epilogue hands out chunks of whole heads). K blocks are stored
 * dimension-major (a dimension's 64 positions are contiguous, for the score
 * vectors), V blocks position-major; Q8_0 blocks the same way, with their
 * scales after the int8s (es_kv_block_off). */
void es_kv_put_k(es_kv *kv, int l, int32_t pos, int64_t r0, int64_t r1, const float *x) {
    int hd = kv->head_dim;
    int32_t b = pos / ES_KV_BLOCK, t = pos % ES_KV_BLOCK;
    for (int64_t g = r0 / hd; g * hd < r1; g++) {
        uint8_t *blk = (uint8_t *)es_kv_k_block(kv, l, (int)g, b);
        if (kv->type == ES_KV_Q8_0) {
            int8_t *kq = (int8_t *)blk;
            uint16_t *ks = (uint16_t *)(void *)(blk + (size_t)hd * ES_KV_BLOCK);
            for (int j = 0; j < hd / 32; j++) {
                int8_t q[32];
                es_kv_quantize_q8_0(x + g * hd + 32 * j, &ks[(size_t)j * ES_KV_BLOCK + t], q);
                for (int d = 0; d < 32; d++) kq[(size_t)(32 * j + d) * ES_KV_BLOCK + t] = q[d];
            }
            continue;
        }
        uint16_t h[ES_MAX_HEAD_DIM];
        es_fp32_to_fp16_row(h, x + g * hd, hd);
        uint16_t *kh = (uint16_t *)(void *)blk + t;
        for (int d = 0; d < hd; d++) kh[(size_t)d * ES_KV_BLOCK] = h[d];
    }
}

void es_kv_put_v(es_kv *kv, int l, int32_t pos, int64_t r0, int64_t r1, const float *x) {
    int hd = kv->head_dim;
    int32_t b = pos / ES_KV_BLOCK, t = pos % ES_KV_BLOCK;
    for (int64_t g = r0 / hd; g * hd < r1; g++) {
        uint8_t *blk = (uint8_t *)es_kv_v_block(kv, l, (int)g, b);
        if (kv->type == ES_KV_Q8_0) {
            int8_t *vq = (int8_t *)blk + (size_t)t * (size_t)hd;
            uint16_t *vs = (uint16_t *)(void *)(blk + (size_t)hd * ES_KV_BLOCK) + (size_t)t * (size_t)(hd / 32);
            for (int j = 0; j < hd / 32; j++) es_kv_quantize_q8_0(x + g * hd + 32 * j, &vs[j], vq + 32 * j);
            continue;
        }
        es_fp32_to_fp16_row((uint16_t *)(void *)blk + (size_t)t * (size_t)hd, x + g * hd, hd);
    }
}

void es_kv_prefetch(const es_kv *kv, int l, int32_t n_blk_used) {
    if (n_blk_used > kv->layer[l].nb) n_blk_used = kv->layer[l].nb;
    size_t bytes = (size_t)n_blk_used * kv->blk_bytes;
    for (int g = 0; g < kv->n_head_kv; g++) {
        const char *kb = (const char *)es_kv_k_block(kv, l, g, 0), *vb = (const char *)es_kv_v_block(kv, l, g, 0);
        for (size_t o = 0; o < bytes; o += 64) {
            __builtin_prefetch(kb + o, 0, 2);
            __builtin_prefetch(vb + o, 0, 2);
        }
    }
}

void es_kv_prefetch_block(const es_kv *kv, int l, int g, int32_t b) {
    const char *kb = (const char *)es_kv_k_block(kv, l, g, b), *vb = (const char *)es_kv_v_block(kv, l, g, b);
    for (size_t o = 0; o < kv->blk_bytes; o += 64) {
        __builtin_prefetch(kb + o, 0, KV_PF_LOCALITY);
        __builtin_prefetch(vb + o, 0, KV_PF_LOCALITY);
    }
}
