/*
 * a76_insn_plugin.c - a qemu TCG plugin (plugin API version 1, qemu 7.2 as
 * Debian 12 ships it in qemu-user) that counts the guest instructions a
 * program executes and prints "insns N" to stderr when it exits. Used by
 * bench/a76_estimate.py (`qemu-aarch64 -plugin ./a76_insn_plugin.so ...`) to
 * count instructions per forward of an aarch64 build.
 *
 * The few API declarations are written out here (the same signatures as
 * qemu's include/qemu/qemu-plugin.h of that version), so the plugin builds
 * without qemu's source: cc -O2 -shared -fPIC a76_insn_plugin.c -o a76_insn_plugin.so
 * The count is a per-translation-block inline add: exact for a program
 * that runs on one thread (a block left early by an exception counts in
 * full; the engine raises none). Several threads race on the counter.
 */
#include <inttypes.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef uint64_t qemu_plugin_id_t;
typedef struct qemu_info_t qemu_info_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;

static uint64_t insns;

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns, qemu_plugin_tb_n_insns(tb));
}

static void at_exit(qemu_plugin_id_t id, void *p) {
    (void)id;
    (void)p;
    fprintf(stderr, "insns %" PRIu64 "\n", insns);
}

EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc, char **argv) {
    (void)info;
    (void)argc;
    (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, tb_trans);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
