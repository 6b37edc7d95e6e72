/*
 * test_vision.c - the Qwen3-VL vision encoder (vision.c) on the committed tiny projector
 * (tests/data/models/qwen3vl-mmproj-F16.gguf; the tests run from engine_c/): load and info,
 * refused files (missing, a text model, another projector type, truncated), bad encode arguments,
 * results bitwise independent of the thread count and of whether deepstack is asked for, the
 * SIMD kernels bitwise equal to their scalar twins (es_vision_encode_path's reference mode) at
 * several image shapes (tails of the row blocks and panels), and the F16 loads of the packed
 * weights equal to es_fp16_to_fp32 on every finite and infinite value.
 * The values themselves are checked against transformers in tests/test_vision_encoder.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "harness.h"
#include "echospec_engine.h"
#include "rowops.h"

#define MMPROJ "../tests/data/models/qwen3vl-mmproj-F16.gguf"
#define TEXT_MODEL "../tests/data/models/qwen3vl-Q8_0.gguf"

static unsigned char *read_all(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long sz = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *p = malloc((size_t)sz);
    if (p && fread(p, 1, (size_t)sz, f) != (size_t)sz) {
        free(p);
        p = NULL;
    }
    fclose(f);
    *n = (size_t)sz;
    return p;
}

static void write_all(const char *path, const unsigned char *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (fwrite(p, 1, n, f) != n) abort();
    fclose(f);
}

TEST(load_and_info) {
    es_vision *v = NULL;
    char err[256];
    es_status st = es_vision_load(MMPROJ, &v, err, sizeof err);
    CHECK_EQ_INT(st, ES_OK);
    if (st) {
        fprintf(stderr, "  %s\n", err);
        return;
    }
    es_vision_info info;
    CHECK_EQ_INT(es_vision_get_info(v, &info), ES_OK);
    CHECK_EQ_INT(info.patch_size, 16);
    CHECK_EQ_INT(info.merge_size, 2);
    CHECK_EQ_INT(info.n_embd, 64);
    CHECK_EQ_INT(info.n_embd_vision, 64);
    CHECK_EQ_INT(info.n_layer, 2);
    CHECK_EQ_INT(info.n_head, 2);
    CHECK_EQ_INT(info.n_deepstack, 1);
    CHECK(info.image_mean[0] == 0.5f && info.image_std[2] == 0.5f);
    CHECK_EQ_INT(es_vision_deepstack_layer(v, 0), 0);
    CHECK_EQ_INT(es_vision_deepstack_layer(v, 1), -1);
    CHECK_EQ_INT(es_vision_get_info(v, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_get_info(NULL, &info), ES_ERR_INVALID_ARG);
    es_vision_free(v);
    es_vision_free(NULL);
}

TEST(refused_files) {
    es_vision *v = (es_vision *)1;
    char err[256];
    CHECK_EQ_INT(es_vision_load(NULL, &v, err, sizeof err), ES_ERR_INVALID_ARG);
    CHECK(v == NULL);
    CHECK_EQ_INT(es_vision_load(MMPROJ, NULL, err, sizeof err), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_load("no-such-file.gguf", &v, err, sizeof err), ES_ERR_IO);
    CHECK(v == NULL && err[0]);
    CHECK_EQ_INT(es_vision_load(TEXT_MODEL, &v, err, sizeof err), ES_ERR_UNSUPPORTED);
    CHECK(v == NULL && strstr(err, "clip") != NULL);

    size_t n;
    unsigned char *p = read_all(MMPROJ, &n);
    CHECK(p != NULL);
    if (!p) return;
    char path[256];
    snprintf(path, sizeof path, "%s/es_test_vision_%ld.gguf", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
             (long)getpid());
    /* another projector type of the same length */
    unsigned char *q = malloc(n);
    memcpy(q, p, n);
    unsigned char *hit = NULL;
    for (size_t i = 0; i + 14 <= n; i++)
        if (memcmp(q + i, "qwen3vl_merger", 14) == 0) { hit = q + i; break; }
    CHECK(hit != NULL);
    if (hit) {
        memcpy(hit, "qwen2vl_merger", 14);
        write_all(path, q, n);
        CHECK_EQ_INT(es_vision_load(path, &v, err, sizeof err), ES_ERR_UNSUPPORTED);
        CHECK(v == NULL && strstr(err, "qwen2vl_merger") != NULL);
    }
    /* truncated: the header only, then half the file */
    size_t cuts[2] = {200, n / 2};
    for (int k = 0; k < 2; k++) {
        write_all(path, p, cuts[k]);
        es_status st = es_vision_load(path, &v, err, sizeof err);
        CHECK(st != ES_OK);
        CHECK(v == NULL && err[0]);
    }
    /* a renamed tensor: reported by name */
    memcpy(q, p, n);
    hit = NULL;
    for (size_t i = 0; i + 12 <= n; i++)
        if (memcmp(q + i, "v.post_ln.we", 12) == 0) { hit = q + i; break; }
    CHECK(hit != NULL);
    if (hit) {
        hit[2] = 'X';
        write_all(path, q, n);
        CHECK_EQ_INT(es_vision_load(path, &v, err, sizeof err), ES_ERR_MISSING_TENSOR);
        CHECK(strstr(err, "v.post_ln.weight") != NULL);
    }
    remove(path);
    free(q);
    free(p);
}

