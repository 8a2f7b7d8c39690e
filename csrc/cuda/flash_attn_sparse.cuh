// pagedkv CUDA backend: what the two kernels of flash_attn_paged_sparse share.
//
// flash_attn_paged_sparse.cu holds the tiled kernel (one CTA per query row
// and KV head; listed K/V rows staged in shared memory by cp.async or TMA
// gather4), the host plan and the C entry points; flash_attn_sparse_portable.cu
// holds the portable warp-per-(row, head) kernel that serves what the tiled
// one does not (float32 caches, other head sizes, too little shared memory).
#pragma once

#include "tile.cuh"

namespace pkv {

struct SparseParams {
  pkv_rows_view q, out;               // [T, Hq, D], [T, Hq, Dv]
  pkv_cache_view k, v;                // [N, P, Hk, D], [N, P, Hk, Dv]
  pkv_cache_view k_scales, v_scales;  // f32 [N, P, Hk, ceil(D/G)] (FP8) or zeros
  const int32_t *indices;             // [T, Hk or 1, K]
  int64_t ix_stride_t, ix_stride_h, ix_stride_k, ix_heads, ix_count;
  const float *sinks;  // [Hq] or null
  int64_t sinks_stride;
  int64_t group, quant_group;  // Hq / Hk; channels per FP8 scale
  float score_scale, softcap;  // scale; softcap (0: off)
};

// The portable kernel (flash_attn_sparse_portable.cu): any dtypes, head sizes
// up to kSparsePortableMaxDv, plain global loads.
constexpr int kSparsePortableMaxDv = 576;
cudaError_t launch_sparse_portable(const SparseParams &p, cudaStream_t stream);

}  // namespace pkv
