/*
 * gguf.c - GGUF v2/v3 reader over a read-only mmap.
 *
 * Byte layout (little-endian, as ggml writes it):
 *
 *   u32 magic "GGUF" | u32 version (2, 3) | u64 n_tensors | u64 n_kv
 *   n_kv      x { string key | u32 value type | value }
 *   n_tensors x { string name | u32 n_dims | u64 ne[n_dims] | u32 type | u64 offset }
 *   zero padding up to the next multiple of `alignment`   (data_start)
 *   tensor data: tensor i starts at data_start + offset_i (offset_i % alignment == 0)
 *   (each tensor padded to the alignment; at most alignment - 1 bytes after the last one)
 *
 *   string = u64 length | bytes (no NUL)
 *   array  = u32 element type | u64 count | elements (strings are length-prefixed each)
 *   alignment = general.alignment (an integer KV, nonzero power of two) or 32
 *
 * Every length, count, dimension and offset is checked against the bytes left
 * in the file and for overflow before it is used, so a hostile file produces
 * an error message naming the field, never an out-of-bounds read. Beyond
 * bounds: tensor regions must not overlap (a region shorter than its type and
 * shape need overlaps the next), the padding before the data section must be
 * zero, and every key of k_key_types must have its expected value type.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c reads little-endian GGUF files with memcpy; a big-endian host needs byte swaps"
#endif

#define GGUF_MAGIC "GGUF"
#define GGUF_DEFAULT_ALIGNMENT 32
#define GGUF_MAX_DIMS 4

/* es_gguf plus the sorted indexes used for duplicate checks and lookups.
 * `pub` must stay first: an es_gguf * handed out is a gguf_impl *. */
typedef struct {
    es_gguf pub;
    const es_gguf_kv **kv_sorted;   /* [n_kv] by key */
    const es_tensor **t_sorted;     /* [n_tensors] by name */
} gguf_impl;

/* Read position in the mapping; `where` names the section for messages. */
typedef struct {
    const uint8_t *base;
    size_t size;
    size_t off;
    char where[112];
    char *err;
    size_t err_len;
} cursor;

/* ---- tensor types ------------------------------------------------------ */

static const struct {
    uint32_t type;
    const char *name;
    size_t block_bytes;
    int64_t block_elems;
} k_types[] = {
    { ES_TYPE_F32,  "F32",  4,   1   },
    { ES_TYPE_F16,  "F16",  2,   1   },
    { ES_TYPE_Q4_0, "Q4_0", 18,  32  },
    { ES_TYPE_Q4_1, "Q4_1", 20,  32  },
    { ES_TYPE_Q5_0, "Q5_0", 22,  32  },
    { ES_TYPE_Q5_1, "Q5_1", 24,  32  },
    { ES_TYPE_Q8_0, "Q8_0", 34,  32  },
    { ES_TYPE_Q8_1, "Q8_1", 0,   32  },   /* known to ggml, not supported here */
    { ES_TYPE_Q2_K, "Q2_K", 0,   256 },
    { ES_TYPE_Q3_K, "Q3_K", 0,   256 },
    { ES_TYPE_Q4_K, "Q4_K", 144, 256 },
    { ES_TYPE_Q5_K, "Q5_K", 176, 256 },
    { ES_TYPE_Q6_K, "Q6_K", 210, 256 },
    { ES_TYPE_Q8_K, "Q8_K", 0,   256 },
    { ES_TYPE_BF16, "BF16", 2,   1   },
};

static int type_index(uint32_t type) {
    for (size_t i = 0; i < sizeof k_types / sizeof k_types[0]; i++) {
        if (k_types[i].type == type) return (int)i;
    }
    return -1;
}

/* Bytes per block of `type`; 0 when the type is unknown or not supported. */
size_t es_type_block_bytes(uint32_t type) {
    int i = type_index(type);
    return i < 0 ? 0 : k_types[i].block_bytes;
}

/* Elements per block of `type`; 0 when the type is unknown or not supported. */
int64_t es_type_block_elems(uint32_t type) {
    int i = type_index(type);
    return (i < 0 || k_types[i].block_bytes == 0) ? 0 : k_types[i].block_elems;
}

/* ggml's name of `type` ("Q4_1"), or "unknown". Never NULL. */
const char *es_type_name(uint32_t type) {
    int i = type_index(type);
    return i < 0 ? "unknown" : k_types[i].name;
}

/* ---- cursor ------------------------------------------------------------ */

static es_status truncated(cursor *c, const char *field) {
    es_set_err(c->err, c->err_len, "gguf: truncated while reading %s (%s) at byte %zu of %zu",
               c->where, field, c->off, c->size);
    return ES_ERR_FORMAT;
}

static es_status rd(cursor *c, void *dst, size_t n, const char *field) {
    if (n > c->size - c->off) return truncated(c, field);
    memcpy(dst, c->base + c->off, n);
    c->off += n;
    return ES_OK;
}

static es_status rd_u32(cursor *c, uint32_t *v, const char *field) {
    return rd(c, v, sizeof *v, field);
}

