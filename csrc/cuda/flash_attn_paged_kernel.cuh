// pagedkv CUDA backend: flash_attn_paged's kernels. attn_body is the attention of one CTA
// (Q tile, double-buffered K/V tiles through the loader, QK^T and PV on mma.sync, online softmax, the
// epilogue); attn_kernel wraps it with its launch bounds; attn_combine_kernel merges split-KV partials.
// The kernel body is one piece: its tile loop shares the accumulators, the masks and the pipeline
// state. kWgmma (sm_90a) takes the products to warpgroup MMAs instead (wgmma.cuh: the CTA's 4 warps are
// one warpgroup, and its accumulators hold the same per-thread values as the mma.sync fragments, so the
// softmax, masks and epilogue are shared). Internal to flash_attn_paged.cu (its one includer): everything
// here has internal linkage.
#pragma once

#include "flash_attn_paged_params.cuh"
#include "wgmma.cuh"

namespace pkv {
namespace {

// Keys that some rows of a CTA's query tile see and others do not (the causal diagonal, the window
// edge) go through P V with probability 0 for the others, and 0 * NaN is NaN. attn_body calls this for
// the K/V tiles that hold such keys (block-uniform): their V rows (the 16-bit image the MMAs read, after
// any FP8 conversion and scales) are checked by a block vote; where one holds NaN or inf (rare), the
// values are zeroed once every thread has found its rows that see one. Returns bit 2 * mb + i for this
// thread's rows (attn_body's r0 / r1 of m-block mb) that see a non-finite value: their sums become NaN,
// so their outputs are NaN. Not inlined: it keeps its registers out of the tile loop's.
template <typename T, int D, int kMB, int BN, bool kFence>
__device__ __noinline__ int masked_mixed_nonfinite(const AttnParams &p, uint8_t *vtile, int64_t tile_key0,
                                                  int64_t cached, int64_t total, int64_t tile_first, int tile_rows,
                                                  bool key_split, bool warp_ready) {
  constexpr int kUnits = D / 8;
  int64_t lo_first, hi_first, lo_last, hi_last;
  pkv_visible_keys(cached + tile_first / p.heads_per_kv, total, p.causal, p.window_left, &lo_first, &hi_first);
  pkv_visible_keys(cached + (tile_first + tile_rows - 1) / p.heads_per_kv, total, p.causal, p.window_left, &lo_last,
                   &hi_last);
  if (warp_ready) __syncthreads();  // every warp's rows, not only its own
  const bool any = rows_nonfinite<T, BN, kAttnThreads>(vtile, kUnits, tile_key0, lo_first, lo_last, hi_first, hi_last,
                                                       false);
  if (!__syncthreads_or(any)) return 0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int poisoned = 0;
  for (int mb = 0; mb < kMB; mb++)
    for (int i = 0; i < 2; i++) {  // this thread's rows, as attn_body numbers them: every key of the tile they see
      const int r = (key_split ? 0 : (warp * kMB + mb) * 16) + (lane >> 2) + 8 * i;
      if (r >= tile_rows) continue;
      int64_t lo, hi;
      pkv_visible_keys(cached + (tile_first + r) / p.heads_per_kv, total, p.causal, p.window_left, &lo, &hi);
      for (int k = 0; k < BN; k++)
        if (tile_key0 + k >= lo && tile_key0 + k < hi && row_nonfinite<T, BN>(vtile, kUnits, k))
          poisoned |= 1 << (2 * mb + i);
    }
  __syncthreads();  // every row checked before the values go
  rows_nonfinite<T, BN, kAttnThreads>(vtile, kUnits, tile_key0, lo_first, lo_last, hi_first, hi_last, true);
  if constexpr (kFence) fence_proxy_async_smem();  // a TMA-loaded stage: the next loads write it again
  __syncthreads();
  return poisoned;
}

template <int D, typename T, bool kFp8, int kLoader, int kBM, bool kWgmma>
__device__ __forceinline__ void attn_body(const AttnParams &p, const CUtensorMap *kmap, const CUtensorMap *vmap,
                                          uint8_t *smem) {
  using L = AttnLayout<D, kFp8, kBM>;
  constexpr int BN = L::kRowsN, BM = kBM;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t kv_head = blockIdx.y, split = blockIdx.z;

  if (p.num_splits == 1) zero_padding_rows<T>(p, kv_head, D);

  int64_t b, tile;
  locate_tile<kBM>(p, blockIdx.x, &b, &tile);
  if (b < 0) return;  // block-uniform: more CTAs than tiles

  // ---- what this CTA computes ----
  int64_t row_start, n_new;
  batch_rows(p, b, &row_start, &n_new);
  int64_t cached = pkv_cache_length(&p.lengths, b);
  cached = cached < 0 ? 0 : cached;
  const int64_t page_size = p.k.page_size;
  int64_t total = cached + n_new;
  const int64_t table_keys = p.table.cols * page_size;
  total = total < table_keys ? total : table_keys;  // keys past the table do not exist
  const int64_t packed_total = n_new * p.heads_per_kv;
  const int64_t tile_first = tile * BM;
  const int tile_rows = static_cast<int>(packed_total - tile_first < BM ? packed_total - tile_first : BM);
  // keys any row of the tile may see: lo of its first row, hi of its last
  int64_t lo_tile, hi_tile, hi_first, lo_last;
  pkv_visible_keys(cached + tile_first / p.heads_per_kv, total, p.causal, p.window_left, &lo_tile, &hi_first);
  pkv_visible_keys(cached + (tile_first + tile_rows - 1) / p.heads_per_kv, total, p.causal, p.window_left, &lo_last,
                   &hi_tile);
  const int64_t kt_begin = lo_tile / BN;
  const int64_t kt_end = hi_tile > lo_tile ? (hi_tile + BN - 1) / BN : kt_begin;
  const int64_t per_split = (kt_end - kt_begin + p.num_splits - 1) / p.num_splits;
  const int64_t my_begin = kt_begin + split * per_split;
  int64_t my_end = my_begin + per_split;
  my_end = my_end < kt_end ? my_end : kt_end;
  const int n_tiles = my_end > my_begin ? static_cast<int>(my_end - my_begin) : 0;
  // the iterations whose K/V tile holds keys that some rows of the tile see and others do not, [lo_tile,
  // lo_last) and [hi_first, hi_tile): [mixed_a0, mixed_a1] and [mixed_b0, mixed_b1] (empty: a1 < a0)
  auto tile_of = [&](int64_t key) {
    const int64_t t = key / BN - my_begin;
    return static_cast<int>(t < -1 ? -1 : t > n_tiles ? n_tiles : t);
  };
  const int mixed_a0 = tile_of(lo_tile), mixed_a1 = lo_last > lo_tile ? tile_of(lo_last - 1) : mixed_a0 - 1;
  const int mixed_b0 = tile_of(hi_first), mixed_b1 = hi_tile > hi_first ? tile_of(hi_tile - 1) : mixed_b0 - 1;

  uint8_t *sq = smem;
  uint8_t *sraw = smem + L::kRawOffset;  // [stage][K, V]
  uint8_t *sconv = smem + L::kConvOffset;
  TileRows *srows = reinterpret_cast<TileRows *>(smem + L::kRowsOffset);  // [3][BN]
  uint64_t *sbar = reinterpret_cast<uint64_t *>(smem + L::kBarOffset);
  float *sscale = reinterpret_cast<float *>(smem + L::kScaleOffset);  // [2][K, V][BN] (FP8)

  // ---- Q tile -> shared memory (16-bit image, zeros for rows past the tile) ----
  {
    constexpr int kUnits = D / 8;
    const T *qbase = static_cast<const T *>(p.q.data);
    for (int u = tid; u < BM * kUnits; u += kAttnThreads) {
      const int r = u / kUnits, j = u - r * kUnits;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < tile_rows) {
        const int64_t gp = tile_first + r;
        const int64_t row = row_start + gp / p.heads_per_kv, head = kv_head * p.heads_per_kv + gp % p.heads_per_kv;
        const T *src = qbase + row * p.q.stride_row + head * p.q.stride_head + j * 8;
        if (p.q_aligned) {
          v = __ldg(reinterpret_cast<const uint4 *>(src));
        } else {
          uint16_t e[8];
#pragma unroll
          for (int i = 0; i < 8; i++) e[i] = reinterpret_cast<const uint16_t *>(src)[i];
          v = *reinterpret_cast<const uint4 *>(e);
        }
      }
      *reinterpret_cast<uint4 *>(sq + tile_unit_offset(r, j, BM)) = v;
    }
  }

