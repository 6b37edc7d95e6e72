/*
 * test_gguf.c - the GGUF reader and model loading against files written
 * byte by byte here: a valid tiny llama/qwen2/qwen3 model, and corruptions of
 * it (every truncation point of the metadata, counts near 2^64, bad offsets,
 * alignments, types, versions, names, shapes). Each error case checks the
 * status and that the message names the field.
 *
 * The real SmolLM2 file is checked when present (its absence is reported and
 * that single check is not counted; the Python suite covers it).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "internal.h"

#define MAX_T 64
#define REAL_MODEL_NAME "SmolLM2-135M-Instruct.Q4_1.gguf"   /* scripts/fetch_model.py's default */

static char g_dir[64];
static char g_path[96];

/* ---- a growable byte buffer -------------------------------------------- */

typedef struct {
    uint8_t *p;
    size_t n, cap;
} buf;

static void put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (b->p == NULL) abort();
    }
    if (n) memcpy(b->p + b->n, src, n);
    b->n += n;
}
static void put_u32(buf *b, uint32_t v) { put(b, &v, 4); }
static void put_u64(buf *b, uint64_t v) { put(b, &v, 8); }
static void put_str(buf *b, const char *s) { put_u64(b, strlen(s)); put(b, s, strlen(s)); }
static void patch_u32(buf *b, size_t pos, uint32_t v) { memcpy(b->p + pos, &v, 4); }
static void patch_u64(buf *b, size_t pos, uint64_t v) { memcpy(b->p + pos, &v, 8); }

/* ---- a GGUF builder ---------------------------------------------------- */

typedef struct {
    char name[48];
    int n_dims;
    int64_t ne[4];
    uint32_t type;
    float fill;         /* value of every element of F32/F16/BF16 tensors */
} tdesc;

typedef struct {
    uint32_t version;
    uint64_t align;     /* layout alignment */
    buf kv;             /* serialized KV pairs */
    uint64_t n_kv;
    tdesc t[MAX_T];
    int n_t;
    /* offsets inside kv (add layout.kv_start for the file offset) */
    size_t pos_arch_strlen, pos_tokens_arrlen, pos_tokens_elem5;
} gbuild;

typedef struct {
    size_t kv_start, ti_start, info_end, data_start, size;
    size_t ti_pos[MAX_T], ti_ndims[MAX_T], ti_ne[MAX_T], ti_type[MAX_T], ti_off[MAX_T];
} layout;

/* Sizes written by the test, independent of gguf.c's table. */
static size_t t_nbytes(const tdesc *t) {
    int64_t n = t->ne[0] * t->ne[1] * t->ne[2] * t->ne[3];
    switch (t->type) {
    case ES_TYPE_F32: return (size_t)n * 4;
    case ES_TYPE_F16: case ES_TYPE_BF16: return (size_t)n * 2;
    case ES_TYPE_Q4_0: return (size_t)n / 32 * 18;
    case ES_TYPE_Q8_0: return (size_t)n / 32 * 34;
    default: return 0;
    }
}

static void kv_key(gbuild *g, const char *key, uint32_t type) {
    put_str(&g->kv, key);
    put_u32(&g->kv, type);
    g->n_kv++;
}
static void kv_u32(gbuild *g, const char *key, uint32_t v) { kv_key(g, key, GGUF_T_UINT32); put_u32(&g->kv, v); }
static void kv_u64(gbuild *g, const char *key, uint64_t v) { kv_key(g, key, GGUF_T_UINT64); put_u64(&g->kv, v); }
static void kv_i32(gbuild *g, const char *key, int32_t v) { kv_key(g, key, GGUF_T_INT32); put(&g->kv, &v, 4); }
static void kv_f32(gbuild *g, const char *key, float v) { kv_key(g, key, GGUF_T_FLOAT32); put(&g->kv, &v, 4); }
static void kv_u8(gbuild *g, const char *key, uint8_t v) { kv_key(g, key, GGUF_T_UINT8); put(&g->kv, &v, 1); }
/* An array of n elements of `type`, each `esz` zero bytes (not for strings). */
static void kv_zero_array(gbuild *g, const char *key, uint32_t type, size_t esz, uint64_t n) {
    kv_key(g, key, GGUF_T_ARRAY);
    put_u32(&g->kv, type);
    put_u64(&g->kv, n);
    uint8_t z[8] = { 0 };
    for (uint64_t i = 0; i < n; i++) put(&g->kv, z, esz);
}
static size_t kv_str(gbuild *g, const char *key, const char *v) {
    kv_key(g, key, GGUF_T_STRING);
    size_t pos = g->kv.n;
    put_str(&g->kv, v);
    return pos;
}

