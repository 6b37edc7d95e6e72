/*
 * model.c - es_model: hyperparameters from the GGUF metadata and the binding
 * of every tensor the forward pass reads, with its shape checked.
 *
 * Tensor names and shapes (ne[0] = row length, ne[1] = rows), llama.cpp's:
 *   token_embd.weight            [n_embd, n_vocab]    n_vocab is read from here
 *   output_norm.weight           [n_embd]
 *   output.weight                [n_embd, n_vocab]    absent: tied to token_embd
 *   blk.N.attn_norm.weight       [n_embd]
 *   blk.N.attn_q.weight          [n_embd, n_head * head_dim]
 *   blk.N.attn_k/attn_v.weight   [n_embd, n_head_kv * head_dim]
 *   blk.N.attn_q/k/v.bias        [rows of the matching matrix]   qwen2 (optional elsewhere)
 *   blk.N.attn_q_norm/attn_k_norm.weight [head_dim]               qwen3 (optional elsewhere)
 *   blk.N.attn_output.weight     [n_head * head_dim, n_embd]
 *   blk.N.ffn_norm.weight        [n_embd]
 *   blk.N.ffn_gate/ffn_up.weight [n_embd, n_ff]
 *   blk.N.ffn_down.weight        [n_ff, n_embd]
 * Mixture of experts (qwen3moe, qwen3vlmoe), instead of ffn_gate/up/down:
 *   blk.N.ffn_gate_inp.weight    [n_embd, n_expert]                the router
 *   blk.N.ffn_gate_exps.weight   [n_embd, n_ff_exp, n_expert]      expert e's gate is the
 *   blk.N.ffn_up_exps.weight     [n_embd, n_ff_exp, n_expert]      matrix e of the 3-D tensor
 *   blk.N.ffn_down_exps.weight   [n_ff_exp, n_embd, n_expert]
 * Each expert's matrices become 2-D views (model.expert_views) that the
 * matmuls, the packing and the byte counts treat like any other matrix.
 * qwen3vl / qwen3vlmoe: the text decoder of Qwen3-VL: qwen3 / qwen3moe plus
 * rope.dimension_sections (multimodal RoPE) and n_deepstack_layers.
 * gemma3 (Gemma 3's text decoder, as llama.cpp reads it): qwen3's q/k head
 * norms plus
 *   blk.N.post_attention_norm.weight [n_embd]   RMSNorm of the attention output
 *   blk.N.post_ffw_norm.weight       [n_embd]   RMSNorm of the FFN output
 * (each applied before its residual add); a GELU-gated FFN (tanh form);
 * embeddings scaled by sqrtf(n_embd); sliding-window attention on the local
 * layers (attention.sliding_window; attention.sliding_window_pattern: every
 * n-th layer global, default 6, or one bool per layer; rope.freq_base_swa,
 * default 10000, their RoPE base). The converter stores Gemma's (1 + w)
 * norm weights with the 1 added, so every norm is the plain x / rms * w.
 *
 * 1-D tensors (norms, biases) are converted to float once, into f32_pool;
 * es_model_vec returns that view.
 */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "quant.h"

/* es_model plus the f32_pool index of each 1-D tensor.
 * `pub` must stay first: an es_model * handed out is a model_impl *. */
typedef struct {
    es_model pub;
    int64_t *vec_off;       /* [gguf->n_tensors]: offset into f32_pool, -1 if not converted */
    void *arena;            /* the packed weights of every repacked tensor, in the order of use */
} model_impl;

/* Load-time context: the open file, the architecture and the error buffer. */
typedef struct {
    const es_gguf *g;
    const char *arch;
    char *err;
    size_t err_len;
} loader;

es_model_params es_model_default_params(void) {
    es_model_params p;
    memset(&p, 0, sizeof p);
    return p;
}

/* ---- metadata ---------------------------------------------------------- */

/* Read "<arch>.<suffix>" as an integer of any GGUF integer type into *out,
 * range-checked to [lo, hi]. Absent: *out = def, or ES_ERR_FORMAT when
 * required. A non-integer type is ES_ERR_FORMAT. */
static es_status hp_int(const loader *ld, const char *suffix, bool required, int64_t def,
                        int64_t lo, int64_t hi, int64_t *out) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", ld->arch, suffix);
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, key);
    if (kv == NULL) {
        if (required) {
            es_set_err(ld->err, ld->err_len, "model: missing key %s", key);
            return ES_ERR_FORMAT;
        }
        *out = def;
        return ES_OK;
    }
    int64_t v;
    switch (kv->type) {
    case GGUF_T_UINT8: case GGUF_T_UINT16: case GGUF_T_UINT32: case GGUF_T_UINT64:
        v = kv->v.u64 > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)kv->v.u64;
        break;
    case GGUF_T_INT8: case GGUF_T_INT16: case GGUF_T_INT32: case GGUF_T_INT64:
        v = kv->v.i64;
        break;
    default:
        es_set_err(ld->err, ld->err_len, "model: key %s has value type %u, expected an integer",
                   key, kv->type);
        return ES_ERR_FORMAT;
    }
    if (v < lo || v > hi) {
        es_set_err(ld->err, ld->err_len, "model: %s = %lld out of range %lld..%lld", key,
                   (long long)v, (long long)lo, (long long)hi);
        return ES_ERR_FORMAT;
    }
    *out = v;
    return ES_OK;
}

/* Read "<arch>.<suffix>" as a float (float32/float64 or an integer), finite
 * and in (lo, hi]. Absent: *out = def. */
