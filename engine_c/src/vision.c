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
 * Arithmetic: float32 everywhere; weights F16 or F32 are widened row by row, each output element
 * is one sequential dot product. Threads split output rows (and attention's query rows) only, so
 * results are bitwise independent of the thread count. No SIMD path (scalar only).
 */
#include <math.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define VIS_MAX_LAYERS 256
#define VIS_ERR_LEN 512

typedef struct {
    const float *w, *b;     /* LayerNorm weight / bias, owned copies inside the arena */
} vis_norm;

typedef struct {
    const es_tensor *w;     /* [n_out][n_in] F16 or F32 */
    const float *b;         /* [n_out] */
    int64_t n_in, n_out;
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
    const float *patch_w;   /* [n_embd_v][3][patch][patch] (the two temporal halves summed) */
    const float *patch_b;   /* [n_embd_v] */
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

static es_status get_linear(loader *L, const char *prefix, int64_t n_in, int64_t n_out, vis_linear *out) {
    char name[128];
    snprintf(name, sizeof name, "%s.weight", prefix);
    es_status st = get_tensor(L, name, &out->w);
    if (st) return st;
    const es_tensor *w = out->w;
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
    out->n_in = n_in;
    out->n_out = n_out;
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
    v->patch_w = pw;
    L.next += pk;
    if ((st = get_vec(&L, "v.patch_embd.bias", D, &v->patch_b)) ||
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

/* ---- kernels (scalar) ---------------------------------------------------------------------- */

typedef struct {
    const vis_linear *lin;
    const float *X;         /* [N][n_in] */
    float *Y;               /* [N][n_out] */
    int N;
    float *rowbuf;          /* [nth][n_in] */
} linear_task;

static void linear_fn(void *ctx, int ith, int nth) {
    const linear_task *t = ctx;
    const vis_linear *l = t->lin;
    const int64_t n_in = l->n_in, n_out = l->n_out;
    const int64_t r0 = n_out * ith / nth, r1 = n_out * (ith + 1) / nth;
    float *w = t->rowbuf + (size_t)ith * (size_t)n_in;
    for (int64_t r = r0; r < r1; r++) {
        const float *wr;
        if (l->w->type == ES_TYPE_F32) {
            wr = (const float *)l->w->data + r * n_in;
        } else {
            const uint16_t *s = (const uint16_t *)l->w->data + r * n_in;
            for (int64_t k = 0; k < n_in; k++) w[k] = es_fp16_to_fp32(s[k]);
            wr = w;
        }
        for (int i = 0; i < t->N; i++) {
            const float *x = t->X + (size_t)i * (size_t)n_in;
            float acc = 0.0f;
            for (int64_t k = 0; k < n_in; k++) acc += wr[k] * x[k];
            t->Y[(size_t)i * (size_t)n_out + (size_t)r] = acc + l->b[r];
        }
    }
}

typedef struct {
    es_pool *pool;
    float *rowbuf;          /* [nth][max n_in] */
} runner;

static void linear(runner *R, const vis_linear *l, const float *X, int N, float *Y) {
    linear_task t = {l, X, Y, N, R->rowbuf};
    es_pool_run(R->pool, linear_fn, &t);
}

static void layer_norm(const float *x, float *y, int n, int64_t d, const vis_norm *nm, float eps) {
    for (int i = 0; i < n; i++) {
        const float *xi = x + (size_t)i * (size_t)d;
        float *yi = y + (size_t)i * (size_t)d;
        float mean = 0.0f;
        for (int64_t k = 0; k < d; k++) mean += xi[k];
        mean /= (float)d;
        float var = 0.0f;
        for (int64_t k = 0; k < d; k++) {
            float c = xi[k] - mean;
            var += c * c;
        }
        var /= (float)d;
        float rs = 1.0f / sqrtf(var + eps);
        for (int64_t k = 0; k < d; k++) yi[k] = (xi[k] - mean) * rs * nm->w[k] + nm->b[k];
    }
}

static float gelu_tanh(float x) {
    const float c = 0.7978845608028654f;   /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(c * (x + 0.044715f * x * x * x)));
}

static float gelu_erf(float x) { return 0.5f * x * (1.0f + erff(x * 0.7071067811865476f)); }

typedef struct {
    const float *qkv;       /* [T][3 D], q and k already rotated */
    float *out;             /* [T][D] */
    float *scores;          /* [nth][T] */
    int T, n_head, hd, D;
    float scale;
} attn_task;

static void attn_fn(void *ctx, int ith, int nth) {
    const attn_task *a = ctx;
    const int64_t total = (int64_t)a->T * a->n_head;
    const int64_t j0 = total * ith / nth, j1 = total * (ith + 1) / nth;
    float *s = a->scores + (size_t)ith * (size_t)a->T;
    const size_t ld = 3 * (size_t)a->D;
    for (int64_t j = j0; j < j1; j++) {
        const int h = (int)(j % a->n_head), qi = (int)(j / a->n_head);
        const float *q = a->qkv + (size_t)qi * ld + (size_t)h * a->hd;
        float mx = -INFINITY;
        for (int t = 0; t < a->T; t++) {
            const float *k = a->qkv + (size_t)t * ld + (size_t)a->D + (size_t)h * a->hd;
            float acc = 0.0f;
            for (int e = 0; e < a->hd; e++) acc += q[e] * k[e];
            s[t] = acc * a->scale;
            if (s[t] > mx) mx = s[t];
        }
        float sum = 0.0f;
        for (int t = 0; t < a->T; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        float inv = 1.0f / sum;
        float *o = a->out + (size_t)qi * (size_t)a->D + (size_t)h * a->hd;
        for (int e = 0; e < a->hd; e++) o[e] = 0.0f;
        for (int t = 0; t < a->T; t++) {
            const float *vv = a->qkv + (size_t)t * ld + 2 * (size_t)a->D + (size_t)h * a->hd;
            const float p = s[t] * inv;
            for (int e = 0; e < a->hd; e++) o[e] += p * vv[e];
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

static void embed_patches(const es_vision *v, const float *px, int H, int W, float *x) {
    const int P = v->patch, D = v->n_embd_v, gh = H / P, gw = W / P, T = gh * gw;
    const int side = v->n_pos_side;
    const int K = 3 * P * P;
    float *patch = x + (size_t)T * (size_t)D;   /* caller gives room for T D + K floats */
    for (int t = 0; t < T; t++) {
        int r, c;
        token_rc(v, gw, t, &r, &c);
        for (int ch = 0; ch < 3; ch++)
            for (int ky = 0; ky < P; ky++)
                memcpy(patch + (ch * P + ky) * P, px + ((size_t)ch * H + (size_t)(r * P + ky)) * W + (size_t)c * P,
                       (size_t)P * sizeof(float));
        float *xt = x + (size_t)t * D;
        for (int o = 0; o < D; o++) {
            const float *w = v->patch_w + (size_t)o * K;
            float acc = 0.0f;
            for (int k = 0; k < K; k++) acc += w[k] * patch[k];
            xt[o] = acc + v->patch_b[o];
        }
        /* bilinear position embedding (fast_pos_embed_interpolate) */
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

/* 2-D RoPE on q and k of every head, in place in qkv [T][3 D]. */
static void rope_2d(const es_vision *v, float *qkv, int T, int gw) {
    const int D = v->n_embd_v, hd = D / v->n_head, half = hd / 2, nf = half / 2;
    float inv[512];
    for (int j = 0; j < nf; j++) inv[j] = 1.0f / powf(10000.0f, (float)(2 * j) / (float)half);
    for (int t = 0; t < T; t++) {
        int r, c;
        token_rc(v, gw, t, &r, &c);
        for (int i = 0; i < half; i++) {
            const float ang = i < nf ? (float)r * inv[i] : (float)c * inv[i - nf];
            const float cs = cosf(ang), sn = sinf(ang);
            for (int qk = 0; qk < 2; qk++)
                for (int h = 0; h < v->n_head; h++) {
                    float *p = qkv + (size_t)t * 3 * D + (size_t)qk * D + (size_t)h * hd;
                    const float a = p[i], b = p[i + half];
                    p[i] = a * cs - b * sn;
                    p[i + half] = b * cs + a * sn;
                }
        }
    }
}

/* A merger over x [T][D] (post-shuffle norm when post != 0, else per-token norm first). */
static void merger(runner *R, const es_vision *v, const vis_norm *nm, const vis_linear *fc1, const vis_linear *fc2,
                   int post, const float *x, int T, float *buf_a, float *buf_b, float *out) {
    const int D = v->n_embd_v, M2 = v->merge * v->merge, Tm = T / M2;
    if (post) {
        layer_norm(x, buf_a, Tm, (int64_t)D * M2, nm, v->eps);
    } else {
        layer_norm(x, buf_a, T, D, nm, v->eps);
    }
    linear(R, fc1, buf_a, Tm, buf_b);
    for (size_t i = 0; i < (size_t)Tm * D * M2; i++) buf_b[i] = gelu_erf(buf_b[i]);
    linear(R, fc2, buf_b, Tm, out);
}

es_status es_vision_encode(es_vision *v, const float *pixels, int32_t height, int32_t width, int32_t n_threads,
                           float *embd_out, float *deepstack_out) {
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
    const int K = 3 * v->patch * v->patch;
    const int64_t wide = (int64_t)D * M2 > F ? (int64_t)D * M2 : F;
    const int64_t max_in = wide > K ? wide : K;
    /* x [T D + K], h [T D], qkv [T 3D], att [T D], ff [T wide], m [T D], scores, rowbuf */
    size_t n_f = (size_t)T * D + (size_t)K + (size_t)T * D + (size_t)T * 3 * D + (size_t)T * D +
                 (size_t)T * (size_t)wide + (size_t)T * D + (size_t)n_threads * T + (size_t)n_threads * max_in;
    float *buf = malloc(n_f * sizeof(float));
    es_pool *pool = es_pool_new(n_threads);
    if (!buf || !pool) {
        free(buf);
        if (pool) es_pool_free(pool);
        es_set_err(v->err, sizeof v->err, buf ? "es_vision_encode: threads could not be started"
                                              : "es_vision_encode: out of memory for %d patches", T);
        return buf ? ES_ERR_INTERNAL : ES_ERR_NOMEM;
    }
    float *x = buf, *h = x + (size_t)T * D + K, *qkv = h + (size_t)T * D, *att = qkv + (size_t)T * 3 * D;
    float *ff = att + (size_t)T * D, *mb = ff + (size_t)T * wide, *scores = mb + (size_t)T * D;
    runner R = {pool, scores + (size_t)n_threads * T};
    es_pool_begin(pool);
    embed_patches(v, pixels, height, width, x);
    attn_task at = {qkv, att, scores, T, v->n_head, D / v->n_head, D, 1.0f / sqrtf((float)(D / v->n_head))};
    int k_ds = 0;
    for (int il = 0; il < v->n_layer; il++) {
        const vis_layer *l = &v->layers[il];
        layer_norm(x, h, T, D, &l->ln1, v->eps);
        linear(&R, &l->qkv, h, T, qkv);
        rope_2d(v, qkv, T, gw);
        es_pool_run(pool, attn_fn, &at);
        linear(&R, &l->out, att, T, h);
        for (size_t i = 0; i < (size_t)T * D; i++) x[i] += h[i];
        layer_norm(x, h, T, D, &l->ln2, v->eps);
        linear(&R, &l->up, h, T, ff);
        for (size_t i = 0; i < (size_t)T * F; i++) ff[i] = gelu_tanh(ff[i]);
        linear(&R, &l->down, ff, T, h);
        for (size_t i = 0; i < (size_t)T * D; i++) x[i] += h[i];
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
