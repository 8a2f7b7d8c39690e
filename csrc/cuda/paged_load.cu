// pagedkv CUDA backend: paged_load. Gathers tokens [0, seq_lens[b]) of every
// row into the contiguous ragged output, dequantizing FP8 with the
// (token, head, group) scales. One warp per output row over all its KV heads
// with 16-byte vector loads and stores when the views allow, else one warp per
// (output row, KV head) with element loads.
//
// Bounds: output rows that no [offsets[b], offsets[b] + seq_lens[b]) covers
// are left untouched (as on the CPU); tokens past the lookup table and page
// ids outside [0, N) are skipped, never read.
#include "common.cuh"

namespace pkv {
namespace {

constexpr int kLoadThreads = 128;  // 4 warps

struct LoadParams {
  pkv_cache_view cache;    // [N, P, Hk, D]
  pkv_cache_view scales;   // f32 [N, P, Hk, ceil(D/G)] (FP8)
  pkv_rows_view out;       // [T_out, Hk, D]
  pkv_index_view offsets;  // [B+1] output_row_offsets
  pkv_index_view lengths;  // [B] seq_lens
  pkv_index_view table;    // [B, max_pages]
  int64_t quant_group;  // channels per FP8 scale
};

// Output row `row` -> its cache slot (the batch row b whose block [offsets[b], offsets[b+1]) holds
// it, token t = row - offsets[b]), or false when no block covers it, t is past seq_lens[b] or the
// table, or the page id is invalid.
__device__ __forceinline__ bool load_source(const LoadParams &p, int64_t row, int64_t *page, int64_t *slot) {
  const int64_t page_size = p.cache.page_size;
  const int64_t b = find_batch_row(p.offsets, row);
  if (b < 0) return false;
  const int64_t t = row - pkv_index_at(&p.offsets, b);
  if (t >= pkv_index_at(&p.lengths, b) || t / page_size >= p.table.cols) return false;
  *page = pkv_page_of(&p.table, b, t, page_size);
  if (*page < 0 || *page >= p.cache.num_pages) return false;
  *slot = pkv_slot_of(t, page_size);
  return true;
}

// Elements [c, c + 8) of one head vector (vector path), dequantized for FP8.
template <pkv_dtype kSrc, pkv_dtype kDst>
__device__ __forceinline__ void load_8(const LoadParams &p, int64_t src, int64_t dst, int64_t c, const float *scales) {
  constexpr bool kFp8 = kSrc == PKV_DTYPE_FP8_E4M3 || kSrc == PKV_DTYPE_FP8_E5M2;
  float v[8];
  load8<kSrc>(p.cache.data, src + c, v);
  if constexpr (kFp8) {
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] *= __ldg(scales + (c + k) / p.quant_group);
  }
  store8<kDst>(p.out.data, dst + c, v);
}

template <pkv_dtype kSrc, pkv_dtype kDst, bool kVec>
__global__ void __launch_bounds__(kLoadThreads) load_kernel(const __grid_constant__ LoadParams p) {
#if PKV_ARCH >= 800
  constexpr bool kFp8 = kSrc == PKV_DTYPE_FP8_E4M3 || kSrc == PKV_DTYPE_FP8_E5M2;
  const int lane = threadIdx.x & 31, warps = kLoadThreads / kWarp;
  const int64_t heads = p.cache.num_heads, d = p.cache.head_dim;
  if constexpr (kVec) {
    // a warp per output row: the row's slot is found once, then its lanes walk (head, 8-element
    // group) pairs, all heads' loads in flight together (faster than a warp per (row, head)
    // (measured: benchmarks/README.md, "Measurements behind the CUDA kernels"))
    const int64_t per_head = d / 8;
    for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); row < p.out.num_rows;
         row += static_cast<int64_t>(gridDim.x) * warps) {
      int64_t page, slot;
      if (!load_source(p, row, &page, &slot)) continue;
      for (int64_t e = lane; e < heads * per_head; e += 32) {
        const int64_t head = e / per_head, c = (e - head * per_head) * 8;
        const float *scales = kFp8 ? static_cast<const float *>(p.scales.data) +
                                         pkv_cache_offset(&p.scales, page, slot, head)
                                   : nullptr;
        load_8<kSrc, kDst>(p, pkv_cache_offset(&p.cache, page, slot, head),
                           row * p.out.stride_row + head * p.out.stride_head, c, scales);
      }
    }
    return;
  }
  const int64_t units = p.out.num_rows * heads;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * warps + (threadIdx.x >> 5); u < units;
       u += static_cast<int64_t>(gridDim.x) * warps) {
    const int64_t row = u / heads, head = u % heads;
    int64_t page, slot;
    if (!load_source(p, row, &page, &slot)) continue;
    const int64_t src = pkv_cache_offset(&p.cache, page, slot, head);
    const int64_t dst = row * p.out.stride_row + head * p.out.stride_head;
    const float *scales = kFp8 ? static_cast<const float *>(p.scales.data) + pkv_cache_offset(&p.scales, page, slot, head)
                               : nullptr;
    for (int64_t i = lane; i < d; i += 32) {
      float v = pkv_load_f32(p.cache.data, src + i, kSrc);
      if constexpr (kFp8) v *= __ldg(scales + i / p.quant_group);
      pkv_store_f32(p.out.data, dst + i, kDst, v);
    }
  }
