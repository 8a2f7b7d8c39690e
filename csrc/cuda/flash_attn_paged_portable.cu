// pagedkv CUDA backend: the portable kernel of flash_attn_paged, for what the tiled kernels
// (flash_attn_paged.cu: head sizes 64/96/128/256 with D == Dv) do not serve: MLA's one latent head
// (D 576, Dv 512: a bf16/f16/FP8 K-only cache with V a view of K's first 512 channels, and the
// packed rows of kv_format, whose rope is a bfloat16 K tail at a byte offset in each row), other
// head sizes up to kPortableMaxD, and D != Dv.
//
// One warp per (query row, query head), as flash_attn_sparse_portable.cu: the query row is staged in
// the warp's slice of shared memory, the lanes split each key's dot product over the channels, the
// warp reduces it, and an online softmax in the log2 domain accumulates V with lane i owning channels
// i, i + 32, ... Keys are walked in order over the row's visible range (causal, window); page ids are
// read once per key and a key whose page is outside [0, N) or past the lookup table is skipped,
// never read. Simple and exact in float32; its speed is not the tiled kernels' (no tensor cores, K/V
// read once per query head): the first GPU run measures it (benchmarks/bench_gpu.py, rows MLA-dec).
#include <cuda_runtime.h>

#include "common.cuh"
#include "pkv_cuda.h"