  // ---- key split: a tile of <= 16 packed rows (decode: one query row's heads of this KV head)
  // gives warp 1-3 no rows of their own, so instead every warp takes those 16 rows over its own
  // quarter of each K/V tile's keys, with its own softmax state, and the warps' states are folded
  // together once at the end. Block-uniform. Needs >= 16 keys per warp (one PV k-step).
  constexpr int kWarps = kAttnThreads / kWarp;
  // kMB 16-row m-blocks per warp: 1 (64-row tiles), or 2 (128-row prefill tiles: every
  // K/V fragment read from shared memory feeds two MMAs, and a tile's fixed costs serve twice the rows)
  constexpr int kMB = BM / (kWarps * 16);
  static_assert(kMB * kWarps * 16 == BM && (kMB == 1 || kMB == 2), "query tile rows");
  // the warpgroup path: one 64-row m-block of the warpgroup (warp w's rows 16w .. 16w + 15, as kMB = 1),
  // a whole tile of keys per MMA (N = BN for S, N = D for O), no key split (its calls are prefill-like)
  static_assert(!kWgmma || (kMB == 1 && BN == 64 && (D == 64 || D == 128)), "warpgroup tile shapes");
  constexpr bool kKeySplitFits = !kWgmma && kMB == 1 && BN / kWarps >= 16 && (BN / kWarps) % 16 == 0;
  const bool key_split = kKeySplitFits && tile_rows <= 16;
  // first packed row of m-block mb of this warp (key split: every warp takes rows 0-15)
  auto qrow0 = [&](int mb) { return key_split ? 0 : (warp * kMB + mb) * 16; };

