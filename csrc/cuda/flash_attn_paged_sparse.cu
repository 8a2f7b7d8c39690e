// pagedkv CUDA backend: flash_attn_paged_sparse (top-k attention over listed
// tokens), the tiled kernel and its launch: everything here instantiates or
// launches kernels. The host plan (which kernel and loader serve a call, the
// kernel's parameters) and the C entry points are in
// flash_attn_sparse_plan.cu, which reaches this file through
// flash_attn_sparse.cuh (launch_sparse_tiled, sparse_smem, device_smem_optin).
//
// One CTA = (query row t, KV head, chunk of up to kMaxHeads query heads of
// that KV head's GQA group). It walks the row's index list in tiles of
// kTileRows listed tokens; each tile's K and V rows are staged in shared
// memory once for every query head of the CTA, in the one tile layout of
// tile.cuh, by one of two loaders:
//   - cp.async (sm_80+): 16-byte copies, rows of -1 / out-of-range entries
//     zero-filled without a read; plain loads when a row is not 16-byte
//     aligned (load_tile_cp_async);
//   - TMA tile::gather4 (sm_100a): four listed rows per instruction through
//     the 2-D map over the cache's token rows (issue_tile_gather4); a group of
//     four invalid entries is skipped, an invalid entry inside a loaded group
//     reads the legal row 0 and is masked.
// Tiles are double-buffered: the next tile's loads are in flight while the
// current tile's scores, online softmax (log2 domain) and P V run, in plain
// fp32 FMAs straight from the staged bytes (FP8 decoded and scaled on the
// fly, so float32 queries keep float32 accuracy). Masked rows get a -inf
// score and are skipped in P V, so whatever bytes they hold never matter.
//
// What this kernel does not serve the plan sends to the portable kernel
// (flash_attn_sparse_portable.cu): float32 or mixed-dtype caches, (D, Dv)
// outside kTiledHeadDims, FP8 groups that split an 8-channel unit, and
// devices whose shared memory is too small for the layout.
//
// Bounds: index values are never trusted. Entries outside [0, N * P) are
// masked before any address is formed from them; list entries past K are
// never read.
#include <mutex>

#include "flash_attn_sparse.cuh"

namespace pkv {
namespace {

// Listed tokens per tile: one per lane in the score and softmax steps, a
// multiple of 4 (gather4) and of 8 (the tile swizzle).
constexpr int kTileRows = 32;
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / kWarp;
// Tile-row buffers: the next tile's rows are written before the sync that
// ends the previous tile's P V, which may still read its own (see the loop).
constexpr int kRowBuffers = 3;

constexpr int round_up(int x, int m) { return (x + m - 1) / m * m; }

}  // namespace

// ---------------------------------------------------------------- host: layout and opt-in
// (declared in flash_attn_sparse.cuh: the plan sizes and checks a call with them)

SparseSmem sparse_smem(int d, int dv, int es, bool v_from_k, int heads, int k_groups, int v_groups, int tail) {
  SparseSmem s{};
  const int k_tile = kTileRows * tile_row_bytes(d, es), v_tile = v_from_k ? 0 : kTileRows * tile_row_bytes(dv, es);
  const int tail_tile = tail ? kTileRows * tile_row_bytes(tail, 2) : 0;  // bf16
  s.stage_bytes = k_tile + v_tile + tail_tile;  // a multiple of 1024 (kTileRows x 128-byte chunks): TMA's swizzle alignment
  s.v_tile = k_tile;
  s.tail_tile = k_tile + v_tile;
  // the epilogue's partial sums ([row slices][heads][Dv] floats) reuse the stage buffers
  const int pv_lanes = kThreads / (dv / 8);
  const int epilogue = (pv_lanes > heads ? pv_lanes : heads) * dv * 4;
  int at = 2 * s.stage_bytes > epilogue ? 2 * s.stage_bytes : round_up(epilogue, 1024);
  s.q = at, at += heads * (d + tail) * 4;
  s.scores = at, at += kWarps * heads * kTileRows * 4;
  s.probs = at, at += heads * kTileRows * 4;
  s.alpha = at, at += heads * 4;
  s.inv = at, at += heads * 4;
  s.unit_group = at, at += (d / 8) * 4;
  s.rows = round_up(at, 8), at = s.rows + kRowBuffers * kTileRows * static_cast<int>(sizeof(TileRows));
  s.bars = round_up(at, 8), at = s.bars + 16;
  s.k_scales = at, at += 2 * kTileRows * k_groups * 4;
  s.v_scales = at, at += v_from_k ? 0 : 2 * kTileRows * v_groups * 4;
  s.bytes = at;
  return s;
}

// Largest dynamic shared memory a kernel of `device` may opt into, read once per device.
int device_smem_optin(int device) {
  constexpr int kDevices = 64;
  static int value[kDevices];
  static std::once_flag once[kDevices];
  auto query = [device] {
    int v = 0;
    if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) {
      (void)cudaGetLastError();
      v = 0;
    }
    return v;
  };
  if (device < 0 || device >= kDevices) return query();
  std::call_once(once[device], [&] { value[device] = query(); });
  return value[device];
}