namespace pkv {
namespace {

constexpr int kPortableThreads = 128;  // 4 warps, one (row, head) each
constexpr int kPortableMaxD = 576;     // q and key channels staged per warp (MLA's 576)
constexpr int kPortableLaneDv = (kPortableMaxD + kWarp - 1) / kWarp;

struct PortableParams {
  pkv_rows_view q, out;
  pkv_cache_view k, v, k_scales, v_scales;  // scales: data null when the cache is not FP8
  pkv_index_view offsets, lengths, table;
  int64_t heads_per_kv;  // Hq / Hk
  int64_t quant_group, window_left, k_tail_dim, k_tail_offset, k_elem_bytes;
  float score_scale;  // scale, times log2(e) without softcap
  float softcap;      // 0: off
  int causal;
  const float *sinks;
  int64_t sinks_stride;
  float *lse;
  int64_t lse_stride_row, lse_stride_head;
};

// Channel c of a cache row at element offset off (dequantized with its group scale for FP8).
__device__ __forceinline__ float row_value(const pkv_cache_view &c, const pkv_cache_view &s, int64_t off,
                                           int64_t page, int64_t slot, int64_t head, int64_t ch, int64_t group) {
  float x = pkv_load_f32(c.data, off + ch, c.dtype);
  if (s.data != nullptr) x *= static_cast<const float *>(s.data)[pkv_cache_offset(&s, page, slot, head) + ch / group];
  return x;
}

// The batch row of query row t: the last b with offsets[b] <= t (offsets are monotone when checked; an
// unchecked table that is not gives some row in [0, B), never an out-of-range one).
__device__ int64_t batch_of(const pkv_index_view &offsets, int64_t t) {
  int64_t lo = 0, hi = offsets.rows - 2;  // B - 1
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (pkv_index_at(&offsets, mid) <= t) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kPortableThreads) attn_portable_kernel(const __grid_constant__ PortableParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t hq = p.q.num_heads, d = p.q.head_dim, dk = p.k.head_dim, dv = p.v.head_dim;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * (kPortableThreads / kWarp) + (threadIdx.x >> 5);
  if (item >= p.q.num_rows * hq) return;  // warp-uniform
  const int64_t t = item / hq, head = item % hq, kvh = head / p.heads_per_kv;
  const int64_t o_off = t * p.out.stride_row + head * p.out.stride_head;
  const int64_t batch = p.offsets.rows - 1, end = batch > 0 ? pkv_index_at(&p.offsets, batch) : 0;
  if (t >= end || batch <= 0) {  // a padding row: zeros, lse -inf
    for (int64_t c = lane; c < dv; c += kWarp) pkv_store_f32(p.out.data, o_off + c, p.out.dtype, 0.0f);
    if (p.lse && lane == 0) p.lse[t * p.lse_stride_row + head * p.lse_stride_head] = -INFINITY;
    return;
  }
  const int64_t b = batch_of(p.offsets, t), first = pkv_index_at(&p.offsets, b);
  const int64_t cached = pkv_cache_length(&p.lengths, b), total = cached + pkv_new_tokens(&p.offsets, b);
  int64_t lo, hi;
  pkv_visible_keys(cached + (t - first), total, p.causal, p.window_left, &lo, &hi);
  const int64_t page_size = p.k.page_size, table_keys = p.table.cols * page_size;
  if (hi > table_keys) hi = table_keys;  // keys past the lookup table are never read

  __shared__ float q_shared[kPortableThreads / kWarp][kPortableMaxD];
  float *qs = q_shared[threadIdx.x >> 5];
  const int64_t q_off = t * p.q.stride_row + head * p.q.stride_head;
  for (int64_t c = lane; c < d; c += kWarp) qs[c] = pkv_load_f32(p.q.data, q_off + c, p.q.dtype);
  __syncwarp();
  float m = -INFINITY, l = 0.0f, acc[kPortableLaneDv];
#pragma unroll
  for (int i = 0; i < kPortableLaneDv; i++) acc[i] = 0.0f;
  for (int64_t key = lo; key < hi; key++) {
    const int32_t id = pkv_page_of(&p.table, b, key, page_size);  // read once: the table may change
    if (!pkv_page_in_pool(id, p.k.num_pages)) continue;           // warp-uniform
    const int64_t slot = pkv_slot_of(key, page_size), koff = pkv_cache_offset(&p.k, id, slot, kvh);
    float dot = 0.0f;
    for (int64_t c = lane; c < dk; c += kWarp)
      dot += qs[c] * row_value(p.k, p.k_scales, koff, id, slot, kvh, c, p.quant_group);
    if (p.k_tail_dim > 0) {  // packed MLA rows: the rope, bfloat16 at a byte offset in the row
      const char *tail = static_cast<const char *>(p.k.data) + koff * p.k_elem_bytes + p.k_tail_offset;
      for (int64_t c = lane; c < p.k_tail_dim; c += kWarp)
        dot += qs[dk + c] * pkv_load_f32(tail, c, PKV_DTYPE_BF16);
    }
    dot = warp_sum(dot) * p.score_scale;
    const float s = p.softcap > 0.0f ? p.softcap * tanhf(dot) * 1.4426950408889634f : dot;
    const float m_new = s > m || s != s ? s : m;
    const float corr = m == -INFINITY ? 0.0f : exp2f(m - m_new), w = exp2f(s - m_new);
    l = l * corr + w;
    m = m_new;
    const int64_t voff = pkv_cache_offset(&p.v, id, slot, kvh);
#pragma unroll
    for (int i = 0; i < kPortableLaneDv; i++) {
      const int64_t c = lane + i * kWarp;
      const float v = c < dv ? row_value(p.v, p.v_scales, voff, id, slot, kvh, c, p.quant_group) : 0.0f;
      acc[i] = acc[i] * corr + w * v;
    }
  }
  float inv, lse;
  pkv_softmax_finish(m == -INFINITY ? 0.0f : m, l, p.sinks ? p.sinks[head * p.sinks_stride] : -INFINITY, &inv, &lse);
#pragma unroll
  for (int i = 0; i < kPortableLaneDv; i++) {
    const int64_t c = lane + i * kWarp;
    if (c < dv) pkv_store_f32(p.out.data, o_off + c, p.out.dtype, acc[i] * inv);
  }
  if (p.lse && lane == 0) p.lse[t * p.lse_stride_row + head * p.lse_stride_head] = lse;
}

}  // namespace

int attn_portable_fits(const pkv_attn_args *a) {
  return a->q.sizes[2] <= kPortableMaxD && a->v_cache.sizes[3] <= kPortableMaxD;
}

cudaError_t launch_attn_portable(const pkv_attn_args *a, cudaStream_t stream) {
  PortableParams p{};
  p.q = pkv_rows_view_from(&a->q);
  p.out = pkv_rows_view_from(&a->out);
  p.k = pkv_cache_view_from(&a->k_cache);
  p.v = pkv_cache_view_from(&a->v_cache);
  if (a->k_scales.defined) p.k_scales = pkv_cache_view_from(&a->k_scales);
  if (a->v_scales.defined) p.v_scales = pkv_cache_view_from(&a->v_scales);
  p.offsets = pkv_index_view_from(&a->input_row_offsets);
  p.lengths = pkv_index_view_from(&a->cache_lengths);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.heads_per_kv = a->q.sizes[1] / a->k_cache.sizes[2];
  p.quant_group = a->quant_group;
  p.window_left = a->window_left;
  p.k_tail_dim = a->k_tail_dim;
  p.k_tail_offset = a->k_tail_offset;
  p.k_elem_bytes = static_cast<int64_t>(pkv_dtype_size(a->k_cache.dtype));
  // softcap: s = softcap * tanh(x * scale / softcap), then log2 units; without: x * scale * log2(e)
  p.softcap = static_cast<float>(a->softcap);
  p.score_scale = a->softcap > 0.0 ? static_cast<float>(a->scale / a->softcap)
                                   : static_cast<float>(a->scale) * 1.4426950408889634f;
  p.causal = a->causal;
  if (a->sinks.defined) {
    p.sinks = static_cast<const float *>(a->sinks.data);
    p.sinks_stride = a->sinks.strides[0];
  }
  if (a->lse.defined) {
    p.lse = static_cast<float *>(a->lse.data);
    p.lse_stride_row = a->lse.strides[0];
    p.lse_stride_head = a->lse.strides[1];
  }
  const int64_t items = p.q.num_rows * p.q.num_heads, per_block = kPortableThreads / kWarp;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  attn_portable_kernel<<<static_cast<unsigned>(blocks), kPortableThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pkv