#else
  __trap();
#endif
}

template <pkv_dtype kSrc, pkv_dtype kDst>
cudaError_t launch_load(const LoadParams &p, bool vec, cudaStream_t stream) {
  const int64_t units = vec ? p.out.num_rows : p.out.num_rows * p.cache.num_heads;  // warps' work items
  if (units == 0) return cudaSuccess;
  const int64_t warps = kLoadThreads / kWarp;
  int64_t blocks = (units + warps - 1) / warps;
  blocks = blocks < 65535 * 8 ? blocks : 65535 * 8;
  if (vec)
    load_kernel<kSrc, kDst, true><<<static_cast<unsigned>(blocks), kLoadThreads, 0, stream>>>(p);
  else
    load_kernel<kSrc, kDst, false><<<static_cast<unsigned>(blocks), kLoadThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <pkv_dtype kSrc>
cudaError_t dispatch_out(const LoadParams &p, bool vec, cudaStream_t stream) {
  switch (p.out.dtype) {
  case PKV_DTYPE_F32: return launch_load<kSrc, PKV_DTYPE_F32>(p, vec, stream);
  case PKV_DTYPE_F16: return launch_load<kSrc, PKV_DTYPE_F16>(p, vec, stream);
  case PKV_DTYPE_BF16: return launch_load<kSrc, PKV_DTYPE_BF16>(p, vec, stream);
  default: return cudaErrorInvalidValue;
  }
}

}  // namespace
}  // namespace pkv

extern "C" {

pkv_status pkv_cuda_load_supported(const pkv_load_args *a, pkv_error *err) {
  (void)a;
  (void)err;
  return PKV_OK;
}

cudaError_t pkv_cuda_load(const pkv_load_args *a, cudaStream_t stream) {
  using namespace pkv;
  LoadParams p{};
  p.cache = pkv_cache_view_from(&a->cache);
  if (a->scales.defined) p.scales = pkv_cache_view_from(&a->scales);
  p.out = pkv_rows_view_from(&a->out);
  p.offsets = pkv_index_view_from(&a->output_row_offsets);
  p.lengths = pkv_index_view_from(&a->seq_lens);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.quant_group = a->quant_group;
  if (p.lengths.rows == 0) return cudaSuccess;
  const int64_t ces = static_cast<int64_t>(pkv_dtype_size(p.cache.dtype));
  const int64_t oes = static_cast<int64_t>(pkv_dtype_size(p.out.dtype));
  // a group of 8 elements: 8 * es bytes, loaded/stored as 8- or 16-byte vectors
  const bool vec = p.cache.head_dim % 8 == 0 && pkv_cache_aligned(&p.cache, ces, 8 * ces < 16 ? 8 * ces : 16) &&
                   pkv_rows_aligned(&p.out, oes, 16);
  switch (p.cache.dtype) {
  case PKV_DTYPE_F32: return dispatch_out<PKV_DTYPE_F32>(p, vec, stream);
  case PKV_DTYPE_F16: return dispatch_out<PKV_DTYPE_F16>(p, vec, stream);
  case PKV_DTYPE_BF16: return dispatch_out<PKV_DTYPE_BF16>(p, vec, stream);
  case PKV_DTYPE_FP8_E4M3: return dispatch_out<PKV_DTYPE_FP8_E4M3>(p, vec, stream);
  case PKV_DTYPE_FP8_E5M2: return dispatch_out<PKV_DTYPE_FP8_E5M2>(p, vec, stream);
  default: return cudaErrorInvalidValue;
  }
}

}  // extern "C"