namespace {

// ---------------------------------------------------------------- device

// Elements [8u, 8u + 8) of tile row r as floats (FP8: unscaled).
template <pkv_dtype kCache>
__device__ __forceinline__ void tile_unit8(const uint8_t *tile, int r, int u, float (&v)[8]) {
  if constexpr (kCache == PKV_DTYPE_FP8_E4M3 || kCache == PKV_DTYPE_FP8_E5M2) {
    const uint2 raw = *reinterpret_cast<const uint2 *>(tile + tile_elem_offset<1>(r, u * 8, kTileRows));
    const uint32_t w[2] = {raw.x, raw.y};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const uint16_t two = static_cast<uint16_t>(w[i / 2] >> (16 * (i % 2)));
      const float2 f = kCache == PKV_DTYPE_FP8_E4M3 ? e4m3x2_to_float2(two) : e5m2x2_to_float2(two);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  } else {
    const uint4 raw = *reinterpret_cast<const uint4 *>(tile + tile_elem_offset<2>(r, u * 8, kTileRows));
    const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
      if constexpr (kCache == PKV_DTYPE_BF16) {
        v[2 * i] = __uint_as_float(w[i] << 16);
        v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&w[i]));
        v[2 * i] = f.x;
        v[2 * i + 1] = f.y;
      }
    }
  }
}

// q[0, 8) . k[0, 8), q 16-byte aligned (the CTA's query rows in shared memory).
__device__ __forceinline__ float dot8(const float *q, const float (&k)[8]) {
  const float4 a = *reinterpret_cast<const float4 *>(q), b = *reinterpret_cast<const float4 *>(q + 4);
  return a.x * k[0] + a.y * k[1] + a.z * k[2] + a.w * k[3] + b.x * k[4] + b.y * k[5] + b.z * k[6] + b.w * k[7];
}

// Thread t < kTileRows decodes list entry `first + t`: (page, slot), or page
// -1 for -1, an out-of-range token or a position past the list.
__device__ __forceinline__ void fill_sparse_row(TileRows *rows, const int32_t *list, int64_t stride, int64_t count,
                                                int64_t first, int64_t tokens, int64_t page_size) {
  const int t = threadIdx.x;
  if (t >= kTileRows) return;
  int32_t page = -1, slot = 0;
  if (first + t < count) {
    const int64_t token = list[(first + t) * stride];
    if (token >= 0 && token < tokens) {
      page = static_cast<int32_t>(token / page_size);
      slot = static_cast<int32_t>(token - page * page_size);
    }
  }
  rows[t].page = page;
  rows[t].slot = slot;
}

// FP8 scales of a tile's rows, [kTileRows][groups] floats, as 4-byte
// cp.async copies in the tile's commit group (zeros for masked rows).
__device__ __forceinline__ void load_tile_scales(float *dst, const pkv_cache_view &scales, const TileRows *rows,
                                                 int64_t head, int groups) {
  const float *base = static_cast<const float *>(scales.data);
  for (int i = threadIdx.x; i < kTileRows * groups; i += kThreads) {
    const int r = i / groups, g = i - r * groups;
    const TileRows tr = rows[r];
    const float *src = tr.page >= 0 ? base + pkv_cache_offset(&scales, tr.page, tr.slot, head) + g : base;
    cp_async_4(dst + i, src, tr.page >= 0 ? 4u : 0u);
  }
}