  // ---- per-thread query rows of m-block mb: r0 = qrow0(mb) + lane/4 and r1 = r0 + 8 ----
  int64_t lo_r[kMB][2], hi_r[kMB][2];
  bool valid_r[kMB][2];
  float o[kMB][D / 8][4];
  float row_max[kMB][2], row_sum[kMB][2];
#pragma unroll
  for (int mb = 0; mb < kMB; mb++) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int r = qrow0(mb) + (lane >> 2) + 8 * i;
      valid_r[mb][i] = r < tile_rows;
      const int64_t pos = cached + (tile_first + (valid_r[mb][i] ? r : 0)) / p.heads_per_kv;
      pkv_visible_keys(pos, total, p.causal, p.window_left, &lo_r[mb][i], &hi_r[mb][i]);
      if (!valid_r[mb][i]) hi_r[mb][i] = lo_r[mb][i];  // sees nothing
      row_max[mb][i] = -INFINITY;
      row_sum[mb][i] = 0.0f;
    }
#pragma unroll
    for (int dt = 0; dt < D / 8; dt++) o[mb][dt][0] = o[mb][dt][1] = o[mb][dt][2] = o[mb][dt][3] = 0.0f;
  }
  // (the warpgroup's MMAs need all four warps, past the tile's rows too: those rows see no key)
  const bool warp_active = kWgmma || key_split || warp * kMB * 16 < tile_rows;

  // the warpgroup path's A operand of S = Q K^T: Q's fragments, read from shared memory once for all tiles
  // (the mma.sync path reads them at every tile)
  uint32_t q_frag[kWgmma ? D / 16 : 1][4];
  if constexpr (kWgmma) {
    __syncthreads();  // the Q tile
    const int m = lane >> 3;
    const uint32_t q_lane = swizzle_lane_base(smem_u32(sq), warp * 16 + (m & 1) * 8 + (lane & 7), m >> 1);
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) ldmatrix_x4(q_frag[kk], swizzle_step(q_lane, 2 * kk, BM));
  }

  const int64_t num_pages = p.k.num_pages;
  // keys outside [lo_tile, hi_tile) are masked (zeroed): no row of the tile sees them, and a causal
  // tile's last K/V tile may reach past hi_tile into keys of later rows, whose V may hold NaN
  auto fill_rows = [&](int it) -> int {
    if (tid >= BN) return 0;
    return fill_tile_row(srows + (it % 3) * BN, tid, (my_begin + it) * BN, lo_tile, hi_tile, p.table, b, page_size,
                         num_pages);
  };
  auto issue = [&](int it) {
    uint8_t *kt = sraw + (it & 1) * 2 * L::kRawTileBytes, *vt = kt + L::kRawTileBytes;
    const TileRows *rows = srows + (it % 3) * BN;
    if constexpr (kLoader == PKV_LOADER_CP_ASYNC) {
      load_tile_cp_async<BN, kAttnThreads>(kt, p.k, rows, kv_head, L::kRawUnits, L::kEs, p.kv_aligned);
      load_tile_cp_async<BN, kAttnThreads>(vt, p.v, rows, kv_head, L::kRawUnits, L::kEs, p.kv_aligned);
      cp_async_commit();
    } else if (tid == 0) {
      uint64_t *bar = sbar + (it & 1);
      if constexpr (kLoader == PKV_LOADER_TMA_PAGES) {
        mbar_arrive_expect_tx(bar, 2 * count_tile_pages<BN>(rows, p.box_rows, L::kRawChunks));
        issue_tile_pages<BN>(kt, kmap, bar, rows, static_cast<int>(kv_head), p.box_rows, L::kRawChunks, L::kEs);
        issue_tile_pages<BN>(vt, vmap, bar, rows, static_cast<int>(kv_head), p.box_rows, L::kRawChunks, L::kEs);
      } else {
        mbar_arrive_expect_tx(bar, 2 * count_tile_gather4<BN>(rows, L::kRawChunks));
        issue_tile_gather4<BN>(kt, kmap, bar, rows, kv_head * p.k.stride_head, p.rows_per_page, L::kRawChunks,
                               L::kEs);
        issue_tile_gather4<BN>(vt, vmap, bar, rows, kv_head * p.v.stride_head, p.rows_per_page, L::kRawChunks,
                               L::kEs);
      }
    }
  };

  // FP8 with one scale per row: thread t < BN loads row t's K and V scales of tile `it` into
  // registers right after publishing the tile's rows, and stores them to shared memory at the top
  // of the next iteration, so the global loads' latency hides behind a tile of compute instead of
  // stalling the conversion
  const bool scale_ahead = kFp8 && p.quant_group >= D;
  // FP8 K fragments (a key split with one scale per row): a warp reads its K's MMA operands from the raw
  // FP8 tile, two codes per 16-bit load and one hardware cvt per pair, exact and unscaled, and multiplies
  // each key's scores by that key's scale afterwards; only V is converted, and only the warp's own quarter
  // of the tile's rows (the keys it reads), so the block barrier (B) before the math is a warp barrier.
  // Faster decode than converting K too (measured: benchmarks/README.md, "Measurements behind the CUDA kernels").
  const bool k_fragments = kFp8 && key_split && scale_ahead;
  constexpr int kOwnRows = kKeySplitFits ? BN / kWarps : BN;
  const int own_row0 = warp * kOwnRows;
  float k_scale_next = 0.0f, v_scale_next = 0.0f;
  auto load_scales = [&](int it) {
    if (!scale_ahead || tid >= BN) return;
    const TileRows tr = srows[(it % 3) * BN + tid];  // this thread's own entry (fill_rows)
    k_scale_next = v_scale_next = 0.0f;
    if (tr.page >= 0) {
      k_scale_next = __ldg(static_cast<const float *>(p.k_scales.data) +
                           pkv_cache_offset(&p.k_scales, tr.page, tr.slot, kv_head));
      v_scale_next = __ldg(static_cast<const float *>(p.v_scales.data) +
                           pkv_cache_offset(&p.v_scales, tr.page, tr.slot, kv_head));
    }
  };

  if constexpr (kLoader != PKV_LOADER_CP_ASYNC) {
    if (tid == 0) {
      prefetch_tensor_map(kmap);
      prefetch_tensor_map(vmap);
      mbar_init(sbar, 1);
      mbar_init(sbar + 1, 1);
      fence_mbar_init();
    }
  }

  int masked_next = 0;
  if (n_tiles > 0) {
    masked_next = __syncthreads_count(fill_rows(0));
    issue(0);
    load_scales(0);
  }
  for (int it = 0; it < n_tiles; it++) {
    const int masked_here = masked_next;
    const bool has_next = it + 1 < n_tiles;
    if (scale_ahead && tid < BN) {  // tile it's scales, loaded an iteration ago; (A) publishes them
      sscale[(it & 1) * 2 * BN + tid] = k_scale_next;
      sscale[(it & 1) * 2 * BN + BN + tid] = v_scale_next;
    }
    // (A): the next tile's rows are published and every thread is done with
    // the stage, tile rows and converted tiles that the next loads overwrite.
    masked_next = __syncthreads_count(has_next ? fill_rows(it + 1) : 0);
    if (has_next) {
      issue(it + 1);
      load_scales(it + 1);
    }

    const TileRows *rows = srows + (it % 3) * BN;
    uint8_t *kt = sraw + (it & 1) * 2 * L::kRawTileBytes, *vt = kt + L::kRawTileBytes;
    if constexpr (kLoader == PKV_LOADER_CP_ASYNC) {
      if (has_next)
        cp_async_wait<1>();
      else
        cp_async_wait<0>();
    } else {
      mbar_wait(sbar + (it & 1), (it >> 1) & 1);
    }
    const uint8_t *ks = kt, *vs = vt;
    // FP8 with one scale per row: tile it's K and V scales, staged by load_scales
    const float *k_row_scales = scale_ahead ? sscale + (it & 1) * 2 * BN : nullptr;
    const float *v_row_scales = scale_ahead ? sscale + (it & 1) * 2 * BN + BN : nullptr;
    if constexpr (kFp8) {
      if constexpr (kLoader == PKV_LOADER_CP_ASYNC) __syncthreads();  // other threads' copies
      // the fast conversion of rows [row0, row0 + kConvRows) by kConvThreads threads numbered `thread`
      // (K stays raw with k_fragments), in the FP8 format's compile-time instance
      auto convert_rows = [&](auto rows_tag, auto threads_tag, int row0, int thread) {
        constexpr int kConvRows = decltype(rows_tag)::value, kConvThreads = decltype(threads_tag)::value;
        auto both = [&](auto e4m3_tag) {
          constexpr bool kE4m3 = decltype(e4m3_tag)::value != 0;
          if (!k_fragments)
            convert_fp8_tile_row_scaled<T, kConvRows, kConvThreads, D, kE4m3, BN>(sconv, kt, rows, k_row_scales,
                                                                                  row0, thread);
          convert_fp8_tile_row_scaled<T, kConvRows, kConvThreads, D, kE4m3, BN>(sconv + L::kConvTileBytes, vt, rows,
                                                                                v_row_scales, row0, thread);
        };
        if (p.e4m3)
          both(IntTag<1>{});
        else
          both(IntTag<0>{});
      };
      if (k_fragments) {  // this warp's own V rows
        convert_rows(IntTag<kOwnRows>{}, IntTag<kWarp>{}, own_row0, lane);
      } else if (scale_ahead) {
        convert_rows(IntTag<BN>{}, IntTag<kAttnThreads>{}, 0, tid);
      } else {
        convert_fp8_tile<T, BN, kAttnThreads>(sconv, kt, rows, p.k_scales, kv_head, D, p.quant_group, p.e4m3,
                                              k_row_scales);
        convert_fp8_tile<T, BN, kAttnThreads>(sconv + L::kConvTileBytes, vt, rows, p.v_scales, kv_head, D,
                                              p.quant_group, p.e4m3, v_row_scales);
      }
      ks = sconv;
      vs = sconv + L::kConvTileBytes;
    } else if constexpr (kLoader != PKV_LOADER_CP_ASYNC) {
      if (masked_here > 0) {
        zero_masked_rows<BN, kAttnThreads>(kt, rows, L::kRawUnits);
        zero_masked_rows<BN, kAttnThreads>(vt, rows, L::kRawUnits);
        fence_proxy_async_smem();  // these bytes are TMA-written again two tiles later
      }
    }
    // the warpgroup MMAs read shared memory through the async proxy: the threads' writes (cp.async copies,
    // FP8 conversions) are made visible to it before the barrier (16-bit TMA tiles: only zeroed masked
    // rows are written, and that branch fences)
    if constexpr (kWgmma && (kFp8 || kLoader == PKV_LOADER_CP_ASYNC)) fence_proxy_async_smem();
    if (k_fragments)
      __syncwarp();  // this warp's rows are ready (Q and the tile rows were published by (A))
    else
      __syncthreads();  // (B): the tile (and Q) is complete for every warp

    // a tile holding mixed keys (masked_mixed_nonfinite): NaN sums for the rows that see a non-finite V value
    if ((it >= mixed_a0 && it <= mixed_a1) || (it >= mixed_b0 && it <= mixed_b1)) {
      const int poisoned = masked_mixed_nonfinite<T, D, kMB, BN, kWgmma || (!kFp8 && kLoader != PKV_LOADER_CP_ASYNC)>(
          p, const_cast<uint8_t *>(vs), (my_begin + it) * BN, cached, total, tile_first, tile_rows, key_split,
          k_fragments);
#pragma unroll
      for (int mb = 0; mb < kMB; mb++)
#pragma unroll
        for (int i = 0; i < 2; i++)
          if (poisoned & (1 << (2 * mb + i))) row_sum[mb][i] = NAN;
    }

    // S = Q K^T, softmax update and O += P V over NT 8-key column blocks of the tile from
    // column kcol0: the whole tile (BN / 8 blocks), or in a key split this warp's quarter
    auto tile_math = [&](auto nt_tag, int kcol0) {
      constexpr int NT = decltype(nt_tag)::value;
      const int64_t k0 = (my_begin + it) * BN + kcol0;
      float s[kMB][NT][4];
#pragma unroll
      for (int mb = 0; mb < kMB; mb++)
#pragma unroll
        for (int i = 0; i < NT; i++) s[mb][i][0] = s[mb][i][1] = s[mb][i][2] = s[mb][i][3] = 0.0f;
      // ldmatrix: lane l gives the row address of matrix l / 8 (swizzle_lane_base / swizzle_step: tile_elem_offset
      // at each k-step, one XOR each): Q rows + 8 for matrices 1, 3 and channels + 8 for 2, 3; K keys + 8 for
      // 2, 3 and channels + 8 for 1, 3; V keys + 8 for 1, 3 and channels + 8 for 2, 3
      const int m = lane >> 3;
      uint32_t q_lane[kMB];
#pragma unroll
      for (int mb = 0; mb < kMB; mb++)
        q_lane[mb] = swizzle_lane_base(smem_u32(sq), qrow0(mb) + (m & 1) * 8 + (lane & 7), m >> 1);
      const uint32_t k_lane = swizzle_lane_base(smem_u32(ks), kcol0 + (m >> 1) * 8 + (lane & 7), m & 1);
      const uint32_t v_lane = swizzle_lane_base(smem_u32(vs), kcol0 + (m & 1) * 8 + (lane & 7), m >> 1);
      // S = Q K^T
      if constexpr (kWgmma) {
        wgmma_product<NT * 8, T, 0>(&s[0][0][0], q_frag,
                                     [&](int kk) { return wgmma_desc_k_major(smem_u32(ks), kk, BN); });
      } else {
#pragma unroll
        for (int kk = 0; kk < D / 16; kk++) {
          uint32_t a[kMB][4];
#pragma unroll
          for (int mb = 0; mb < kMB; mb++) ldmatrix_x4(a[mb], swizzle_step(q_lane[mb], 2 * kk, BM));
#pragma unroll
          for (int nt = 0; nt < NT; nt += 2) {
            uint32_t bf[4];
            if (kFp8 && k_fragments) {
              // the B operand's registers as ldmatrix would give them: key nt * 8 + lane / 4 (+ 8 for
              // bf[2], bf[3]), channels kk * 16 + 2 * (lane % 4) and + 1 (+ 8 for bf[1], bf[3])
#pragma unroll
              for (int x = 0; x < 4; x++) {
                const int key = kcol0 + (nt + (x >> 1)) * 8 + (lane >> 2), col = kk * 16 + 2 * (lane & 3) + (x & 1) * 8;
                const uint16_t two = *reinterpret_cast<const uint16_t *>(kt + tile_elem_offset<1>(key, col, BN));
                const float2 f = p.e4m3 ? fp8x2_to_float2<true>(two) : fp8x2_to_float2<false>(two);
                bf[x] = pack2<T>(f.x, f.y);
              }
            } else {
              ldmatrix_x4(bf, swizzle_step(k_lane, 2 * kk, BN) + nt * 8 * 128);
            }
#pragma unroll
            for (int mb = 0; mb < kMB; mb++) {
              mma_16816<T>(s[mb][nt], a[mb], bf[0], bf[1]);
              mma_16816<T>(s[mb][nt + 1], a[mb], bf[2], bf[3]);
            }
          }
        }
      }
      // P as the A operand of P V, m-block by m-block: packed to 16 bits as soon as a block's softmax is
      // done, so that with two m-blocks the second's float scores are the only ones live beside it
      uint32_t pa[kMB][NT / 2][4];
#pragma unroll
      for (int mb = 0; mb < kMB; mb++) {
        if (kFp8 && k_fragments) {  // each key's scale (0 for a masked key, whose score is masked below)
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[mb][nt][e] *= k_row_scales[kcol0 + nt * 8 + 2 * (lane & 3) + (e & 1)];
        }
        // scale, softcap, mask (log2 domain)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
          for (int e = 0; e < 4; e++) {
            float x = s[mb][nt][e] * p.score_scale;
            if (p.softcap_log2 > 0.0f) x = tanhf(x) * p.softcap_log2;
            s[mb][nt][e] = x;
          }
#pragma unroll
        for (int i = 0; i < 2; i++) {
          const bool full = k0 >= lo_r[mb][i] && k0 + NT * 8 <= hi_r[mb][i] && masked_here == 0;
          if (full) continue;
#pragma unroll
          for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
              const int col = nt * 8 + 2 * (lane & 3) + e;
              const int64_t key = k0 + col;
              const bool visible = key >= lo_r[mb][i] && key < hi_r[mb][i] && rows[kcol0 + col].page >= 0;
              if (!visible) s[mb][nt][2 * i + e] = -INFINITY;
            }
        }
        // online softmax: rows r0 (i = 0) and r1 (i = 1) of this thread in m-block mb. With two m-blocks (a
        // softmax step per half tile, O's rescale 2 x D / 4 multiplications per step) the running maximum is
        // lazy: kept until a step's maximum exceeds it by more than kLazySlack (log2), so probabilities stay
        // below 2^8, and O is rescaled only when a row of the warp raised its maximum (the CPU kernels' rule)
        float alpha[2];
        bool raised = false;
#pragma unroll
        for (int i = 0; i < 2; i++) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < NT; nt++) mx = fmaxf(mx, fmaxf(s[mb][nt][2 * i], s[mb][nt][2 * i + 1]));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const bool move = kMB == 1 || mx > row_max[mb][i] + kLazySlack;
          const float m_new = move ? fmaxf(row_max[mb][i], mx) : row_max[mb][i];
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that saw nothing yet
          alpha[i] = exp2_ftz(row_max[mb][i] - m_use);
          raised = raised || alpha[i] != 1.0f;
          row_max[mb][i] = m_new;
          float sum = 0.0f;
#pragma unroll
          for (int nt = 0; nt < NT; nt++) {
            s[mb][nt][2 * i] = exp2_ftz(s[mb][nt][2 * i] - m_use);
            s[mb][nt][2 * i + 1] = exp2_ftz(s[mb][nt][2 * i + 1] - m_use);
            sum += s[mb][nt][2 * i] + s[mb][nt][2 * i + 1];
          }
          row_sum[mb][i] = row_sum[mb][i] * alpha[i] + sum;
          if constexpr (kMB == 1) {
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++) {
              o[mb][dt][2 * i] *= alpha[i];
              o[mb][dt][2 * i + 1] *= alpha[i];
            }
          }
        }
        if constexpr (kMB > 1) {
          if (__any_sync(0xffffffffu, raised)) {
#pragma unroll
            for (int dt = 0; dt < D / 8; dt++)
#pragma unroll
              for (int e = 0; e < 4; e++) o[mb][dt][e] *= alpha[e >> 1];
          }
        }
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
          pa[mb][kk][0] = pack2<T>(s[mb][2 * kk][0], s[mb][2 * kk][1]);
          pa[mb][kk][1] = pack2<T>(s[mb][2 * kk][2], s[mb][2 * kk][3]);
          pa[mb][kk][2] = pack2<T>(s[mb][2 * kk + 1][0], s[mb][2 * kk + 1][1]);
          pa[mb][kk][3] = pack2<T>(s[mb][2 * kk + 1][2], s[mb][2 * kk + 1][3]);
        }
      }
      // O += P V
      if constexpr (kWgmma) {
        wgmma_product<D, T, 1>(&o[0][0][0], pa[0],
                                [&](int kk) { return wgmma_desc_mn_major(smem_u32(vs), kk, BN); });
      } else {
#pragma unroll
        for (int kk = 0; kk < NT / 2; kk++) {
#pragma unroll
          for (int dt = 0; dt < D / 8; dt += 2) {
            uint32_t bf[4];
            ldmatrix_x4_trans(bf, swizzle_step(v_lane, dt, BN) + kk * 16 * 128);
#pragma unroll
            for (int mb = 0; mb < kMB; mb++) {
              mma_16816<T>(o[mb][dt], pa[mb][kk], bf[0], bf[1]);
              mma_16816<T>(o[mb][dt + 1], pa[mb][kk], bf[2], bf[3]);
            }
          }
        }
      }
    };
    if constexpr (kKeySplitFits) {
      if (key_split) {
        tile_math(IntTag<BN / kWarps / 8>{}, warp * (BN / kWarps));
        continue;
      }
    }
    if constexpr (kMB == 2) {
      // two m-blocks' scores over a whole tile (64 floats) beside their output fragments (D / 2 each)
      // spill at D 128: take the tile's keys in two halves, each with its own softmax step
      if (warp_active) {
        tile_math(IntTag<BN / 16>{}, 0);
        tile_math(IntTag<BN / 16>{}, BN / 2);
      }
    } else if (warp_active) {
      tile_math(IntTag<BN / 8>{}, 0);
    }
  }

  // ---- key split: fold warps 1-3's softmax states (same rows, other keys) into warp 0's ----
  if constexpr (kKeySplitFits) {
    if (key_split) {
      static_assert((kWarps - 1) * (D / 2 + 4) * kWarp * 4 <= 4 * L::kRawTileBytes, "fold fits the K/V stages");
      __syncthreads();  // every warp is done reading its last tile: the K/V stages are free
      fold_warp_states<D, kWarps>(reinterpret_cast<float *>(sraw), warp, lane, o[0], row_max[0], row_sum[0]);
      if (warp > 0) return;
    }
  }

  // ---- epilogue: normalise and write (or write the split's partial) ----
  if (!warp_active) return;
