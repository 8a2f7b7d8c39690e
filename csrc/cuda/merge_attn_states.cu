// pagedkv CUDA backend: merge_attn_states. One warp per (token, head): the two
// log-sum-exps give the weights (pkv_merge_weights, shared with the CPU: from their
// difference only, exact at any magnitude), then
// the lanes blend the Dv values in float32. Element-wise and memory-bound.
#include "common.cuh"

namespace pkv {
namespace {

constexpr int kMergeThreads = 128;  // 4 warps, one (token, head) each

struct MergeParams {
  pkv_rows_view out_a, out_b, out;  // [T, H, Dv]
  const float *lse_a, *lse_b;       // [T, H]
  float *lse;
  int64_t lse_a_row, lse_a_head, lse_b_row, lse_b_head, lse_row, lse_head;  // strides
};

__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __grid_constant__ MergeParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t heads = p.out_a.num_heads;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kMergeThreads / kWarp) + (threadIdx.x >> 5);
  if (item >= p.out_a.num_rows * heads) return;
  const int64_t row = item / heads, h = item % heads;
  float wa, wb, lse;
  pkv_merge_weights(p.lse_a[row * p.lse_a_row + h * p.lse_a_head], p.lse_b[row * p.lse_b_row + h * p.lse_b_head],
                    &wa, &wb, &lse);
  if (lane == 0) p.lse[row * p.lse_row + h * p.lse_head] = lse;
  const int64_t ia = row * p.out_a.stride_row + h * p.out_a.stride_head;
  const int64_t ib = row * p.out_b.stride_row + h * p.out_b.stride_head;
  const int64_t io = row * p.out.stride_row + h * p.out.stride_head;
  for (int64_t c = lane; c < p.out_a.head_dim; c += kWarp) {
    // a part with weight 0 saw no key: its values may be anything, never read
    const float a = wa != 0.0f ? wa * pkv_load_f32(p.out_a.data, ia + c, p.out_a.dtype) : 0.0f;
    const float b = wb != 0.0f ? wb * pkv_load_f32(p.out_b.data, ib + c, p.out_b.dtype) : 0.0f;
    pkv_store_f32(p.out.data, io + c, p.out.dtype, a + b);
  }
}

}  // namespace
}  // namespace pkv

extern "C" cudaError_t pkv_cuda_merge(const pkv_merge_args *a, cudaStream_t stream) {
  using namespace pkv;
  MergeParams p{};
  p.out_a = pkv_rows_view_from(&a->out_a);
  p.out_b = pkv_rows_view_from(&a->out_b);
  p.out = pkv_rows_view_from(&a->out);
  p.lse_a = static_cast<const float *>(a->lse_a.data);
  p.lse_b = static_cast<const float *>(a->lse_b.data);
  p.lse = static_cast<float *>(a->lse.data);
  p.lse_a_row = a->lse_a.strides[0], p.lse_a_head = a->lse_a.strides[1];
  p.lse_b_row = a->lse_b.strides[0], p.lse_b_head = a->lse_b.strides[1];
  p.lse_row = a->lse.strides[0], p.lse_head = a->lse.strides[1];
  const int64_t items = p.out_a.num_rows * p.out_a.num_heads;
  if (items == 0) return cudaSuccess;
  const int64_t per_block = kMergeThreads / kWarp, blocks = (items + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  merge_kernel<<<static_cast<unsigned>(blocks), kMergeThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