// kTail: bf16 channels of K after its D (packed MLA rows' rope, kPackedTail), staged as a tile of
// their own from p.tail; the query rows hold D + kTail channels.
template <int D, int DV, pkv_dtype kCache, int kLoader, int kTail>
__device__ __forceinline__ void sparse_tiled_body(const TiledParams &p, const CUtensorMap *kmap,
                                                  const CUtensorMap *vmap, uint8_t *smem) {
  constexpr bool kFp8 = kCache == PKV_DTYPE_FP8_E4M3 || kCache == PKV_DTYPE_FP8_E5M2;
  constexpr int kEs = kFp8 ? 1 : 2;
  constexpr int kUnitsK = D / 8, kUnitsV = DV / 8;  // 8-channel units of a K and a V row
  constexpr int kUnitsTail = kTail / 8, DQ = D + kTail;  // the tail's units; query channels
  // P V: thread -> (value unit, head lane, row slice); kPvLanes threads share a unit
  constexpr int kPvLanes = kThreads / kUnitsV;
  constexpr int kHeadsPerThread = (kMaxHeads + kPvLanes - 1) / kPvLanes;
  constexpr int kHeadsPerWarp = kMaxHeads / kWarps;  // softmax: warp w owns heads w, w + 4, ...
  static_assert(kUnitsV <= kThreads && D % 8 == 0 && DV % 8 == 0 && DV <= D, "head sizes");
  static_assert(kTileRows == kWarp && kMaxHeads % kWarps == 0, "lane = tile row; warp w owns heads w, w + 4, ...");

  const SparseParams &s = p.s;
  const SparseSmem &L = p.smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t t = blockIdx.x, kvh = blockIdx.y;
  const int heads_left = static_cast<int>(s.heads_per_kv - static_cast<int64_t>(blockIdx.z) * kMaxHeads);
  const int heads = heads_left < p.heads_per_cta ? heads_left : p.heads_per_cta;
  const int64_t head0 = kvh * s.heads_per_kv + static_cast<int64_t>(blockIdx.z) * kMaxHeads;  // first query head
  const int32_t *list = s.indices + t * s.ix_stride_t + (s.ix_heads == 1 ? 0 : kvh) * s.ix_stride_h;
  const int64_t tokens = pkv_cache_tokens(&s.k);
  const int64_t n_tiles = (s.ix_count + kTileRows - 1) / kTileRows;

  float *sq = reinterpret_cast<float *>(smem + L.q);
  float *spart = reinterpret_cast<float *>(smem + L.scores);
  float *sprob = reinterpret_cast<float *>(smem + L.probs);
  float *salpha = reinterpret_cast<float *>(smem + L.alpha);
  float *sinv = reinterpret_cast<float *>(smem + L.inv);
  int *sunit_group = reinterpret_cast<int *>(smem + L.unit_group);
  TileRows *srows = reinterpret_cast<TileRows *>(smem + L.rows);
  uint64_t *sbar = reinterpret_cast<uint64_t *>(smem + L.bars);
  float *skscale = reinterpret_cast<float *>(smem + L.k_scales);
  // V alias of K: V's groups are K's first ones (same scale rows)
  float *svscale = p.v_from_k ? skscale : reinterpret_cast<float *>(smem + L.v_scales);
  const int v_groups = p.v_from_k ? p.k_groups : p.v_groups;

  // ---- the CTA's query rows (any float dtype) and the FP8 group of each unit ----
  for (int i = tid; i < heads * DQ; i += kThreads) {
    const int g = i / DQ, c = i - g * DQ;
    sq[i] = pkv_load_f32(s.q.data, t * s.q.stride_row + (head0 + g) * s.q.stride_head + c, s.q.dtype);
  }
  // quant_group % 8 == 0 or >= D (the plan's condition): one scale per unit
  for (int u = tid; u < kUnitsK; u += kThreads) sunit_group[u] = kFp8 ? static_cast<int>(u * 8 / s.quant_group) : 0;

  auto fill_rows = [&](int64_t it) {
    fill_sparse_row(srows + (it % kRowBuffers) * kTileRows, list, s.ix_stride_k, s.ix_count, it * kTileRows, tokens,
                    s.k.page_size);
  };
  // Start the loads of tile `it` into stage it & 1: one cp.async commit group per tile
  // (scales, and the rows on the cp.async path) plus, for gather4, the stage's barrier.
  auto issue = [&](int64_t it) {
    const int stage = static_cast<int>(it & 1);
    uint8_t *kt = smem + stage * L.stage_bytes, *vt = kt + L.v_tile;
    const TileRows *rows = srows + (it % kRowBuffers) * kTileRows;
    if constexpr (kFp8) {
      load_tile_scales(skscale + stage * kTileRows * p.k_groups, s.k_scales, rows, kvh, p.k_groups);
      if (!p.v_from_k) load_tile_scales(svscale + stage * kTileRows * v_groups, s.v_scales, rows, kvh, v_groups);
    }
    uint8_t *tt = kt + L.tail_tile;
    if constexpr (kLoader == PKV_LOADER_CP_ASYNC) {
      load_tile_cp_async<kTileRows, kThreads>(kt, s.k, rows, kvh, D * kEs / 16, kEs, p.kv_aligned);
      if (!p.v_from_k) load_tile_cp_async<kTileRows, kThreads>(vt, s.v, rows, kvh, DV * kEs / 16, kEs, p.kv_aligned);
      if constexpr (kTail > 0) load_tile_cp_async<kTileRows, kThreads>(tt, p.tail, rows, kvh, kTail * 2 / 16, 2, p.kv_aligned);
    } else if (tid == 0) {
      constexpr int kChunksK = D * kEs / kChunkBytes, kChunksV = DV * kEs / kChunkBytes;
      constexpr int kChunksTail = kTail * 2 / kChunkBytes;
      uint64_t *bar = sbar + stage;
      uint32_t bytes = count_tile_gather4<kTileRows>(rows, kChunksK);
      if (!p.v_from_k) bytes += count_tile_gather4<kTileRows>(rows, kChunksV);
      if constexpr (kTail > 0) bytes += count_tile_gather4<kTileRows>(rows, kChunksTail);
      mbar_arrive_expect_tx(bar, bytes);  // 0 bytes (every row masked) completes the phase at once
      issue_tile_gather4<kTileRows>(kt, kmap, bar, rows, kvh * s.k.stride_head, p.rows_per_page, kChunksK, kEs);
      if (!p.v_from_k)
        issue_tile_gather4<kTileRows>(vt, vmap, bar, rows, kvh * s.v.stride_head, p.rows_per_page, kChunksV, kEs);
      if constexpr (kTail > 0)  // the tail through its own map (vmap: V is read from K here), the seeds' rope view
        issue_tile_gather4<kTileRows>(tt, vmap, bar, rows, kvh * p.tail.stride_head, p.rows_per_page, kChunksTail, 2);
    }
    cp_async_commit();
  };

  if constexpr (kLoader == PKV_LOADER_TMA_GATHER4) {
    if (tid == 0) {
      prefetch_tensor_map(kmap);
      if (!p.v_from_k) prefetch_tensor_map(vmap);
      mbar_init(sbar, 1);
      mbar_init(sbar + 1, 1);
      fence_mbar_init();
    }
  }

  // softmax state of the heads this warp owns (warp-uniform): running max (log2) and sum
  float m_run[kHeadsPerWarp], l_run[kHeadsPerWarp];
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; i++) m_run[i] = -INFINITY, l_run[i] = 0.0f;

  // P V roles: few heads leave head lanes over, which then split the tile's rows
  const int head_lanes = heads < kPvLanes ? heads : kPvLanes, row_slices = kPvLanes / head_lanes;
  const int pv_unit = tid % kUnitsV, pv_rest = tid / kUnitsV;
  const bool pv_active = pv_rest < head_lanes * row_slices;
  const int pv_lane = pv_rest % head_lanes, pv_slice = pv_rest / head_lanes;
  const int pv_group = kFp8 ? static_cast<int>(pv_unit * 8 / s.quant_group) : 0;
  float acc[kHeadsPerThread][8];
