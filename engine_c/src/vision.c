/* vision.c - the Qwen3-VL vision encoder, read from a projector GGUF ("mmproj", projector type
 * qwen3vl_merger, as llama.cpp's converter writes it with --mmproj).
 *
 * Stages (transformers' Qwen3VLVisionModel):
 *   1. patch embedding: a conv3d of kernel (temporal 2, patch, patch) over two identical frames,
 *      i.e. the two temporal kernel halves summed, plus the bias;
 *   2. the learned position embedding (a square grid of side sqrt(rows)) bilinearly interpolated
 *      to the image's patch grid (transformers' fast_pos_embed_interpolate: linspace sample
 *      points, floor / floor + 1 clipped, the four weights);
 *   3. tokens in the order the 2x2 merge expects: merge blocks row-major, then the merge x merge
 *      patches of a block row-major;
 *   4. ViT blocks: x += proj(attn(LN1(x))), x += fc2(gelu_tanh(fc1(LN2(x)))); attention with QKV
 *      bias, full (non-causal) over the image's patches, 2-D RoPE: of a head's dims, the first
 *      quarter of the rotary frequencies rotate with the patch row and the second with the
 *      column, pairs (i, i + head_dim / 2) (rotate_half);
 *   5. deepstack mergers after the layers clip.vision.is_deepstack_layers marks: the merge x merge
 *      tokens of a block concatenated, LayerNorm (post-shuffle), fc1, GELU (erf), fc2;
 *   6. the final merger: LayerNorm per token (v.post_ln), concatenation, mm.0, GELU (erf), mm.2.
 *
 * Arithmetic: float32. The matrices (every linear layer and the patch embedding) are packed at
 * load into column panels of PW = 2 AW output columns, [n_out / PW][n_in][PW] (F16 weights stay
 * F16, converted exactly in registers; the summed patch kernel is F32). Every output element of a
 * linear layer is one sequential fused multiply-add chain over k from 0, acc = fmaf(w[k], x[k],
 * acc), then + bias; the SIMD lanes of the micro-kernel (vis_tile) are different output columns
 * doing that same chain, so every target gives the scalar chain's bits. Attention per head:
 * scores are the same chain over the head dimension (keys transposed once per head and layer),
 * times the scale; softmax with rowops.h's exp (expv's lanes are exp_cephes) and an 8-lane sum in
 * a fixed order; the output is the chain over keys of p * v, times 1 / sum. The GELU (tanh) is
 * rowops.h's form x / (1 + exp(-z)) (no libm tanh). The plain scalar twins of the matrix and
 * attention kernels (es_vision_encode_path with reference set) compute the same bits; the C
 * tests compare them. Threads split output columns (panels), rows and (head, query) blocks, never
 * a sum, so results are bitwise independent of the thread count.
 */
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "rowops.h"

#define VIS_MAX_LAYERS 256
#define VIS_ERR_LEN 512

typedef struct {
    const float *w, *b;     /* LayerNorm weight / bias, owned copies inside the arena */
} vis_norm;

/* Output columns per panel and token rows per micro-kernel call (vis_tile): 2 x VIS_R vectors of
 * accumulators, which fit the registers (AVX-512 and NEON 32: 16 of them; AVX2 16: 12, and 8
 * rows would spill). */
#define VIS_NV 2
#define PW (VIS_NV * AW)
#if defined(__AVX512F__) || defined(__aarch64__)
#define VIS_R 8
#else
#define VIS_R 6
#endif

typedef struct {
    void *pan;              /* [n_pan][n_in][PW] F16 (f16) or F32, columns past n_out zero; owned */
    int f16;
    const float *b;         /* [n_out] */
    int64_t n_in, n_out, n_pan;
} vis_linear;

typedef struct {
    vis_norm ln1, ln2;
    vis_linear qkv, out, up, down;
} vis_layer;

typedef struct {
    vis_norm norm;
    vis_linear fc1, fc2;
    int layer;              /* the vision layer whose output it reads */
} vis_merger;

struct es_vision {
    es_gguf *g;
    int32_t n_embd_v, n_ff, n_head, n_layer, patch, merge, n_out, n_pos_side;
    float eps, mean[3], std[3];
    int64_t min_pixels, max_pixels;
    float *arena;           /* owned float copies: norms, biases, summed patch kernel, pos embd */
    vis_linear patch_embd;  /* [n_embd_v][3 patch patch] F32 (the two temporal halves summed), bias */
    const float *pos;       /* [n_pos_side^2][n_embd_v] */
    vis_layer *layers;
    vis_norm post_ln;
    vis_linear mm0, mm2;
    int32_t n_deepstack;
    vis_merger *ds;
    char err[VIS_ERR_LEN];
};

/* ---- loading ---------------------------------------------------------------------------- */

static const es_gguf_kv *kv_u32(const es_gguf *g, const char *key, int64_t *v, char *err, size_t n,
                                int required) {
    const es_gguf_kv *kv = es_gguf_find_kv(g, key);
    if (!kv) {
        if (required) es_set_err(err, n, "projector GGUF: key %s is missing", key);
        return NULL;
    }
    if (kv->type == GGUF_T_UINT8 || kv->type == GGUF_T_UINT16 || kv->type == GGUF_T_UINT32 ||
        kv->type == GGUF_T_UINT64) {
        *v = kv->v.u64 > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)kv->v.u64;
    } else if (kv->type == GGUF_T_INT8 || kv->type == GGUF_T_INT16 || kv->type == GGUF_T_INT32 ||
               kv->type == GGUF_T_INT64) {
        *v = kv->v.i64;
    } else {
        es_set_err(err, n, "projector GGUF: key %s is not an integer", key);
        return NULL;
    }
    return kv;
}

static int str_is(const es_gguf_kv *kv, const char *s) {
    return kv && kv->type == GGUF_T_STRING && kv->str_len == strlen(s) && memcmp(kv->str, s, kv->str_len) == 0;
}

/* Widen a tensor of n elements (F32, F16 or BF16) into dst. */
static int widen(const es_tensor *t, float *dst, int64_t n) {
    if (t->n_elements != n) return -1;
    if (t->type == ES_TYPE_F32) {
        memcpy(dst, t->data, (size_t)n * sizeof(float));
    } else if (t->type == ES_TYPE_F16) {
        const uint16_t *s = t->data;
        for (int64_t i = 0; i < n; i++) dst[i] = es_fp16_to_fp32(s[i]);
    } else if (t->type == ES_TYPE_BF16) {
        const uint16_t *s = t->data;
        for (int64_t i = 0; i < n; i++) dst[i] = es_bf16_to_fp32(s[i]);
    } else {
        return -2;
    }
    return 0;
}