static es_status rd_u64(cursor *c, uint64_t *v, const char *field) {
    return rd(c, v, sizeof *v, field);
}

/* Read a string: u64 length (field "<field> length") then the bytes, which
 * stay in the map. On failure *s is unchanged and the cursor may have moved. */
static es_status rd_str(cursor *c, const char *field, const char **s, uint64_t *len) {
    char what[64];
    snprintf(what, sizeof what, "%s length", field);
    uint64_t n;
    es_status st = rd_u64(c, &n, what);
    if (st != ES_OK) return st;
    if (n > c->size - c->off) {
        es_set_err(c->err, c->err_len,
                   "gguf: truncated while reading %s (%s): length %llu exceeds the %zu bytes left",
                   c->where, field, (unsigned long long)n, c->size - c->off);
        return ES_ERR_FORMAT;
    }
    *s = (const char *)(c->base + c->off);
    *len = n;
    c->off += (size_t)n;
    return ES_OK;
}

/* Read a non-empty string and return a NUL-terminated heap copy in *out. */
static es_status rd_str_copy(cursor *c, const char *field, char **out) {
    const char *s;
    uint64_t n;
    es_status st = rd_str(c, field, &s, &n);
    if (st != ES_OK) return st;
    if (n == 0) {
        es_set_err(c->err, c->err_len, "gguf: %s: empty %s", c->where, field);
        return ES_ERR_FORMAT;
    }
    if (memchr(s, 0, (size_t)n) != NULL) {
        es_set_err(c->err, c->err_len, "gguf: %s: %s contains a NUL byte", c->where, field);
        return ES_ERR_FORMAT;
    }
    char *p = malloc((size_t)n + 1);
    if (p == NULL) {
        es_set_err(c->err, c->err_len, "gguf: out of memory for %s of %s", field, c->where);
        return ES_ERR_NOMEM;
    }
    memcpy(p, s, (size_t)n);
    p[n] = '\0';
    *out = p;
    return ES_OK;
}

/* ---- key/value pairs ---------------------------------------------------- */

/* Size in bytes of a fixed-size GGUF value type; 0 for string, array, unknown. */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case GGUF_T_UINT8: case GGUF_T_INT8: case GGUF_T_BOOL: return 1;
    case GGUF_T_UINT16: case GGUF_T_INT16: return 2;
    case GGUF_T_UINT32: case GGUF_T_INT32: case GGUF_T_FLOAT32: return 4;
    case GGUF_T_UINT64: case GGUF_T_INT64: case GGUF_T_FLOAT64: return 8;
    default: return 0;
    }
}

static es_status read_scalar(cursor *c, es_gguf_kv *kv) {
    uint8_t b[8];
    es_status st = rd(c, b, scalar_size(kv->type), "value");
    if (st != ES_OK) return st;
    uint8_t u8; int8_t i8; uint16_t u16; int16_t i16; uint32_t u32; int32_t i32;
    float f32; double f64;
    switch (kv->type) {
    case GGUF_T_BOOL:
    case GGUF_T_UINT8:   memcpy(&u8, b, 1);  kv->v.u64 = u8;  break;
    case GGUF_T_INT8:    memcpy(&i8, b, 1);  kv->v.i64 = i8;  break;
    case GGUF_T_UINT16:  memcpy(&u16, b, 2); kv->v.u64 = u16; break;
    case GGUF_T_INT16:   memcpy(&i16, b, 2); kv->v.i64 = i16; break;
    case GGUF_T_UINT32:  memcpy(&u32, b, 4); kv->v.u64 = u32; break;
    case GGUF_T_INT32:   memcpy(&i32, b, 4); kv->v.i64 = i32; break;
    case GGUF_T_FLOAT32: memcpy(&f32, b, 4); kv->v.f64 = f32; break;
    case GGUF_T_UINT64:  memcpy(&kv->v.u64, b, 8); break;
    case GGUF_T_INT64:   memcpy(&kv->v.i64, b, 8); break;
    case GGUF_T_FLOAT64: memcpy(&f64, b, 8); kv->v.f64 = f64; break;
    default: break;
    }
    return ES_OK;
}

/* Array value: element type, count, elements. Arrays of strings are walked
 * string by string (each length checked); nested arrays are refused. */