static void add_t(gbuild *g, const char *name, int n_dims, int64_t ne0, int64_t ne1, uint32_t type,
                  float fill) {
    tdesc *t = &g->t[g->n_t++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->n_dims = n_dims;
    t->ne[0] = ne0; t->ne[1] = ne1; t->ne[2] = 1; t->ne[3] = 1;
    t->type = type;
    t->fill = fill;
}

static tdesc *find_t(gbuild *g, const char *name) {
    for (int i = 0; i < g->n_t; i++) if (strcmp(g->t[i].name, name) == 0) return &g->t[i];
    return NULL;
}

static void remove_t(gbuild *g, const char *name) {
    tdesc *t = find_t(g, name);
    if (t == NULL) abort();
    *t = g->t[--g->n_t];
}

static void fill_data(buf *b, const tdesc *t) {
    size_t nb = t_nbytes(t);
    size_t n = (size_t)(t->ne[0] * t->ne[1]);
    for (size_t i = 0; i < n && t->type == ES_TYPE_F32; i++) put(b, &t->fill, 4);
    for (size_t i = 0; i < n && (t->type == ES_TYPE_F16 || t->type == ES_TYPE_BF16); i++) {
        uint16_t h;
        if (t->type == ES_TYPE_F16) {
            h = es_fp32_to_fp16(t->fill);
        } else {
            uint32_t bits;
            memcpy(&bits, &t->fill, 4);
            h = (uint16_t)(bits >> 16);
        }
        put(b, &h, 2);
    }
    if (t->type != ES_TYPE_F32 && t->type != ES_TYPE_F16 && t->type != ES_TYPE_BF16) {
        uint8_t z[64] = { 0 };
        for (size_t left = nb; left > 0;) {
            size_t k = left < sizeof z ? left : sizeof z;
            put(b, z, k);
            left -= k;
        }
    }
}

static void pad_to(buf *b, uint64_t align) {
    uint8_t z = 0;
    while (b->n % align) put(b, &z, 1);
}

/* Serialize: header, KVs, tensor infos, padding, data. *L gets the offsets. */
static buf build(const gbuild *g, layout *L) {
    buf b = { 0 };
    memset(L, 0, sizeof *L);
    put(&b, "GGUF", 4);
    put_u32(&b, g->version);
    put_u64(&b, (uint64_t)g->n_t);
    put_u64(&b, g->n_kv);
    L->kv_start = b.n;
    put(&b, g->kv.p, g->kv.n);
    L->ti_start = b.n;
    uint64_t off = 0;
    for (int i = 0; i < g->n_t; i++) {
        const tdesc *t = &g->t[i];
        L->ti_pos[i] = b.n;
        put_str(&b, t->name);
        L->ti_ndims[i] = b.n;
        put_u32(&b, (uint32_t)t->n_dims);
        L->ti_ne[i] = b.n;
        for (int d = 0; d < t->n_dims; d++) put_u64(&b, (uint64_t)t->ne[d]);
        L->ti_type[i] = b.n;
        put_u32(&b, t->type);
        L->ti_off[i] = b.n;
        put_u64(&b, off);
        off += (t_nbytes(t) + g->align - 1) / g->align * g->align;
    }
    L->info_end = b.n;
    pad_to(&b, g->align);
    L->data_start = b.n;
    for (int i = 0; i < g->n_t; i++) {
        fill_data(&b, &g->t[i]);
        pad_to(&b, g->align);
    }
    L->size = b.n;
    return b;
}

/* Tiny model options (a zeroed struct gives the valid llama default). */
typedef struct {
    const char *arch;           /* NULL: "llama" */
    int64_t block_count;        /* 0: 2 */
    int64_t head_count_kv;      /* 0: 2 */
    int n_tokens;               /* 0: n_vocab */
    bool alignment_kv;          /* write general.alignment = alignment */
    uint64_t alignment;
    bool dup_key;
    bool no_eps;
} tiny_opts;

enum { T_EMBD = 32, T_FF = 64, T_HEAD = 4, T_HD = 8, T_VOCAB = 64, T_LAYER = 2 };

static void tiny_kvs(gbuild *g, const tiny_opts *o, const char *arch) {
    char key[96];
    g->pos_arch_strlen = kv_str(g, "general.architecture", arch);
    if (o->alignment_kv) kv_u32(g, "general.alignment", (uint32_t)o->alignment);
#define K(s) (snprintf(key, sizeof key, "%s.%s", arch, s), key)
    kv_u64(g, K("block_count"), (uint64_t)(o->block_count ? o->block_count : T_LAYER));
    kv_u32(g, K("context_length"), 256);
    kv_i32(g, K("embedding_length"), T_EMBD);
    kv_u32(g, K("feed_forward_length"), T_FF);
    kv_u32(g, K("attention.head_count"), T_HEAD);
    kv_u32(g, K("attention.head_count_kv"), (uint32_t)(o->head_count_kv ? o->head_count_kv : 2));
    kv_f32(g, K("rope.freq_base"), 50000.0f);
    if (!o->no_eps) kv_f32(g, K("attention.layer_norm_rms_epsilon"), 1e-6f);
    if (o->dup_key) kv_u32(g, K("context_length"), 512);
#undef K
    int n_tok = o->n_tokens ? o->n_tokens : T_VOCAB;
    kv_key(g, "tokenizer.ggml.tokens", GGUF_T_ARRAY);
    put_u32(&g->kv, GGUF_T_STRING);
    g->pos_tokens_arrlen = g->kv.n;
    put_u64(&g->kv, (uint64_t)n_tok);
    for (int i = 0; i < n_tok; i++) {
        char s[16];
        snprintf(s, sizeof s, "t%d", i);
        if (i == 5) g->pos_tokens_elem5 = g->kv.n;
        put_str(&g->kv, s);
    }
}

static void tiny_model(gbuild *g, const tiny_opts *o) {
    memset(g, 0, sizeof *g);
    const char *arch = o->arch ? o->arch : "llama";
    g->version = 3;
    g->align = (o->alignment_kv && o->alignment && !(o->alignment & (o->alignment - 1)))
                   ? o->alignment : 32;
    tiny_kvs(g, o, arch);
    const int E = T_EMBD, Q = T_HEAD * T_HD, KV = 2 * T_HD;
    add_t(g, "token_embd.weight", 2, E, T_VOCAB, ES_TYPE_Q8_0, 0);
    add_t(g, "output_norm.weight", 1, E, 1, ES_TYPE_F32, 2.0f);
    for (int il = 0; il < T_LAYER; il++) {
        char n[48];
#define L(s) (snprintf(n, sizeof n, "blk.%d.%s", il, s), n)
        add_t(g, L("attn_norm.weight"), 1, E, 1, il == 1 ? ES_TYPE_F16 : ES_TYPE_F32, 0.5f);
        add_t(g, L("attn_q.weight"), 2, E, Q, ES_TYPE_Q4_0, 0);
        add_t(g, L("attn_k.weight"), 2, E, KV, ES_TYPE_Q4_0, 0);
        add_t(g, L("attn_v.weight"), 2, E, KV, ES_TYPE_Q8_0, 0);
        add_t(g, L("attn_output.weight"), 2, Q, E, ES_TYPE_Q4_0, 0);
        add_t(g, L("ffn_norm.weight"), 1, E, 1, ES_TYPE_BF16, 1.5f);
        add_t(g, L("ffn_gate.weight"), 2, E, T_FF, ES_TYPE_Q4_0, 0);
        add_t(g, L("ffn_up.weight"), 2, E, T_FF, ES_TYPE_Q4_0, 0);
        add_t(g, L("ffn_down.weight"), 2, T_FF, E, ES_TYPE_F16, 0);
        if (o->arch && strcmp(o->arch, "qwen2") == 0) {
            add_t(g, L("attn_q.bias"), 1, Q, 1, ES_TYPE_F32, 0.25f);
            add_t(g, L("attn_k.bias"), 1, KV, 1, ES_TYPE_F32, 0.25f);
            add_t(g, L("attn_v.bias"), 1, KV, 1, ES_TYPE_F32, 0.25f);
        }
        if (o->arch && strcmp(o->arch, "qwen3") == 0) {
            add_t(g, L("attn_q_norm.weight"), 1, T_HD, 1, ES_TYPE_F32, 3.0f);
            add_t(g, L("attn_k_norm.weight"), 1, T_HD, 1, ES_TYPE_F32, 3.0f);
        }
#undef L
    }
}

/* ---- running the reader on bytes --------------------------------------- */

static void write_file(const void *p, size_t n) {
    FILE *f = fopen(g_path, "wb");
    if (f == NULL) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    fclose(f);
}

static char g_err[512];

static es_status open_bytes(const buf *b, size_t n) {
    write_file(b->p, n);
    es_gguf *g = NULL;
    g_err[0] = '\0';
    es_status st = es_gguf_open(g_path, &g, g_err, sizeof g_err);
    if ((st == ES_OK) != (g != NULL)) st = ES_ERR_INTERNAL;
    es_gguf_close(g);
    return st;
}

static es_status load_bytes(const buf *b, es_model **out) {
    write_file(b->p, b->n);
    es_model *m = NULL;
    g_err[0] = '\0';
    es_status st = es_model_load(g_path, NULL, &m, g_err, sizeof g_err);
    if ((st == ES_OK) != (m != NULL)) st = ES_ERR_INTERNAL;
    if (out != NULL) *out = m;
    else es_model_free(m);
    return st;
}

/* Load a tiny model built with o, expect status `want` and `needle` in the message. */
static bool expect_load(const gbuild *g, es_status want, const char *needle) {
    layout L;
    buf b = build(g, &L);
    es_status st = load_bytes(&b, NULL);
    free(b.p);
    bool ok = st == want && (needle == NULL || strstr(g_err, needle) != NULL);
    if (!ok) fprintf(stderr, "  got status %d, message \"%s\"; want %d with \"%s\"\n", st, g_err,
                     want, needle ? needle : "");
    return ok;
}

static void gfree(gbuild *g) { free(g->kv.p); }

#define CHECK_MSG(needle) do { CHECK(strstr(g_err, (needle)) != NULL); \
    if (strstr(g_err, (needle)) == NULL) fprintf(stderr, "  message: %s\n", g_err); } while (0)