/* A deterministic image [3][h][w] in roughly [-1, 1]. */
static float *make_image(int h, int w) {
    float *px = malloc(sizeof(float) * 3 * (size_t)h * (size_t)w);
    uint64_t s = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < 3 * (size_t)h * (size_t)w; i++) {
        s ^= s << 13; s ^= s >> 7; s ^= s << 17;
        px[i] = (float)((double)(s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
    }
    return px;
}

TEST(bad_encode_args) {
    es_vision *v = NULL;
    char err[256];
    if (es_vision_load(MMPROJ, &v, err, sizeof err) != ES_OK) {
        CHECK(!"load failed");
        return;
    }
    float *px = make_image(64, 96);
    float out[6 * 64];
    CHECK_EQ_INT(es_vision_encode(NULL, px, 64, 96, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, NULL, 64, 96, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_vision_last_error(v), "pixels") != NULL);
    CHECK_EQ_INT(es_vision_encode(v, px, 64, 96, 1, NULL, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, px, 48, 96, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_vision_last_error(v), "multiples of 32") != NULL);
    CHECK_EQ_INT(es_vision_encode(v, px, 64, 80, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, px, 0, 96, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, px, -32, 96, 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, px, 64, 96, 0, out, NULL), ES_ERR_INVALID_ARG);
    CHECK(strstr(es_vision_last_error(v), "n_threads") != NULL);
    CHECK_EQ_INT(es_vision_encode(v, px, 64, 96, ES_MAX_THREADS + 1, out, NULL), ES_ERR_INVALID_ARG);
    CHECK_EQ_INT(es_vision_encode(v, px, 32 * 1025, 32, 1, out, NULL), ES_ERR_INVALID_ARG);
    /* and a good call after the bad ones clears the message */
    CHECK_EQ_INT(es_vision_encode(v, px, 64, 96, 1, out, NULL), ES_OK);
    CHECK(es_vision_last_error(v)[0] == 0);
    free(px);
    es_vision_free(v);
}

TEST(thread_count_independent) {
    es_vision *v = NULL;
    char err[256];
    if (es_vision_load(MMPROJ, &v, err, sizeof err) != ES_OK) {
        CHECK(!"load failed");
        return;
    }
    const int h = 64, w = 96, n = (h / 32) * (w / 32), d = 64;
    float *px = make_image(h, w);
    float *e[3], *ds[3];
    for (int k = 0; k < 3; k++) {
        e[k] = malloc(sizeof(float) * n * d);
        ds[k] = malloc(sizeof(float) * n * d);
        CHECK_EQ_INT(es_vision_encode(v, px, h, w, k + 1, e[k], ds[k]), ES_OK);
    }
    int finite = 1;
    for (int i = 0; i < n * d; i++) finite &= isfinite(e[0][i]) && isfinite(ds[0][i]);
    CHECK(finite);
    for (int k = 1; k < 3; k++) {
        CHECK(memcmp(e[0], e[k], sizeof(float) * n * d) == 0);
        CHECK(memcmp(ds[0], ds[k], sizeof(float) * n * d) == 0);
    }
    /* without deepstack outputs: the same embeddings */
    float *e4 = malloc(sizeof(float) * n * d);
    CHECK_EQ_INT(es_vision_encode(v, px, h, w, 2, e4, NULL), ES_OK);
    CHECK(memcmp(e[0], e4, sizeof(float) * n * d) == 0);
    /* the deepstack output is not the final merger's */
    CHECK(memcmp(e[0], ds[0], sizeof(float) * n * d) != 0);
    /* a transposed image is encoded differently (rows and columns are not confused) */
    float *pt = malloc(sizeof(float) * 3 * h * w);
    for (int c = 0; c < 3; c++)
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++) pt[((size_t)c * w + x) * h + y] = px[((size_t)c * h + y) * w + x];
    CHECK_EQ_INT(es_vision_encode(v, pt, w, h, 1, e4, NULL), ES_OK);
    CHECK(memcmp(e[0], e4, sizeof(float) * n * d) != 0);
    free(pt);
    free(e4);
    for (int k = 0; k < 3; k++) {
        free(e[k]);
        free(ds[k]);
    }
    free(px);
    es_vision_free(v);
}