#pragma unroll
  for (int mb = 0; mb < kMB; mb++)
#pragma unroll
    for (int i = 0; i < 2; i++) {
      float l = row_sum[mb][i];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      if (!valid_r[mb][i]) continue;
      const int r = qrow0(mb) + (lane >> 2) + 8 * i;
      const int64_t gp = tile_first + r;
      const int64_t row = row_start + gp / p.heads_per_kv, head = kv_head * p.heads_per_kv + gp % p.heads_per_kv;
      if (p.num_splits == 1) {
        // the sink joins here; a NaN sum (a NaN or +inf score) stays NaN (pkv_softmax_finish)
        float inv, lse;
        pkv_softmax_finish(row_max[mb][i], l, p.sinks ? p.sinks[head * p.sinks_stride] : -INFINITY, &inv, &lse);
        if (p.lse && (lane & 3) == 0) p.lse[row * p.lse_stride_row + head * p.lse_stride_head] = lse;
        T *dst = static_cast<T *>(p.out.data) + row * p.out.stride_row + head * p.out.stride_head;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
          store_pair<T>(dst + dt * 8 + 2 * (lane & 3), o[mb][dt][2 * i] * inv, o[mb][dt][2 * i + 1] * inv,
                        p.out_aligned);
      } else {
        // a split's partial: its own normalisation (the sink joins once, in the combine); a NaN
        // sum stays NaN in both so the combine cannot drop it
        const float inv = l > 0.0f ? 1.0f / l : (l == l ? 0.0f : NAN);
        const int64_t hq = p.q.num_heads;
        const int64_t idx = (split * p.num_rows + row) * hq + head;
        float *dst = p.partial_out + idx * D;
#pragma unroll
        for (int dt = 0; dt < D / 8; dt++)
          *reinterpret_cast<float2 *>(dst + dt * 8 + 2 * (lane & 3)) =
              make_float2(o[mb][dt][2 * i] * inv, o[mb][dt][2 * i + 1] * inv);
        if ((lane & 3) == 0)
          p.partial_lse[idx] = l > 0.0f ? row_max[mb][i] + log2f(l) : (l == l ? -INFINITY : NAN);
      }
    }
}