#pragma unroll
  for (int i = 0; i < kHeadsPerThread; i++)
#pragma unroll
    for (int e = 0; e < 8; e++) acc[i][e] = 0.0f;

  if (n_tiles > 0) {
    fill_rows(0);
    __syncthreads();  // rows of tile 0, the barrier init, Q
    issue(0);
  }
  for (int64_t it = 0; it < n_tiles; it++) {
    const bool has_next = it + 1 < n_tiles;
    const int stage = static_cast<int>(it & 1);
    if (has_next) fill_rows(it + 1);
    // (A) the next tile's rows are published, and every thread is done with the
    // stage the next loads overwrite (last read by tile it - 1)
    __syncthreads();
    if (has_next) issue(it + 1);
    if (has_next)
      cp_async_wait<1>();
    else
      cp_async_wait<0>();
    if constexpr (kLoader == PKV_LOADER_TMA_GATHER4) mbar_wait(sbar + stage, static_cast<uint32_t>((it >> 1) & 1));
    __syncthreads();  // (B) tile it is complete for every thread (other threads' copies)

    const TileRows *rows = srows + (it % kRowBuffers) * kTileRows;
    const uint8_t *kt = smem + stage * L.stage_bytes;
    const uint8_t *vt = p.v_from_k ? kt : kt + L.v_tile;

    // ---- scores: lane = tile row, warp = a quarter of the K units; every K unit is
    // decoded once and used for all heads ----
    {
      const float *kscale = skscale + (stage * kTileRows + lane) * p.k_groups;
      float part[kMaxHeads];
#pragma unroll
      for (int g = 0; g < kMaxHeads; g++) part[g] = 0.0f;
      for (int u = warp; u < kUnitsK; u += kWarps) {
        float k8[8];
        tile_unit8<kCache>(kt, lane, u, k8);
        if constexpr (kFp8) {
          const float sc = kscale[sunit_group[u]];
#pragma unroll
          for (int e = 0; e < 8; e++) k8[e] *= sc;
        }
#pragma unroll
        for (int g = 0; g < kMaxHeads; g++) {
          if (g >= heads) break;
          part[g] += dot8(sq + g * DQ + u * 8, k8);
        }
      }
      if constexpr (kTail > 0) {  // the tail's units (bf16, no scale): query channels D, D + 1, ...
        const uint8_t *tt = kt + L.tail_tile;
        for (int u = warp; u < kUnitsTail; u += kWarps) {
          float k8[8];
          tile_unit8<PKV_DTYPE_BF16>(tt, lane, u, k8);
#pragma unroll
          for (int g = 0; g < kMaxHeads; g++) {
            if (g >= heads) break;
            part[g] += dot8(sq + g * DQ + D + u * 8, k8);
          }
        }
      }
#pragma unroll
      for (int g = 0; g < kMaxHeads; g++)
        if (g < heads) spart[(warp * heads + g) * kTileRows + lane] = part[g];
    }
    __syncthreads();  // (C) score partials complete

    // ---- online softmax (log2 domain): warp w owns heads w, w + 4, ...; lane = tile row ----
#pragma unroll
    for (int i = 0; i < kHeadsPerWarp; i++) {
      const int g = warp + i * kWarps;
      if (g >= heads) break;  // warp-uniform
      float x = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; w++) x += spart[(w * heads + g) * kTileRows + lane];
      x *= p.score_scale;
      if (p.softcap_log2 > 0.0f) x = tanhf(x) * p.softcap_log2;
      const float sc = rows[lane].page >= 0 ? x : -INFINITY;
      // fmaxf drops a NaN score, but its 2^(s - m) is NaN and makes the sum (and the row) NaN,
      // as pkv_softmax_finish expects
      const float m_new = fmaxf(m_run[i], warp_max(sc));
      const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a head that saw nothing yet
      const float alpha = exp2f(m_run[i] - m_use);
      const float prob = exp2f(sc - m_use);
      l_run[i] = l_run[i] * alpha + warp_sum(prob);
      m_run[i] = m_new;
      sprob[g * kTileRows + lane] = prob;
      if (lane == 0) salpha[g] = alpha;
    }
    __syncthreads();  // (D) probabilities and rescales complete

    // ---- O += P V: thread = (value unit, head lane, row slice); masked rows skipped ----
    if (pv_active) {
#pragma unroll
      for (int i = 0; i < kHeadsPerThread; i++) {
        const int g = pv_lane + i * head_lanes;
        if (g >= heads) break;
        const float alpha = salpha[g];
#pragma unroll
        for (int e = 0; e < 8; e++) acc[i][e] *= alpha;
      }
      const float *vscale = svscale + stage * kTileRows * v_groups;
      for (int j = pv_slice; j < kTileRows; j += row_slices) {
        if (rows[j].page < 0) continue;
        float v8[8];
        tile_unit8<kCache>(vt, j, pv_unit, v8);
        if constexpr (kFp8) {
          const float sc = vscale[j * v_groups + pv_group];
#pragma unroll
          for (int e = 0; e < 8; e++) v8[e] *= sc;
        }
#pragma unroll
        for (int i = 0; i < kHeadsPerThread; i++) {
          const int g = pv_lane + i * head_lanes;
          if (g >= heads) break;
          const float prob = sprob[g * kTileRows + j];
#pragma unroll
          for (int e = 0; e < 8; e++) acc[i][e] += prob * v8[e];
        }
      }
    }
  }

  // ---- epilogue: normalisers (the sink joins here), row-slice sums in a fixed
  // order (deterministic), one coalesced pass over the output ----
