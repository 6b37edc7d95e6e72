/*
 * a76_insn_plugin.c - a qemu TCG plugin (plugin API version 1, qemu 7.2 as
 * Debian 12 ships it in qemu-user) that counts the guest instructions a
 * program executes. At each marker system call, write(-1, buf, len) (an
 * fd no program writes to; a76_count.c makes them around the calls
 * it measures), it prints "mark LEN insns N" to stderr, and at exit
 * "insns N". Used by a76_estimate.py
 * (`qemu-aarch64 -plugin ./a76_insn_plugin.so ...`).
 *
 * The few API declarations are written out here (the same signatures as
 * qemu's include/qemu/qemu-plugin.h of that version), so the plugin builds
 * without qemu's source: `make -C tools/perf a76_insn_plugin.so`.
 * The count is a per-translation-block inline add at the block's entry:
 * exact for a program that runs on one thread (a block left early by an
 * exception counts in full; the engine raises none; a system call ends its
 * block, so a marker sees every instruction before it). Several threads
 * race on the counter.
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
typedef void (*qemu_plugin_vcpu_syscall_cb_t)(qemu_plugin_id_t id, unsigned int vcpu_index, int64_t num,
                                              uint64_t a1, uint64_t a2, uint64_t a3, uint64_t a4, uint64_t a5,
                                              uint64_t a6, uint64_t a7, uint64_t a8);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *tb, enum qemu_plugin_op op, void *ptr,
                                              uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);
void qemu_plugin_register_vcpu_syscall_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_syscall_cb_t cb);

#define EXPORT __attribute__((visibility("default")))
EXPORT int qemu_plugin_version = 1;

#define AARCH64_NR_WRITE 64

static uint64_t insns;

static void tb_trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns, qemu_plugin_tb_n_insns(tb));
}

static void on_syscall(qemu_plugin_id_t id, unsigned int vcpu, int64_t num, uint64_t a1, uint64_t a2, uint64_t a3,
                       uint64_t a4, uint64_t a5, uint64_t a6, uint64_t a7, uint64_t a8) {
    (void)id, (void)vcpu, (void)a2, (void)a4, (void)a5, (void)a6, (void)a7, (void)a8;
    if (num == AARCH64_NR_WRITE && (int64_t)a1 == -1) fprintf(stderr, "mark %" PRIu64 " insns %" PRIu64 "\n", a3, insns);
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
    qemu_plugin_register_vcpu_syscall_cb(id, on_syscall);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