/* ---- valid files ------------------------------------------------------- */

TEST(tiny_llama_loads) {
    gbuild g;
    tiny_opts o = { .no_eps = true };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    es_model *m = NULL;
    CHECK_EQ_INT(load_bytes(&b, &m), ES_OK);
    if (m != NULL) {
        es_model_info i;
        CHECK_EQ_INT(es_model_get_info(m, &i), ES_OK);
        CHECK(strcmp(i.arch, "llama") == 0);
        CHECK_EQ_INT(i.n_vocab, T_VOCAB);
        CHECK_EQ_INT(i.n_ctx_train, 256);
        CHECK_EQ_INT(i.n_embd, T_EMBD);
        CHECK_EQ_INT(i.n_layer, T_LAYER);
        CHECK_EQ_INT(i.n_head, T_HEAD);
        CHECK_EQ_INT(i.n_head_kv, 2);
        CHECK_EQ_INT(i.head_dim, T_HD);
        CHECK_EQ_INT(i.n_ff, T_FF);
        CHECK_EQ_INT(i.rope_dim, T_HD);
        CHECK_EQ_INT(i.rope_neox, 0);
        CHECK_EQ_INT(i.tied_output, 1);
        CHECK(i.rope_freq_base == 50000.0f);
        CHECK(i.norm_eps == 1e-5f);        /* llama default */
        /* per step: output (= token_embd) + output_norm + all layer tensors */
        int64_t want = 0;
        for (int k = 0; k < g.n_t; k++) want += (int64_t)t_nbytes(&g.t[k]);
        CHECK_EQ_INT(i.weight_bytes, want);
        CHECK(m->output == m->tok_embd);
        const float *v = es_model_vec(m, m->output_norm);
        CHECK(v != NULL && v[0] == 2.0f && v[T_EMBD - 1] == 2.0f);
        v = es_model_vec(m, m->layers[1].attn_norm);       /* F16 */
        CHECK(v != NULL && v[0] == 0.5f && v[T_EMBD - 1] == 0.5f);
        v = es_model_vec(m, m->layers[0].ffn_norm);        /* BF16 */
        CHECK(v != NULL && v[0] == 1.5f && v[T_EMBD - 1] == 1.5f);
        CHECK(es_model_vec(m, m->layers[0].wq) == NULL);   /* matrices have no float view */
        CHECK(m->layers[0].bq == NULL && m->layers[0].q_norm == NULL);
        CHECK_EQ_INT(m->layers[0].wq->row_bytes, T_EMBD / 32 * 18);
        CHECK((uintptr_t)m->layers[0].wq->data % 32 == 0);
        CHECK(es_gguf_find_kv(m->gguf, "llama.context_length") != NULL);
        CHECK(es_gguf_find_kv(m->gguf, "nope") == NULL);
        CHECK(es_gguf_find_tensor(m->gguf, "blk.2.attn_q.weight") == NULL);
    }
    es_model_free(m);
    free(b.p);
    gfree(&g);
}