static es_status read_array(cursor *c, es_gguf_kv *kv) {
    es_status st = rd_u32(c, &kv->arr_type, "array element type");
    if (st != ES_OK) return st;
    if (kv->arr_type > GGUF_T_FLOAT64) {
        es_set_err(c->err, c->err_len, "gguf: %s: unknown array element type %u",
                   c->where, kv->arr_type);
        return ES_ERR_FORMAT;
    }
    if (kv->arr_type == GGUF_T_ARRAY) {
        es_set_err(c->err, c->err_len, "gguf: %s: nested arrays are not supported", c->where);
        return ES_ERR_UNSUPPORTED;
    }
    if ((st = rd_u64(c, &kv->arr_len, "array length")) != ES_OK) return st;
    size_t left = c->size - c->off;
    size_t esz = kv->arr_type == GGUF_T_STRING ? 8 : scalar_size(kv->arr_type);
    uint64_t need;
    if (__builtin_mul_overflow(kv->arr_len, (uint64_t)esz, &need) || need > left) {
        es_set_err(c->err, c->err_len,
                   "gguf: truncated while reading %s (array length): %llu elements of %zu bytes "
                   "exceed the %zu bytes left", c->where, (unsigned long long)kv->arr_len, esz, left);
        return ES_ERR_FORMAT;
    }
    kv->arr_data = c->base + c->off;
    if (kv->arr_type != GGUF_T_STRING) {
        c->off += (size_t)need;
        return ES_OK;
    }
    for (uint64_t i = 0; i < kv->arr_len; i++) {
        const char *s;
        uint64_t n;
        char field[48];
        snprintf(field, sizeof field, "array element %llu string", (unsigned long long)i);
        if ((st = rd_str(c, field, &s, &n)) != ES_OK) return st;
    }
    return ES_OK;
}

static es_status read_kv(cursor *c, es_gguf_kv *kv, int64_t i) {
    snprintf(c->where, sizeof c->where, "kv %lld", (long long)i);
    es_status st = rd_str_copy(c, "key", &kv->key);
    if (st != ES_OK) return st;
    snprintf(c->where, sizeof c->where, "kv %lld '%.64s'", (long long)i, kv->key);
    if ((st = rd_u32(c, &kv->type, "value type")) != ES_OK) return st;
    if (kv->type == GGUF_T_STRING) return rd_str(c, "string", &kv->str, &kv->str_len);
    if (kv->type == GGUF_T_ARRAY) return read_array(c, kv);
    if (scalar_size(kv->type) == 0) {
        es_set_err(c->err, c->err_len, "gguf: %s: unknown value type %u", c->where, kv->type);
        return ES_ERR_FORMAT;
    }
    return read_scalar(c, kv);
}

/* general.alignment: any integer type, a nonzero power of two. */
static es_status read_alignment(const es_gguf_kv *kv, uint64_t *align, char *err, size_t err_len) {
    uint64_t a;
    switch (kv->type) {
    case GGUF_T_UINT8: case GGUF_T_UINT16: case GGUF_T_UINT32: case GGUF_T_UINT64:
        a = kv->v.u64;
        break;
    case GGUF_T_INT8: case GGUF_T_INT16: case GGUF_T_INT32: case GGUF_T_INT64:
        a = kv->v.i64 < 0 ? 0 : (uint64_t)kv->v.i64;   /* negative: reported as 0 below */
        break;
    default:
        es_set_err(err, err_len, "gguf: general.alignment has value type %u, expected an integer",
                   kv->type);
        return ES_ERR_FORMAT;
    }
    if (a == 0 || (a & (a - 1)) != 0) {
        es_set_err(err, err_len, "gguf: general.alignment = %llu is not a nonzero power of two",
                   (unsigned long long)a);
        return ES_ERR_FORMAT;
    }
    *align = a;
    return ES_OK;
}

/* ---- expected value types of the keys read ------------------------------ */

/* Value-type classes. An integer key takes any GGUF integer type (the value
 * is range-checked where it is used); a number also takes float32/float64. */
enum { KT_INT = 1, KT_NUMBER, KT_BOOL, KT_STRING, KT_ARRAY_STRING, KT_ARRAY_INT };

/* Every key a reader of this project reads (the engine here, the Python
 * tokenizer in services/text/gguf_reader.py, whose KEY_TYPES table must list
 * the same entries: tests/test_gguf_malformed.py compares the two). "{arch}."
 * stands for the value of general.architecture. A present key of another
 * value type makes es_gguf_open fail with a message naming the key. */
static const struct {
    const char *key;
    int want;
} k_key_types[] = {
    { "general.alignment",                        KT_INT },
    { "general.architecture",                     KT_STRING },
    { "tokenizer.ggml.model",                     KT_STRING },
    { "tokenizer.ggml.pre",                       KT_STRING },
    { "tokenizer.ggml.tokens",                    KT_ARRAY_STRING },
    { "tokenizer.ggml.token_type",                KT_ARRAY_INT },
    { "tokenizer.ggml.merges",                    KT_ARRAY_STRING },
    { "tokenizer.ggml.bos_token_id",              KT_INT },
    { "tokenizer.ggml.eos_token_id",              KT_INT },
    { "tokenizer.ggml.eot_token_id",              KT_INT },
    { "tokenizer.ggml.eom_token_id",              KT_INT },
    { "tokenizer.ggml.unknown_token_id",          KT_INT },
    { "tokenizer.ggml.padding_token_id",          KT_INT },
    { "tokenizer.ggml.add_bos_token",             KT_BOOL },
    { "tokenizer.chat_template",                  KT_STRING },
    { "{arch}.block_count",                       KT_INT },
    { "{arch}.context_length",                    KT_INT },
    { "{arch}.embedding_length",                  KT_INT },
    { "{arch}.feed_forward_length",               KT_INT },
    { "{arch}.attention.head_count",              KT_INT },
    { "{arch}.attention.head_count_kv",           KT_INT },
    { "{arch}.attention.key_length",              KT_INT },
    { "{arch}.attention.value_length",            KT_INT },
    { "{arch}.rope.dimension_count",              KT_INT },
    { "{arch}.rope.freq_base",                    KT_NUMBER },
    { "{arch}.attention.layer_norm_rms_epsilon",  KT_NUMBER },
};

