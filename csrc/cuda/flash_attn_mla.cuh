// pagedkv CUDA backend: flash_attn_paged's MLA kernel, DeepSeek's one latent KV head read once per tile
// for many query heads: D 576 (the 512-channel latent and the 64-channel rope), Dv 512 with V the
// latent itself (a view of K's first 512 channels, not a second cache). Caches: a 16-bit K-only cache
// of q's dtype, or the packed FP8 rows of kv_format (e4m3/e5m2 latent with in-row or per-tensor
// float32 scales, the rope a bfloat16 K tail at a byte offset in each row). What does not fit
// (other head sizes, a V that is not K's latent, unaligned views) runs on the portable kernel.
//
// One CTA = (query token, block of 16 query heads of one KV head, KV split). The 16 rows share one
// visible key range (a token's heads), so a K tile's keys are either seen by every row or by none:
// keys outside the range, and keys whose page id is outside [0, N), are zeroed in shared memory and
// scored -inf, and no 0 * NaN from an unused slot reaches P V. Per 32-key tile (double-buffered,
// cp.async; FP8 rows staged raw and converted to q's 16-bit type with their scales):
//   S = Q K^T     warp w scores keys 8w..8w+7 over all 576 channels (36 mma.sync m16n8k16)
//   softmax       the tile's row maxima are exchanged through shared memory, so every warp holds the
//                 same running maximum; each warp keeps its own partial row sums
//   O += P V      P (16 x 32) through shared memory; warp w owns output channels 128w..128w+127
//                 (32 mma.sync per tile, V fragments by ldmatrix.trans from the K tile)
// Split-KV writes normalised partials and log-sum-exps for flash_attn_paged's combine kernel.
// Internal to flash_attn_paged.cu (its one includer).
#pragma once

#include "flash_attn_paged_params.cuh"

