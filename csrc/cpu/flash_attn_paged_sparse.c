/* pagedkv core: flash_attn_paged_sparse on the CPU, the ISA-free driver.
 *
 * Work items are (query row t, KV head) pairs; the kernel is kernels/sparse_item.inc, compiled per
 * ISA like the attention kernels and picked by pkv_cpu_sparse_get() (PAGEDKV_CPU_ISA applies).
 *
 * Why it is built this way (measured 2026-11-25 on the 2-core AVX2 EPYC of the quick benchmark,
 * benchmarks/bench_sparse.py: B=1, L=65536, K=2048, Hq/Hk 32/8, D 128, bf16, page 16):
 * the first kernel (a plain C file, no ISA flags) ran 6.3 ms against 47.4 ms dense (7.5x of the
 * ideal L/K = 32x). perf over 400 single-thread calls of it, kernel symbols only:
 *   - 61% gathering rows (gather_rows): 93% of that on its prefetcht0, i.e. waiting for the
 *     random 256-byte rows, prefetched only 8 rows ahead, while nothing else could run;
 *   - 28% the dot products and the P.V loop: compiled for the baseline x86-64 (SSE, no FMA,
 *     4 lanes), one query head at a time against the gathered rows, the P.V accumulator in
 *     memory (a load and a store per 4 multiply-adds);
 *   - 6% scalar exp2f, 5% the row conversion (load_vec: already vectorized, AVX2 table);
 *   - every call also allocated 2 MiB of scratch per thread (K then V of the whole list as
 *     float32) and touched it fresh: page faults beyond the glibc mmap threshold, and a working
 *     set far beyond L2, so the gathered rows were read from memory twice (cache, then scratch).
 * Threads: the torch shim splits the 8 items over both cores (4 each); the index decode
 * (page = idx / P: two divisions per token) cost under 1%.
 * The kernel now walks the list in 32-entry chunks (scratch of a few KiB, L1-resident), prefetches
 * the next chunk's rows while converting this one's, scores every query head of the GQA group
 * against each loaded row with vector FMAs, keeps an online softmax over the chunks and the P.V
 * accumulators in registers, per ISA; see sparse_item.inc. */
#include "pkv_cpu.h"
#include "pkv_cpu_sparse.h"

int64_t pkv_sparse_cpu_work(const pkv_sparse_args *a) { return a->q.sizes[0] * a->k_cache.sizes[2]; }

pkv_status pkv_sparse_cpu(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err) {
  return pkv_cpu_sparse_get()(a, begin, end, err);
}