static es_status hp_float(const loader *ld, const char *suffix, double def, double lo, double hi,
                          float *out) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", ld->arch, suffix);
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, key);
    double v = def;
    if (kv != NULL) {
        switch (kv->type) {
        case GGUF_T_FLOAT32: case GGUF_T_FLOAT64: v = kv->v.f64; break;
        case GGUF_T_UINT8: case GGUF_T_UINT16: case GGUF_T_UINT32: case GGUF_T_UINT64:
            v = (double)kv->v.u64; break;
        case GGUF_T_INT8: case GGUF_T_INT16: case GGUF_T_INT32: case GGUF_T_INT64:
            v = (double)kv->v.i64; break;
        default:
            es_set_err(ld->err, ld->err_len, "model: key %s has value type %u, expected a number",
                       key, kv->type);
            return ES_ERR_FORMAT;
        }
    }
    if (!isfinite(v) || !(v > lo) || !(v <= hi)) {
        es_set_err(ld->err, ld->err_len, "model: %s = %g out of range (%g, %g]", key, v, lo, hi);
        return ES_ERR_FORMAT;
    }
    *out = (float)v;
    return ES_OK;
}

/* The architectures this engine runs, and what sets them apart. */
static const struct arch_desc {
    const char *name;
    bool qkv_bias;      /* qwen2: biases on q, k, v */
    bool qk_norm;       /* qwen3*: RMSNorm over each head of q and k */
    bool moe;           /* mixture of experts instead of one SwiGLU FFN */
    bool mrope;         /* multimodal RoPE sections, deepstack layers (Qwen3-VL) */
    bool gemma;         /* Gemma 3: post-norms, GELU FFN, scaled embeddings, sliding window */
} archs[] = {
    { "llama",      false, false, false, false, false },
    { "qwen2",      true,  false, false, false, false },
    { "qwen3",      false, true,  false, false, false },
    { "qwen3moe",   false, true,  true,  false, false },
    { "qwen3vl",    false, true,  false, true,  false },
    { "qwen3vlmoe", false, true,  true,  true,  false },
    { "gemma3",     false, true,  false, false, true  },
};

static const struct arch_desc *arch_of(const char *name) {
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++)
        if (strcmp(archs[i].name, name) == 0) return &archs[i];
    return NULL;
}

/* general.architecture -> info->arch and ld->arch. Missing or not a string:
 * ES_ERR_FORMAT; not one of archs: ES_ERR_UNSUPPORTED naming it. */
static es_status read_arch(loader *ld, es_model_info *info) {
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, "general.architecture");
    if (kv == NULL || kv->type != GGUF_T_STRING) {
        es_set_err(ld->err, ld->err_len, "model: general.architecture is %s",
                   kv == NULL ? "missing" : "not a string");
        return ES_ERR_FORMAT;
    }
    for (size_t i = 0; i < sizeof archs / sizeof archs[0]; i++) {
        const char *a = archs[i].name;
        if (kv->str_len == strlen(a) && memcmp(kv->str, a, kv->str_len) == 0) {
            snprintf(info->arch, sizeof info->arch, "%s", a);
            ld->arch = info->arch;
            return ES_OK;
        }
    }
    int shown = kv->str_len > 32 ? 32 : (int)kv->str_len;
    es_set_err(ld->err, ld->err_len,
               "model: unsupported architecture '%.*s' (general.architecture; supported: llama, "
               "qwen2, qwen3, qwen3moe, qwen3vl, qwen3vlmoe, gemma3)", shown, kv->str);
    return ES_ERR_UNSUPPORTED;
}

/* "<arch>.rope.dimension_sections": 4 non-negative integers (int32 or
 * uint32 array; llama.cpp's converter writes 4, padding with 0) whose sum
 * is 1 .. rope_dim / 2, into info->rope_sections. */
static es_status read_sections(const loader *ld, es_model_info *info) {
    char key[96];
    snprintf(key, sizeof key, "%s.rope.dimension_sections", ld->arch);
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, key);
    if (kv == NULL) {
        es_set_err(ld->err, ld->err_len, "model: missing key %s", key);
        return ES_ERR_FORMAT;
    }
    if (kv->type != GGUF_T_ARRAY || (kv->arr_type != GGUF_T_INT32 && kv->arr_type != GGUF_T_UINT32) ||
        kv->arr_len < 3 || kv->arr_len > 4) {
        es_set_err(ld->err, ld->err_len, "model: %s must be an array of 3 or 4 integers", key);
        return ES_ERR_FORMAT;
    }
    int64_t sum = 0;
    for (uint64_t i = 0; i < 4; i++) {
        int32_t v = 0;
        if (i < kv->arr_len) memcpy(&v, (const uint8_t *)kv->arr_data + 4 * i, 4);
        if (v < 0 || v > info->rope_dim) {
            es_set_err(ld->err, ld->err_len, "model: %s[%d] = %d out of range 0..%d", key, (int)i,
                       (int)v, (int)info->rope_dim);
            return ES_ERR_FORMAT;
        }
        info->rope_sections[i] = v;
        sum += v;
    }
    if (sum < 1 || sum > info->rope_dim / 2) {
        es_set_err(ld->err, ld->err_len, "model: %s sums to %lld; expected 1..%d (rope_dim / 2)", key,
                   (long long)sum, (int)(info->rope_dim / 2));
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

/* The mixture-of-experts keys: expert_count (2..ES_MAX_EXPERT), expert_used_count
 * (1..min(expert_count, ES_MAX_EXPERT_USED)), expert_feed_forward_length
 * (default: feed_forward_length / expert_used_count, as llama.cpp). */
static es_status read_moe(const loader *ld, es_model_info *info) {
    int64_t ne, nu, ff;
    es_status st;
    if ((st = hp_int(ld, "expert_count", true, 0, 2, ES_MAX_EXPERT, &ne)) != ES_OK) return st;
    int64_t hi = ne < ES_MAX_EXPERT_USED ? ne : ES_MAX_EXPERT_USED;
    if ((st = hp_int(ld, "expert_used_count", true, 0, 1, hi, &nu)) != ES_OK) return st;
    int64_t def = info->n_ff > 0 ? info->n_ff / nu : 0;
    if ((st = hp_int(ld, "expert_feed_forward_length", def == 0, def, 1, 1 << 20, &ff)) != ES_OK) return st;
    info->n_expert = (int32_t)ne;
    info->n_expert_used = (int32_t)nu;
    info->n_ff_exp = (int32_t)ff;
    return ES_OK;
}

/* A string key "<arch>.<suffix>" equal to `want`? *present says whether it exists. */
static bool hp_str_is(const loader *ld, const char *suffix, const char *want, bool *present) {
    char key[96];
    snprintf(key, sizeof key, "%s.%s", ld->arch, suffix);
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, key);
    *present = kv != NULL;
    return kv != NULL && kv->type == GGUF_T_STRING && kv->str_len == strlen(want) &&
           memcmp(kv->str, want, kv->str_len) == 0;
}