namespace pkv {
namespace {

constexpr int kMlaD = 576, kMlaDv = 512, kMlaLatent = 512, kMlaRope = 64;
constexpr int kMlaRows = kMlaPlanRows;  // query heads per CTA: one m-block (16)
constexpr int kMlaKeys = kMlaPlanKeys;  // keys per K tile (32): 8 per warp in S, the PV k-steps' 2 x 16
constexpr int kMlaThreads = 128;  // 4 warps
constexpr int kMlaWarps = kMlaThreads / kWarp;
constexpr int kMlaStride = kMlaD * 2 + 16;        // bytes per 16-bit row of Q and K tiles: +16 so that
                                                   // ldmatrix's 8 rows fall on distinct banks
constexpr int kMlaPStride = kMlaKeys * 2 + 16;    // P rows, likewise
constexpr int kMlaRawStride = kMlaLatent + kMlaRope * 2;  // FP8 staging: latent codes, then the rope
constexpr int kMlaThreadsPerKey = kMlaThreads / kMlaKeys;  // the loads: 4 threads per key row
constexpr int kMlaScaleSlots = kMlaLatent / 8;            // FP8 scale groups per row, at most (groups of >= 8)
static_assert(kMlaKeys * kMlaThreadsPerKey == kMlaThreads && kMlaKeys == 8 * kMlaWarps, "MLA tile shape");
static_assert(kMlaDv == 128 * kMlaWarps, "each warp owns 128 output channels");

struct MlaParams {
  pkv_rows_view q, out;  // [T, Hq, 576], [T, Hq, 512]
  pkv_kv_cache k;        // values (576 16-bit channels, or the 512-channel FP8 latent), scales, rope tail
  pkv_index_view offsets, lengths, table;
  int64_t num_rows;      // T
  int64_t heads_per_kv;  // Hq / Hk
  int64_t head_blocks;   // ceil(heads_per_kv / 16)
  int64_t window_left;
  float score_scale;     // scale * log2(e); scale / softcap with a softcap
  float softcap_log2;    // softcap * log2(e); 0: no softcap
  int causal, num_splits, out_aligned;
  const float *sinks;
  int64_t sinks_stride;
  float *lse;
  int64_t lse_stride_row, lse_stride_head;
  float *partial_out, *partial_lse;  // [S, T, Hq, 512], [S, T, Hq] (num_splits > 1)
};

// Shared memory: Q, two K stages (16-bit rows; FP8: two raw stages and one converted tile), P, the
// key rows' pages, the warps' row maxima and sums.
template <bool kFp8>
struct MlaLayout {
  static constexpr int kQBytes = kMlaRows * kMlaStride;
  static constexpr int kTileBytes = kMlaKeys * kMlaStride;
  static constexpr int kRawBytes = kMlaKeys * kMlaRawStride;
  static constexpr int kStageBytes = kFp8 ? kRawBytes : kTileBytes;
  static constexpr int kStageOffset = kQBytes;
  static constexpr int kConvOffset = kStageOffset + 2 * kStageBytes;  // FP8 only
  static constexpr int kPOffset = kConvOffset + (kFp8 ? kTileBytes : 0);
  static constexpr int kRowsOffset = kPOffset + kMlaRows * kMlaPStride;
  static constexpr int kRedOffset = kRowsOffset + 2 * kMlaKeys * 8;
  static constexpr int kScaleOffset = kRedOffset + kMlaWarps * kMlaRows * 4;  // FP8: the tile's group scales
  static constexpr int kBytes = kScaleOffset + (kFp8 ? kMlaKeys * kMlaScaleSlots * 4 : 0);
};

struct MlaKeyRow {  // a tile's key row: its page (-1: masked) and slot
  int32_t page, slot;
};

template <typename T>
__device__ __forceinline__ uint32_t bf16x2_as(uint32_t two) {  // two bf16 rope values in q's type
  if constexpr (dtype_of<T>() == PKV_DTYPE_BF16) {
    return two;
  } else {
    const float lo = __uint_as_float(two << 16), hi = __uint_as_float(two & 0xffff0000u);
    return pack2<T>(lo, hi);
  }
}

// Issue the copies of key tile `tile` (keys tile * 32 ...) into stage `st`: thread t takes key row t / 4
// and every 4th 16-byte unit of it; masked rows are zero-filled without a read. 16-bit: the row's 576
// channels straight into the K tile; FP8: the latent's codes and the rope's bytes into the raw stage.
template <bool kFp8>
__device__ __forceinline__ void mla_issue(const MlaParams &p, uint8_t *stage, MlaKeyRow *rows, int64_t tile,
                                          int64_t b, int64_t kv_head, int64_t lo, int64_t hi) {
  const int r = threadIdx.x / kMlaThreadsPerKey, sub = threadIdx.x % kMlaThreadsPerKey;
  const int64_t key = tile * kMlaKeys + r, page_size = p.k.values.page_size;
  int32_t page = -1, slot = 0;
  if (key >= lo && key < hi) {
    const int32_t id = pkv_page_of(&p.table, b, key, page_size);  // read once: the table may change
    if (pkv_page_in_pool(id, p.k.values.num_pages)) {
      page = id;
      slot = static_cast<int32_t>(pkv_slot_of(key, page_size));
    }
  }
  if (sub == 0) rows[r] = MlaKeyRow{page, slot};
  const uint8_t *base = static_cast<const uint8_t *>(p.k.values.data);
  const uint8_t *row = page >= 0 ? base + pkv_cache_offset(&p.k.values, page, slot, kv_head) * p.k.elem_bytes : base;
  const uint32_t bytes = page >= 0 ? 16u : 0u;
  if constexpr (kFp8) {
    uint8_t *dst = stage + r * kMlaRawStride;
    for (int u = sub; u < kMlaRawStride / 16; u += kMlaThreadsPerKey) {
      const int off = u * 16;
      const uint8_t *src = off < kMlaLatent ? row + off : row + p.k.tail_offset + (off - kMlaLatent);
      cp_async_16(dst + off, page >= 0 ? src : base, bytes);
    }
  } else {
    uint8_t *dst = stage + r * kMlaStride;
    for (int u = sub; u < kMlaD * 2 / 16; u += kMlaThreadsPerKey) cp_async_16(dst + u * 16, row + u * 16, bytes);
  }
}

// FP8 stage -> the 16-bit K tile: codes times their group's scale, the rope converted to q's type;
// masked rows zeros (their scales are never read). The tile's group scales are read once into shared
// memory first (a few loads per thread, in parallel), not once per 8 channels.
template <typename T, bool kE4m3>
__device__ __forceinline__ void mla_convert(const MlaParams &p, const uint8_t *raw, uint8_t *tile,
                                            const MlaKeyRow *rows, float *sscale, int64_t kv_head) {
  const int64_t group = p.k.group;
  const int groups = static_cast<int>(group >= kMlaLatent ? 1 : (kMlaLatent + group - 1) / group);
  for (int i = threadIdx.x; i < kMlaKeys * groups; i += kMlaThreads) {
    const int r = i / groups, g = i - r * groups;
    const MlaKeyRow kr = rows[r];
    sscale[r * kMlaScaleSlots + g] = kr.page >= 0 ? pkv_kv_scale(&p.k, kr.page, kr.slot, kv_head, g * group) : 0.0f;
  }
  __syncthreads();
  constexpr int kUnits = kMlaD / 8;  // 8 channels per unit: 64 latent units, 8 rope units
  for (int u = threadIdx.x; u < kMlaKeys * kUnits; u += kMlaThreads) {
    const int r = u / kUnits, j = u - r * kUnits;
    const MlaKeyRow kr = rows[r];
    uint4 out = make_uint4(0, 0, 0, 0);
    if (kr.page >= 0) {
      if (j < kMlaLatent / 8) {
        const uint2 codes = *reinterpret_cast<const uint2 *>(raw + r * kMlaRawStride + j * 8);
        const float s = sscale[r * kMlaScaleSlots + static_cast<int>(j * 8 / group)];
        const uint16_t *pairs = reinterpret_cast<const uint16_t *>(&codes);
        uint32_t packed[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
          const float2 f = fp8x2_to_float2<kE4m3>(pairs[i]);
          packed[i] = pack2<T>(f.x * s, f.y * s);
        }
        out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      } else {
        const uint4 two = *reinterpret_cast<const uint4 *>(raw + r * kMlaRawStride + kMlaLatent + (j - 64) * 16);
        out = make_uint4(bf16x2_as<T>(two.x), bf16x2_as<T>(two.y), bf16x2_as<T>(two.z), bf16x2_as<T>(two.w));
      }
    }
    *reinterpret_cast<uint4 *>(tile + r * kMlaStride + j * 16) = out;
  }
}

template <typename T, bool kFp8, bool kE4m3>
__global__ void __launch_bounds__(kMlaThreads) attn_mla_kernel(const __grid_constant__ MlaParams p) {
  using L = MlaLayout<kFp8>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t *smem = smem_align_1024(smem_raw);
  uint8_t *sq = smem, *sp = smem + L::kPOffset;
  MlaKeyRow *srows = reinterpret_cast<MlaKeyRow *>(smem + L::kRowsOffset);  // [2][32]
  float *sred = reinterpret_cast<float *>(smem + L::kRedOffset);             // [4 warps][16 rows]
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x, kv_head = blockIdx.y / p.head_blocks, block = blockIdx.y % p.head_blocks;
  const int64_t split = blockIdx.z, hq = p.q.num_heads;
  const int64_t head0 = kv_head * p.heads_per_kv + block * kMlaRows;  // query head of row 0
  const int valid_rows = static_cast<int>(p.heads_per_kv - block * kMlaRows < kMlaRows
                                              ? p.heads_per_kv - block * kMlaRows : kMlaRows);
  const int64_t b = find_batch_row(p.offsets, t);

  // ---- the token's visible keys, and this split's tiles of them ----
  int64_t lo = 0, hi = 0;
  if (b >= 0) {
    const int64_t first = pkv_index_at(&p.offsets, b);
    int64_t cached = pkv_cache_length(&p.lengths, b);
    cached = cached < 0 ? 0 : cached;
    pkv_visible_keys(cached + (t - first), cached + pkv_new_tokens(&p.offsets, b), p.causal, p.window_left, &lo, &hi);
    const int64_t table_keys = p.table.cols * p.k.values.page_size;
    hi = hi < table_keys ? hi : table_keys;  // keys past the lookup table do not exist
  }
  const int64_t kt_begin = lo / kMlaKeys, kt_end = hi > lo ? (hi + kMlaKeys - 1) / kMlaKeys : kt_begin;
  const int64_t per_split = (kt_end - kt_begin + p.num_splits - 1) / p.num_splits;
  const int64_t my_begin = kt_begin + split * per_split;
  const int64_t my_end = my_begin + per_split < kt_end ? my_begin + per_split : kt_end;
  const int n_tiles = my_end > my_begin ? static_cast<int>(my_end - my_begin) : 0;

  // ---- Q rows -> shared memory (zeros for rows past this KV head's query heads) ----
  for (int u = tid; u < kMlaRows * (kMlaD / 8); u += kMlaThreads) {
    const int r = u / (kMlaD / 8), j = u - r * (kMlaD / 8);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r < valid_rows && b >= 0)
      v = __ldg(reinterpret_cast<const uint4 *>(static_cast<const T *>(p.q.data) + t * p.q.stride_row +
                                                (head0 + r) * p.q.stride_head + j * 8));
    *reinterpret_cast<uint4 *>(sq + r * kMlaStride + j * 16) = v;
  }

