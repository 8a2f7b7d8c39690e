// pagedkv CUDA backend: TMA tensor maps (host) and the PTX that uses them
// (device): mbarriers, per-page 4-D box loads (sm_90) and tile::gather4
// (sm_100). PTX forms follow shared/notes/TMA.md (compile-checked there).
#pragma once

#include <cuda.h>  // CUtensorMap and its enums only; libcuda is reached through the runtime
#include <stdint.h>

#include "common.cuh"

namespace pkv {

// ---------------------------------------------------------------- host
// Bytes of one swizzle span: every TMA box is one 128-byte column chunk.
constexpr int kSwizzleBytes = 128;

// 2-D map over the cache's token rows for gather4: dims {cols, rows} with
// cols = (Hk-1)*stride_head + D and rows = pkv_cache_num_rows; box {128 B, 1}.
// Needs stride_page % stride_token == 0 and rows < 2^31 (int32 coordinates).
cudaError_t tma_map_rows(CUtensorMap *map, const pkv_cache_view &cache);
// 4-D map {D, Hk, P, N} with the view's strides; box {128 B, 1, box_rows, 1}:
// one box never leaves its page.
cudaError_t tma_map_pages(CUtensorMap *map, const pkv_cache_view &cache, int box_rows);
// Whether the view meets TMA's address rules (16-byte base and strides,
// head rows a whole number of 128-byte chunks).
bool tma_view_ok(const pkv_cache_view &cache);
bool tma_rows_ok(const pkv_cache_view &cache);  // plus the gather4 2-D view conditions

// ---------------------------------------------------------------- device
// mbarrier (sm_90+).
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t count) {
#if PKV_ARCH >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
#else
  __trap();
#endif
}
// Makes the barrier init visible to the async proxy before the first TMA.
__device__ __forceinline__ void fence_mbar_init() {
#if PKV_ARCH >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Orders this thread's generic-proxy shared-memory writes before later
// async-proxy (TMA) writes to the same bytes.
__device__ __forceinline__ void fence_proxy_async_smem() {
#if PKV_ARCH >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
#if PKV_ARCH >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
#else
  __trap();
#endif
}
// Spin until the phase with parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
#if PKV_ARCH >= 900
  asm volatile(
      "{\n\t.reg .pred P1;\n"
      "PKV_WAIT:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n\t"
      "@P1 bra PKV_DONE;\n\t"
      "bra PKV_WAIT;\n"
      "PKV_DONE:\n\t}" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap *map) {
#if PKV_ARCH >= 900
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

// 4-D box load, coordinates innermost first {col, head, slot, page}.
// .shared::cluster destination: PTX 8.0, valid in a launch without clusters.
__device__ __forceinline__ void tma_load_4d(void *dst, const CUtensorMap *map, uint64_t *bar, int c0, int c1, int c2,
                                            int c3) {
#if PKV_ARCH >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2), "r"(c3)
      : "memory");
#else
  __trap();
#endif
}

// gather4: 4 arbitrary rows x one 128-byte column chunk of the 2-D map,
// written as 4 consecutive 128-byte smem rows. Base form (.shared::cta, no
// .cta_group): sm_100 and later.
__device__ __forceinline__ void tma_gather4(void *dst, const CUtensorMap *map, uint64_t *bar, int col, int r0, int r1,
                                            int r2, int r3) {
#if PKV_ARCH >= 1000
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cta.global.tile::gather4.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5, %6, %7}], [%2];" ::"r"(smem_u32(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(smem_u32(bar)), "r"(col), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
      : "memory");
#else
  __trap();
#endif
}

}  // namespace pkv