// The explicit minimum of one CTA per SM matters: without it ptxas held the bf16 D 128 kernel to 172
// registers instead of 201 (two CTAs per SM either way, by shared memory), and decode and prefill ran
// slower (measured: benchmarks/README.md, "Measurements behind the CUDA kernels"). The D 64 kernels with 64-row tiles are the exception: shared memory
// lets three (FP8) to five (16-bit) CTAs share an SM, and 168 registers would let three (ptxas -v gives
// each kernel's count; 169-173 at the last count).
// The warpgroup kernels ask for two CTAs per SM (shared memory allows two at D 128): one CTA's softmax
// runs while the other's MMAs do.
constexpr int attn_min_ctas(int d, int bm, bool wgmma) {
  return wgmma ? 2 : d == 64 && bm == kAttnRowsM ? 3 : 1;
}

template <int D, typename T, bool kFp8, int kLoader, int kBM = kAttnRowsM, bool kWgmma = false>
__global__ void __launch_bounds__(kAttnThreads, attn_min_ctas(D, kBM, kWgmma))
    attn_kernel(const __grid_constant__ AttnParams p, const __grid_constant__ CUtensorMap kmap,
                const __grid_constant__ CUtensorMap vmap) {
  if constexpr (loader_compiled<kLoader>() && (!kWgmma || wgmma_compiled())) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_align_1024(smem_raw);
    attn_body<D, T, kFp8, kLoader, kBM, kWgmma>(p, &kmap, &vmap, smem);
  } else {
    __trap();
  }
}

