// pagedkv CUDA backend: what a CTA of flash_attn_paged's attention kernel works on: the kernel
// parameters (AttnParams), the shared-memory layout (AttnLayout), which batch row and query tile a CTA
// takes (locate_tile), the padding rows' zeros and the key split's fold of the warps' softmax states.
// Internal to flash_attn_paged.cu (its one includer): everything here has internal linkage.
#pragma once

#include <math.h>

#include "flash_attn.cuh"

namespace pkv {
namespace {

constexpr int kAttnThreads = 128;  // 4 warps x 16 (128-row prefill tiles: 32) packed query rows
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLazySlack = 8.0f;  // 128-row tiles: how far (log2) a row's maximum may rise before O is rescaled

template <int D, bool kFp8, int kBM = kAttnRowsM>
struct AttnLayout {
  static constexpr int kRowsN = attn_tile_keys(D);
  static constexpr int kEs = kFp8 ? 1 : 2;
  static constexpr int kDPad = tile_row_bytes(D, 2) / 2;       // 16-bit elements per smem row
  static constexpr int kRawRowBytes = tile_row_bytes(D, kEs);  // bytes per row as loaded
  static constexpr int kRawUnits = D * kEs / 16;               // 16-byte units holding data
  static constexpr int kRawChunks = kRawRowBytes / kChunkBytes;
  static constexpr int kQBytes = kBM * kDPad * 2;
  static constexpr int kRawTileBytes = kRowsN * kRawRowBytes;
  static constexpr int kConvTileBytes = kFp8 ? kRowsN * kDPad * 2 : 0;
  // [Q][stage 0 K, V][stage 1 K, V][converted K, V][3 x tile rows][2 barriers][FP8 row scales]
  static constexpr int kRawOffset = kQBytes;
  static constexpr int kConvOffset = kRawOffset + 4 * kRawTileBytes;
  static constexpr int kRowsOffset = kConvOffset + 2 * kConvTileBytes;
  static constexpr int kBarOffset = kRowsOffset + 3 * kRowsN * static_cast<int>(sizeof(TileRows));
  // FP8 with one scale per row: [2 stages][K, V][kRowsN] scales staged a tile ahead
  static constexpr int kScaleOffset = kBarOffset + 16;
  static constexpr int kBytes = kScaleOffset + (kFp8 ? 4 * kRowsN * static_cast<int>(sizeof(float)) : 0);
  static constexpr int kAllocBytes = kBytes + 1024;  // room to align the base to 1024 bytes
  static_assert(kRowsN % 16 == 0 && D % 16 == 0 && kRawChunks >= 1, "tile shapes");
};

struct AttnParams {
  pkv_rows_view q;    // [T, Hq, D]
  pkv_rows_view out;  // [T, Hq, Dv]
  pkv_cache_view k, v;              // [N, P, Hk, D]
  pkv_cache_view k_scales, v_scales;  // f32 [N, P, Hk, ceil(D/G)] (FP8 only)
  pkv_index_view offsets;  // [B+1]
  pkv_index_view lengths;  // [B] cache_lengths
  pkv_index_view table;    // [B, max_pages]
  int64_t num_rows;        // T
  int64_t heads_per_kv;    // Hq / Hk: query heads per KV head (GQA)
  int64_t quant_group;
  int64_t window_left;
  int64_t rows_per_page;   // stride_page / stride_token (gather4 rows)
  float score_scale;       // scale * log2(e); scale / softcap with a softcap
  float softcap_log2;      // softcap * log2(e); 0: no softcap
  int causal;
  int num_splits;
  int e4m3;
  int q_aligned, out_aligned, kv_aligned;
  int box_rows;
  float *partial_out;  // [S, T, Hq, Dv]
  float *partial_lse;  // [S, T, Hq]
  const float *sinks;  // [Hq] or null: exp(sinks[h]) joins head h's softmax denominator
  int64_t sinks_stride;
  float *lse;          // [T, Hq] or null: natural-log softmax denominators (flash_attn_paged_lse)
  int64_t lse_stride_row, lse_stride_head;
};

// Rows [start, start + n) of batch row b, clamped to [0, T).
__device__ __forceinline__ void batch_rows(const AttnParams &p, int64_t b, int64_t *start, int64_t *n) {
  int64_t s = pkv_index_at(&p.offsets, b), e = pkv_index_at(&p.offsets, b + 1);
  s = s < 0 ? 0 : (s > p.num_rows ? p.num_rows : s);
  e = e < s ? s : (e > p.num_rows ? p.num_rows : e);
  *start = s;
  *n = e - s;
}

template <int kBM>
__device__ __forceinline__ int64_t tiles_of(const AttnParams &p, int64_t b) {
  int64_t s, n;
  batch_rows(p, b, &s, &n);
  return (n * p.heads_per_kv + kBM - 1) / kBM;
}

// CTA x handles tile `tile` of batch row `b`: a block-wide scan of the tile
// counts (every CTA does it; B int32 reads from L2 cost less than a launch).
template <int kBM>
__device__ void locate_tile(const AttnParams &p, int64_t x, int64_t *b_out, int64_t *tile_out) {
  __shared__ int64_t warp_total[kAttnThreads / kWarp];
  __shared__ int64_t found_b, found_tile;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) found_b = -1;
  const int64_t batch = p.offsets.rows - 1;
  const int64_t per = (batch + kAttnThreads - 1) / kAttnThreads;
  const int64_t b0 = threadIdx.x * per, b1 = b0 + per < batch ? b0 + per : batch;
  int64_t local = 0;
  for (int64_t b = b0; b < b1; b++) local += tiles_of<kBM>(p, b);
  int64_t incl = local;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int64_t v = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == kWarp - 1) warp_total[warp] = incl;
  __syncthreads();
  int64_t before = 0;
  for (int w = 0; w < warp; w++) before += warp_total[w];
  int64_t acc = before + incl - local;
  if (x >= acc && x < acc + local) {
    for (int64_t b = b0; b < b1; b++) {
      const int64_t n = tiles_of<kBM>(p, b);
      if (x < acc + n) {
        found_b = b;
        found_tile = x - acc;
        break;
      }
      acc += n;
    }
  }
  __syncthreads();
  *b_out = found_b;
  *tile_out = found_tile;
}