#pragma unroll
  for (int i = 0; i < kHeadsPerWarp; i++) {
    const int g = warp + i * kWarps;
    if (g >= heads) break;
    if (lane == 0) {
      float inv, lse;
      const float sink = s.sinks ? s.sinks[(head0 + g) * s.sinks_stride] : -INFINITY;
      pkv_softmax_finish(m_run[i] == -INFINITY ? 0.0f : m_run[i], l_run[i], sink, &inv, &lse);
      sinv[g] = inv;
    }
  }
  __syncthreads();  // every tile consumed (the last one waited for all copies): the stages are free
  float *sums = reinterpret_cast<float *>(smem);  // [row_slices][heads][DV]
  if (pv_active) {
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; i++) {
      const int g = pv_lane + i * head_lanes;
      if (g >= heads) break;
      float *dst = sums + (pv_slice * heads + g) * DV + pv_unit * 8;
      *reinterpret_cast<float4 *>(dst) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      *reinterpret_cast<float4 *>(dst + 4) = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
  }
  __syncthreads();
  for (int i = tid; i < heads * DV; i += kThreads) {
    const int g = i / DV, c = i - g * DV;
    float v = 0.0f;
    for (int r = 0; r < row_slices; r++) v += sums[r * heads * DV + i];
    pkv_store_f32(s.out.data, t * s.out.stride_row + (head0 + g) * s.out.stride_head + c, s.out.dtype, v * sinv[g]);
  }
}

