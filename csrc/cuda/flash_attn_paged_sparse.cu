// pagedkv CUDA backend: flash_attn_paged_sparse (top-k attention over listed
// tokens). One warp per (query token row, query head): the lanes split each
// listed key's dot product over the head size, the warp reduces it, and an
// online softmax in the log2 domain accumulates V with each lane owning
// channels lane, lane + 32, ... The query row is read from global memory once,
// into the warp's slice of shared memory (registers would cost occupancy: 128
// instead of 94 per thread on sm_90a), not again for every listed key. A portable first kernel (any sm_80+): reads
// through the read-only cache, no TMA yet; entries outside [0, N * P) are
// skipped, never read, whether or not the host checked them.
#include "common.cuh"

namespace pkv {
namespace {

constexpr int kSparseThreads = 128;                    // 4 warps, one (row, head) each
constexpr int kSparseMaxDv = 576;                      // MLA's 512 and every usual head size
constexpr int kSparseLaneDv = kSparseMaxDv / kWarp;    // value channels per lane
constexpr int kSparseSharedD = 576;                    // query channels staged in shared memory (MLA's
                                                       // 576); wider heads read the rest from global

struct SparseParams {
  pkv_rows_view q, out;               // [T, Hq, D], [T, Hq, Dv]
  pkv_cache_view k, v;                // [N, P, Hk, D], [N, P, Hk, Dv]
  pkv_cache_view k_scales, v_scales;  // f32 [N, P, Hk, ceil(D/G)] (FP8) or zeros
  const int32_t *indices;             // [T, Hk or 1, K]
  int64_t ix_stride_t, ix_stride_h, ix_stride_k, ix_heads, ix_count;
  const float *sinks;                 // [Hq] or null
  int64_t sinks_stride;
  int64_t group, quant_group;
  float score_scale, softcap;  // scale; softcap (0: off)
};

// Element c of a cache row (dequantized with its group scale for FP8).
__device__ __forceinline__ float cache_value(const pkv_cache_view &c, const pkv_cache_view &s, int64_t off,
                                             int64_t token, int64_t head, int64_t ch, int64_t group) {
  float x = pkv_load_f32(c.data, off + ch, c.dtype);
  if (s.data != nullptr)
    x *= static_cast<const float *>(s.data)[pkv_cache_token_offset(&s, token, head) + ch / group];
  return x;
}

__global__ void __launch_bounds__(kSparseThreads) sparse_kernel(const __grid_constant__ SparseParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t hq = p.q.num_heads, d = p.q.head_dim, dv = p.v.head_dim;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kSparseThreads / kWarp) + (threadIdx.x >> 5);
  if (item >= p.q.num_rows * hq) return;  // warp-uniform
  const int64_t t = item / hq, head = item % hq, kvh = head / p.group, list = p.ix_heads == 1 ? 0 : kvh;
  const int64_t tokens = p.k.num_pages * p.k.page_size, q_off = t * p.q.stride_row + head * p.q.stride_head;
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
    const int64_t koff = pkv_cache_token_offset(&p.k, token, kvh);
    float dot = 0.0f;
    for (int c = lane; c < d_shared; c += kWarp)
      dot += qs[c] * cache_value(p.k, p.k_scales, koff, token, kvh, c, p.quant_group);
    for (int64_t c = lane + kSparseSharedD; c < d; c += kWarp)
      dot += pkv_load_f32(p.q.data, q_off + c, p.q.dtype) * cache_value(p.k, p.k_scales, koff, token, kvh, c,
                                                                        p.quant_group);
    dot = warp_sum(dot) * p.score_scale;
    const float s = (p.softcap > 0.0f ? p.softcap * tanhf(dot / p.softcap) : dot) * 1.4426950408889634f;
    const float m_new = s > m || s != s ? s : m;
    const float corr = m == -INFINITY ? 0.0f : exp2f(m - m_new), w = exp2f(s - m_new);
    l = l * corr + w;
    m = m_new;
    const int64_t voff = pkv_cache_token_offset(&p.v, token, kvh);
#pragma unroll
    for (int i = 0; i < kSparseLaneDv; i++) {
      const int64_t c = lane + i * kWarp;
      const float v = c < dv ? cache_value(p.v, p.v_scales, voff, token, kvh, c, p.quant_group) : 0.0f;
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
}  // namespace pkv

extern "C" pkv_status pkv_cuda_sparse_supported(const pkv_sparse_args *a, pkv_error *err) {
  if (a->v_cache.sizes[3] > pkv::kSparseMaxDv)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "flash_attn_paged_sparse: value head size %lld is not supported on CUDA (at most %d)",
                    (long long)a->v_cache.sizes[3], pkv::kSparseMaxDv);
  return PKV_OK;
}

extern "C" cudaError_t pkv_cuda_sparse(const pkv_sparse_args *a, cudaStream_t stream) {
  using namespace pkv;
  SparseParams p{};
  p.q = pkv_rows_view_from(&a->q);
  p.out = pkv_rows_view_from(&a->out);
  p.k = pkv_cache_view_from(&a->k_cache);
  p.v = pkv_cache_view_from(&a->v_cache);
  if (a->k_scales.defined) p.k_scales = pkv_cache_view_from(&a->k_scales);
  if (a->v_scales.defined) p.v_scales = pkv_cache_view_from(&a->v_scales);
  p.indices = static_cast<const int32_t *>(a->indices.data);
  p.ix_stride_t = a->indices.strides[0], p.ix_stride_h = a->indices.strides[1], p.ix_stride_k = a->indices.strides[2];
  p.ix_heads = a->indices.sizes[1], p.ix_count = a->indices.sizes[2];
  if (a->sinks.defined) {
    p.sinks = static_cast<const float *>(a->sinks.data);
    p.sinks_stride = a->sinks.strides[0];
  }
  p.group = a->q.sizes[1] / a->k_cache.sizes[2];
  p.quant_group = a->quant_group;
  p.score_scale = static_cast<float>(a->scale);
  p.softcap = static_cast<float>(a->softcap);
  const int64_t items = p.q.num_rows * p.q.num_heads, per_block = kSparseThreads / kWarp;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  sparse_kernel<<<static_cast<unsigned>(blocks), kSparseThreads, 0, stream>>>(p);
  return cudaGetLastError();
}
