/* pagedkv core: flash_attn_paged_sparse on the CPU, the ISA-free driver.
 *
 * Work items are (query row t, KV head) pairs, all on one path that the plan chooses once per call
 * (pkv_sparse_cpu_plan); the kernel is kernels/sparse_item.inc, compiled per ISA like the attention
 * kernels and picked by pkv_cpu_sparse_get() (PAGEDKV_CPU_ISA applies).
 *
 * Why it is built this way. Measured 2026-11-25 on the 2-core AVX2 EPYC (shared: load average 4-8
 * from other jobs throughout) with the quick benchmark's item (benchmarks/bench_sparse.py: B=1,
 * L=65536, K=2048, Hq/Hk 32/8, D 128, bf16, page 16; 8 items of 2048 random 256-byte rows of K
 * and of V). The first kernel (one plain C file, no ISA flags) ran 6.3 ms against 47.4 ms dense
 * (7.5x, ideal L/K = 32x). perf over 400 single-thread calls, shares of its own symbols:
 *   - 61% gathering rows (gather_rows), 93% of that on the instruction after its prefetcht0:
 *     waiting on the scattered rows, requested only 8 rows ahead;
 *   - 28% the dot products and P.V, compiled for baseline x86-64 (SSE, no FMA), one query head
 *     at a time over the gathered rows, the P.V accumulator in memory;
 *   - 6% scalar exp2f, 5% the row conversion (load_vec of the AVX2 table, already vectorized);
 *   - the index decode (page = idx / P, twice per token) showed no instruction above 2% of
 *     gather_rows; every item gathered all 2048 K and V rows as float32 (2 MiB per thread) before
 *     using them, so the converted rows came back from L3 or memory, not L1.
 * Threads: the torch shim splits the 8 items over both cores (4 each), as it should.
 *
 * The kernel now walks the list in 32-entry chunks (a few KiB of scratch, L1-resident), requests
 * each row 16 rows before converting it, scores every query head of the GQA group against each
 * loaded row with vector FMAs, keeps an online softmax over the chunks and the P.V accumulators in
 * registers, per ISA (sparse_item.inc). Single thread, best of 40-60 calls: 6.4 ms before, 3.0 to
 * 3.3 ms after (requests 8, 16, 32 or 64 rows ahead; 4.9 ms when each chunk's rows were requested
 * at the start of the chunk before, 7.7 ms at 128 ahead). CPU time medians over 15 calls, old and
 * new runs alternated at load 5.4-6.4: 8.7 and 8.8 ms before, 7.9 and 7.3 ms after: under memory
 * contention from other jobs the gain shrinks, because what is left is the memory system's.
 * perf now: multiply-adds, softmax and stores 7% of all samples, row conversion 3%, the gather
 * 24%, 96% of it on the prefetch. Much of that wait is the TLB's: each gathered row lies in another
 * 4 KiB page of the 256 MiB pool; the same pool in transparent huge pages (madvise before first
 * touch) ran the item in 2.3 ms, and bench_sparse.py reports both pools. Prefetch variants (CPU
 * time medians, two runs each): every line with prefetcht0 7.5/7.9 ms (kept), first line only
 * 7.5/9.6, prefetchnta 8.9/9.7, prefetcht2 9.1/10.3, a load of the row's first byte 13.4/13.8. */
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