template <int D, int DV, pkv_dtype kCache, int kLoader, int kTail>
__global__ void __launch_bounds__(kThreads)
    sparse_tiled_kernel(const __grid_constant__ TiledParams p, const __grid_constant__ CUtensorMap kmap,
                        const __grid_constant__ CUtensorMap vmap) {
  if constexpr (loader_compiled<kLoader>()) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_align_1024(smem_raw);
    sparse_tiled_body<D, DV, kCache, kLoader, kTail>(p, &kmap, &vmap, smem);
  } else {
    __trap();  // a loader this target cannot run: the host never launches it
  }
}

// ---------------------------------------------------------------- host: launch

template <int D, int DV, pkv_dtype kCache, int kLoader, int kTail>
cudaError_t launch_tiled(const TiledParams &p, const CUtensorMap &kmap, const CUtensorMap &vmap, dim3 grid,
                         cudaStream_t stream) {
  constexpr auto kernel = sparse_tiled_kernel<D, DV, kCache, kLoader, kTail>;
  // the opt-in covers every layout this kernel can need: the device's whole opt-in
  PKV_CUDA_TRY(shared_memory_opt_in<kernel>(device_smem_optin));
  kernel<<<grid, kThreads, p.smem.bytes + 1024, stream>>>(p, kmap, vmap);
  return cudaGetLastError();
}