/* gemma3's keys, as llama.cpp reads them: attention.sliding_window (absent
 * or 0: no local layers), rope.freq_base_swa (default 10000), linear RoPE
 * scaling of the global layers (rope.scaling.type "linear" with
 * rope.scaling.factor, or rope.scale_linear); a final logit softcapping is
 * refused (Gemma 3 has none; the engine does not implement it). */
static es_status read_gemma(const loader *ld, es_model_info *info) {
    int64_t swa;
    es_status st;
    if ((st = hp_int(ld, "attention.sliding_window", false, 0, 0, INT32_MAX, &swa)) != ES_OK) return st;
    info->n_swa = (int32_t)swa;
    if ((st = hp_float(ld, "rope.freq_base_swa", 10000.0, 0.0, 1e12, &info->rope_freq_base_swa))) return st;
    float cap;
    if ((st = hp_float(ld, "final_logit_softcapping", 0.0, -1.0, 1e9, &cap))) return st;
    if (cap != 0.0f) {
        es_set_err(ld->err, ld->err_len, "model: %s.final_logit_softcapping = %g: logit softcapping is not "
                   "supported", ld->arch, (double)cap);
        return ES_ERR_UNSUPPORTED;
    }
    bool present, linear = hp_str_is(ld, "rope.scaling.type", "linear", &present);
    if (present && !linear && !hp_str_is(ld, "rope.scaling.type", "none", &present)) {
        es_set_err(ld->err, ld->err_len, "model: %s.rope.scaling.type: only linear RoPE scaling is supported",
                   ld->arch);
        return ES_ERR_UNSUPPORTED;
    }
    float factor, lin;
    if ((st = hp_float(ld, "rope.scaling.factor", 0.0, -1.0, 1e6, &factor))) return st;
    if ((st = hp_float(ld, "rope.scale_linear", 0.0, -1.0, 1e6, &lin))) return st;
    if (factor == 0.0f) factor = lin;   /* llama.cpp: the factor, else the older key */
    if (factor < 0.0f) {
        es_set_err(ld->err, ld->err_len, "model: %s.rope.scaling.factor = %g is negative", ld->arch,
                   (double)factor);
        return ES_ERR_FORMAT;
    }
    info->rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
    return ES_OK;
}

/* Which layers have the sliding window (gemma3 with n_swa > 0), as
 * llama.cpp's load_swa_pattern: "<arch>.attention.sliding_window_pattern"
 * as one bool (or integer) per layer, or as an integer n (default 6): layer
 * l is local unless l % n == n - 1 (n = 0: every layer is local). */
static es_status read_swa_layers(const loader *ld, es_model *m) {
    es_model_info *in = &m->info;
    in->n_swa_layers = 0;
    if (in->n_swa == 0) return ES_OK;
    char key[96];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", ld->arch);
    const es_gguf_kv *kv = es_gguf_find_kv(ld->g, key);
    if (kv != NULL && kv->type == GGUF_T_ARRAY) {
        size_t w = kv->arr_type == GGUF_T_BOOL || kv->arr_type <= GGUF_T_INT8 ? 1
                 : kv->arr_type <= GGUF_T_INT16 ? 2 : kv->arr_type <= GGUF_T_INT32 ? 4 : 0;
        if (w == 0 || kv->arr_type == GGUF_T_FLOAT32 || kv->arr_len != (uint64_t)in->n_layer) {
            es_set_err(ld->err, ld->err_len, "model: %s must be an integer or %d bools", key, (int)in->n_layer);
            return ES_ERR_FORMAT;
        }
        for (int l = 0; l < in->n_layer; l++) {
            uint32_t v = 0;
            memcpy(&v, (const uint8_t *)kv->arr_data + (size_t)l * w, w);
            m->layers[l].swa = v != 0;
        }
    } else {
        int64_t n;
        es_status st = hp_int(ld, "attention.sliding_window_pattern", false, 6, 0, 1 << 20, &n);
        if (st != ES_OK) return st;
        for (int l = 0; l < in->n_layer; l++) m->layers[l].swa = n == 0 || l % n < n - 1;
    }
    for (int l = 0; l < in->n_layer; l++) in->n_swa_layers += m->layers[l].swa;
    return ES_OK;
}

