/*
 * fuzz_gguf.c - libFuzzer entry point for the GGUF reader and model loading.
 *
 * Each input is written to one memfd and opened by path (/proc/self/fd/N),
 * as a real file would be: es_gguf_open, the key and tensor lookups, then
 * es_model_load with and without the weight repack. The contract under test:
 * any bytes give a status and a message, never a crash, a leak or UB (the
 * build adds ASan + UBSan). Built and run by .ci/fuzz_gguf.sh.
 *
 * -DES_FUZZ_CANARY plants a crash on any valid version-2 file, so the CI
 * script can prove that a crash found by the fuzzer fails the run.
 */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

static int g_fd = -1;
static char g_path[64];

static int write_input(const uint8_t *data, size_t size) {
    if (g_fd < 0) {
        g_fd = memfd_create("fuzz_gguf", MFD_CLOEXEC);
        if (g_fd < 0) abort();
        snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    }
    if (ftruncate(g_fd, 0) != 0) abort();
    size_t done = 0;
    while (done < size) {
        ssize_t n = pwrite(g_fd, data + done, size - done, (off_t)done);
        if (n <= 0) abort();
        done += (size_t)n;
    }
    return 0;
}

static void check_message(es_status st, const char *err) {
    /* every failure carries a message */
    if (st != ES_OK && err[0] == '\0') abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    write_input(data, size);
    char err[256] = "";
    es_gguf *g = NULL;
    es_status st = es_gguf_open(g_path, &g, err, sizeof err);
    check_message(st, err);
    if (st != ES_OK) return 0;
#ifdef ES_FUZZ_CANARY
    if (g->version == 2) abort();
#endif
    for (int64_t i = 0; i < g->n_kv; i++) {
        if (es_gguf_find_kv(g, g->kv[i].key) != &g->kv[i]) abort();
    }
    for (int64_t i = 0; i < g->n_tensors; i++) {
        const es_tensor *t = &g->tensors[i];
        if (es_gguf_find_tensor(g, t->name) != t) abort();
        /* touch the first and last byte of every region: inside the map */
        volatile uint8_t sink = ((const uint8_t *)t->data)[0];
        sink = ((const uint8_t *)t->data)[t->nbytes - 1];
        (void)sink;
    }
    es_gguf_close(g);
    for (int repack = 0; repack < 2; repack++) {
        es_model_params p = es_model_default_params();
        p.flags = repack ? 0 : ES_MODEL_NO_REPACK;
        es_model *m = NULL;
        err[0] = '\0';
        st = es_model_load(g_path, &p, &m, err, sizeof err);
        check_message(st, err);
        es_model_free(m);
    }
    return 0;
}
