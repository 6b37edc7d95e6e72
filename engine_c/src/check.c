/*
 * check.c - the weights check at load (es_model_load's contract in
 * echospec_engine.h): no NaN or infinity in a tensor's block scales or in
 * its float values.
 *
 * A quantized value is d * q (Q4_0, Q5_0, Q8_0, Q6_K: d times an integer
 * scale and quant on the K types) or d * q - m (Q4_1, Q5_1; Q4_K and Q5_K
 * with dmin), with q and the 6-bit sub-block scales small integers, so finite
 * scales make every value finite: the default check reads the scales only
 * (one or two f16 per block, a memory-bandwidth-bound pass over the file's
 * pages) and every element of the F32 / F16 / BF16 tensors. The full check
 * (ES_MODEL_CHECK_WEIGHTS) decodes every row of every quantized tensor with
 * es_dequantize_row and checks each value.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "quant.h"

static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

/* 1 when the IEEE binary16 / bfloat16 / binary32 bits are NaN or infinite (exponent all ones). */
static int f16_bad(uint16_t h) { return (h & 0x7c00u) == 0x7c00u; }
static int bf16_bad(uint16_t h) { return (h & 0x7f80u) == 0x7f80u; }
static int f32_bad(uint32_t b) { return (b & 0x7f800000u) == 0x7f800000u; }

/* "NaN", "+inf" or "-inf" for a value whose exponent bits are all ones. */
static const char *bad_name(int nan, int neg) { return nan ? "NaN" : neg ? "-inf" : "+inf"; }

/* Byte offsets of the f16 scales in a block of type t: off[0] is d, off[1] the
 * second scale (m, dmin) or -1. 0 when t is not a quantized type. */
static int scale_offsets(uint32_t t, int off[2]) {
    off[1] = -1;
    switch (t) {
    case ES_TYPE_Q4_0: case ES_TYPE_Q5_0: case ES_TYPE_Q8_0:
        off[0] = 0;
        return 1;
    case ES_TYPE_Q4_1: case ES_TYPE_Q5_1: case ES_TYPE_Q4_K: case ES_TYPE_Q5_K:
        off[0] = 0;
        off[1] = 2;
        return 1;
    case ES_TYPE_Q6_K:
        off[0] = (int)offsetof(es_block_q6_K, d);
        return 1;
    default:
        return 0;
    }
}

/* The scales of every block of quantized tensor t. Blocks are scanned in runs
 * whose flags are OR-ed (a loop without a branch per block); a run with a bad
 * scale is scanned again for the first one. */
static es_status check_scales(const es_tensor *t, const int off[2], char *err, size_t err_len) {
    const uint8_t *p = t->data;
    size_t bb = es_type_block_bytes(t->type);
    size_t nb = t->nbytes / bb;
    const char *names[2] = {"d", t->type == ES_TYPE_Q4_1 || t->type == ES_TYPE_Q5_1 ? "m" : "dmin"};
    for (size_t b0 = 0; b0 < nb; b0 += 4096) {
        size_t b1 = nb - b0 < 4096 ? nb : b0 + 4096;
        int bad = 0;
        for (int k = 0; k < 2 && off[k] >= 0; k++)
            for (size_t b = b0; b < b1; b++) bad |= f16_bad(rd16(p + b * bb + (size_t)off[k]));
        if (!bad) continue;
        for (size_t b = b0; b < b1; b++)
            for (int k = 0; k < 2 && off[k] >= 0; k++) {
                uint16_t h = rd16(p + b * bb + (size_t)off[k]);
                if (!f16_bad(h)) continue;
                es_set_err(err, err_len, "weights: tensor '%.64s' (%s): block %zu of %zu has scale %s = %s "
                           "(f16 0x%04x); the file is corrupt", t->name, es_type_name(t->type), b, nb,
                           names[k], bad_name((h & 0x3ffu) != 0, (h & 0x8000u) != 0), (unsigned)h);
                return ES_ERR_BAD_WEIGHTS;
            }
    }
    return ES_OK;
}