static bool is_int_type(uint32_t t) {
    return t <= GGUF_T_INT32 || t == GGUF_T_UINT64 || t == GGUF_T_INT64;
}

static bool type_matches(const es_gguf_kv *kv, int want) {
    switch (want) {
    case KT_INT: return is_int_type(kv->type);
    case KT_NUMBER:
        return is_int_type(kv->type) || kv->type == GGUF_T_FLOAT32 || kv->type == GGUF_T_FLOAT64;
    case KT_BOOL: return kv->type == GGUF_T_BOOL;
    case KT_STRING: return kv->type == GGUF_T_STRING;
    case KT_ARRAY_STRING: return kv->type == GGUF_T_ARRAY && kv->arr_type == GGUF_T_STRING;
    case KT_ARRAY_INT: return kv->type == GGUF_T_ARRAY && is_int_type(kv->arr_type);
    default: return false;
    }
}

static const char *kt_name(int want) {
    switch (want) {
    case KT_INT: return "an integer";
    case KT_NUMBER: return "a number";
    case KT_BOOL: return "a bool";
    case KT_STRING: return "a string";
    case KT_ARRAY_STRING: return "an array of strings";
    default: return "an array of integers";
    }
}

static const char *value_type_name(uint32_t t) {
    static const char *const names[] = { "UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32",
                                         "FLOAT32", "BOOL", "STRING", "ARRAY", "UINT64", "INT64",
                                         "FLOAT64" };
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Does `key` name table entry `pattern`? "{arch}." matches the architecture
 * prefix only (arch NULL: general.architecture absent or not a string). */
static bool key_is(const char *key, const char *pattern, const char *arch, size_t arch_len) {
    static const char ph[] = "{arch}.";
    if (strncmp(pattern, ph, sizeof ph - 1) != 0) return strcmp(key, pattern) == 0;
    if (arch == NULL || strncmp(key, arch, arch_len) != 0 || key[arch_len] != '.') return false;
    return strcmp(key + arch_len + 1, pattern + sizeof ph - 1) == 0;
}

/* Check every present key of k_key_types against its expected type. */
static es_status check_key_types(const es_gguf *g, char *err, size_t err_len) {
    const char *arch = NULL;
    size_t arch_len = 0;
    for (int64_t i = 0; i < g->n_kv; i++) {
        const es_gguf_kv *kv = &g->kv[i];
        if (strcmp(kv->key, "general.architecture") == 0 && kv->type == GGUF_T_STRING &&
            memchr(kv->str, 0, (size_t)kv->str_len) == NULL) {
            arch = kv->str;
            arch_len = (size_t)kv->str_len;
        }
    }
    for (int64_t i = 0; i < g->n_kv; i++) {
        const es_gguf_kv *kv = &g->kv[i];
        for (size_t j = 0; j < sizeof k_key_types / sizeof k_key_types[0]; j++) {
            if (!key_is(kv->key, k_key_types[j].key, arch, arch_len)) continue;
            if (type_matches(kv, k_key_types[j].want)) break;
            if (kv->type == GGUF_T_ARRAY) {
                es_set_err(err, err_len, "gguf: key '%.80s' is an array of %s, expected %s",
                           kv->key, value_type_name(kv->arr_type), kt_name(k_key_types[j].want));
            } else {
                es_set_err(err, err_len, "gguf: key '%.80s' has value type %s (%u), expected %s",
                           kv->key, value_type_name(kv->type), kv->type,
                           kt_name(k_key_types[j].want));
            }
            return ES_ERR_FORMAT;
        }
    }
    return ES_OK;
}

/* ---- tensor infos ------------------------------------------------------ */

/* Type, block divisibility, element count, byte sizes and offset alignment
 * of one tensor whose fields are already read. */
static es_status check_tensor(cursor *c, es_tensor *t, uint64_t offset, uint64_t align) {
    size_t bb = es_type_block_bytes(t->type);
    int64_t be = es_type_block_elems(t->type);
    if (bb == 0) {
        if (type_index(t->type) < 0) {
            es_set_err(c->err, c->err_len, "gguf: tensor '%.64s' has unknown type id %u",
                       t->name, t->type);
        } else {
            es_set_err(c->err, c->err_len,
                       "gguf: tensor '%.64s' has type %s (id %u), which this engine does not support",
                       t->name, es_type_name(t->type), t->type);
        }
        return ES_ERR_UNSUPPORTED;
    }
    if (t->ne[0] % be != 0) {
        es_set_err(c->err, c->err_len,
                   "gguf: tensor '%.64s': ne[0] = %lld is not a multiple of the %s block size %lld",
                   t->name, (long long)t->ne[0], es_type_name(t->type), (long long)be);
        return ES_ERR_FORMAT;
    }
    int64_t n = 1;
    uint64_t bytes;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) {
        if (__builtin_mul_overflow(n, t->ne[d], &n)) n = -1;
        if (n < 0) break;
    }
    if (n < 0 || __builtin_mul_overflow((uint64_t)(n / be), (uint64_t)bb, &bytes) ||
        bytes > SIZE_MAX) {
        es_set_err(c->err, c->err_len, "gguf: tensor '%.64s': element count (ne) overflows",
                   t->name);
        return ES_ERR_FORMAT;
    }
    t->n_elements = n;
    t->nbytes = (size_t)bytes;
    t->row_bytes = (size_t)(t->ne[0] / be) * bb;
    if (offset % align != 0) {
        es_set_err(c->err, c->err_len,
                   "gguf: tensor '%.64s': data offset %llu is not a multiple of the alignment %llu",
                   t->name, (unsigned long long)offset, (unsigned long long)align);
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

static es_status read_tensor_info(cursor *c, es_tensor *t, int64_t i, uint64_t *offset,
                                  uint64_t align) {
    snprintf(c->where, sizeof c->where, "tensor info %lld", (long long)i);
    es_status st = rd_str_copy(c, "name", &t->name);
    if (st != ES_OK) return st;
    snprintf(c->where, sizeof c->where, "tensor info %lld '%.64s'", (long long)i, t->name);
    uint32_t n_dims;
    if ((st = rd_u32(c, &n_dims, "n_dims")) != ES_OK) return st;
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS) {
        es_set_err(c->err, c->err_len, "gguf: %s: n_dims = %u not in 1..%d", c->where, n_dims,
                   GGUF_MAX_DIMS);
        return ES_ERR_FORMAT;
    }
    t->n_dims = (int32_t)n_dims;
    for (int d = 0; d < GGUF_MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        char field[16];
        uint64_t ne;
        snprintf(field, sizeof field, "ne[%u]", d);
        if ((st = rd_u64(c, &ne, field)) != ES_OK) return st;
        if (ne < 1 || ne > (uint64_t)INT64_MAX) {
            es_set_err(c->err, c->err_len, "gguf: %s: %s = %llu out of range 1..2^63-1",
                       c->where, field, (unsigned long long)ne);
            return ES_ERR_FORMAT;
        }
        t->ne[d] = (int64_t)ne;
    }
    if ((st = rd_u32(c, &t->type, "type")) != ES_OK) return st;
    if ((st = rd_u64(c, offset, "offset")) != ES_OK) return st;
    return check_tensor(c, t, *offset, align);
}

/* ---- sorted indexes and duplicates ------------------------------------- */

static int cmp_kv(const void *a, const void *b) {
    return strcmp((*(const es_gguf_kv *const *)a)->key, (*(const es_gguf_kv *const *)b)->key);
}

static int cmp_tensor(const void *a, const void *b) {
    return strcmp((*(const es_tensor *const *)a)->name, (*(const es_tensor *const *)b)->name);
}

/* Build the sorted indexes; a repeated key or tensor name is ES_ERR_FORMAT. */
static es_status build_indexes(gguf_impl *gi, char *err, size_t err_len) {
    es_gguf *g = &gi->pub;
    gi->kv_sorted = calloc((size_t)g->n_kv + 1, sizeof *gi->kv_sorted);
    gi->t_sorted = calloc((size_t)g->n_tensors + 1, sizeof *gi->t_sorted);
    if (gi->kv_sorted == NULL || gi->t_sorted == NULL) {
        es_set_err(err, err_len, "gguf: out of memory for the key and tensor indexes");
        return ES_ERR_NOMEM;
    }
    for (int64_t i = 0; i < g->n_kv; i++) gi->kv_sorted[i] = &g->kv[i];
    for (int64_t i = 0; i < g->n_tensors; i++) gi->t_sorted[i] = &g->tensors[i];
    qsort(gi->kv_sorted, (size_t)g->n_kv, sizeof *gi->kv_sorted, cmp_kv);
    qsort(gi->t_sorted, (size_t)g->n_tensors, sizeof *gi->t_sorted, cmp_tensor);
    for (int64_t i = 1; i < g->n_kv; i++) {
        if (strcmp(gi->kv_sorted[i - 1]->key, gi->kv_sorted[i]->key) == 0) {
            es_set_err(err, err_len, "gguf: duplicate key '%.64s'", gi->kv_sorted[i]->key);
            return ES_ERR_FORMAT;
        }
    }
    for (int64_t i = 1; i < g->n_tensors; i++) {
        if (strcmp(gi->t_sorted[i - 1]->name, gi->t_sorted[i]->name) == 0) {
            es_set_err(err, err_len, "gguf: duplicate tensor name '%.64s'", gi->t_sorted[i]->name);
            return ES_ERR_FORMAT;
        }
    }
    return ES_OK;
}

/* ---- whole file -------------------------------------------------------- */

/* Magic, version and the two counts, bounded by the file size (a KV takes
 * at least 14 bytes, a tensor info at least 33). The arrays grow as entries
 * are read, so memory follows what the file holds, not what it claims. */
static es_status read_header(cursor *c, es_gguf *g, uint64_t *n_tensors, uint64_t *n_kv) {
    snprintf(c->where, sizeof c->where, "header");
    char magic[4];
    es_status st = rd(c, magic, 4, "magic");
    if (st != ES_OK) return st;
    if (memcmp(magic, GGUF_MAGIC, 4) != 0) {
        es_set_err(c->err, c->err_len, "gguf: bad magic %02x %02x %02x %02x (expected \"GGUF\")",
                   (uint8_t)magic[0], (uint8_t)magic[1], (uint8_t)magic[2], (uint8_t)magic[3]);
        return ES_ERR_FORMAT;
    }
    if ((st = rd_u32(c, &g->version, "version")) != ES_OK) return st;
    if (g->version != 2 && g->version != 3) {
        es_set_err(c->err, c->err_len, "gguf: unsupported version %u (this reader takes 2 and 3)",
                   g->version);
        return ES_ERR_UNSUPPORTED;
    }
    if ((st = rd_u64(c, n_tensors, "tensor count")) != ES_OK) return st;
    if ((st = rd_u64(c, n_kv, "kv count")) != ES_OK) return st;
    if (*n_kv > c->size / 14) {
        es_set_err(c->err, c->err_len,
                   "gguf: truncated or corrupt header: kv count %llu cannot fit in the %zu bytes "
                   "of the file", (unsigned long long)*n_kv, c->size);
        return ES_ERR_FORMAT;
    }
    if (*n_tensors > c->size / 33) {
        es_set_err(c->err, c->err_len,
                   "gguf: truncated or corrupt header: tensor count %llu cannot fit in the %zu "
                   "bytes of the file", (unsigned long long)*n_tensors, c->size);
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

/* Make room for element i of *arr (capacity *cap elements of elsz bytes),
 * doubling and zeroing the new part; false when out of memory (*arr kept). */
static bool reserve(void **arr, size_t *cap, size_t i, size_t elsz) {
    if (i < *cap) return true;
    size_t ncap = *cap ? *cap * 2 : 16;
    void *p = realloc(*arr, ncap * elsz);
    if (p == NULL) return false;
    memset((char *)p + *cap * elsz, 0, (ncap - *cap) * elsz);
    *arr = p;
    *cap = ncap;
    return true;
}

/* The data section starts at the aligned end of the tensor infos, and the
 * padding before it is zero (the spec's 0x00 padding): nonzero bytes there,
 * or more than alignment - 1 bytes after the last tensor, mean the writer
 * put the data somewhere else (an unpadded section followed by other bytes),
 * and every tensor would be read at the wrong offset. */
static es_status check_data_section(const cursor *c, const es_gguf *g, uint64_t data_start,
                                    uint64_t data_end, const char *last) {
    for (size_t p = c->off; p < data_start; p++) {
        if (c->base[p] != 0) {
            es_set_err(c->err, c->err_len,
                       "gguf: the data section does not start at the aligned offset %llu: "
                       "padding byte %zu after the tensor infos (which end at byte %zu, "
                       "alignment %llu) is 0x%02x, not zero", (unsigned long long)data_start, p,
                       c->off, (unsigned long long)g->alignment, c->base[p]);
            return ES_ERR_FORMAT;
        }
    }
    if (c->size - data_end >= g->alignment) {
        es_set_err(c->err, c->err_len,
                   "gguf: %llu bytes follow the last tensor '%.64s' (its data ends at byte %llu "
                   "of %zu, alignment %llu): the data section does not start at the aligned "
                   "offset %llu, or the file has trailing bytes",
                   (unsigned long long)(c->size - data_end), last, (unsigned long long)data_end,
                   c->size, (unsigned long long)g->alignment, (unsigned long long)data_start);
        return ES_ERR_FORMAT;
    }
    return ES_OK;
}

typedef struct {
    uint64_t offset;
    const es_tensor *t;
} region;

static int cmp_region(const void *a, const void *b) {
    const region *x = a, *y = b;
    if (x->offset != y->offset) return x->offset < y->offset ? -1 : 1;
    return strcmp(x->t->name, y->t->name);
}

/* No two tensors' byte ranges [offset, offset + nbytes) overlap; nbytes is
 * what the type and shape need, so a region too short for its tensor is an
 * overlap with the next one (or runs past the end, checked by the caller).
 * Fills *data_end with the end of the last region relative to data_start. */
static es_status check_overlaps(cursor *c, es_gguf *g, const uint64_t *offsets,
                                uint64_t *data_end, const char **last) {
    *data_end = 0;
    *last = "";
    if (g->n_tensors == 0) return ES_OK;
    region *r = malloc((size_t)g->n_tensors * sizeof *r);
    if (r == NULL) {
        es_set_err(c->err, c->err_len, "gguf: out of memory for the tensor region check");
        return ES_ERR_NOMEM;
    }
    for (int64_t i = 0; i < g->n_tensors; i++) r[i] = (region){ offsets[i], &g->tensors[i] };
    qsort(r, (size_t)g->n_tensors, sizeof *r, cmp_region);
    es_status st = ES_OK;
    for (int64_t i = 0; i + 1 < g->n_tensors; i++) {
        const es_tensor *a = r[i].t, *b = r[i + 1].t;
        if (r[i + 1].offset - r[i].offset < (uint64_t)a->nbytes) {
            es_set_err(c->err, c->err_len,
                       "gguf: tensors '%.64s' and '%.64s' overlap: '%.64s' (%s [%lld, %lld, %lld, "
                       "%lld]) needs %zu bytes from data offset %llu, '%.64s' starts at data "
                       "offset %llu", a->name, b->name, a->name, es_type_name(a->type),
                       (long long)a->ne[0], (long long)a->ne[1], (long long)a->ne[2],
                       (long long)a->ne[3], a->nbytes, (unsigned long long)r[i].offset, b->name,
                       (unsigned long long)r[i + 1].offset);
            st = ES_ERR_FORMAT;
            break;
        }
    }
    if (st == ES_OK) {
        const region *e = &r[g->n_tensors - 1];
        *data_end = e->offset + e->t->nbytes;   /* in the file: checked by place_data */
        *last = e->t->name;
    }
    free(r);
    return st;
}

/* Place every tensor's data: data_start is the aligned end of the tensor
 * infos; each [data_start + offset, + nbytes) must lie inside the file, the
 * regions must not overlap, and the data section must start at data_start. */
static es_status place_data(cursor *c, es_gguf *g, const uint64_t *offsets) {
    uint64_t data_start;
    if (__builtin_add_overflow((uint64_t)c->off, g->alignment - 1, &data_start)) {
        data_start = UINT64_MAX;
    } else {
        data_start &= ~(g->alignment - 1);
    }
    if (g->n_tensors > 0 && data_start > c->size) {
        es_set_err(c->err, c->err_len,
                   "gguf: truncated before the tensor data: the data section starts at byte %llu "
                   "of %zu (alignment %llu)", (unsigned long long)data_start, c->size,
                   (unsigned long long)g->alignment);
        return ES_ERR_FORMAT;
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        es_tensor *t = &g->tensors[i];
        uint64_t start, end;
        if (__builtin_add_overflow(data_start, offsets[i], &start) ||
            __builtin_add_overflow(start, (uint64_t)t->nbytes, &end) || end > c->size) {
            es_set_err(c->err, c->err_len,
                       "gguf: tensor '%.64s': data offset %llu + %zu bytes runs past the end of "
                       "the file (data section at byte %llu of %zu)", t->name,
                       (unsigned long long)offsets[i], t->nbytes, (unsigned long long)data_start,
                       c->size);
            return ES_ERR_FORMAT;
        }
        t->data = c->base + start;
    }
    if (g->n_tensors == 0) return ES_OK;
    uint64_t data_end;
    const char *last;
    es_status st = check_overlaps(c, g, offsets, &data_end, &last);
    if (st != ES_OK) return st;
    return check_data_section(c, g, data_start, data_start + data_end, last);
}

static es_status read_tensor_infos(cursor *c, es_gguf *g, uint64_t n_tensors) {
    uint64_t *offsets = NULL;
    size_t cap_t = 0, cap_o = 0;
    es_status st = ES_OK;
    for (uint64_t i = 0; i < n_tensors && st == ES_OK; i++) {
        if (!reserve((void **)&g->tensors, &cap_t, (size_t)i, sizeof *g->tensors) ||
            !reserve((void **)&offsets, &cap_o, (size_t)i, sizeof *offsets)) {
            es_set_err(c->err, c->err_len, "gguf: out of memory at tensor info %llu",
                       (unsigned long long)i);
            st = ES_ERR_NOMEM;
            break;
        }
        g->n_tensors = (int64_t)i + 1;   /* count it so close() frees its name */
        st = read_tensor_info(c, &g->tensors[i], (int64_t)i, &offsets[i], g->alignment);
    }
    if (st == ES_OK) st = place_data(c, g, offsets);
    free(offsets);
    return st;
}

static es_status read_kvs(cursor *c, es_gguf *g, uint64_t n_kv) {
    size_t cap = 0;
    for (uint64_t i = 0; i < n_kv; i++) {
        if (!reserve((void **)&g->kv, &cap, (size_t)i, sizeof *g->kv)) {
            es_set_err(c->err, c->err_len, "gguf: out of memory at kv %llu", (unsigned long long)i);
            return ES_ERR_NOMEM;
        }
        g->n_kv = (int64_t)i + 1;   /* count the pair so close() frees its key */
        es_status st = read_kv(c, &g->kv[i], (int64_t)i);
        if (st != ES_OK) return st;
    }
    return ES_OK;
}

static es_status parse(gguf_impl *gi, char *err, size_t err_len) {
    es_gguf *g = &gi->pub;
    cursor c = { .base = g->map, .size = g->size, .off = 0, .err = err, .err_len = err_len };
    uint64_t n_tensors, n_kv;
    es_status st = read_header(&c, g, &n_tensors, &n_kv);
    if (st == ES_OK) st = read_kvs(&c, g, n_kv);
    if (st != ES_OK) return st;
    if ((st = check_key_types(g, err, err_len)) != ES_OK) return st;
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (int64_t i = 0; i < g->n_kv; i++) {
        if (strcmp(g->kv[i].key, "general.alignment") == 0) {
            if ((st = read_alignment(&g->kv[i], &g->alignment, err, err_len)) != ES_OK) return st;
        }
    }
    if ((st = read_tensor_infos(&c, g, n_tensors)) != ES_OK) return st;
    return build_indexes(gi, err, err_len);
}
/* Open and validate the GGUF file at `path`.
 * On success *out owns the mapping and every parsed record (es_gguf_close).
 * On failure *out is NULL, the file is closed and unmapped, nothing leaks,
 * and err holds a message naming the section and field:
 *   ES_ERR_IO (open/stat/mmap), ES_ERR_FORMAT (malformed or truncated),
 *   ES_ERR_UNSUPPORTED (version, tensor type, nested array), ES_ERR_NOMEM,
 *   ES_ERR_INVALID_ARG (path or out NULL). */
es_status es_gguf_open(const char *path, es_gguf **out, char *err, size_t err_len) {
    if (out != NULL) *out = NULL;
    if (path == NULL || out == NULL) {
        es_set_err(err, err_len, "gguf: path and out must not be NULL");
        return ES_ERR_INVALID_ARG;
    }
    /* O_NONBLOCK: opening a FIFO (or a device) for reading would otherwise wait for a writer;
     * the fstat below then refuses it. The file is only mapped, never read(), so the flag
     * changes nothing for a regular file. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
        es_set_err(err, err_len, "gguf: cannot open '%s': %s", path, strerror(errno));
        return ES_ERR_IO;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || (uint64_t)sb.st_size > SIZE_MAX) {
        es_set_err(err, err_len, "gguf: '%s' is not a readable regular file", path);
        close(fd);
        return ES_ERR_IO;
    }
    size_t size = (size_t)sb.st_size;
    void *map = NULL;
    if (size > 0) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) {
            es_set_err(err, err_len, "gguf: cannot mmap '%s' (%zu bytes): %s", path, size,
                       strerror(errno));
            close(fd);
            return ES_ERR_IO;
        }
    }
    close(fd);
    gguf_impl *gi = calloc(1, sizeof *gi);
    if (gi == NULL) {
        if (map != NULL) munmap(map, size);
        es_set_err(err, err_len, "gguf: out of memory");
        return ES_ERR_NOMEM;
    }
    gi->pub.map = map;
    gi->pub.size = size;
    es_status st = parse(gi, err, err_len);
    if (st != ES_OK) {
        es_gguf_close(&gi->pub);
        return st;
    }
    *out = &gi->pub;
    return ES_OK;
}

/* Unmap the file and free every record. Accepts a half-built handle. NULL is a no-op. */
void es_gguf_close(es_gguf *g) {
    if (g == NULL) return;
    gguf_impl *gi = (gguf_impl *)g;
    if (g->kv != NULL) {
        for (int64_t i = 0; i < g->n_kv; i++) free(g->kv[i].key);
    }
    if (g->tensors != NULL) {
        for (int64_t i = 0; i < g->n_tensors; i++) {
            free(g->tensors[i].name);
            if (g->tensors[i].packed_owned) free(g->tensors[i].packed);
        }
    }
    free(g->kv);
    free(g->tensors);
    free(gi->kv_sorted);
    free(gi->t_sorted);
    if (g->map != NULL) munmap(g->map, g->size);
    free(gi);
}

/* The KV pair with this key, or NULL. O(log n_kv). */
const es_gguf_kv *es_gguf_find_kv(const es_gguf *g, const char *key) {
    if (g == NULL || key == NULL) return NULL;
    const gguf_impl *gi = (const gguf_impl *)g;
    es_gguf_kv probe = { .key = (char *)key };
    const es_gguf_kv *pp = &probe;
    const es_gguf_kv **hit = bsearch(&pp, gi->kv_sorted, (size_t)g->n_kv, sizeof *gi->kv_sorted,
                                     cmp_kv);
    return hit ? *hit : NULL;
}

/* The tensor with this name, or NULL. O(log n_tensors). */
const es_tensor *es_gguf_find_tensor(const es_gguf *g, const char *name) {
    if (g == NULL || name == NULL) return NULL;
    const gguf_impl *gi = (const gguf_impl *)g;
    es_tensor probe = { .name = (char *)name };
    const es_tensor *pp = &probe;
    const es_tensor **hit = bsearch(&pp, gi->t_sorted, (size_t)g->n_tensors, sizeof *gi->t_sorted,
                                    cmp_tensor);
    return hit ? *hit : NULL;
}