  auto stage = [&](int it) { return smem + L::kStageOffset + (it & 1) * L::kStageBytes; };
  if (n_tiles > 0) {
    mla_issue<kFp8>(p, stage(0), srows, my_begin, b, kv_head, lo, hi);
    cp_async_commit();
  }

  // this thread's rows of the m16n8 fragments: r0 = lane / 4 and r0 + 8
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[kMlaDv / kMlaWarps / 8][4];
#pragma unroll
  for (int j = 0; j < kMlaDv / kMlaWarps / 8; j++) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
  const uint32_t q_base = smem_u32(sq), p_base = smem_u32(sp);

  for (int it = 0; it < n_tiles; it++) {
    if (it + 1 < n_tiles) {  // the other stage: read by tile it - 1, released by its closing barrier
      mla_issue<kFp8>(p, stage(it + 1), srows + ((it + 1) & 1) * kMlaKeys, my_begin + it + 1, b, kv_head, lo, hi);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // tile it (and, the first time, Q) complete for every warp
    const MlaKeyRow *rows = srows + (it & 1) * kMlaKeys;
    uint8_t *ktile = stage(it);
    if constexpr (kFp8) {
      ktile = smem + L::kConvOffset;
      mla_convert<T, kE4m3>(p, stage(it), ktile, rows, reinterpret_cast<float *>(smem + L::kScaleOffset), kv_head);
      __syncthreads();
    }
    const uint32_t k_base = smem_u32(ktile);

    // ---- S = Q K^T: this warp's 8 keys, 36 k-steps of 16 channels ----
    float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
    for (int k0 = 0; k0 < kMlaD; k0 += 32) {
      uint32_t kb[4];  // b0, b1 of k-step k0 and of k0 + 16
      ldmatrix_x4(kb, k_base + (8 * warp + (lane & 7)) * kMlaStride + (k0 + 8 * (lane >> 3)) * 2);
#pragma unroll
      for (int h = 0; h < 2; h++) {
        uint32_t qa[4];
        ldmatrix_x4(qa, q_base + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kMlaStride +
                            (k0 + 16 * h + 8 * (lane >> 4)) * 2);
        mma_16816<T>(s, qa, kb[2 * h], kb[2 * h + 1]);
      }
    }

    // ---- softmax in the log2 domain: scale, softcap, masked keys -inf, the tile's row maxima ----
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = 8 * warp + 2 * (lane & 3) + (e & 1);
      float x = s[e] * p.score_scale;
      if (p.softcap_log2 > 0.0f) x = p.softcap_log2 * tanhf(x);
      s[e] = rows[key].page >= 0 ? x : -INFINITY;
      tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[e]);
    }
#pragma unroll
    for (int i = 0; i < 2; i++) {
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 1));
      tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(0xffffffffu, tile_max[i], 2));
      if ((lane & 3) == 0) sred[warp * kMlaRows + (lane >> 2) + 8 * i] = tile_max[i];
    }
    __syncthreads();  // every warp's maxima
    float corr[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
      float mx = m[i];
#pragma unroll
      for (int w = 0; w < kMlaWarps; w++) mx = fmaxf(mx, sred[w * kMlaRows + (lane >> 2) + 8 * i]);
      const float base = mx == -INFINITY ? 0.0f : mx;  // every key so far masked: p = 0, nothing to rescale
      corr[i] = exp2_ftz(m[i] - base);
      m[i] = mx;
      const float p0 = exp2_ftz(s[2 * i] - base), p1 = exp2_ftz(s[2 * i + 1] - base);
      l[i] = l[i] * corr[i] + p0 + p1;
      *reinterpret_cast<uint32_t *>(sp + ((lane >> 2) + 8 * i) * kMlaPStride + (8 * warp + 2 * (lane & 3)) * 2) =
          pack2<T>(p0, p1);
    }