/* Every hyperparameter except n_vocab (taken from token_embd), range-checked. */
static es_status read_hparams(loader *ld, es_model_info *info) {
    int64_t n_layer, n_embd, n_ff, n_head, n_head_kv, head_dim, v_dim, n_ctx, rope_dim;
    es_status st;
    if ((st = hp_int(ld, "block_count", true, 0, 1, 1024, &n_layer)) != ES_OK) return st;
    if ((st = hp_int(ld, "embedding_length", true, 0, 1, 65536, &n_embd)) != ES_OK) return st;
    const struct arch_desc *ad = arch_of(ld->arch);
    if ((st = hp_int(ld, "feed_forward_length", !ad->moe, 0, ad->moe ? 0 : 1, 1 << 20, &n_ff)) != ES_OK)
        return st;
    if ((st = hp_int(ld, "attention.head_count", true, 0, 1, 1024, &n_head)) != ES_OK) return st;
    if ((st = hp_int(ld, "attention.head_count_kv", false, n_head, 1, n_head, &n_head_kv)) != ES_OK)
        return st;
    if (n_head % n_head_kv != 0) {
        es_set_err(ld->err, ld->err_len,
                   "model: %s.attention.head_count (%lld) is not a multiple of head_count_kv (%lld)",
                   ld->arch, (long long)n_head, (long long)n_head_kv);
        return ES_ERR_FORMAT;
    }
    int64_t hd_def = n_embd % n_head == 0 ? n_embd / n_head : 0;  /* 0: fails the range check */
    if ((st = hp_int(ld, "attention.key_length", false, hd_def, 2, ES_MAX_HEAD_DIM, &head_dim)) != ES_OK)
        return st;
    if (head_dim % 2 != 0) {
        es_set_err(ld->err, ld->err_len, "model: head_dim (%s.attention.key_length) = %lld is odd",
                   ld->arch, (long long)head_dim);
        return ES_ERR_FORMAT;
    }
    if ((st = hp_int(ld, "attention.value_length", false, head_dim, head_dim, head_dim, &v_dim)))
        return st;
    if ((st = hp_int(ld, "context_length", true, 0, 1, INT32_MAX, &n_ctx)) != ES_OK) return st;
    if ((st = hp_int(ld, "rope.dimension_count", false, head_dim, 2, head_dim, &rope_dim)))
        return st;
    if (rope_dim % 2 != 0) {
        es_set_err(ld->err, ld->err_len, "model: %s.rope.dimension_count = %lld is odd", ld->arch,
                   (long long)rope_dim);
        return ES_ERR_FORMAT;
    }
    bool is_llama = strcmp(ld->arch, "llama") == 0;
    if ((st = hp_float(ld, "rope.freq_base", 10000.0, 0.0, 1e12, &info->rope_freq_base)))
        return st;
    if ((st = hp_float(ld, "attention.layer_norm_rms_epsilon", is_llama ? 1e-5 : 1e-6, 0.0, 1.0,
                       &info->norm_eps)))
        return st;
    info->n_layer = (int32_t)n_layer;
    info->n_embd = (int32_t)n_embd;
    info->n_ff = (int32_t)n_ff;
    info->n_head = (int32_t)n_head;
    info->n_head_kv = (int32_t)n_head_kv;
    info->head_dim = (int32_t)head_dim;
    info->n_ctx_train = (int32_t)n_ctx;
    info->rope_dim = (int32_t)rope_dim;
    info->rope_neox = is_llama ? 0 : 1;
    info->rope_freq_base_swa = info->rope_freq_base;
    info->rope_freq_scale = 1.0f;
    if (ad->moe && (st = read_moe(ld, info)) != ES_OK) return st;
    if (ad->gemma && (st = read_gemma(ld, info)) != ES_OK) return st;
    if (ad->mrope) {
        int64_t nds;
        if ((st = read_sections(ld, info)) != ES_OK) return st;
        if ((st = hp_int(ld, "n_deepstack_layers", false, 0, 0, n_layer, &nds)) != ES_OK) return st;
        info->n_deepstack = (int32_t)nds;
    }
    return ES_OK;
}

/* ---- tensors ----------------------------------------------------------- */

enum { KIND_MATRIX, KIND_VECTOR };

static bool is_float_type(uint32_t t) {
    return t == ES_TYPE_F32 || t == ES_TYPE_F16 || t == ES_TYPE_BF16;
}

/* Find `name` and check its shape: a matrix is [ne0, ne1] (ne1 < 0: any
 * rows), a vector is [ne0] in F32/F16/BF16. *out = NULL when absent and not
 * required. Absent or mis-shaped: ES_ERR_MISSING_TENSOR; a vector of a
 * quantized type: ES_ERR_UNSUPPORTED. */