template <typename T>
__device__ __forceinline__ void store_pair(T *dst, float x, float y, bool aligned) {
  if (aligned) {
    *reinterpret_cast<uint32_t *>(dst) = pack2<T>(x, y);
  } else {
    const uint32_t v = pack2<T>(x, y);
    reinterpret_cast<uint16_t *>(dst)[0] = static_cast<uint16_t>(v & 0xffff);
    reinterpret_cast<uint16_t *>(dst)[1] = static_cast<uint16_t>(v >> 16);
  }
}

// Padding rows [offsets[B], T) output zeros and lse -inf (non-split launches;
// the combine kernel does it otherwise). Spread over the CTAs of split 0.
template <typename T>
__device__ void zero_padding_rows(const AttnParams &p, int64_t kv_head, int dv) {
  int64_t first = pkv_index_at(&p.offsets, p.offsets.rows - 1);
  first = first < 0 ? 0 : first;
  const int64_t heads = p.heads_per_kv;
  for (int64_t r = first + blockIdx.x; r < p.num_rows; r += gridDim.x) {
    for (int64_t i = threadIdx.x; i < heads * dv; i += kAttnThreads) {
      const int64_t h = kv_head * p.heads_per_kv + i / dv, c = i % dv;
      T *dst = static_cast<T *>(p.out.data) + r * p.out.stride_row + h * p.out.stride_head + c;
      *reinterpret_cast<uint16_t *>(dst) = 0;
    }
    if (p.lse)
      for (int64_t i = threadIdx.x; i < heads; i += kAttnThreads)
        p.lse[r * p.lse_stride_row + (kv_head * p.heads_per_kv + i) * p.lse_stride_head] = -INFINITY;
  }
}

template <int N>
struct IntTag {
  static constexpr int value = N;
};

// The key split's end: warps 1..kWarps-1 hold softmax states (running max, partial sums, unnormalised
// output fragments) of the same 16 rows as warp 0 over other keys. They leave them in `fold` (shared
// memory, [warp - 1][slot][lane]: the same fragment layout in every warp) and warp 0 merges them into
// its own. A state that saw no key (max -inf) holds zeros and adds nothing; a NaN sum stays NaN.
// Called by every thread of the CTA (it synchronises).
template <int D, int kWarps>
__device__ __forceinline__ void fold_warp_states(float *fold, int warp, int lane, float (&o)[D / 8][4],
                                                 float (&row_max)[2], float (&row_sum)[2]) {
  constexpr int kSlots = D / 2 + 4;  // o fragments, then row_max[2], row_sum[2]
  if (warp > 0) {
    float *mine = fold + (warp - 1) * kSlots * kWarp + lane;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
      for (int e = 0; e < 4; e++) mine[(dt * 4 + e) * kWarp] = o[dt][e];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      mine[(D / 2 + i) * kWarp] = row_max[i];
      mine[(D / 2 + 2 + i) * kWarp] = row_sum[i];
    }
  }
  __syncthreads();
  if (warp > 0) return;
#pragma unroll
  for (int i = 0; i < 2; i++) {
    float m = row_max[i];
    for (int w = 1; w < kWarps; w++) m = fmaxf(m, fold[((w - 1) * kSlots + D / 2 + i) * kWarp + lane]);
    const float f0 = row_max[i] == -INFINITY ? 0.0f : exp2f(row_max[i] - m);
    row_sum[i] *= f0;
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) {
      o[dt][2 * i] *= f0;
      o[dt][2 * i + 1] *= f0;
    }
    for (int w = 1; w < kWarps; w++) {
      const float *theirs = fold + (w - 1) * kSlots * kWarp + lane;
      const float mw = theirs[(D / 2 + i) * kWarp];
      const float f = mw == -INFINITY ? 0.0f : exp2f(mw - m);
      row_sum[i] += f * theirs[(D / 2 + 2 + i) * kWarp];
#pragma unroll
      for (int dt = 0; dt < D / 8; dt++) {
        o[dt][2 * i] += f * theirs[(dt * 4 + 2 * i) * kWarp];
        o[dt][2 * i + 1] += f * theirs[(dt * 4 + 2 * i + 1) * kWarp];
      }
    }
    row_max[i] = m;
  }
}

}  // namespace
}  // namespace pkv