TEST(untied_output_and_v2) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    g.version = 2;
    add_t(&g, "output.weight", 2, T_EMBD, T_VOCAB, ES_TYPE_Q4_0, 0);
    layout L;
    buf b = build(&g, &L);
    es_model *m = NULL;
    CHECK_EQ_INT(load_bytes(&b, &m), ES_OK);
    if (m != NULL) {
        CHECK_EQ_INT(m->info.tied_output, 0);
        CHECK(m->output != m->tok_embd && m->output != NULL);
        CHECK(m->info.norm_eps == 1e-6f);
    }
    es_model_free(m);
    free(b.p);
    gfree(&g);
}

TEST(qwen2_and_qwen3_load) {
    gbuild g;
    tiny_opts o = { .arch = "qwen2", .no_eps = true };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    es_model *m = NULL;
    CHECK_EQ_INT(load_bytes(&b, &m), ES_OK);
    if (m != NULL) {
        CHECK_EQ_INT(m->info.rope_neox, 1);
        CHECK(m->info.norm_eps == 1e-6f);          /* qwen default */
        const float *v = es_model_vec(m, m->layers[1].bk);
        CHECK(v != NULL && v[0] == 0.25f && v[2 * T_HD - 1] == 0.25f);
    }
    es_model_free(m);
    free(b.p);
    gfree(&g);

    o.arch = "qwen3";
    tiny_model(&g, &o);
    b = build(&g, &L);
    CHECK_EQ_INT(load_bytes(&b, &m), ES_OK);
    if (m != NULL) {
        CHECK_EQ_INT(m->info.rope_neox, 1);
        const float *v = es_model_vec(m, m->layers[1].k_norm);
        CHECK(v != NULL && v[0] == 3.0f && v[T_HD - 1] == 3.0f);
    }
    es_model_free(m);
    free(b.p);
    gfree(&g);
}

TEST(custom_alignment_loads) {
    gbuild g;
    tiny_opts o = { .alignment_kv = true, .alignment = 256 };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    es_model *m = NULL;
    CHECK_EQ_INT(load_bytes(&b, &m), ES_OK);
    if (m != NULL) {
        CHECK_EQ_INT(m->gguf->alignment, 256);
        CHECK((uintptr_t)m->layers[1].w_down->data % 256 == 0);
    }
    es_model_free(m);
    free(b.p);
    gfree(&g);
}

/* ---- truncation -------------------------------------------------------- */

TEST(cut_at_every_metadata_byte) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    int bad = 0;
    write_file(b.p, b.n);
    for (size_t cut = L.data_start; cut-- > 0;) {     /* shrink one file: no rewrites */
        if (truncate(g_path, (off_t)cut) != 0) abort();
        es_gguf *gg = NULL;
        g_err[0] = '\0';
        es_status st = es_gguf_open(g_path, &gg, g_err, sizeof g_err);
        if (st != ES_ERR_FORMAT || gg != NULL || strstr(g_err, "truncated") == NULL) {
            if (bad++ < 5) fprintf(stderr, "  cut %zu: status %d, \"%s\"\n", cut, st, g_err);
        }
        es_gguf_close(gg);
    }
    CHECK_EQ_INT(bad, 0);
    /* inside the data: every tensor's end */
    size_t cuts[] = { L.data_start + 1, L.size - 1, L.size - 32, (L.data_start + L.size) / 2 };
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        CHECK_EQ_INT(open_bytes(&b, cuts[i]), ES_ERR_FORMAT);
        CHECK_MSG("past the end");
        write_file(b.p, cuts[i]);
        es_model *m = (es_model *)1;
        CHECK_EQ_INT(es_model_load(g_path, NULL, &m, g_err, sizeof g_err), ES_ERR_FORMAT);
        CHECK(m == NULL);
    }
    CHECK_EQ_INT(open_bytes(&b, L.size), ES_OK);
    free(b.p);
    gfree(&g);
}

TEST(truncation_messages_name_the_field) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    CHECK_EQ_INT(open_bytes(&b, 0), ES_ERR_FORMAT);
    CHECK_MSG("header (magic)");
    CHECK_EQ_INT(open_bytes(&b, 10), ES_ERR_FORMAT);
    CHECK_MSG("header (tensor count)");
    CHECK_EQ_INT(open_bytes(&b, 20), ES_ERR_FORMAT);
    CHECK_MSG("header (kv count)");
    CHECK_EQ_INT(open_bytes(&b, L.ti_pos[3] + 4), ES_ERR_FORMAT);
    CHECK_MSG("tensor info 3 (name length)");
    CHECK_EQ_INT(open_bytes(&b, L.ti_ne[3] + 9), ES_ERR_FORMAT);
    CHECK_MSG("(ne[1])");
    CHECK_EQ_INT(open_bytes(&b, L.ti_off[3] + 2), ES_ERR_FORMAT);
    CHECK_MSG("(offset)");
    CHECK_EQ_INT(open_bytes(&b, 100), ES_ERR_FORMAT);
    CHECK_MSG("truncated or corrupt header: kv count 10 cannot fit in the 100 bytes");
    CHECK_EQ_INT(open_bytes(&b, 500), ES_ERR_FORMAT);
    CHECK_MSG("truncated or corrupt header: tensor count 20 cannot fit in the 500 bytes");
    CHECK_EQ_INT(open_bytes(&b, L.ti_start - 3), ES_ERR_FORMAT);
    CHECK_MSG("truncated while reading kv 9 'tokenizer.ggml.tokens' (array element 63 string)");
    free(b.p);
    gfree(&g);
}

/* ---- absurd counts and lengths ----------------------------------------- */