static es_status bind(const loader *ld, const char *name, int kind, int64_t ne0, int64_t ne1,
                      bool required, const es_tensor **out) {
    const es_tensor *t = es_gguf_find_tensor(ld->g, name);
    *out = NULL;
    if (t == NULL) {
        if (!required) return ES_OK;
        es_set_err(ld->err, ld->err_len, "model: missing tensor '%s' (architecture %s)", name,
                   ld->arch);
        return ES_ERR_MISSING_TENSOR;
    }
    int64_t want1 = kind == KIND_VECTOR ? 1 : (ne1 < 0 ? t->ne[1] : ne1);
    if (t->ne[0] != ne0 || t->ne[1] != want1 || t->ne[2] != 1 || t->ne[3] != 1) {
        char want[48];
        if (kind == KIND_VECTOR) snprintf(want, sizeof want, "[%lld]", (long long)ne0);
        else if (ne1 < 0) snprintf(want, sizeof want, "[%lld, n_vocab]", (long long)ne0);
        else snprintf(want, sizeof want, "[%lld, %lld]", (long long)ne0, (long long)ne1);
        es_set_err(ld->err, ld->err_len,
                   "model: tensor '%s' has shape [%lld, %lld, %lld, %lld], expected %s", name,
                   (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2],
                   (long long)t->ne[3], want);
        return ES_ERR_MISSING_TENSOR;
    }
    if (kind == KIND_VECTOR && !is_float_type(t->type)) {
        es_set_err(ld->err, ld->err_len,
                   "model: tensor '%s' has type %s; norms and biases must be F32, F16 or BF16",
                   name, es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    *out = t;
    return ES_OK;
}

/* Find the 3-D expert tensor `name`, [ne0, ne1, n_expert], and cut it into
 * n_expert 2-D views views[e] = its matrix e ([ne0, ne1]), which the rest
 * of the engine treats as matrices of their own. */
static es_status bind_experts(const loader *ld, const char *name, int64_t ne0, int64_t ne1, int64_t n_expert,
                              es_tensor *views) {
    const es_tensor *t = es_gguf_find_tensor(ld->g, name);
    if (t == NULL) {
        es_set_err(ld->err, ld->err_len, "model: missing tensor '%s' (architecture %s)", name, ld->arch);
        return ES_ERR_MISSING_TENSOR;
    }
    if (t->ne[0] != ne0 || t->ne[1] != ne1 || t->ne[2] != n_expert || t->ne[3] != 1) {
        es_set_err(ld->err, ld->err_len,
                   "model: tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld]", name,
                   (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                   (long long)ne0, (long long)ne1, (long long)n_expert);
        return ES_ERR_MISSING_TENSOR;
    }
    if (is_float_type(t->type) && t->type != ES_TYPE_F32 && t->type != ES_TYPE_F16) {
        es_set_err(ld->err, ld->err_len, "model: tensor '%s' has type %s, which the expert matmuls do not take",
                   name, es_type_name(t->type));
        return ES_ERR_UNSUPPORTED;
    }
    size_t mat_bytes = (size_t)ne1 * t->row_bytes;   /* nbytes = n_expert * mat_bytes, checked by the reader */
    for (int64_t e = 0; e < n_expert; e++) {
        es_tensor *v = &views[e];
        memset(v, 0, sizeof *v);
        v->name = t->name;   /* the 3-D tensor's (not owned) */
        v->type = t->type;
        v->n_dims = 2;
        v->ne[0] = ne0;
        v->ne[1] = ne1;
        v->ne[2] = v->ne[3] = 1;
        v->n_elements = ne0 * ne1;
        v->nbytes = mat_bytes;
        v->row_bytes = t->row_bytes;
        v->data = (const uint8_t *)t->data + (size_t)e * mat_bytes;
    }
    return ES_OK;
}

/* Bind the tensors of block il into *L (ev: its 3 * n_expert expert views,
 * mixture of experts only). On failure *L is partly filled. */
static es_status bind_layer(const loader *ld, const es_model_info *hp, int il, es_layer *L, es_tensor *ev) {
    const int64_t E = hp->n_embd, F = hp->n_ff, D = hp->head_dim;
    const int64_t Q = (int64_t)hp->n_head * D, KV = (int64_t)hp->n_head_kv * D;
    const struct arch_desc *ad = arch_of(ld->arch);
    const bool dense = !ad->moe;
    const struct {
        const char *suffix; int kind; int64_t ne0, ne1; bool required; const es_tensor **dst;
    } spec[] = {
        { "attn_norm.weight",   KIND_VECTOR, E, 1, true,  &L->attn_norm },
        { "attn_q.weight",      KIND_MATRIX, E, Q, true,  &L->wq },
        { "attn_k.weight",      KIND_MATRIX, E, KV, true, &L->wk },
        { "attn_v.weight",      KIND_MATRIX, E, KV, true, &L->wv },
        { "attn_q.bias",        KIND_VECTOR, Q, 1, ad->qkv_bias, &L->bq },
        { "attn_k.bias",        KIND_VECTOR, KV, 1, ad->qkv_bias, &L->bk },
        { "attn_v.bias",        KIND_VECTOR, KV, 1, ad->qkv_bias, &L->bv },
        { "attn_q_norm.weight", KIND_VECTOR, D, 1, ad->qk_norm, &L->q_norm },
        { "attn_k_norm.weight", KIND_VECTOR, D, 1, ad->qk_norm, &L->k_norm },
        { "attn_output.weight", KIND_MATRIX, Q, E, true,  &L->wo },
        { "post_attention_norm.weight", KIND_VECTOR, E, 1, ad->gemma, &L->attn_post_norm },
        { "ffn_norm.weight",    KIND_VECTOR, E, 1, true,  &L->ffn_norm },
        { "post_ffw_norm.weight", KIND_VECTOR, E, 1, ad->gemma, &L->ffn_post_norm },
        { "ffn_gate.weight",    KIND_MATRIX, E, F, dense, &L->w_gate },
        { "ffn_up.weight",      KIND_MATRIX, E, F, dense, &L->w_up },
        { "ffn_down.weight",    KIND_MATRIX, F, E, dense, &L->w_down },
        { "ffn_gate_inp.weight", KIND_MATRIX, E, hp->n_expert, ad->moe, &L->gate_inp },
    };
    for (size_t i = 0; i < sizeof spec / sizeof spec[0]; i++) {
        if (!dense && spec[i].dst != &L->gate_inp &&
            (spec[i].dst == &L->w_gate || spec[i].dst == &L->w_up || spec[i].dst == &L->w_down))
            continue;   /* a mixture of experts has no dense FFN */
        if (dense && spec[i].dst == &L->gate_inp) continue;
        char name[96];
        snprintf(name, sizeof name, "blk.%d.%s", il, spec[i].suffix);
        es_status st = bind(ld, name, spec[i].kind, spec[i].ne0, spec[i].ne1, spec[i].required,
                            spec[i].dst);
        if (st != ES_OK) return st;
    }
    if (dense) return ES_OK;
    const int64_t NE = hp->n_expert, FE = hp->n_ff_exp;
    L->exp_gate = ev;
    L->exp_up = ev + NE;
    L->exp_down = ev + 2 * NE;
    const struct { const char *suffix; int64_t ne0, ne1; es_tensor *dst; } ex[] = {
        { "ffn_gate_exps.weight", E, FE, L->exp_gate },
        { "ffn_up_exps.weight",   E, FE, L->exp_up },
        { "ffn_down_exps.weight", FE, E, L->exp_down },
    };
    for (size_t i = 0; i < sizeof ex / sizeof ex[0]; i++) {
        char name[96];
        snprintf(name, sizeof name, "blk.%d.%s", il, ex[i].suffix);
        es_status st = bind_experts(ld, name, ex[i].ne0, ex[i].ne1, NE, ex[i].dst);
        if (st != ES_OK) return st;
    }
    if (!es_matmul_supported(L->gate_inp->type)) {
        es_set_err(ld->err, ld->err_len, "model: blk.%d.ffn_gate_inp.weight has type %s, which the router "
                   "matmul does not take", il, es_type_name(L->gate_inp->type));
        return ES_ERR_UNSUPPORTED;
    }
    return ES_OK;
}

/* token_embd (defines n_vocab), output_norm, output (or tied), all blocks. */
static es_status bind_all(const loader *ld, es_model *m) {
    es_model_info *hp = &m->info;
    es_status st = bind(ld, "token_embd.weight", KIND_MATRIX, hp->n_embd, -1, true, &m->tok_embd);
    if (st != ES_OK) return st;
    if (m->tok_embd->ne[1] > INT32_MAX) {
        es_set_err(ld->err, ld->err_len, "model: token_embd.weight has %lld rows (n_vocab), "
                   "more than 2^31-1", (long long)m->tok_embd->ne[1]);
        return ES_ERR_FORMAT;
    }
    hp->n_vocab = (int32_t)m->tok_embd->ne[1];
    const es_gguf_kv *tok = es_gguf_find_kv(ld->g, "tokenizer.ggml.tokens");
    if (tok != NULL && (tok->type != GGUF_T_ARRAY || tok->arr_len != (uint64_t)hp->n_vocab)) {
        es_set_err(ld->err, ld->err_len, "model: tokenizer.ggml.tokens has %llu entries but "
                   "token_embd.weight has %d rows (n_vocab)",
                   tok->type == GGUF_T_ARRAY ? (unsigned long long)tok->arr_len : 0ULL,
                   hp->n_vocab);
        return ES_ERR_FORMAT;
    }
    if ((st = bind(ld, "output_norm.weight", KIND_VECTOR, hp->n_embd, 1, true, &m->output_norm)))
        return st;
    if ((st = bind(ld, "output.weight", KIND_MATRIX, hp->n_embd, hp->n_vocab, false, &m->output)))
        return st;
    hp->tied_output = m->output == NULL;
    if (m->output == NULL) m->output = m->tok_embd;
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (m->layers == NULL) {
        es_set_err(ld->err, ld->err_len, "model: out of memory for %d layers", hp->n_layer);
        return ES_ERR_NOMEM;
    }
    if (hp->n_expert > 0) {
        m->expert_views = calloc((size_t)hp->n_layer * 3 * (size_t)hp->n_expert, sizeof *m->expert_views);
        if (m->expert_views == NULL) {
            es_set_err(ld->err, ld->err_len, "model: out of memory for the expert views");
            return ES_ERR_NOMEM;
        }
    }
    for (int il = 0; il < hp->n_layer; il++) {
        es_tensor *ev = m->expert_views ? m->expert_views + (size_t)il * 3 * (size_t)hp->n_expert : NULL;
        if ((st = bind_layer(ld, hp, il, &m->layers[il], ev)) != ES_OK) return st;
    }
    return ES_OK;
}

/* ---- float pool -------------------------------------------------------- */

/* The 1-D tensors of the model, at most 1 + 9 per layer; returns the count. */
static int list_vectors(const es_model *m, const es_tensor **v, int cap) {
    int n = 0;
    if (n < cap) v[n++] = m->output_norm;
    for (int il = 0; il < m->info.n_layer; il++) {
        const es_layer *L = &m->layers[il];
        const es_tensor *lv[] = { L->attn_norm, L->bq, L->bk, L->bv, L->q_norm, L->k_norm,
                                  L->attn_post_norm, L->ffn_norm, L->ffn_post_norm };
        for (size_t i = 0; i < sizeof lv / sizeof lv[0]; i++) {
            if (lv[i] != NULL && n < cap) v[n++] = lv[i];
        }
    }
    return n;
}

static void to_f32(const es_tensor *t, float *dst) {
    const uint8_t *src = t->data;
    for (int64_t i = 0; i < t->n_elements; i++) {
        if (t->type == ES_TYPE_F32) {
            memcpy(&dst[i], src + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = t->type == ES_TYPE_F16 ? es_fp16_to_fp32(h) : es_bf16_to_fp32(h);
        }
    }
}

/* Convert every 1-D tensor into f32_pool and record its offset in vec_off.
 * On failure (ES_ERR_NOMEM) the partial allocations are owned by *mi. */
static es_status build_pool(model_impl *mi, char *err, size_t err_len) {
    es_model *m = &mi->pub;
    int cap = 1 + 9 * m->info.n_layer;
    const es_tensor **v = calloc((size_t)cap, sizeof *v);
    mi->vec_off = malloc((size_t)m->gguf->n_tensors * sizeof *mi->vec_off + 1);
    if (v == NULL || mi->vec_off == NULL) {
        free(v);
        es_set_err(err, err_len, "model: out of memory for the vector index");
        return ES_ERR_NOMEM;
    }
    for (int64_t i = 0; i < m->gguf->n_tensors; i++) mi->vec_off[i] = -1;
    int n = list_vectors(m, v, cap);
    int64_t total = 0;   /* bounded: each vector has <= 1024 * 512 elements */
    for (int i = 0; i < n; i++) total += v[i]->n_elements;
    m->f32_pool = malloc((size_t)total * sizeof(float) + 1);
    if (m->f32_pool == NULL) {
        free(v);
        es_set_err(err, err_len, "model: out of memory for %lld floats of norms and biases",
                   (long long)total);
        return ES_ERR_NOMEM;
    }
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        mi->vec_off[v[i] - m->gguf->tensors] = off;
        to_f32(v[i], m->f32_pool + off);
        off += v[i]->n_elements;
    }
    free(v);
    return ES_OK;
}

/* Bytes of tensor data one decode step reads (*all: the bytes of every tensor
 * the forward pass uses): every block tensor, the output matrix (the whole
 * embedding when tied) and output_norm; of a mixture of experts, the router
 * and n_expert_used of the n_expert experts of each layer. */
static int64_t step_bytes(const es_model *m, int64_t *all) {
    int64_t sum = (int64_t)m->output->nbytes + (int64_t)m->output_norm->nbytes, experts = 0;
    for (int il = 0; il < m->info.n_layer; il++) {
        const es_layer *L = &m->layers[il];
        const es_tensor *lt[] = { L->attn_norm, L->wq, L->wk, L->wv, L->bq, L->bk, L->bv,
                                  L->q_norm, L->k_norm, L->wo, L->attn_post_norm, L->ffn_norm,
                                  L->ffn_post_norm, L->w_gate, L->w_up, L->w_down, L->gate_inp };
        for (size_t i = 0; i < sizeof lt / sizeof lt[0]; i++) {
            if (lt[i] != NULL) sum += (int64_t)lt[i]->nbytes;
        }
        for (int e = 0; L->exp_gate && e < m->info.n_expert; e++)
            experts += (int64_t)(L->exp_gate[e].nbytes + L->exp_up[e].nbytes + L->exp_down[e].nbytes);
    }
    *all = sum + experts;
    if (m->info.n_expert > 0) sum += experts / m->info.n_expert * m->info.n_expert_used;
    return sum;
}

/* ---- public ------------------------------------------------------------ */

/* Repack the matmul weights of the packed types (quant.h; the layers' seven
 * matrices and the output projection, which is token_embd when tied) for the
 * SIMD kernels (quant.h: es_tensor_pack; nothing in builds without a packed
 * kernel). The packed copy replaces the mapped bytes in every matmul; the
 * mapped pages of a packed tensor are then released (MADV_DONTNEED: read
 * again from the file only if the embedding lookup or a scalar path needs
 * them), so the weights are resident once. An untied token_embd is only
 * read row by row for the embedding lookup and stays mapped.
 * ES_ERR_NOMEM when a copy can not be made.
 *
 * The copies share one arena, in the order a forward pass reads them (the
 * weight stream of a step is one run of memory), aligned to 2 MiB and
 * advised as huge pages (MADV_HUGEPAGE, Linux): the stream then crosses a
 * page boundary every 2 MiB instead of every 4 KiB, with fewer TLB misses
 * and no stop of the hardware prefetchers at each 4 KiB (SmolLM2, 2
 * threads, tools/perf/forward_ab.c: T 4.14 -> 3.87 ms, V(4) 5.48 -> 5.11 ms).
 * Without transparent huge pages the advice is ignored. */
#define ARENA_ALIGN ((size_t)2 << 20)

static size_t round64(size_t n) { return (n + 63) / 64 * 64; }

/* The matrices to repack, in the order of use; returns their count (at most
 * pack_cap(m)): per layer q, k, v, o, then the dense FFN or each expert's
 * gate, up and down; then the output projection. */
static size_t pack_cap(const es_model *m) {
    return (size_t)m->info.n_layer * (7 + 3 * (size_t)m->info.n_expert) + 1;
}

static int pack_list(const es_model *m, es_tensor **out) {
    int n = 0;
    for (int l = 0; l < m->info.n_layer; l++) {
        const es_layer *L = &m->layers[l];
        const es_tensor *w[7] = {L->wq, L->wk, L->wv, L->wo, L->w_gate, L->w_up, L->w_down};
        for (int i = 0; i < 7; i++)
            if (w[i]) out[n++] = (es_tensor *)w[i];   /* owned by the model's es_gguf */
        for (int e = 0; L->exp_gate && e < m->info.n_expert; e++) {
            out[n++] = &L->exp_gate[e];
            out[n++] = &L->exp_up[e];
            out[n++] = &L->exp_down[e];
        }
    }
    out[n++] = (es_tensor *)m->output;
    return n;
}

static es_status pack_weights(model_impl *mi, char *err, size_t err_len) {
    es_model *m = &mi->pub;
    es_tensor **ts = malloc(sizeof *ts * pack_cap(m));
    if (ts == NULL) {
        es_set_err(err, err_len, "model: out of memory");
        return ES_ERR_NOMEM;
    }
    int n = pack_list(m, ts);
    size_t total = 0;
    for (int i = 0; i < n; i++) total += round64(es_tensor_pack_size(ts[i]));
    if (total == 0) {   /* nothing to repack in this build or for these types */
        free(ts);
        return ES_OK;
    }
    size_t alloc = (total + ARENA_ALIGN - 1) / ARENA_ALIGN * ARENA_ALIGN;
    /* the copy replaces the mapped pages, but not before it is made */
    int rc = es_mem_check((int64_t)alloc, "model: the repacked weights",
                          "free memory or load a smaller file", err, err_len);
    if (rc != ES_OK) {
        free(ts);
        return (es_status)rc;
    }
    if (posix_memalign(&mi->arena, ARENA_ALIGN, alloc) != 0) {
        mi->arena = NULL;
        free(ts);
        char sz[32];
        es_set_err(err, err_len, "model: out of memory repacking the weights (%s)", es_size_str((double)alloc, sz));
        return ES_ERR_NOMEM;
    }
#ifdef MADV_HUGEPAGE
    madvise(mi->arena, alloc, MADV_HUGEPAGE);
#endif
    long page = sysconf(_SC_PAGESIZE);
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        es_tensor *t = ts[i];
        size_t bytes = es_tensor_pack_size(t);
        if (bytes == 0 || es_tensor_pack_into(t, (uint8_t *)mi->arena + off) != 1) continue;
        off += round64(bytes);
        if (page > 0) {   /* the mapped bytes are not read again (see above) */
            uintptr_t a = ((uintptr_t)t->data + (uintptr_t)page - 1) & ~((uintptr_t)page - 1);
            uintptr_t e = ((uintptr_t)t->data + t->nbytes) & ~((uintptr_t)page - 1);
            if (e > a) madvise((void *)a, e - a, MADV_DONTNEED);
        }
    }
    free(ts);
    return ES_OK;
}

/* The per-architecture constants of the forward pass. The attention scale
 * is llama.cpp's: 1 / sqrt(head_dim), except Gemma 3 27B (62 layers; its
 * query_pre_attn_scalar is n_embd / n_head), as gemma_pytorch's config. */
static void set_arch_math(es_model *m) {
    const es_model_info *in = &m->info;
    bool gemma = arch_of(in->arch)->gemma;
    m->emb_scale = gemma ? sqrtf((float)in->n_embd) : 0.0f;
    m->gelu = gemma;
    m->attn_scale = gemma && in->n_layer == 62 ? 1.0f / sqrtf((float)(in->n_embd / in->n_head))
                                               : 1.0f / sqrtf((float)in->head_dim);
}

/* See echospec_engine.h. On failure *out is NULL, the file is unmapped and
 * every partial allocation is freed (es_model_free accepts a half-built model). */
es_status es_model_load(const char *path, const es_model_params *params, es_model **out,
                        char *err, size_t err_len) {
    if (out != NULL) *out = NULL;
    const int32_t known = ES_MODEL_NO_REPACK | ES_MODEL_CHECK_WEIGHTS;
    if (path == NULL || out == NULL || (params != NULL && (params->flags & ~known) != 0)) {
        es_set_err(err, err_len, "model: path and out must not be NULL and params->flags may hold only "
                   "ES_MODEL_NO_REPACK and ES_MODEL_CHECK_WEIGHTS");
        return ES_ERR_INVALID_ARG;
    }
    model_impl *mi = calloc(1, sizeof *mi);
    if (mi == NULL) {
        es_set_err(err, err_len, "model: out of memory");
        return ES_ERR_NOMEM;
    }
    es_model *m = &mi->pub;
    es_status st = es_gguf_open(path, &m->gguf, err, err_len);
    loader ld = { .g = m->gguf, .arch = NULL, .err = err, .err_len = err_len };
    if (st == ES_OK) st = read_arch(&ld, &m->info);
    if (st == ES_OK) st = read_hparams(&ld, &m->info);
    if (st == ES_OK) st = bind_all(&ld, m);
    if (st == ES_OK) st = read_swa_layers(&ld, m);
    if (st == ES_OK) set_arch_math(m);
    if (st == ES_OK)   /* before the repack, which releases the mapped pages it reads */
        st = es_check_weights(m->gguf, params != NULL && (params->flags & ES_MODEL_CHECK_WEIGHTS), err, err_len);
    if (st == ES_OK) st = build_pool(mi, err, err_len);
    if (st == ES_OK && !(params != NULL && (params->flags & ES_MODEL_NO_REPACK)))
        st = pack_weights(mi, err, err_len);
    if (st != ES_OK) {
        es_model_free(m);
        return st;
    }
    m->info.weight_bytes = step_bytes(m, &m->info.file_weight_bytes);
    *out = m;
    return ES_OK;
}

/* Free the model, its float pool, layer table and mapping. NULL is a no-op. */
void es_model_free(es_model *model) {
    if (model == NULL) return;
    model_impl *mi = (model_impl *)model;
    free(mi->vec_off);
    free(model->f32_pool);
    free(model->layers);
    free(model->expert_views);
    es_gguf_close(model->gguf);
    free(mi->arena);
    free(mi);
}

/* Copy the hyperparameters; ES_ERR_INVALID_ARG (and *info untouched) when either is NULL. */
es_status es_model_get_info(const es_model *model, es_model_info *info) {
    if (model == NULL || info == NULL) return ES_ERR_INVALID_ARG;
    *info = model->info;
    return ES_OK;
}

/* Float view of a 1-D tensor of this model (norm or bias), [t->n_elements]
 * floats owned by the model; NULL when t is NULL or not such a tensor. */
const float *es_model_vec(const es_model *m, const es_tensor *t) {
    if (m == NULL || t == NULL || m->gguf == NULL) return NULL;
    const model_impl *mi = (const model_impl *)m;
    const es_tensor *base = m->gguf->tensors;
    if (t < base || t >= base + m->gguf->n_tensors) return NULL;
    int64_t off = mi->vec_off[t - base];
    return off < 0 ? NULL : m->f32_pool + off;
}