// Merge the splits of one (row, query head) per warp:
// out = sum_s 2^(lse_s - L) o_s with L = log2 sum_s 2^lse_s (plus the sink's 2^sink in the
// sum when there is one). A NaN partial makes the row NaN, as on the CPU.
template <typename T>
__global__ void __launch_bounds__(128) attn_combine_kernel(const __grid_constant__ AttnParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t hq = p.q.num_heads, dv = p.v.head_dim;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * 4 + (threadIdx.x >> 5);
  if (item >= p.num_rows * hq) return;  // warp-uniform
  const int64_t row = item / hq, head = item % hq;
  T *dst = static_cast<T *>(p.out.data) + row * p.out.stride_row + head * p.out.stride_head;
  const bool real = find_batch_row(p.offsets, row) >= 0;
  float lse = -INFINITY;
  if (real && lane < p.num_splits) lse = p.partial_lse[(lane * p.num_rows + row) * hq + head];
  const bool any_nan = __any_sync(0xffffffffu, lse != lse);
  const float mx = warp_max(lse);
  const float w = mx == -INFINITY || lse == -INFINITY ? 0.0f : exp2f(lse - mx);
  const float total = any_nan ? NAN : warp_sum(w);
  float norm, row_lse;
  pkv_softmax_finish(mx, total, real && p.sinks ? p.sinks[head * p.sinks_stride] : -INFINITY, &norm, &row_lse);
  if (p.lse && lane == 0) p.lse[row * p.lse_stride_row + head * p.lse_stride_head] = row_lse;
  // every lane runs every iteration (the shuffles need the whole warp), whatever dv is
  for (int64_t c0 = 0; c0 < dv; c0 += kWarp) {
    const int64_t c = c0 + lane;
    float acc = 0.0f;
    for (int s = 0; s < p.num_splits; s++) {
      const float ws = __shfl_sync(0xffffffffu, w, s);
      if (ws > 0.0f && c < dv) acc += ws * p.partial_out[((s * p.num_rows + row) * hq + head) * dv + c];
    }
    if (c >= dv) continue;
    const float v = acc * norm;
    if (dtype_of<T>() == PKV_DTYPE_BF16)
      reinterpret_cast<uint16_t *>(dst)[c] = pkv_f32_to_bf16(v);
    else
      reinterpret_cast<uint16_t *>(dst)[c] = pkv_f32_to_f16(v);
  }
}

}  // namespace
}  // namespace pkv
