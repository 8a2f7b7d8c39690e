/* pagedkv core: flash_attn_paged_sparse on the CPU, the ISA-free driver.
 *
 * Work items are (query row t, KV head) pairs, all on one path that the plan chooses once per call
 * (pkv_sparse_cpu_plan); the kernel is kernels/sparse_item.inc, compiled per ISA like the attention
 * kernels and picked by pkv_cpu_sparse_get() (PAGEDKV_CPU_ISA applies).
 *
 * Each item walks its index list in 32-entry chunks (a few KiB of scratch that stays in L1),
 * requests each row 16 rows before converting it, scores every query head of the GQA group against
 * each loaded row with vector FMAs, and keeps an online softmax over the chunks with the P.V
 * accumulators in registers (sparse_item.inc). The rows are scattered, so the time left is mostly the
 * wait for them (and the TLB's, over 4 KiB pages: bench_sparse.py reports huge-page pools too); every
 * line of a row gets a prefetcht0 (measured: benchmarks/README.md, "Measurements behind the CPU kernels"). */
#include "pkv_cpu.h"
#include "pkv_cpu_sparse.h"

int64_t pkv_sparse_cpu_work(const pkv_sparse_args *a) { return a->q.sizes[0] * a->k_cache.sizes[2]; }

/* The items' path, chosen once per call by the table's sparse_path (kernels/sparse_item.inc), where every
 * rule of it is. */
pkv_sparse_plan pkv_sparse_cpu_plan(const pkv_sparse_args *a) {
  pkv_sparse_plan plan = {(int)pkv_cpu_sparse_get()->sparse_path(a)};
  return plan;
}

pkv_status pkv_sparse_cpu(const pkv_sparse_args *a, const pkv_sparse_plan *plan, int64_t begin, int64_t end,
                          pkv_error *err) {
  return pkv_cpu_sparse_get()->sparse_items(a, (pkv_cpu_sparse_path)plan->path, begin, end, err);
}
