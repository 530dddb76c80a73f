/* qemu-user TCG plugin for native/tests/neon_icount.py: counts how often each guest instruction in
 * [lo, hi) runs and writes "address count" lines to out= at exit. Written against QEMU's plugin
 * API version 1 (QEMU 6.x-8.1: the inline-add-per-instruction call; the declarations below are
 * the few the plugin uses, so it needs no QEMU headers). Build: cc -O2 -shared -fPIC. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
struct qemu_plugin_insn;
typedef struct qemu_info_t qemu_info_t;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
typedef void (*qemu_plugin_udata_cb_t)(qemu_plugin_id_t id, void *userdata);
typedef void (*qemu_plugin_vcpu_tb_trans_cb_t)(qemu_plugin_id_t id, struct qemu_plugin_tb *tb);
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t id, qemu_plugin_vcpu_tb_trans_cb_t cb);
void qemu_plugin_register_vcpu_insn_exec_inline(struct qemu_plugin_insn *insn, enum qemu_plugin_op op, void *ptr,
                                                uint64_t imm);
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *tb);
struct qemu_plugin_insn *qemu_plugin_tb_get_insn(const struct qemu_plugin_tb *tb, size_t idx);
uint64_t qemu_plugin_insn_vaddr(const struct qemu_plugin_insn *insn);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t id, qemu_plugin_udata_cb_t cb, void *userdata);

__attribute__((visibility("default"))) int qemu_plugin_version = 1;
static uint64_t lo, hi, *cnt;
static const char *out_path = "icount.txt";

static void on_tb(qemu_plugin_id_t id, struct qemu_plugin_tb *tb) {
  (void)id;
  const size_t n = qemu_plugin_tb_n_insns(tb);
  for (size_t i = 0; i < n; i++) {
    struct qemu_plugin_insn *in = qemu_plugin_tb_get_insn(tb, i);
    const uint64_t a = qemu_plugin_insn_vaddr(in);
    if (a >= lo && a < hi) qemu_plugin_register_vcpu_insn_exec_inline(in, QEMU_PLUGIN_INLINE_ADD_U64, &cnt[(a - lo) / 4], 1);
  }
}
static void on_exit_cb(qemu_plugin_id_t id, void *u) {
  (void)id, (void)u;
  FILE *f = fopen(out_path, "w");
  if (!f) return;
  for (uint64_t k = 0; k < (hi - lo) / 4; k++)
    if (cnt[k]) fprintf(f, "%llx %llu\n", (unsigned long long)(lo + 4 * k), (unsigned long long)cnt[k]);
  fclose(f);
}
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info, int argc,
                                                               char **argv) {
  (void)info;
  for (int i = 0; i < argc; i++) {
    if (!strncmp(argv[i], "lo=", 3)) lo = strtoull(argv[i] + 3, NULL, 16);
    else if (!strncmp(argv[i], "hi=", 3)) hi = strtoull(argv[i] + 3, NULL, 16);
    else if (!strncmp(argv[i], "out=", 4)) out_path = argv[i] + 4;
  }
  if (hi <= lo || !(cnt = calloc((size_t)((hi - lo) / 4), sizeof *cnt))) return -1;
  qemu_plugin_register_vcpu_tb_trans_cb(id, on_tb);
  qemu_plugin_register_atexit_cb(id, on_exit_cb, NULL);
  return 0;
}