#pragma unroll
    for (int j = 0; j < kMlaDv / kMlaWarps / 8; j++) {
      o[j][0] *= corr[0];
      o[j][1] *= corr[0];
      o[j][2] *= corr[1];
      o[j][3] *= corr[1];
    }
    __syncthreads();  // P complete

    // ---- O += P V: V = the tile's first 512 channels; this warp's 128 ----
#pragma unroll
    for (int k0 = 0; k0 < kMlaKeys; k0 += 16) {
      uint32_t pa[4];
      ldmatrix_x4(pa, p_base + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kMlaPStride + (k0 + 8 * (lane >> 4)) * 2);
#pragma unroll
      for (int j = 0; j < kMlaDv / kMlaWarps / 8; j += 2) {
        uint32_t vb[4];  // b0, b1 of channel blocks n0 and n0 + 8
        const int n0 = 128 * warp + 8 * j;
        ldmatrix_x4_trans(vb, k_base + (k0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kMlaStride + (n0 + 8 * (lane >> 4)) * 2);
        mma_16816<T>(o[j], pa, vb[0], vb[1]);
        mma_16816<T>(o[j + 1], pa, vb[2], vb[3]);
      }
    }
    __syncthreads();  // done with this stage, the converted tile, P and the maxima
  }

  // ---- row sums: the quad's keys, then the four warps' ----