typedef struct {
    es_vision *v;
    float *next;            /* arena cursor */
    float *end;
    char *err;
    size_t err_len;
} loader;

static es_status get_tensor(loader *L, const char *name, const es_tensor **out) {
    *out = es_gguf_find_tensor(L->v->g, name);
    if (!*out) {
        es_set_err(L->err, L->err_len, "projector GGUF: tensor %s is missing", name);
        return ES_ERR_MISSING_TENSOR;
    }
    return ES_OK;
}

/* A vector of n floats from tensor `name` into the arena. */
static es_status get_vec(loader *L, const char *name, int64_t n, const float **out) {
    const es_tensor *t;
    es_status st = get_tensor(L, name, &t);
    if (st) return st;
    if (t->n_elements != n || L->end - L->next < n) {
        es_set_err(L->err, L->err_len, "projector GGUF: tensor %s has %lld elements, expected %lld", name,
                   (long long)t->n_elements, (long long)n);
        return ES_ERR_MISSING_TENSOR;
    }
    if (widen(t, L->next, n)) {
        es_set_err(L->err, L->err_len, "projector GGUF: tensor %s has type %s (F32, F16 or BF16 expected)",
                   name, es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    *out = L->next;
    L->next += n;
    return ES_OK;
}

static es_status get_norm(loader *L, const char *prefix, int64_t n, vis_norm *out) {
    char name[128];
    snprintf(name, sizeof name, "%s.weight", prefix);
    es_status st = get_vec(L, name, n, &out->w);
    if (st) return st;
    snprintf(name, sizeof name, "%s.bias", prefix);
    return get_vec(L, name, n, &out->b);
}

/* Pack an [n_out][n_in] matrix (F16 when src_f16, else F32) into out's column panels
 * [n_pan][n_in][PW], zero past n_out, keeping its type. */
static es_status pack_panels(vis_linear *out, const void *src, int src_f16, int64_t n_in, int64_t n_out) {
    const int64_t n_pan = (n_out + PW - 1) / PW;
    const size_t esz = src_f16 ? 2 : 4, bytes = (size_t)n_pan * (size_t)n_in * PW * esz;
    out->pan = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!out->pan) return ES_ERR_NOMEM;
    memset(out->pan, 0, bytes);
    for (int64_t o = 0; o < n_out; o++) {
        const int64_t p = o / PW, c = o % PW;
        if (src_f16) {
            const uint16_t *s = (const uint16_t *)src + o * n_in;
            uint16_t *d = (uint16_t *)out->pan + (size_t)p * (size_t)n_in * PW + (size_t)c;
            for (int64_t k = 0; k < n_in; k++) d[(size_t)k * PW] = s[k];
        } else {
            const float *s = (const float *)src + o * n_in;
            float *d = (float *)out->pan + (size_t)p * (size_t)n_in * PW + (size_t)c;
            for (int64_t k = 0; k < n_in; k++) d[(size_t)k * PW] = s[k];
        }
    }
    out->f16 = src_f16;
    out->n_in = n_in;
    out->n_out = n_out;
    out->n_pan = n_pan;
    return ES_OK;
}

static es_status get_linear(loader *L, const char *prefix, int64_t n_in, int64_t n_out, vis_linear *out) {
    char name[128];
    const es_tensor *w;
    snprintf(name, sizeof name, "%s.weight", prefix);
    es_status st = get_tensor(L, name, &w);
    if (st) return st;
    if (w->n_dims != 2 || w->ne[0] != n_in || w->ne[1] != n_out) {
        es_set_err(L->err, L->err_len, "projector GGUF: tensor %s has shape [%lld, %lld], expected [%lld, %lld]",
                   name, (long long)w->ne[0], (long long)w->ne[1], (long long)n_in, (long long)n_out);
        return ES_ERR_MISSING_TENSOR;
    }
    if (w->type != ES_TYPE_F32 && w->type != ES_TYPE_F16) {
        es_set_err(L->err, L->err_len, "projector GGUF: tensor %s has type %s (F32 or F16 expected)", name,
                   es_type_name(w->type));
        return ES_ERR_UNSUPPORTED;
    }
    if (pack_panels(out, w->data, w->type == ES_TYPE_F16, n_in, n_out)) {
        es_set_err(L->err, L->err_len, "out of memory packing the projector's tensor %s", name);
        return ES_ERR_NOMEM;
    }
    snprintf(name, sizeof name, "%s.bias", prefix);
    return get_vec(L, name, n_out, &out->b);
}

static es_status read_hparams(es_vision *v, char *err, size_t n) {
    const es_gguf *g = v->g;
    const es_gguf_kv *arch = es_gguf_find_kv(g, "general.architecture");
    if (!str_is(arch, "clip")) {
        es_set_err(err, n, "not a projector GGUF: general.architecture is not \"clip\"");
        return ES_ERR_UNSUPPORTED;
    }
    const es_gguf_kv *pt = es_gguf_find_kv(g, "clip.projector_type");
    if (!pt || pt->type != GGUF_T_STRING) {
        es_set_err(err, n, "projector GGUF: key clip.projector_type is missing");
        return ES_ERR_FORMAT;
    }
    if (!str_is(pt, "qwen3vl_merger")) {
        es_set_err(err, n, "projector type \"%.*s\" is not supported (qwen3vl_merger only)",
                   (int)(pt->str_len > 64 ? 64 : pt->str_len), pt->str);
        return ES_ERR_UNSUPPORTED;
    }
    int64_t d, ff, nh, nl, p, m, out;
    if (!kv_u32(g, "clip.vision.embedding_length", &d, err, n, 1) ||
        !kv_u32(g, "clip.vision.feed_forward_length", &ff, err, n, 1) ||
        !kv_u32(g, "clip.vision.attention.head_count", &nh, err, n, 1) ||
        !kv_u32(g, "clip.vision.block_count", &nl, err, n, 1) ||
        !kv_u32(g, "clip.vision.patch_size", &p, err, n, 1) ||
        !kv_u32(g, "clip.vision.spatial_merge_size", &m, err, n, 1) ||
        !kv_u32(g, "clip.vision.projection_dim", &out, err, n, 1))
        return ES_ERR_FORMAT;
    if (d < 1 || d > 65536 || ff < 1 || ff > 1 << 20 || nh < 1 || d % nh || (d / nh) % 4 || nl < 1 ||
        nl > VIS_MAX_LAYERS || p < 1 || p > 64 || m < 1 || m > 8 || out < 1 || out > 1 << 20) {
        es_set_err(err, n, "projector GGUF: unusable sizes (embedding %lld, ffn %lld, heads %lld, blocks %lld, "
                   "patch %lld, merge %lld, projection %lld)", (long long)d, (long long)ff, (long long)nh,
                   (long long)nl, (long long)p, (long long)m, (long long)out);
        return ES_ERR_FORMAT;
    }
    v->n_embd_v = (int32_t)d; v->n_ff = (int32_t)ff; v->n_head = (int32_t)nh; v->n_layer = (int32_t)nl;
    v->patch = (int32_t)p; v->merge = (int32_t)m; v->n_out = (int32_t)out;
    const es_gguf_kv *eps = es_gguf_find_kv(g, "clip.vision.attention.layer_norm_epsilon");
    v->eps = eps && eps->type == GGUF_T_FLOAT32 ? (float)eps->v.f64 : 1e-6f;
    const char *mk[2] = {"clip.vision.image_mean", "clip.vision.image_std"};
    float *dst[2] = {v->mean, v->std};
    for (int k = 0; k < 2; k++) {
        const es_gguf_kv *a = es_gguf_find_kv(g, mk[k]);
        if (!a || a->type != GGUF_T_ARRAY || a->arr_type != GGUF_T_FLOAT32 || a->arr_len != 3) {
            es_set_err(err, n, "projector GGUF: key %s is missing or not 3 floats", mk[k]);
            return ES_ERR_FORMAT;
        }
        memcpy(dst[k], a->arr_data, 3 * sizeof(float));
        for (int c = 0; c < 3; c++)
            if (!isfinite(dst[k][c]) || (k == 1 && !(dst[k][c] > 0))) {
                es_set_err(err, n, "projector GGUF: %s[%d] = %g is not usable", mk[k], c, (double)dst[k][c]);
                return ES_ERR_FORMAT;
            }
    }
    int64_t mp;
    if (kv_u32(g, "clip.vision.image_min_pixels", &mp, err, n, 0)) v->min_pixels = mp;
    if (kv_u32(g, "clip.vision.image_max_pixels", &mp, err, n, 0)) v->max_pixels = mp;
    return ES_OK;
}

static es_status load_weights(es_vision *v, char *err, size_t n) {
    const int64_t D = v->n_embd_v, F = v->n_ff, P = v->patch, M2 = (int64_t)v->merge * v->merge;
    const es_tensor *pe;
    loader L = {v, NULL, NULL, err, n};
    es_status st = get_tensor(&L, "v.position_embd.weight", &pe);
    if (st) return st;
    int64_t n_pos = pe->n_dims == 2 && pe->ne[0] == D ? pe->ne[1] : 0;
    int64_t side = (int64_t)llround(sqrt((double)n_pos));
    if (n_pos < 1 || side * side != n_pos) {
        es_set_err(err, n, "projector GGUF: v.position_embd.weight is not [%lld, side^2]", (long long)D);
        return ES_ERR_MISSING_TENSOR;
    }
    v->n_pos_side = (int32_t)side;
    const es_gguf_kv *ds = es_gguf_find_kv(v->g, "clip.vision.is_deepstack_layers");
    const uint8_t *dsl = NULL;
    if (ds) {
        if (ds->type != GGUF_T_ARRAY || ds->arr_type != GGUF_T_BOOL || ds->arr_len != (uint64_t)v->n_layer) {
            es_set_err(err, n, "projector GGUF: clip.vision.is_deepstack_layers is not %d bools", v->n_layer);
            return ES_ERR_FORMAT;
        }
        dsl = ds->arr_data;
        for (int i = 0; i < v->n_layer; i++) v->n_deepstack += dsl[i] != 0;
    }
    /* arena: patch kernel + bias, pos, per layer 4 D (norms) + 3D + D + F + D (biases),
     * post_ln 2 D, mm biases, per deepstack 2 D M2 (norm) + D M2 + out */
    int64_t total = D * 3 * P * P + D + n_pos * D + v->n_layer * (4 * D + 3 * D + D + F + D) + 2 * D +
                    D * M2 + v->n_out + v->n_deepstack * (2 * D * M2 + D * M2 + v->n_out);
    v->arena = malloc((size_t)total * sizeof(float));
    v->layers = calloc((size_t)v->n_layer, sizeof *v->layers);
    v->ds = calloc((size_t)(v->n_deepstack ? v->n_deepstack : 1), sizeof *v->ds);
    float *tmp = malloc((size_t)(D * 3 * P * P) * sizeof(float));
    if (!v->arena || !v->layers || !v->ds || !tmp) {
        free(tmp);
        es_set_err(err, n, "out of memory loading the projector");
        return ES_ERR_NOMEM;
    }
    L.next = v->arena;
    L.end = v->arena + total;
    /* patch embedding: the two temporal halves summed */
    const es_tensor *w0, *w1;
    if ((st = get_tensor(&L, "v.patch_embd.weight", &w0)) || (st = get_tensor(&L, "v.patch_embd.weight.1", &w1))) {
        free(tmp);
        return st;
    }
    const int64_t pk = D * 3 * P * P;
    if (w0->n_elements != pk || w1->n_elements != pk || w0->ne[0] != P || w0->ne[1] != P || w0->ne[2] != 3 ||
        w1->ne[0] != P || w1->ne[1] != P || w1->ne[2] != 3) {
        free(tmp);
        es_set_err(err, n, "projector GGUF: v.patch_embd.weight(.1) is not [%d, %d, 3, %lld]", v->patch, v->patch,
                   (long long)D);
        return ES_ERR_MISSING_TENSOR;
    }
    float *pw = L.next;
    if (widen(w0, pw, pk) || widen(w1, tmp, pk)) {
        free(tmp);
        es_set_err(err, n, "projector GGUF: v.patch_embd.weight has type %s", es_type_name(w0->type));
        return ES_ERR_UNSUPPORTED;
    }
    for (int64_t i = 0; i < pk; i++) pw[i] += tmp[i];
    free(tmp);
    if (pack_panels(&v->patch_embd, pw, 0, 3 * P * P, D)) {
        es_set_err(err, n, "out of memory packing the projector's patch embedding");
        return ES_ERR_NOMEM;
    }
    L.next += pk;
    if ((st = get_vec(&L, "v.patch_embd.bias", D, &v->patch_embd.b)) ||
        (st = get_vec(&L, "v.position_embd.weight", n_pos * D, &v->pos)))
        return st;
    char name[96];
    for (int i = 0; i < v->n_layer; i++) {
        vis_layer *l = &v->layers[i];
#define PFX(s) (snprintf(name, sizeof name, "v.blk.%d.%s", i, s), name)
        if ((st = get_norm(&L, PFX("ln1"), D, &l->ln1)) || (st = get_norm(&L, PFX("ln2"), D, &l->ln2)) ||
            (st = get_linear(&L, PFX("attn_qkv"), D, 3 * D, &l->qkv)) ||
            (st = get_linear(&L, PFX("attn_out"), D, D, &l->out)) ||
            (st = get_linear(&L, PFX("ffn_up"), D, F, &l->up)) ||
            (st = get_linear(&L, PFX("ffn_down"), F, D, &l->down)))
            return st;
#undef PFX
    }
    if ((st = get_norm(&L, "v.post_ln", D, &v->post_ln)) || (st = get_linear(&L, "mm.0", D * M2, D * M2, &v->mm0)) ||
        (st = get_linear(&L, "mm.2", D * M2, v->n_out, &v->mm2)))
        return st;
    int k = 0;
    for (int i = 0; dsl && i < v->n_layer; i++) {
        if (!dsl[i]) continue;
        vis_merger *m = &v->ds[k++];
        m->layer = i;
#define PFX(s) (snprintf(name, sizeof name, "v.deepstack.%d.%s", i, s), name)
        if ((st = get_norm(&L, PFX("norm"), D * M2, &m->norm)) ||
            (st = get_linear(&L, PFX("fc1"), D * M2, D * M2, &m->fc1)) ||
            (st = get_linear(&L, PFX("fc2"), D * M2, v->n_out, &m->fc2)))
            return st;
#undef PFX
    }
    return ES_OK;
}

es_status es_vision_load(const char *path, es_vision **out, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (!out) {
        es_set_err(err, err_len, "es_vision_load: out is NULL");
        return ES_ERR_INVALID_ARG;
    }
    *out = NULL;
    if (!path) {
        es_set_err(err, err_len, "es_vision_load: path is NULL");
        return ES_ERR_INVALID_ARG;
    }
    es_vision *v = calloc(1, sizeof *v);
    if (!v) {
        es_set_err(err, err_len, "out of memory loading the projector");
        return ES_ERR_NOMEM;
    }
    es_status st = es_gguf_open(path, &v->g, err, err_len);
    if (!st) st = read_hparams(v, err, err_len);
    if (!st) st = es_check_weights(v->g, 0, err, err_len);
    if (!st) st = load_weights(v, err, err_len);
    if (st) {
        es_vision_free(v);
        return st;
    }
    *out = v;
    return ES_OK;
}

void es_vision_free(es_vision *v) {
    if (!v) return;
    if (v->g) es_gguf_close(v->g);
    free(v->patch_embd.pan);
    for (int i = 0; v->layers && i < v->n_layer; i++) {
        free(v->layers[i].qkv.pan);
        free(v->layers[i].out.pan);
        free(v->layers[i].up.pan);
        free(v->layers[i].down.pan);
    }
    free(v->mm0.pan);
    free(v->mm2.pan);
    for (int i = 0; v->ds && i < v->n_deepstack; i++) {
        free(v->ds[i].fc1.pan);
        free(v->ds[i].fc2.pan);
    }
    free(v->arena);
    free(v->layers);
    free(v->ds);
    free(v);
}

es_status es_vision_get_info(const es_vision *v, es_vision_info *info) {
    if (!v || !info) return ES_ERR_INVALID_ARG;
    memset(info, 0, sizeof *info);
    info->patch_size = v->patch;
    info->merge_size = v->merge;
    info->n_embd = v->n_out;
    info->n_embd_vision = v->n_embd_v;
    info->n_layer = v->n_layer;
    info->n_head = v->n_head;
    info->n_deepstack = v->n_deepstack;
    for (int c = 0; c < 3; c++) {
        info->image_mean[c] = v->mean[c];
        info->image_std[c] = v->std[c];
    }
    info->min_pixels = v->min_pixels;
    info->max_pixels = v->max_pixels;
    return ES_OK;
}

const char *es_vision_last_error(const es_vision *v) { return v ? v->err : ""; }

int32_t es_vision_deepstack_layer(const es_vision *v, int32_t k) {
    return v && k >= 0 && k < v->n_deepstack ? v->ds[k].layer : -1;
}

/* ---- kernels ------------------------------------------------------------------------------ */

/* AW copies of x (one broadcast; va_splat's 0 + x would add an addition per use). */
static inline __attribute__((always_inline)) vaf bcast(const float *x) {
#if !defined(ES_FORCE_SCALAR) && defined(__AVX512F__)
    return (vaf)_mm512_set1_ps(*x);
#elif !defined(ES_FORCE_SCALAR) && defined(__AVX__)
    return (vaf)_mm256_set1_ps(*x);
#elif !defined(ES_FORCE_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
    return (vaf)vld1q_dup_f32(x);
#else
    vaf v;
    for (int i = 0; i < AW; i++) v[i] = *x;
    return v;
#endif
}

/* The micro-kernel: Y[i][c] = sum over k in [0, K) of w[k][c] * X[i][k] for i < nr, c < PW, each
 * one fused multiply-add chain from 0 in k order (fmaf(w, x, acc)); w[k] is the PW floats (F16
 * when f16) at W + k * ldw, X rows ldx apart, Y rows ldy apart. Lanes are columns, so every target
 * and the scalar twin (vis_ref_dot) give the same bits. nr and f16 are constants after inlining
 * into the vis_tile_* entry points. */
static inline __attribute__((always_inline)) void tile(const int nr, const int f16, const float *X, size_t ldx,
                                                       const void *W, size_t ldw, int64_t K, float *Y,
                                                       size_t ldy) {
    vaf acc[VIS_R][VIS_NV];
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < VIS_NV; j++) acc[i][j] = (vaf){0};
    for (int64_t k = 0; k < K; k++) {
        vaf w[VIS_NV];
        for (int j = 0; j < VIS_NV; j++) {
            if (f16) {
                w[j] = ld_h((const uint16_t *)W + (size_t)k * ldw + (size_t)j * AW);
            } else {
                memcpy(&w[j], (const float *)W + (size_t)k * ldw + (size_t)j * AW, sizeof w[j]);
            }
            IN_REG(w[j]);
        }
        for (int i = 0; i < nr; i++) {
            const vaf xb = bcast(X + (size_t)i * ldx + (size_t)k);
            for (int j = 0; j < VIS_NV; j++) acc[i][j] = fma_a(w[j], xb, acc[i][j]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int j = 0; j < VIS_NV; j++) memcpy(Y + (size_t)i * ldy + (size_t)j * AW, &acc[i][j], sizeof(vaf));
}

__attribute__((noinline)) static void vis_tile_h(const float *X, size_t ldx, const void *W, size_t ldw, int64_t K,
                                                 float *Y, size_t ldy) {
    tile(VIS_R, 1, X, ldx, W, ldw, K, Y, ldy);
}
__attribute__((noinline)) static void vis_tile_h1(const float *X, size_t ldx, const void *W, size_t ldw, int64_t K,
                                                  float *Y, size_t ldy) {
    tile(1, 1, X, ldx, W, ldw, K, Y, ldy);
}
__attribute__((noinline)) static void vis_tile_f(const float *X, size_t ldx, const void *W, size_t ldw, int64_t K,
                                                 float *Y, size_t ldy) {
    tile(VIS_R, 0, X, ldx, W, ldw, K, Y, ldy);
}
__attribute__((noinline)) static void vis_tile_f1(const float *X, size_t ldx, const void *W, size_t ldw, int64_t K,
                                                  float *Y, size_t ldy) {
    tile(1, 0, X, ldx, W, ldw, K, Y, ldy);
}

/* Rows [0, n) of X against one panel: whole VIS_R blocks, then single rows. */
static void tile_rows(int f16, const float *X, size_t ldx, int n, const void *W, size_t ldw, int64_t K, float *Y,
                      size_t ldy) {
    int i = 0;
    for (; i + VIS_R <= n; i += VIS_R) {
        if (f16) vis_tile_h(X + (size_t)i * ldx, ldx, W, ldw, K, Y + (size_t)i * ldy, ldy);
        else vis_tile_f(X + (size_t)i * ldx, ldx, W, ldw, K, Y + (size_t)i * ldy, ldy);
    }
    for (; i < n; i++) {
        if (f16) vis_tile_h1(X + (size_t)i * ldx, ldx, W, ldw, K, Y + (size_t)i * ldy, ldy);
        else vis_tile_f1(X + (size_t)i * ldx, ldx, W, ldw, K, Y + (size_t)i * ldy, ldy);
    }
}

/* The scalar twin of tile: one chain sum over k of w[k * ldw] * x[k * ldx], from 0. */
__attribute__((noinline)) static float vis_ref_dot(int f16, const void *w, size_t ldw, const float *x, size_t ldx,
                                                   int64_t K) {
    float acc = 0.0f;
    for (int64_t k = 0; k < K; k++) {
        const float wk = f16 ? es_fp16_to_fp32(((const uint16_t *)w)[(size_t)k * ldw])
                             : ((const float *)w)[(size_t)k * ldw];
        acc = fmaf(wk, x[(size_t)k * ldx], acc);
    }
    return acc;
}

/* sum8 (rowops.h) sums by 8 lanes; vis_ref_sum8 is its scalar twin. */
static float vis_ref_sum8(const float *x, int64_t n) {
    float l[8] = {0};
    for (int64_t i = 0; i < n; i++) l[i & 7] += x[i];
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

/* Rows per chunk of a linear layer: the chunk of X (rows x n_in floats) stays in the L2 cache
 * while every panel of the thread passes over it. */
static int chunk_rows(int64_t n_in) {
    int64_t r = (int64_t)(128 * 1024 / 4) / (n_in > 0 ? n_in : 1) / VIS_R * VIS_R;
    return r < VIS_R ? VIS_R : r > 256 ? 256 : (int)r;
}

typedef struct {
    const vis_linear *lin;
    const float *X;         /* [N][n_in] */
    float *Y;               /* [N][n_out] */
    int N;
    int reference;          /* the scalar twin (vis_ref_dot) instead of the micro-kernel */
} linear_task;

static void linear_fn(void *ctx, int ith, int nth) {
    const linear_task *t = ctx;
    const vis_linear *l = t->lin;
    const int64_t n_in = l->n_in, n_out = l->n_out;
    const int64_t p0 = l->n_pan * ith / nth, p1 = l->n_pan * (ith + 1) / nth;
    const size_t esz = l->f16 ? 2 : 4, pan_bytes = (size_t)n_in * PW * esz;
    const int rc = chunk_rows(n_in);
    float tmp[256 * PW];
    for (int r0 = 0; r0 < t->N; r0 += rc) {
        const int nr = t->N - r0 < rc ? t->N - r0 : rc;
        const float *X = t->X + (size_t)r0 * (size_t)n_in;
        for (int64_t p = p0; p < p1; p++) {
            const unsigned char *W = (const unsigned char *)l->pan + (size_t)p * pan_bytes;
            const int64_t c0 = p * PW, nc = n_out - c0 < PW ? n_out - c0 : PW;
            if (t->reference) {
                for (int i = 0; i < nr; i++)
                    for (int64_t c = 0; c < nc; c++)
                        tmp[(size_t)i * PW + (size_t)c] =
                            vis_ref_dot(l->f16, W + (size_t)c * esz, PW, X + (size_t)i * (size_t)n_in, 1, n_in);
            } else {
                tile_rows(l->f16, X, (size_t)n_in, nr, W, PW, n_in, tmp, PW);
            }
            for (int i = 0; i < nr; i++) {
                float *y = t->Y + (size_t)(r0 + i) * (size_t)n_out + (size_t)c0;
                for (int64_t c = 0; c < nc; c++) y[c] = tmp[(size_t)i * PW + (size_t)c] + l->b[c0 + c];
            }
        }
    }
}

typedef struct {
    es_pool *pool;
    int reference;
} runner;

static void linear(runner *R, const vis_linear *l, const float *X, int N, float *Y) {
    linear_task t = {l, X, Y, N, R->reference};
    es_pool_run(R->pool, linear_fn, &t);
}

/* Per-row work split across the pool: LayerNorm, the GELUs, residual adds. */
enum { ROW_LN, ROW_GELU_TANH, ROW_GELU_ERF, ROW_ADD };

typedef struct {
    int op;
    const float *x;         /* ROW_LN: input; ROW_ADD: the addend */
    float *y;               /* output (in place for the GELUs and ROW_ADD) */
    int n;
    int64_t d;              /* floats per row */
    const vis_norm *nm;
    float eps;
} rows_task;

/* LayerNorm of one row: mean and variance by sum8 (fixed order), then (x - mean) * rs * w + b. */
static void layer_norm_row(const float *x, float *y, int64_t d, const vis_norm *nm, float eps) {
    const float mean = sum8(x, d) / (float)d;
    for (int64_t k = 0; k < d; k++) {
        const float c = x[k] - mean;
        y[k] = c * c;
    }
    const float var = sum8(y, d) / (float)d;
    const float rs = 1.0f / sqrtf(var + eps);
    for (int64_t k = 0; k < d; k++) y[k] = (x[k] - mean) * rs * nm->w[k] + nm->b[k];
}

/* GELU, tanh form, as rowops.h's gelu_row without the product: x / (1 + exp(-z)),
 * z = x (GELU_K0 + GELU_K1 x^2); lanes and the scalar tail are the same operations. */
static void gelu_tanh_row(float *g, int64_t n) {
    int64_t i = 0;
    for (; i + AW <= n; i += AW) {
        vaf gv;
        memcpy(&gv, g + i, sizeof gv);
        vaf z = gv * (va_splat(GELU_K0) + va_splat(GELU_K1) * (gv * gv));
        gv = gv / (va_splat(1.0f) + expv(-z));
        memcpy(g + i, &gv, sizeof gv);
    }
    for (; i < n; i++) {
        const float x = g[i], z = x * (GELU_K0 + GELU_K1 * (x * x));
        g[i] = x / (1.0f + exp_cephes(-z));
    }
}

static float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

static void rows_fn(void *ctx, int ith, int nth) {
    const rows_task *t = ctx;
    const int i0 = (int)((int64_t)t->n * ith / nth), i1 = (int)((int64_t)t->n * (ith + 1) / nth);
    for (int i = i0; i < i1; i++) {
        float *y = t->y + (size_t)i * (size_t)t->d;
        const float *x = t->x ? t->x + (size_t)i * (size_t)t->d : NULL;
        if (t->op == ROW_LN) {
            layer_norm_row(x, y, t->d, t->nm, t->eps);
        } else if (t->op == ROW_GELU_TANH) {
            gelu_tanh_row(y, t->d);
        } else if (t->op == ROW_GELU_ERF) {
            for (int64_t k = 0; k < t->d; k++) y[k] = gelu_erf(y[k]);
        } else {
            for (int64_t k = 0; k < t->d; k++) y[k] += x[k];
        }
    }
}

static void rows(runner *R, int op, const float *x, float *y, int n, int64_t d, const vis_norm *nm, float eps) {
    rows_task t = {op, x, y, n, d, nm, eps};
    es_pool_run(R->pool, rows_fn, &t);
}

/* Attention over the T tokens, every head. Per head, the keys transposed and the values padded
 * (attn_pack_fn), then units of (head, VIS_R queries) (attn_fn): scores by the micro-kernel
 * against the transposed keys (one chain over the head dimension per score) times the scale,
 * exp(s - max) (expv), the sum by sum8, the output by the micro-kernel over the keys (one chain
 * over keys per element) times 1 / sum. */
typedef struct {
    const float *qkv;       /* [T][3 D], q and k already rotated */
    float *out;             /* [T][D] */
    float *kt;              /* [n_head][hdp][Tp]: keys transposed, zero past T */
    float *vp;              /* [n_head][T][hdp]: values, zero past hd */
    float *ws;              /* per thread: scores [VIS_R][Tp], outputs [VIS_R][hdp] */
    int T, Tp, n_head, hd, hdp, D;
    float scale;
    int reference;
} attn_task;

static void attn_pack_fn(void *ctx, int ith, int nth) {
    const attn_task *a = ctx;
    const size_t ld = 3 * (size_t)a->D;
    for (int h = a->n_head * ith / nth; h < a->n_head * (ith + 1) / nth; h++) {
        float *kt = a->kt + (size_t)h * a->hdp * a->Tp, *vp = a->vp + (size_t)h * a->T * a->hdp;
        memset(kt, 0, sizeof(float) * (size_t)a->hdp * a->Tp);
        memset(vp, 0, sizeof(float) * (size_t)a->T * a->hdp);
        for (int t = 0; t < a->T; t++) {
            const float *k = a->qkv + (size_t)t * ld + (size_t)a->D + (size_t)h * a->hd;
            for (int e = 0; e < a->hd; e++) kt[(size_t)e * a->Tp + (size_t)t] = k[e];
            memcpy(vp + (size_t)t * a->hdp, k + a->D, sizeof(float) * (size_t)a->hd);
        }
    }
}

/* The scalar twin of one unit of attn_fn: queries [q0, q0 + nq) of head h. */
static void attn_ref(const attn_task *a, int h, int q0, int nq, float *s) {
    const size_t ld = 3 * (size_t)a->D;
    for (int qi = q0; qi < q0 + nq; qi++) {
        const float *q = a->qkv + (size_t)qi * ld + (size_t)h * a->hd;
        for (int t = 0; t < a->T; t++)
            s[t] = vis_ref_dot(0, a->qkv + (size_t)t * ld + (size_t)a->D + (size_t)h * a->hd, 1, q, 1, a->hd) *
                   a->scale;
        float mx = s[0];
        for (int t = 1; t < a->T; t++) mx = s[t] > mx ? s[t] : mx;
        for (int t = 0; t < a->T; t++) s[t] = exp_cephes(s[t] - mx);
        const float inv = 1.0f / vis_ref_sum8(s, a->T);
        float *o = a->out + (size_t)qi * (size_t)a->D + (size_t)h * a->hd;
        for (int e = 0; e < a->hd; e++)
            o[e] = vis_ref_dot(0, a->qkv + 2 * (size_t)a->D + (size_t)h * a->hd + (size_t)e, ld, s, 1, a->T) * inv;
    }
}

/* x[t] *= scale for t in [0, n), n >= 1, and the largest of them as max_row finds it (from
 * x[0], "x[t] > best"; exact in any order). */
static float scale_max_row(float *x, int n, float scale) {
    const float x0 = x[0] * scale;
    float m = x0;
    vaf mv = va_splat(x0);
    int t = 0;
    for (; t + AW <= n; t += AW) {
        vaf v;
        memcpy(&v, x + t, sizeof v);
        v = v * scale;
        memcpy(x + t, &v, sizeof v);
        mv = va_sel(v > mv, v, mv);
    }
    for (int l = 0; l < AW; l++) m = mv[l] > m ? mv[l] : m;
    for (; t < n; t++) {
        x[t] = x[t] * scale;
        m = x[t] > m ? x[t] : m;
    }
    return m;
}

static void attn_fn(void *ctx, int ith, int nth) {
    const attn_task *a = ctx;
    const int nqb = (a->T + VIS_R - 1) / VIS_R;
    const int64_t total = (int64_t)nqb * a->n_head;
    const int64_t u0 = total * ith / nth, u1 = total * (ith + 1) / nth;
    float *s = a->ws + (size_t)ith * (size_t)VIS_R * (size_t)(a->Tp + a->hdp);
    float *o = s + (size_t)VIS_R * a->Tp;
    const size_t ld = 3 * (size_t)a->D;
    for (int64_t u = u0; u < u1; u++) {
        const int h = (int)(u / nqb), q0 = (int)(u % nqb) * VIS_R;
        const int nq = a->T - q0 < VIS_R ? a->T - q0 : VIS_R;
        if (a->reference) {
            attn_ref(a, h, q0, nq, s);
            continue;
        }
        const float *kt = a->kt + (size_t)h * a->hdp * a->Tp, *vp = a->vp + (size_t)h * a->T * a->hdp;
        const float *q = a->qkv + (size_t)q0 * ld + (size_t)h * a->hd;
        for (int p = 0; p < a->Tp; p += PW) tile_rows(0, q, ld, nq, kt + p, a->Tp, a->hd, s + p, a->Tp);
        float inv[VIS_R];
        for (int i = 0; i < nq; i++) {
            float *si = s + (size_t)i * a->Tp;
            exp_sub_row(si, scale_max_row(si, a->T, a->scale), a->T);
            inv[i] = 1.0f / sum8(si, a->T);
        }
        for (int p = 0; p < a->hdp; p += PW) tile_rows(0, s, a->Tp, nq, vp + p, a->hdp, a->T, o + p, a->hdp);
        for (int i = 0; i < nq; i++) {
            float *oi = a->out + (size_t)(q0 + i) * (size_t)a->D + (size_t)h * a->hd;
            for (int e = 0; e < a->hd; e++) oi[e] = o[(size_t)i * a->hdp + (size_t)e] * inv[i];
        }
    }
}

/* torch.linspace(0, end, steps) in float32 (it fills the second half from the end). */
static float linspace_at(int i, int steps, float end) {
    if (steps <= 1) return 0.0f;
    const float step = end / (float)(steps - 1);
    return i < steps / 2 ? step * (float)i : end - step * (float)(steps - 1 - i);
}

/* Row-major grid coordinates (row, col) of token t in merge order. */
static void token_rc(const es_vision *v, int gw, int t, int *row, int *col) {
    const int m = v->merge, bw_n = gw / m;
    const int blk = t / (m * m), in = t % (m * m);
    *row = (blk / bw_n) * m + in / m;
    *col = (blk % bw_n) * m + in % m;
}

/* Patch embedding and position embedding into x [T][D]: the patches in merge order as rows of
 * pm [T][3 P P], the packed kernel over them, then the bilinear position embedding
 * (fast_pos_embed_interpolate) added. */
static void embed_patches(runner *R, const es_vision *v, const float *px, int H, int W, float *pm, float *x) {
    const int P = v->patch, D = v->n_embd_v, gh = H / P, gw = W / P, T = gh * gw;
    const int side = v->n_pos_side;
    const int K = 3 * P * P;
    for (int t = 0; t < T; t++) {
        int r, c;
        token_rc(v, gw, t, &r, &c);
        float *patch = pm + (size_t)t * K;
        for (int ch = 0; ch < 3; ch++)
            for (int ky = 0; ky < P; ky++)
                memcpy(patch + (ch * P + ky) * P, px + ((size_t)ch * H + (size_t)(r * P + ky)) * W + (size_t)c * P,
                       (size_t)P * sizeof(float));
    }
    linear(R, &v->patch_embd, pm, T, x);
    for (int t = 0; t < T; t++) {
        int r, c;
        token_rc(v, gw, t, &r, &c);
        float *xt = x + (size_t)t * D;
        const float hy = linspace_at(r, gh, (float)(side - 1)), wx = linspace_at(c, gw, (float)(side - 1));
        const int h0 = (int)hy, w0 = (int)wx;
        const int h1 = h0 + 1 < side ? h0 + 1 : side - 1, w1 = w0 + 1 < side ? w0 + 1 : side - 1;
        const float dh = hy - (float)h0, dw = wx - (float)w0;
        const float wt[4] = {(1.0f - dh) * (1.0f - dw), (1.0f - dh) * dw, dh * (1.0f - dw), dh * dw};
        const float *pr[4] = {v->pos + (size_t)(h0 * side + w0) * D, v->pos + (size_t)(h0 * side + w1) * D,
                              v->pos + (size_t)(h1 * side + w0) * D, v->pos + (size_t)(h1 * side + w1) * D};
        for (int o = 0; o < D; o++) {
            float pe = wt[0] * pr[0][o] + wt[1] * pr[1][o] + wt[2] * pr[2][o] + wt[3] * pr[3][o];
            xt[o] += pe;
        }
    }
}

/* The 2-D RoPE's cos and sin per token and rotary index, cs / sn [T][hd / 2]: of the hd / 2
 * frequencies, the first quarter turn with the patch row and the second with the column. */
static void rope_tables(const es_vision *v, int T, int gw, float *cs, float *sn) {
    const int hd = v->n_embd_v / v->n_head, half = hd / 2, nf = half / 2;
    float inv[512];
    for (int j = 0; j < nf; j++) inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / (float)half);
    for (int t = 0; t < T; t++) {
        int r, c;
        token_rc(v, gw, t, &r, &c);
        for (int i = 0; i < half; i++) {
            const float ang = i < nf ? (float)r * inv[i] : (float)c * inv[i - nf];
            cs[(size_t)t * half + i] = cosf(ang);
            sn[(size_t)t * half + i] = sinf(ang);
        }
    }
}

/* 2-D RoPE on q and k of every head, in place in qkv [T][3 D] (pairs (i, i + hd / 2)); threads
 * split the tokens. */
typedef struct {
    const es_vision *v;
    float *qkv;
    int T;
    const float *cs, *sn;   /* [T][hd / 2] (rope_tables) */
} rope_task;

static void rope_fn(void *ctx, int ith, int nth) {
    const rope_task *r = ctx;
    const int D = r->v->n_embd_v, hd = D / r->v->n_head, half = hd / 2;
    for (int t = (int)((int64_t)r->T * ith / nth); t < (int)((int64_t)r->T * (ith + 1) / nth); t++)
        for (int qk = 0; qk < 2; qk++)
            for (int h = 0; h < r->v->n_head; h++) {
                float *p = r->qkv + (size_t)t * 3 * D + (size_t)qk * D + (size_t)h * hd;
                const float *c = r->cs + (size_t)t * half, *s = r->sn + (size_t)t * half;
                for (int i = 0; i < half; i++) {
                    const float a = p[i], b = p[i + half];
                    p[i] = a * c[i] - b * s[i];
                    p[i + half] = b * c[i] + a * s[i];
                }
            }
}

/* A merger over x [T][D] (post-shuffle norm when post != 0, else per-token norm first). */
static void merger(runner *R, const es_vision *v, const vis_norm *nm, const vis_linear *fc1, const vis_linear *fc2,
                   int post, const float *x, int T, float *buf_a, float *buf_b, float *out) {
    const int D = v->n_embd_v, M2 = v->merge * v->merge, Tm = T / M2;
    if (post) {
        rows(R, ROW_LN, x, buf_a, Tm, (int64_t)D * M2, nm, v->eps);
    } else {
        rows(R, ROW_LN, x, buf_a, T, D, nm, v->eps);
    }
    linear(R, fc1, buf_a, Tm, buf_b);
    rows(R, ROW_GELU_ERF, NULL, buf_b, Tm, (int64_t)D * M2, NULL, 0.0f);
    linear(R, fc2, buf_b, Tm, out);
}

es_status es_vision_encode(es_vision *v, const float *pixels, int32_t height, int32_t width, int32_t n_threads,
                           float *embd_out, float *deepstack_out) {
    return es_vision_encode_path(v, pixels, height, width, n_threads, embd_out, deepstack_out, 0);
}

es_status es_vision_encode_path(es_vision *v, const float *pixels, int32_t height, int32_t width,
                                int32_t n_threads, float *embd_out, float *deepstack_out, int reference) {
    if (!v) return ES_ERR_INVALID_ARG;
    v->err[0] = 0;
    const int step = v->patch * v->merge;
    if (!pixels || !embd_out) {
        es_set_err(v->err, sizeof v->err, "es_vision_encode: %s is NULL", !pixels ? "pixels" : "embd_out");
        return ES_ERR_INVALID_ARG;
    }
    if (n_threads < 1 || n_threads > ES_MAX_THREADS) {
        es_set_err(v->err, sizeof v->err, "es_vision_encode: n_threads %d outside [1, %d]", n_threads,
                   ES_MAX_THREADS);
        return ES_ERR_INVALID_ARG;
    }
    if (height < step || width < step || height % step || width % step || height > 32768 || width > 32768 ||
        (int64_t)(height / v->patch) * (width / v->patch) > 65536) {
        es_set_err(v->err, sizeof v->err,
                   "es_vision_encode: image %dx%d (height x width): both sides must be positive multiples of %d, "
                   "at most 65536 patches of %d", height, width, step, v->patch);
        return ES_ERR_INVALID_ARG;
    }
    const int gh = height / v->patch, gw = width / v->patch, T = gh * gw;
    const int D = v->n_embd_v, F = v->n_ff, M2 = v->merge * v->merge, Tm = T / M2;
    const int K = 3 * v->patch * v->patch, hd = D / v->n_head;
    const int Tp = (T + PW - 1) / PW * PW, hdp = (hd + PW - 1) / PW * PW;
    int64_t wide = (int64_t)D * M2 > F ? (int64_t)D * M2 : F;
    wide = wide > K ? wide : K;
    /* x, h, att, mb [T D]; qkv [T 3D]; ff [T wide]; keys, values; per thread scores; rope [T hd] */
    const size_t n_f = (size_t)T * D * 4 + (size_t)T * 3 * D + (size_t)T * (size_t)wide +
                       (size_t)v->n_head * hdp * Tp + (size_t)v->n_head * T * hdp +
                       (size_t)n_threads * VIS_R * (size_t)(Tp + hdp) + (size_t)T * hd;
    float *buf = malloc(n_f * sizeof(float));
    es_pool *pool = es_pool_new(n_threads);
    if (!buf || !pool) {
        free(buf);
        if (pool) es_pool_free(pool);
        es_set_err(v->err, sizeof v->err, buf ? "es_vision_encode: threads could not be started"
                                              : "es_vision_encode: out of memory for %d patches", T);
        return buf ? ES_ERR_INTERNAL : ES_ERR_NOMEM;
    }
    float *x = buf, *h = x + (size_t)T * D, *att = h + (size_t)T * D, *mb = att + (size_t)T * D;
    float *qkv = mb + (size_t)T * D, *ff = qkv + (size_t)T * 3 * D, *kt = ff + (size_t)T * wide;
    float *vp = kt + (size_t)v->n_head * hdp * Tp, *ws = vp + (size_t)v->n_head * T * hdp;
    float *cs = ws + (size_t)n_threads * VIS_R * (size_t)(Tp + hdp), *sn = cs + (size_t)T * (hd / 2);
    runner R = {pool, reference != 0};
    es_pool_begin(pool);
    embed_patches(&R, v, pixels, height, width, ff, x);
    rope_tables(v, T, gw, cs, sn);
    rope_task rt = {v, qkv, T, cs, sn};
    attn_task at = {qkv, att, kt, vp, ws, T, Tp, v->n_head, hd, hdp, D, 1.0f / sqrtf((float)hd), reference != 0};
    int k_ds = 0;
    for (int il = 0; il < v->n_layer; il++) {
        const vis_layer *l = &v->layers[il];
        rows(&R, ROW_LN, x, h, T, D, &l->ln1, v->eps);
        linear(&R, &l->qkv, h, T, qkv);
        es_pool_run(pool, rope_fn, &rt);
        es_pool_run(pool, attn_pack_fn, &at);
        es_pool_run(pool, attn_fn, &at);
        linear(&R, &l->out, att, T, h);
        rows(&R, ROW_ADD, h, x, T, D, NULL, 0.0f);
        rows(&R, ROW_LN, x, h, T, D, &l->ln2, v->eps);
        linear(&R, &l->up, h, T, ff);
        rows(&R, ROW_GELU_TANH, NULL, ff, T, F, NULL, 0.0f);
        linear(&R, &l->down, ff, T, h);
        rows(&R, ROW_ADD, h, x, T, D, NULL, 0.0f);
        if (k_ds < v->n_deepstack && v->ds[k_ds].layer == il) {
            if (deepstack_out) {
                const vis_merger *m = &v->ds[k_ds];
                merger(&R, v, &m->norm, &m->fc1, &m->fc2, 1, x, T, mb, ff,
                       deepstack_out + (size_t)k_ds * Tm * v->n_out);
            }
            k_ds++;
        }
    }
    merger(&R, v, &v->post_ln, &v->mm0, &v->mm2, 0, x, T, mb, ff, embd_out);
    es_pool_end(pool);
    es_pool_free(pool);
    free(buf);
    return ES_OK;
}