/* Patch a u64/u32 in a valid tiny llama and expect status + needle from es_gguf_open. */
static bool patched(size_t pos_kind, int which, uint64_t v, int width, es_status want,
                    const char *needle) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    size_t pos = 0;
    switch (pos_kind) {
    case 0: pos = (size_t)which; break;                              /* absolute */
    case 1: pos = L.kv_start + (size_t)which; break;                 /* inside kv */
    case 2: pos = L.ti_ndims[which]; break;
    case 3: pos = L.ti_ne[which]; break;
    case 4: pos = L.ti_ne[which] + 8; break;                         /* ne[1] */
    case 5: pos = L.ti_type[which]; break;
    case 6: pos = L.ti_off[which]; break;
    case 7: pos = L.ti_pos[which]; break;                            /* name length */
    }
    if (width == 4) patch_u32(&b, pos, (uint32_t)v);
    else patch_u64(&b, pos, v);
    es_status st = open_bytes(&b, b.n);
    bool ok = st == want && strstr(g_err, needle) != NULL;
    if (!ok) fprintf(stderr, "  patch %zu/%d = %llu: status %d, \"%s\"; want %d \"%s\"\n",
                     pos_kind, which, (unsigned long long)v, st, g_err, want, needle);
    free(b.p);
    gfree(&g);
    return ok;
}

TEST(counts_near_2_pow_64) {
    const uint64_t M = UINT64_MAX;
    CHECK(patched(0, 8, M, 8, ES_ERR_FORMAT, "tensor count"));
    CHECK(patched(0, 8, 600, 8, ES_ERR_FORMAT, "tensor info 20"));
    CHECK(patched(0, 16, M - 1, 8, ES_ERR_FORMAT, "kv count"));
    CHECK(patched(0, 16, 1ULL << 63, 8, ES_ERR_FORMAT, "kv count"));
    CHECK(patched(1, 0, M, 8, ES_ERR_FORMAT, "kv 0 (key)"));                    /* key length */
    CHECK(patched(1, 0, 0, 8, ES_ERR_FORMAT, "empty key"));
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    size_t arch = g.pos_arch_strlen, arr = g.pos_tokens_arrlen, el5 = g.pos_tokens_elem5;
    gfree(&g);
    CHECK(patched(1, (int)arch, M, 8, ES_ERR_FORMAT, "(string)"));
    CHECK(patched(1, (int)arch, M - 7, 8, ES_ERR_FORMAT, "'general.architecture' (string)"));
    CHECK(patched(1, (int)arr, M, 8, ES_ERR_FORMAT, "array length"));
    CHECK(patched(1, (int)arr, M / 8 + 1, 8, ES_ERR_FORMAT, "array length"));   /* * 8 wraps */
    CHECK(patched(1, (int)arr, 1ULL << 62, 8, ES_ERR_FORMAT, "array length"));
    CHECK(patched(1, (int)el5, M, 8, ES_ERR_FORMAT, "array element 5 string"));
    CHECK(patched(1, (int)arr - 4, 99, 4, ES_ERR_FORMAT, "array element type"));
    CHECK(patched(1, (int)arr - 4, GGUF_T_ARRAY, 4, ES_ERR_UNSUPPORTED, "nested arrays"));
    CHECK(patched(1, (int)arr - 8, 13, 4, ES_ERR_FORMAT, "unknown value type 13"));
    CHECK(patched(7, 2, M, 8, ES_ERR_FORMAT, "tensor info 2 (name)"));
    CHECK(patched(2, 2, 0xffffffffu, 4, ES_ERR_FORMAT, "n_dims = 4294967295"));
    CHECK(patched(2, 2, 0, 4, ES_ERR_FORMAT, "n_dims = 0"));
    CHECK(patched(2, 2, 5, 4, ES_ERR_FORMAT, "n_dims = 5"));
    /* tensor 3 is blk.0.attn_q.weight, Q4_0 [32, 32] */
    CHECK(patched(3, 3, M, 8, ES_ERR_FORMAT, "'blk.0.attn_q.weight': ne[0] = 18446744073709551615"));
    CHECK(patched(4, 3, M, 8, ES_ERR_FORMAT, "ne[1] = 18446744073709551615"));
    CHECK(patched(4, 3, 0, 8, ES_ERR_FORMAT, "ne[1] = 0"));
    CHECK(patched(4, 3, 1ULL << 62, 8, ES_ERR_FORMAT, "overflows"));           /* 32 * 2^62 */
    CHECK(patched(4, 3, 1ULL << 40, 8, ES_ERR_FORMAT, "past the end"));        /* fits, too big */
    CHECK(patched(3, 3, 33, 8, ES_ERR_FORMAT, "ne[0] = 33 is not a multiple of the Q4_0 block"));
}

TEST(offsets_and_alignment) {
    CHECK(patched(6, 5, 1ULL << 40, 8, ES_ERR_FORMAT, "data offset 1099511627776"));
    CHECK(patched(6, 5, UINT64_MAX & ~31ULL, 8, ES_ERR_FORMAT, "past the end"));
    CHECK(patched(6, 5, 33, 8, ES_ERR_FORMAT, "not a multiple of the alignment 32"));
    uint64_t bad[] = { 0, 3, 48, 0xffffffffu };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        gbuild g;
        tiny_opts o = { .alignment_kv = true, .alignment = bad[i] };
        tiny_model(&g, &o);
        CHECK(expect_load(&g, ES_ERR_FORMAT, "general.alignment"));
        gfree(&g);
    }
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    kv_str(&g, "general.alignment", "32");
    CHECK(expect_load(&g, ES_ERR_FORMAT, "key 'general.alignment' has value type STRING (8)"));
    gfree(&g);
}

