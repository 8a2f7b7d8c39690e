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

#include "flash_attn.cuh"

namespace pkv {
namespace {

constexpr int kPortableThreads = 128;  // 4 warps, one (row, head) each
constexpr int kPortableMaxD = 576;     // q and key channels staged per warp (MLA's 576)
constexpr int kPortableLaneDv = (kPortableMaxD + kWarp - 1) / kWarp;

struct PortableParams {
  pkv_rows_view q, out;
  pkv_kv_cache k, v;  // values, scales, group; K's tail (packed rows' rope)
  pkv_index_view offsets, lengths, table;
  int64_t heads_per_kv;  // Hq / Hk
  int64_t window_left;
  float score_scale;  // scale, times log2(e) without softcap
  float softcap;      // 0: off
  int causal;
  const float *sinks;
  int64_t sinks_stride;
  float *lse;
  int64_t lse_stride_row, lse_stride_head;
};

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
  const pkv_kv_cache kc = p.k, vc = p.v;  // local copies: addresses of kernel parameters cost local memory
  const int64_t hq = p.q.num_heads, d = p.q.head_dim, dk = kc.values.head_dim, dv = vc.values.head_dim;
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
  const int64_t page_size = p.k.values.page_size, table_keys = p.table.cols * page_size;
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
    if (!pkv_page_in_pool(id, p.k.values.num_pages)) continue;    // warp-uniform
    const int64_t slot = pkv_slot_of(key, page_size);
    float dot = 0.0f;  // over the values, then the tail (d = pkv_kv_dim)
    for (int64_t c = lane; c < dk; c += kWarp) dot += qs[c] * pkv_kv_value(&kc, id, slot, kvh, c);
    for (int64_t c = lane; c < kc.tail_dim; c += kWarp) dot += qs[dk + c] * pkv_kv_tail(&kc, id, slot, kvh, c);
    dot = warp_sum(dot) * p.score_scale;
    const float s = p.softcap > 0.0f ? p.softcap * tanhf(dot) * 1.4426950408889634f : dot;
    float corr, w;
    online_softmax_key(s, m, l, corr, w);
#pragma unroll
    for (int i = 0; i < kPortableLaneDv; i++) {
      const int64_t c = lane + i * kWarp;
      const float v = c < dv ? pkv_kv_value(&vc, id, slot, kvh, c) : 0.0f;
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
  p.k = pkv_kv_cache_from(&a->k_cache, &a->k_scales, a->quant_group, a->k_tail_dim, a->k_tail_offset);
  p.v = pkv_kv_cache_from(&a->v_cache, &a->v_scales, a->quant_group, 0, 0);
  p.offsets = pkv_index_view_from(&a->input_row_offsets);
  p.lengths = pkv_index_view_from(&a->cache_lengths);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.heads_per_kv = a->q.sizes[1] / a->k_cache.sizes[2];
  p.window_left = a->window_left;
  // softcap: s = softcap * tanh(x * scale / softcap), then log2 units; without: x * scale * log2(e)
  p.softcap = static_cast<float>(a->softcap);
  p.score_scale = a->softcap > 0.0 ? static_cast<float>(a->scale / a->softcap)
                                   : static_cast<float>(a->scale) * 1.4426950408889634f;
  p.causal = a->causal;
  set_sinks_and_lse(p, a);
  const int64_t items = p.q.num_rows * p.q.num_heads, per_block = kPortableThreads / kWarp;
  if (items == 0) return cudaSuccess;
  const int64_t blocks = (items + per_block - 1) / per_block;
  if (blocks > 0x7fffffff) return cudaErrorInvalidConfiguration;
  attn_portable_kernel<<<static_cast<unsigned>(blocks), kPortableThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace pkv