/* ld_h (the micro-kernel's F16 load: F16C, NEON or the scalar loop) against the scalar
 * conversion on all 65536 values: equal bits for finite and infinite ones (subnormals included),
 * NaN for NaNs. */
TEST(f16_loads_are_exact) {
    int bad = 0;
    for (uint32_t base = 0; base < 65536; base += AW) {
        uint16_t hv[AW];
        for (int i = 0; i < AW; i++) hv[i] = (uint16_t)(base + (uint32_t)i);
        vaf f = ld_h(hv);
        for (int i = 0; i < AW; i++) {
            const float s = es_fp16_to_fp32(hv[i]);
            uint32_t a, b;
            memcpy(&a, &f[i], 4);
            memcpy(&b, &s, 4);
            if (isnan(s) ? !isnan(f[i]) : a != b) bad++;
        }
    }
    CHECK_EQ_INT(bad, 0);
}

/* The SIMD kernels against their scalar twins, bitwise, and threads 1, 2 and 3 on both. Shapes:
 * 64x96 (24 patches), 96x160 (60: not a multiple of the row block), 32x32 (4: fewer rows than a
 * block). */
TEST(simd_equals_scalar_twin) {
    es_vision *v = NULL;
    char err[256];
    if (es_vision_load(MMPROJ, &v, err, sizeof err) != ES_OK) {
        CHECK(!"load failed");
        return;
    }
    const int shapes[3][2] = {{64, 96}, {96, 160}, {32, 32}};
    for (int si = 0; si < 3; si++) {
        const int h = shapes[si][0], w = shapes[si][1], n = (h / 32) * (w / 32), d = 64;
        float *px = make_image(h, w);
        float *e[4], *ds[4];
        for (int k = 0; k < 4; k++) {
            e[k] = malloc(sizeof(float) * n * d);
            ds[k] = malloc(sizeof(float) * n * d);
        }
        /* 0: reference, 1 thread; 1: reference, 3 threads; 2: SIMD 2 threads; 3: SIMD 3 threads */
        CHECK_EQ_INT(es_vision_encode_path(v, px, h, w, 1, e[0], ds[0], 1), ES_OK);
        CHECK_EQ_INT(es_vision_encode_path(v, px, h, w, 3, e[1], ds[1], 1), ES_OK);
        CHECK_EQ_INT(es_vision_encode_path(v, px, h, w, 2, e[2], ds[2], 0), ES_OK);
        CHECK_EQ_INT(es_vision_encode(v, px, h, w, 3, e[3], ds[3]), ES_OK);
        int finite = 1;
        for (int i = 0; i < n * d; i++) finite &= isfinite(e[0][i]) && isfinite(ds[0][i]);
        CHECK(finite);
        for (int k = 1; k < 4; k++) {
            if (memcmp(e[0], e[k], sizeof(float) * n * d) || memcmp(ds[0], ds[k], sizeof(float) * n * d)) {
                fprintf(stderr, "  %dx%d: run %d differs from the scalar twin\n", h, w, k);
                CHECK(!"bitwise equal to the scalar twin");
            }
        }
        for (int k = 0; k < 4; k++) {
            free(e[k]);
            free(ds[k]);
        }
        free(px);
    }
    es_vision_free(v);
}

int main(void) {
    RUN(load_and_info);
    RUN(refused_files);
    RUN(bad_encode_args);
    RUN(thread_count_independent);
    RUN(f16_loads_are_exact);
    RUN(simd_equals_scalar_twin);
    return harness_report();
}