TEST(types_versions_magic) {
    CHECK(patched(5, 3, 99, 4, ES_ERR_UNSUPPORTED, "'blk.0.attn_q.weight' has unknown type id 99"));
    CHECK(patched(5, 3, ES_TYPE_Q2_K, 4, ES_ERR_UNSUPPORTED, "type Q2_K (id 10)"));
    CHECK(patched(0, 4, 1, 4, ES_ERR_UNSUPPORTED, "version 1"));
    CHECK(patched(0, 4, 4, 4, ES_ERR_UNSUPPORTED, "version 4"));
    CHECK(patched(0, 4, 0x03000000u, 4, ES_ERR_UNSUPPORTED, "version"));   /* big-endian v3 */
    CHECK(patched(0, 0, 0x47475546u, 4, ES_ERR_FORMAT, "bad magic 46 55 47 47"));  /* "FUGG" */
    CHECK(strcmp(es_type_name(ES_TYPE_Q5_K), "Q5_K") == 0);
    CHECK(strcmp(es_type_name(77), "unknown") == 0);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q5_0), 22);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q5_1), 24);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q5_K), 176);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q6_K), 210);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q4_K), 144);
    CHECK_EQ_INT(es_type_block_elems(ES_TYPE_Q4_K), 256);
    CHECK_EQ_INT(es_type_block_elems(ES_TYPE_BF16), 1);
    CHECK_EQ_INT(es_type_block_bytes(ES_TYPE_Q2_K), 0);
    CHECK_EQ_INT(es_type_block_elems(ES_TYPE_Q8_K), 0);
}

TEST(names_and_keys) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    snprintf(find_t(&g, "blk.1.ffn_up.weight")->name, 48, "blk.0.ffn_up.weight");
    CHECK(expect_load(&g, ES_ERR_FORMAT, "duplicate tensor name 'blk.0.ffn_up.weight'"));
    gfree(&g);
    tiny_opts od = { .dup_key = true };
    tiny_model(&g, &od);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "duplicate key 'llama.context_length'"));
    gfree(&g);
}


/* ---- tensor regions and the data section -------------------------------- */

/* Build the valid tiny llama, let `edit` change the bytes, expect es_gguf_open
 * to fail with ES_ERR_FORMAT and every needle in the message. */
static bool expect_open_edit(void (*edit)(buf *, const layout *), const char *n1, const char *n2) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    edit(&b, &L);
    es_status st = open_bytes(&b, b.n);
    bool ok = st == ES_ERR_FORMAT && strstr(g_err, n1) != NULL && (n2 == NULL || strstr(g_err, n2));
    if (!ok) fprintf(stderr, "  status %d, \"%s\"; want %d \"%s\" \"%s\"\n", st, g_err,
                     ES_ERR_FORMAT, n1, n2 ? n2 : "");
    free(b.p);
    gfree(&g);
    return ok;
}

static uint64_t get_u64(const buf *b, size_t pos) {
    uint64_t v;
    memcpy(&v, b->p + pos, 8);
    return v;
}

/* tensor 5 (blk.0.attn_v.weight) at the offset of tensor 4 (blk.0.attn_k.weight) */
static void same_offset(buf *b, const layout *L) { patch_u64(b, L->ti_off[5], get_u64(b, L->ti_off[4])); }
/* tensor 2 (blk.0.attn_norm.weight, 128 bytes) inside tensor 0 (token_embd, 2176 bytes) */
static void inside(buf *b, const layout *L) { patch_u64(b, L->ti_off[2], 1024); }
/* tensor 3 (blk.0.attn_q.weight, Q4_0 [32, 32]) declared [64, 32]: needs 1152 bytes, has 576 */
static void too_short(buf *b, const layout *L) { patch_u64(b, L->ti_ne[3], 64); }
/* the same region, type Q8_0 instead of Q4_0: needs 1088 bytes */
static void wrong_type(buf *b, const layout *L) { patch_u32(b, L->ti_type[3], ES_TYPE_Q8_0); }
/* the data written right after the tensor infos (no padding), the file then
 * filled up with trailing bytes to its old size: every tensor stays in bounds.
 * The first block's scale is made nonzero, as real weights are (all-zero
 * leading data and fewer than `alignment` trailing bytes would be a valid
 * file with other contents). */
static void unpadded(buf *b, const layout *L) {
    size_t pad = L->data_start - L->info_end;
    if (pad == 0) abort();   /* the tiny model's infos do not end aligned */
    b->p[L->data_start + 1] = 0x3c;
    memmove(b->p + L->info_end, b->p + L->data_start, b->n - L->data_start);
    memset(b->p + b->n - pad, 0xee, pad);
}
static void nonzero_padding(buf *b, const layout *L) { b->p[L->data_start - 1] = 0x01; }
static void trailing(buf *b, const layout *L) {
    uint8_t z[64];
    memset(z, 0x55, sizeof z);
    put(b, z, sizeof z);
}

TEST(regions_and_data_section) {
    CHECK(expect_open_edit(same_offset, "tensors 'blk.0.attn_k.weight' and 'blk.0.attn_v.weight' "
                                        "overlap", NULL));
    CHECK(expect_open_edit(inside, "tensors 'token_embd.weight' and 'blk.0.attn_norm.weight' overlap",
                           "needs 2176 bytes"));
    CHECK(expect_open_edit(too_short, "'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' overlap",
                           "Q4_0 [64, 32, 1, 1]) needs 1152 bytes"));
    CHECK(expect_open_edit(wrong_type, "'blk.0.attn_q.weight' and 'blk.0.attn_k.weight' overlap",
                           "Q8_0 [32, 32, 1, 1]) needs 1088 bytes"));
    CHECK(expect_open_edit(unpadded, "does not start at the aligned offset", NULL));
    CHECK(expect_open_edit(nonzero_padding, "does not start at the aligned offset", "is 0x01"));
    CHECK(expect_open_edit(trailing, "64 bytes follow the last tensor", NULL));
}

/* ---- value types of the keys read --------------------------------------- */