/* Element i of a float tensor: 1 when NaN or infinite; *nan and *neg describe it. */
static int float_elem_bad(const es_tensor *t, const uint8_t *p, size_t i, int *nan, int *neg) {
    if (t->type == ES_TYPE_F32) {
        uint32_t b = rd32(p + 4 * i);
        *nan = (b & 0x7fffffu) != 0;
        *neg = (b >> 31) != 0;
        return f32_bad(b);
    }
    uint16_t h = rd16(p + 2 * i);
    *nan = t->type == ES_TYPE_F16 ? (h & 0x3ffu) != 0 : (h & 0x7fu) != 0;
    *neg = (h >> 15) != 0;
    return t->type == ES_TYPE_F16 ? f16_bad(h) : bf16_bad(h);
}

/* Every element of an F32, F16 or BF16 tensor. */
static es_status check_floats(const es_tensor *t, char *err, size_t err_len) {
    const uint8_t *p = t->data;
    size_t n = (size_t)t->n_elements;
    for (size_t i0 = 0; i0 < n; i0 += 16384) {
        size_t i1 = n - i0 < 16384 ? n : i0 + 16384;
        int bad = 0;
        if (t->type == ES_TYPE_F32)
            for (size_t i = i0; i < i1; i++) bad |= f32_bad(rd32(p + 4 * i));
        else if (t->type == ES_TYPE_F16)
            for (size_t i = i0; i < i1; i++) bad |= f16_bad(rd16(p + 2 * i));
        else
            for (size_t i = i0; i < i1; i++) bad |= bf16_bad(rd16(p + 2 * i));
        if (!bad) continue;
        for (size_t i = i0; i < i1; i++) {
            int nan, neg;
            if (!float_elem_bad(t, p, i, &nan, &neg)) continue;
            es_set_err(err, err_len, "weights: tensor '%.64s' (%s): element %zu of %zu is %s; the file is corrupt",
                       t->name, es_type_name(t->type), i, n, bad_name(nan, neg));
            return ES_ERR_BAD_WEIGHTS;
        }
    }
    return ES_OK;
}

/* The full check of quantized tensor t: every row decoded, every value finite. */
static es_status check_decoded(const es_tensor *t, char *err, size_t err_len) {
    int64_t n_in = t->ne[0], rows = t->n_elements / n_in;
    float *row = malloc((size_t)n_in * sizeof *row);
    if (row == NULL) {
        es_set_err(err, err_len, "weights: out of memory for a row of tensor '%.64s'", t->name);
        return ES_ERR_NOMEM;
    }
    es_status st = ES_OK;
    for (int64_t r = 0; r < rows && st == ES_OK; r++) {
        es_dequantize_row(t->type, (const uint8_t *)t->data + (size_t)r * t->row_bytes, row, n_in);
        int bad = 0;
        for (int64_t i = 0; i < n_in; i++) bad |= row[i] != row[i] || row[i] - row[i] != 0.0f;
        for (int64_t i = 0; bad && i < n_in; i++) {
            if (row[i] == row[i] && row[i] - row[i] == 0.0f) continue;
            es_set_err(err, err_len, "weights: tensor '%.64s' (%s): row %lld, element %lld decodes to %s; "
                       "the file is corrupt", t->name, es_type_name(t->type), (long long)r, (long long)i,
                       bad_name(row[i] != row[i], row[i] < 0.0f));
            st = ES_ERR_BAD_WEIGHTS;
            break;
        }
    }
    free(row);
    return st;
}

/* See es_model_load (echospec_engine.h): every tensor of the file, in file
 * order; the first bad value is reported. full: ES_MODEL_CHECK_WEIGHTS. */
es_status es_check_weights(const es_gguf *g, int full, char *err, size_t err_len) {
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const es_tensor *t = &g->tensors[i];
        int off[2];
        es_status st = ES_OK;
        if (t->type == ES_TYPE_F32 || t->type == ES_TYPE_F16 || t->type == ES_TYPE_BF16)
            st = check_floats(t, err, err_len);
        else if (scale_offsets(t->type, off)) {
            st = check_scales(t, off, err, err_len);
            if (st == ES_OK && full) st = check_decoded(t, err, err_len);
        }
        if (st != ES_OK) return st;
    }
    return ES_OK;
}