#pragma unroll
  for (int i = 0; i < 2; i++) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    if ((lane & 3) == 0) sred[warp * kMlaRows + (lane >> 2) + 8 * i] = l[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 2; i++) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < kMlaWarps; w++) sum += sred[w * kMlaRows + (lane >> 2) + 8 * i];
    l[i] = sum;
  }

  // ---- epilogue: normalise and write, or write the split's partial ----
#pragma unroll
  for (int i = 0; i < 2; i++) {
    const int r = (lane >> 2) + 8 * i;
    if (r >= valid_rows) continue;
    const int64_t head = head0 + r;
    const float mx = m[i] == -INFINITY ? 0.0f : m[i];
    if (p.num_splits == 1) {
      float inv = 0.0f, lse = -INFINITY;  // a padding row: zeros
      if (b >= 0) pkv_softmax_finish(mx, l[i], p.sinks ? p.sinks[head * p.sinks_stride] : -INFINITY, &inv, &lse);
      if (p.lse && warp == 0 && (lane & 3) == 0) p.lse[t * p.lse_stride_row + head * p.lse_stride_head] = lse;
      T *dst = static_cast<T *>(p.out.data) + t * p.out.stride_row + head * p.out.stride_head + 128 * warp;
#pragma unroll
      for (int j = 0; j < kMlaDv / kMlaWarps / 8; j++)
        store_pair<T>(dst + 8 * j + 2 * (lane & 3), o[j][2 * i] * inv, o[j][2 * i + 1] * inv, p.out_aligned);
    } else {
      // a split's partial: its own normalisation (the sink joins once, in the combine); a NaN sum stays
      // NaN in both so the combine cannot drop it
      const float li = l[i];
      const float inv = li > 0.0f ? 1.0f / li : (li == li ? 0.0f : NAN);
      const int64_t idx = (split * p.num_rows + t) * hq + head;
      float *dst = p.partial_out + idx * kMlaDv + 128 * warp;
#pragma unroll
      for (int j = 0; j < kMlaDv / kMlaWarps / 8; j++)
        *reinterpret_cast<float2 *>(dst + 8 * j + 2 * (lane & 3)) = make_float2(o[j][2 * i] * inv, o[j][2 * i + 1] * inv);
      if (warp == 0 && (lane & 3) == 0)
        p.partial_lse[idx] = li > 0.0f ? mx + log2f(li) : (li == li ? -INFINITY : NAN);
    }
  }
}

}  // namespace
}  // namespace pkv