TEST(key_value_types) {
    gbuild g;
    tiny_opts o = { 0 };
    /* general.alignment as INT32 is an integer like UINT32 (the Python reader agrees) */
    tiny_model(&g, &o);
    kv_i32(&g, "general.alignment", 32);
    CHECK(expect_load(&g, ES_OK, NULL));
    gfree(&g);
    tiny_model(&g, &o);
    kv_f32(&g, "general.alignment", 32.0f);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "key 'general.alignment' has value type FLOAT32"));
    gfree(&g);
    tiny_model(&g, &o);
    kv_zero_array(&g, "tokenizer.ggml.token_type", GGUF_T_FLOAT32, 4, T_VOCAB);
    CHECK(expect_load(&g, ES_ERR_FORMAT,
                      "key 'tokenizer.ggml.token_type' is an array of FLOAT32, expected an array "
                      "of integers"));
    gfree(&g);
    tiny_model(&g, &o);
    kv_zero_array(&g, "tokenizer.ggml.token_type", GGUF_T_INT32, 4, T_VOCAB);
    CHECK(expect_load(&g, ES_OK, NULL));
    gfree(&g);
    tiny_model(&g, &o);
    kv_str(&g, "tokenizer.ggml.eos_token_id", "2");
    CHECK(expect_load(&g, ES_ERR_FORMAT, "key 'tokenizer.ggml.eos_token_id' has value type STRING"));
    gfree(&g);
    tiny_model(&g, &o);
    kv_u8(&g, "tokenizer.ggml.add_bos_token", 1);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "'tokenizer.ggml.add_bos_token' has value type UINT8"));
    gfree(&g);
    tiny_model(&g, &o);
    kv_u32(&g, "tokenizer.ggml.merges", 0);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "'tokenizer.ggml.merges' has value type UINT32 (4), "
                                         "expected an array of strings"));
    gfree(&g);
    /* "{arch}." keys are typed for the file's own architecture only */
    tiny_model(&g, &o);
    kv_str(&g, "qwen2.block_count", "x");
    CHECK(expect_load(&g, ES_OK, NULL));
    gfree(&g);
    tiny_model(&g, &o);
    kv_str(&g, "llama.rope.freq_base", "x");
    CHECK(expect_load(&g, ES_ERR_FORMAT, "'llama.rope.freq_base' has value type STRING (8), "
                                         "expected a number"));
    gfree(&g);
}

/* ---- model-level checks ------------------------------------------------ */

TEST(missing_and_misshaped_tensors) {
    gbuild g;
    tiny_opts o = { 0 };
    tiny_model(&g, &o);
    remove_t(&g, "blk.1.ffn_down.weight");
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "missing tensor 'blk.1.ffn_down.weight'"));
    gfree(&g);
    tiny_model(&g, &o);
    remove_t(&g, "output_norm.weight");
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "'output_norm.weight'"));
    gfree(&g);
    tiny_model(&g, &o);
    find_t(&g, "blk.0.attn_k.weight")->ne[1] = 32;
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR,
                      "'blk.0.attn_k.weight' has shape [32, 32, 1, 1], expected [32, 16]"));
    gfree(&g);
    tiny_model(&g, &o);
    find_t(&g, "blk.1.ffn_norm.weight")->ne[0] = 16;
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "expected [32]"));
    gfree(&g);
    tiny_model(&g, &o);
    find_t(&g, "blk.0.attn_norm.weight")->type = ES_TYPE_Q8_0;
    CHECK(expect_load(&g, ES_ERR_UNSUPPORTED, "'blk.0.attn_norm.weight' has type Q8_0"));
    gfree(&g);
    tiny_opts q2 = { .arch = "qwen2" };
    tiny_model(&g, &q2);
    remove_t(&g, "blk.1.attn_v.bias");
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "missing tensor 'blk.1.attn_v.bias'"));
    gfree(&g);
    tiny_opts q3 = { .arch = "qwen3" };
    tiny_model(&g, &q3);
    remove_t(&g, "blk.0.attn_q_norm.weight");
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "'blk.0.attn_q_norm.weight'"));
    gfree(&g);
}

TEST(architecture_and_hparams) {
    gbuild g;
    tiny_opts o = { .arch = "gpt2" };
    tiny_model(&g, &o);
    CHECK(expect_load(&g, ES_ERR_UNSUPPORTED, "unsupported architecture 'gpt2'"));
    gfree(&g);
    tiny_opts ob = { .block_count = 2000 };
    tiny_model(&g, &ob);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "llama.block_count = 2000 out of range"));
    gfree(&g);
    tiny_opts ob2 = { .block_count = 3 };           /* blk.2.* absent */
    tiny_model(&g, &ob2);
    CHECK(expect_load(&g, ES_ERR_MISSING_TENSOR, "'blk.2.attn_norm.weight'"));
    gfree(&g);
    tiny_opts oh = { .head_count_kv = 3 };
    tiny_model(&g, &oh);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "not a multiple of head_count_kv"));
    gfree(&g);
    tiny_opts oh2 = { .head_count_kv = 8 };
    tiny_model(&g, &oh2);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "llama.attention.head_count_kv = 8 out of range"));
    gfree(&g);
    tiny_opts ot = { .n_tokens = 63 };
    tiny_model(&g, &ot);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "tokenizer.ggml.tokens has 63 entries"));
    gfree(&g);
    tiny_opts o0 = { 0 };
    tiny_model(&g, &o0);
    kv_f32(&g, "llama.rope.dimension_count", 8.0f);
    CHECK(expect_load(&g, ES_ERR_FORMAT,
                      "key 'llama.rope.dimension_count' has value type FLOAT32 (6)"));
    gfree(&g);
    tiny_model(&g, &o0);
    kv_u32(&g, "llama.rope.dimension_count", 7);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "llama.rope.dimension_count = 7 is odd"));
    gfree(&g);
    tiny_model(&g, &o0);
    kv_u32(&g, "llama.attention.key_length", 1024);
    CHECK(expect_load(&g, ES_ERR_FORMAT, "llama.attention.key_length = 1024 out of range"));
    gfree(&g);
}