template <int D, int DV, pkv_dtype kCache, int kTail = 0>
cudaError_t dispatch_loader(const TiledParams &p, pkv_loader loader, const CUtensorMap &kmap,
                            const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  // gather4 boxes are whole 128-byte chunks of a row (tma_rows_ok): no instantiation for rows
  // that are not (FP8 D 64 / 96 / 576), the plan never picks it there
  constexpr int kEs = kCache == PKV_DTYPE_FP8_E4M3 || kCache == PKV_DTYPE_FP8_E5M2 ? 1 : 2;
  if constexpr (D * kEs % kChunkBytes == 0 && DV * kEs % kChunkBytes == 0) {
    if (loader == PKV_LOADER_TMA_GATHER4)
      return launch_tiled<D, DV, kCache, PKV_LOADER_TMA_GATHER4, kTail>(p, kmap, vmap, grid, stream);
  } else {
    if (loader == PKV_LOADER_TMA_GATHER4) return cudaErrorInvalidValue;
  }
  return launch_tiled<D, DV, kCache, PKV_LOADER_CP_ASYNC, kTail>(p, kmap, vmap, grid, stream);
}

template <int D, int DV>
cudaError_t dispatch_dtype(const TiledParams &p, pkv_loader loader, const CUtensorMap &kmap,
                           const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  switch (p.s.k.dtype) {
  case PKV_DTYPE_BF16: return dispatch_loader<D, DV, PKV_DTYPE_BF16>(p, loader, kmap, vmap, grid, stream);
  case PKV_DTYPE_F16: return dispatch_loader<D, DV, PKV_DTYPE_F16>(p, loader, kmap, vmap, grid, stream);
  case PKV_DTYPE_FP8_E4M3: return dispatch_loader<D, DV, PKV_DTYPE_FP8_E4M3>(p, loader, kmap, vmap, grid, stream);
  case PKV_DTYPE_FP8_E5M2: return dispatch_loader<D, DV, PKV_DTYPE_FP8_E5M2>(p, loader, kmap, vmap, grid, stream);
  default: return cudaErrorInvalidValue;
  }
}

cudaError_t dispatch_head_dims(const TiledParams &p, pkv_loader loader, const CUtensorMap &kmap,
                               const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  const int64_t d = p.s.k.head_dim, dv = p.s.v.head_dim;
  if (p.tail.head_dim != 0)  // packed MLA rows (tiled_refusal: e4m3, 512 / 512, V from K, a 64-channel tail)
    return d == 512 && dv == 512 && p.tail.head_dim == kPackedTail && p.s.k.dtype == PKV_DTYPE_FP8_E4M3
               ? dispatch_loader<512, 512, PKV_DTYPE_FP8_E4M3, kPackedTail>(p, loader, kmap, vmap, grid, stream)
               : cudaErrorInvalidValue;
  if (d == 64 && dv == 64) return dispatch_dtype<64, 64>(p, loader, kmap, vmap, grid, stream);
  if (d == 96 && dv == 96) return dispatch_dtype<96, 96>(p, loader, kmap, vmap, grid, stream);
  if (d == 128 && dv == 128) return dispatch_dtype<128, 128>(p, loader, kmap, vmap, grid, stream);
  if (d == 256 && dv == 256) return dispatch_dtype<256, 256>(p, loader, kmap, vmap, grid, stream);
  if (d == 576 && dv == 512) return dispatch_dtype<576, 512>(p, loader, kmap, vmap, grid, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

// The plan's way in (flash_attn_sparse.cuh): the grid, then the instantiation for p's shapes.
cudaError_t launch_sparse_tiled(const TiledParams &p, pkv_loader loader, const CUtensorMap &kmap,
                                const CUtensorMap &vmap, cudaStream_t stream) {
  const SparseParams &s = p.s;
  const int64_t chunks = (s.heads_per_kv + kMaxHeads - 1) / kMaxHeads;
  if (s.q.num_rows > 0x7fffffff || s.k.num_heads > 65535 || chunks > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(s.q.num_rows), static_cast<unsigned>(s.k.num_heads),
                  static_cast<unsigned>(chunks));
  return dispatch_head_dims(p, loader, kmap, vmap, grid, stream);
}

}  // namespace pkv
