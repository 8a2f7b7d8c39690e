// pagedkv CUDA backend: the portable kernel of flash_attn_paged_sparse, the
// fallback of the tiled kernel in flash_attn_paged_sparse.cu for what that
// one does not serve (float32 or mixed-dtype caches, head sizes outside its
// list, FP8 groups that split an 8-channel unit, too little shared memory).
//
// One warp per (query token row, query head): the lanes split each listed
// key's dot product over the head size, the warp reduces it, and an online
// softmax in the log2 domain accumulates V with each lane owning channels
// lane, lane + 32, ... The query row is read from global memory once, into
// the warp's slice of shared memory (registers would cost occupancy: 128
// instead of 94 per thread on sm_90a), not again for every listed key. Reads
// K/V through the read-only cache, element by element; entries outside
// [0, N * P) are skipped, never read, whether or not the host checked them.
#include "flash_attn_sparse.cuh"

namespace pkv {
namespace {

constexpr int kSparseThreads = 128;                        // 4 warps, one (row, head) each
constexpr int kSparseLaneDv = kSparsePortableMaxDv / kWarp;  // value channels per lane
constexpr int kSparseSharedD = 576;                        // query channels staged in shared memory (MLA's
                                                           // 576); wider heads read the rest from global

// The descriptor of K or V (pkv_kv_format.h: values, scales, group, K's tail).
__device__ __forceinline__ pkv_kv_cache kv_cache(const pkv_cache_view &values, const pkv_cache_view &scales,
                                                 int64_t group, int64_t tail_dim, int64_t tail_offset,
                                                 int64_t elem_bytes) {
  return pkv_kv_cache{values, scales, group, tail_dim, tail_offset, elem_bytes};
}

__global__ void __launch_bounds__(kSparseThreads) sparse_portable_kernel(const __grid_constant__ SparseParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t hq = p.q.num_heads, d = p.q.head_dim, dv = p.v.head_dim;
  const pkv_kv_cache kc = kv_cache(p.k, p.k_scales, p.quant_group, p.k_tail_dim, p.k_tail_offset, p.k_elem_bytes);
  const pkv_kv_cache vc = kv_cache(p.v, p.v_scales, p.quant_group, 0, 0, 0);
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kSparseThreads / kWarp) + (threadIdx.x >> 5);
  if (item >= p.q.num_rows * hq) return;  // warp-uniform
  const int64_t t = item / hq, head = item % hq, kvh = head / p.heads_per_kv, list = p.ix_heads == 1 ? 0 : kvh;
  const int64_t tokens = pkv_cache_tokens(&p.k), q_off = t * p.q.stride_row + head * p.q.stride_head;
  __shared__ float q_shared[kSparseThreads / kWarp][kSparseSharedD];
  float *qs = q_shared[threadIdx.x >> 5];
  const int d_shared = static_cast<int>(d < kSparseSharedD ? d : kSparseSharedD);
  for (int c = lane; c < d_shared; c += kWarp) qs[c] = pkv_load_f32(p.q.data, q_off + c, p.q.dtype);
  __syncwarp();
  float m = -INFINITY, l = 0.0f, acc[kSparseLaneDv];
#pragma unroll
  for (int i = 0; i < kSparseLaneDv; i++) acc[i] = 0.0f;
  for (int64_t j = 0; j < p.ix_count; j++) {
    const int64_t token = p.indices[t * p.ix_stride_t + list * p.ix_stride_h + j * p.ix_stride_k];
    if (token < 0 || token >= tokens) continue;  // warp-uniform
    const int64_t page = token / p.k.page_size, slot = token % p.k.page_size;
    float dot = 0.0f;  // over the values and K's tail (d = pkv_kv_dim)
    for (int c = lane; c < d_shared; c += kWarp) dot += qs[c] * pkv_kv_load(&kc, page, slot, kvh, c);
    for (int64_t c = lane + kSparseSharedD; c < d; c += kWarp)
      dot += pkv_load_f32(p.q.data, q_off + c, p.q.dtype) * pkv_kv_load(&kc, page, slot, kvh, c);
    dot = warp_sum(dot) * p.score_scale;
    const float s = (p.softcap > 0.0f ? p.softcap * tanhf(dot / p.softcap) : dot) * 1.4426950408889634f;
    float corr, w;
    online_softmax_key(s, m, l, corr, w);
#pragma unroll
    for (int i = 0; i < kSparseLaneDv; i++) {
      const int64_t c = lane + i * kWarp;
      const float v = c < dv ? pkv_kv_value(&vc, page, slot, kvh, c) : 0.0f;
      acc[i] = acc[i] * corr + w * v;
    }
  }
  float inv, lse;
  pkv_softmax_finish(m == -INFINITY ? 0.0f : m, l, p.sinks ? p.sinks[head * p.sinks_stride] : -INFINITY, &inv, &lse);
  const int64_t o_off = t * p.out.stride_row + head * p.out.stride_head;
#pragma unroll
  for (int i = 0; i < kSparseLaneDv; i++) {
    const int64_t c = lane + i * kWarp;
    if (c < dv) pkv_store_f32(p.out.data, o_off + c, p.out.dtype, acc[i] * inv);
  }
}

}  // namespace

cudaError_t launch_sparse_portable(const SparseParams &p, cudaStream_t stream) {
  const int64_t items = p.q.num_rows * p.q.num_heads, per_block = kSparseThreads / kWarp;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  sparse_portable_kernel<<<static_cast<unsigned>(blocks), kSparseThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pkv