TEST(bad_arguments_and_io) {
    es_model *m = (es_model *)1;
    CHECK_EQ_INT(es_model_load(NULL, NULL, &m, g_err, sizeof g_err), ES_ERR_INVALID_ARG);
    CHECK(m == NULL);
    CHECK_EQ_INT(es_model_load(g_path, NULL, NULL, NULL, 0), ES_ERR_INVALID_ARG);
    es_model_params p = es_model_default_params();
    CHECK_EQ_INT(p.flags, 0);
    p.flags = 4;   /* an unknown bit */
    CHECK_EQ_INT(es_model_load(g_path, &p, &m, g_err, sizeof g_err), ES_ERR_INVALID_ARG);
    CHECK_MSG("ES_MODEL_NO_REPACK");
    CHECK_EQ_INT(es_model_load("/nonexistent/x.gguf", NULL, &m, g_err, sizeof g_err), ES_ERR_IO);
    CHECK_MSG("/nonexistent/x.gguf");
    CHECK_EQ_INT(es_model_load(g_dir, NULL, &m, g_err, sizeof g_err), ES_ERR_IO);
    CHECK_EQ_INT(es_model_load("/nonexistent", NULL, &m, NULL, 0), ES_ERR_IO);   /* NULL err ok */
    CHECK(m == NULL);
    es_model_info info;
    CHECK_EQ_INT(es_model_get_info(NULL, &info), ES_ERR_INVALID_ARG);
    CHECK(es_model_vec(NULL, NULL) == NULL);
    es_model_free(NULL);
    es_gguf_close(NULL);
    char small[8];
    gbuild g;
    tiny_opts o = { .arch = "gpt2" };
    tiny_model(&g, &o);
    layout L;
    buf b = build(&g, &L);
    write_file(b.p, b.n);
    CHECK_EQ_INT(es_model_load(g_path, NULL, &m, small, sizeof small), ES_ERR_UNSUPPORTED);
    CHECK(strlen(small) == 7);     /* message cut to the buffer, NUL-terminated */
    free(b.p);
    gfree(&g);
}

/* The real model (when fetched, where scripts/fetch_model.py puts it: $ECHOSPEC_CACHE, or
 * ~/.cache/echospec when that is unset or empty): its shape and tensor types. */
static void real_model_check(void) {
    char path[4096];
    const char *cache = getenv("ECHOSPEC_CACHE"), *home = getenv("HOME");
    if (cache != NULL && cache[0] != '\0')
        snprintf(path, sizeof path, "%s/%s", cache, REAL_MODEL_NAME);
    else if (home != NULL && home[0] != '\0')
        snprintf(path, sizeof path, "%s/.cache/echospec/%s", home, REAL_MODEL_NAME);
    else
        path[0] = '\0';
    if (path[0] == '\0' || access(path, R_OK) != 0) {
        printf("note: %s absent; real-model check not run (the python suite covers it)\n",
               path[0] ? path : REAL_MODEL_NAME);
        return;
    }
    harness_cur_failed = 0;
    es_model *m = NULL;
    CHECK_EQ_INT(es_model_load(path, NULL, &m, g_err, sizeof g_err), ES_OK);
    if (m != NULL) {
        es_model_info i = m->info;
        CHECK(strcmp(i.arch, "llama") == 0);
        CHECK_EQ_INT(i.n_vocab, 49152);
        CHECK_EQ_INT(i.n_ctx_train, 8192);
        CHECK_EQ_INT(i.n_embd, 576);
        CHECK_EQ_INT(i.n_layer, 30);
        CHECK_EQ_INT(i.n_head, 9);
        CHECK_EQ_INT(i.n_head_kv, 3);
        CHECK_EQ_INT(i.head_dim, 64);
        CHECK_EQ_INT(i.n_ff, 1536);
        CHECK_EQ_INT(i.rope_dim, 64);
        CHECK_EQ_INT(i.rope_neox, 0);
        CHECK(i.rope_freq_base == 100000.0f);
        CHECK(i.norm_eps == 1e-5f);
        CHECK_EQ_INT(i.tied_output, 1);
        CHECK_EQ_INT(m->gguf->version, 3);
        CHECK_EQ_INT(m->gguf->n_tensors, 272);
        CHECK_EQ_INT(m->tok_embd->type, ES_TYPE_Q8_0);
        CHECK_EQ_INT(m->layers[29].w_down->type, ES_TYPE_Q4_1);
        CHECK(i.weight_bytes > 90LL << 20 && i.weight_bytes < 94LL << 20);   /* ~92 MiB */
    }
    es_model_free(m);
    if (harness_cur_failed) { harness_failed++; fprintf(stderr, "FAILED real_model\n"); }
    else { harness_passed++; printf("ok real_model\n"); }
}

int main(void) {
    /* tmpfs when there is one: the truncation sweep writes thousands of files */
    const char *tmp = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    snprintf(g_dir, sizeof g_dir, "%s/es_test_gguf.XXXXXX", tmp);
    if (mkdtemp(g_dir) == NULL) { perror("mkdtemp"); return 1; }
    snprintf(g_path, sizeof g_path, "%s/m.gguf", g_dir);
    RUN(tiny_llama_loads);
    RUN(untied_output_and_v2);
    RUN(qwen2_and_qwen3_load);
    RUN(custom_alignment_loads);
    RUN(cut_at_every_metadata_byte);
    RUN(truncation_messages_name_the_field);
    RUN(counts_near_2_pow_64);
    RUN(offsets_and_alignment);
    RUN(types_versions_magic);
    RUN(names_and_keys);
    RUN(regions_and_data_section);
    RUN(key_value_types);
    RUN(missing_and_misshaped_tensors);
    RUN(architecture_and_hparams);
    RUN(bad_arguments_and_io);
    real_model_check();
    unlink(g_path);
    rmdir(g_dir);
    return harness_report();
}
