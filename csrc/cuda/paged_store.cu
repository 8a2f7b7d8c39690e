// pagedkv CUDA backend: paged_store. One launch for the whole ragged batch:
// one warp per (K or V, token row) writes all its head vectors into their page
// slot, converting to the cache dtype; FP8 caches take a warp per (K or V,
// token row, KV head), quantizing with the (token, head, group) amax scale
// fused in (warp reductions, scale, cast, scale write), or with a per-tensor scale (cast only).
// Conversions are the core's bit-exact functions, so CUDA and
// CPU caches hold identical bytes.
//
// Bounds: every index value is checked on the device (host checks are
// optional on CUDA): rows outside every [offsets[b], offsets[b+1]), negative
// positions, positions past the lookup table and page ids outside [0, N) are
// skipped, never written.
#include "../core/pkv_settings.h"
#include "common.cuh"

namespace pkv {
namespace {

constexpr int kStoreThreads = 128;    // 4 warps, one (job, row) or (job, row, head) unit each
constexpr int kStoreMaxChunks = 128;  // vector FP8 path: per-warp chunk maxima in smem (D <= 2048)

struct StoreJob {
  pkv_rows_view src;      // [T, Hk, D] key or value
  pkv_cache_view cache;   // [N, P, Hk, D]
  pkv_cache_view scales;  // f32 [N, P, Hk, ceil(D/G)], FP8 caches only
  const float *fixed_scale;  // FP8 with a per-tensor scale: that one float (read, never written); else null
};

struct StoreParams {
  StoreJob job[2];  // K, and V when it has the same dtypes
  int num_jobs;
  pkv_index_view offsets;  // [B+1]
  pkv_index_view lengths;  // [B]
  pkv_index_view table;    // [B, max_pages]
  int64_t num_rows;        // T = key.size(0)
  int64_t quant_group;     // channels per FP8 scale
};

// The page slot token row `row` goes to, or false when it is skipped.
__device__ __forceinline__ bool store_slot(const StoreParams &p, const pkv_cache_view &c, int64_t row,
                                           int64_t *page_out, int64_t *slot_out) {
  const int64_t b = find_batch_row(p.offsets, row);
  if (b < 0) return false;
  const int64_t pos = pkv_cache_length(&p.lengths, b) + (row - pkv_index_at(&p.offsets, b));
  if (pos < 0 || pos / c.page_size >= p.table.cols) return false;
  const int64_t page = pkv_page_of(&p.table, b, pos, c.page_size);
  if (page < 0 || page >= c.num_pages) return false;
  *page_out = page;
  *slot_out = pkv_slot_of(pos, c.page_size);
  return true;
}

// Element offset of the destination head vector, or -1 when skipped.
__device__ __forceinline__ int64_t store_target(const StoreParams &p, const pkv_cache_view &c, int64_t row,
                                                int64_t head, int64_t *page_out, int64_t *slot_out) {
  if (!store_slot(p, c, row, page_out, slot_out)) return -1;
  return pkv_cache_offset(&c, *page_out, *slot_out, head);
}

// |x| as ordered bits: max over them propagates NaN (as torch's amax does).
__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7fffffffu; }
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Elements [src, src + 16) of a source row quantized with `scale` into the 16 codes at dst (one 16-byte store).
template <pkv_dtype kSrc, pkv_dtype kDst>
__device__ __forceinline__ void quantize_chunk16(const void *data, int64_t src, float scale, uint8_t *dst) {
  float v[8], w[8];
  load8<kSrc>(data, src, v);
  load8<kSrc>(data, src + 8, w);
  uint8_t out[16];
#pragma unroll
  for (int k = 0; k < 8; k++) {
    out[k] = pkv_fp8_quantize(v[k], scale, kDst);
    out[k + 8] = pkv_fp8_quantize(w[k], scale, kDst);
  }
  *reinterpret_cast<uint4 *>(dst) = *reinterpret_cast<const uint4 *>(out);
}

template <pkv_dtype kSrc, pkv_dtype kDst, bool kVec>
__device__ void store_unit(const StoreParams &p, const StoreJob &job, int64_t row, int64_t head,
                           uint32_t *chunk_max) {
  const int lane = threadIdx.x & 31;
  int64_t page, slot;
  const int64_t dst = store_target(p, job.cache, row, head, &page, &slot);
  if (dst < 0) return;
  const int64_t src = row * job.src.stride_row + head * job.src.stride_head;
  const int64_t d = job.cache.head_dim;
  constexpr bool kFp8 = kDst == PKV_DTYPE_FP8_E4M3 || kDst == PKV_DTYPE_FP8_E5M2;

  if constexpr (!kFp8) {  // unaligned rows (aligned ones take store_kernel's warp per row)
    for (int64_t i = lane; i < d; i += 32)
      pkv_store_f32(job.cache.data, dst + i, kDst, pkv_load_f32(job.src.data, src + i, kSrc));
    return;
  } else {
    uint8_t *q = static_cast<uint8_t *>(job.cache.data) + dst;
    if (job.fixed_scale) {  // per-tensor scale: x / s for every element, nothing else written
      const float scale = __ldg(job.fixed_scale);
      if constexpr (kVec) {
        for (int64_t c = lane; c < d / 16; c += 32) {
          quantize_chunk16<kSrc, kDst>(job.src.data, src + c * 16, scale, q + c * 16);
        }
      } else {
        for (int64_t i = lane; i < d; i += 32)
          q[i] = pkv_fp8_quantize(pkv_load_f32(job.src.data, src + i, kSrc), scale, kDst);
      }
      return;
    }
    float *scales = static_cast<float *>(job.scales.data) + pkv_cache_offset(&job.scales, page, slot, head);
    const int64_t g = p.quant_group;
    if constexpr (kVec) {
      // Chunks of 16 elements; the host guarantees G % 16 == 0 or G >= D, so
      // a chunk never straddles two groups.
      const int64_t chunks = d / 16, chunks_per_group = g >= d ? chunks : g / 16;
      for (int64_t c = lane; c < chunks; c += 32) {
        float v[8], w[8];
        load8<kSrc>(job.src.data, src + c * 16, v);
        load8<kSrc>(job.src.data, src + c * 16 + 8, w);
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) m = max(m, max(abs_bits(v[k]), abs_bits(w[k])));
        chunk_max[c] = m;
      }
      __syncwarp();
      for (int64_t c = lane; c < chunks; c += 32) {
        const int64_t first = c / chunks_per_group * chunks_per_group;
        uint32_t m = 0;
        for (int64_t k = first; k < first + chunks_per_group && k < chunks; k++) m = max(m, chunk_max[k]);
        const float scale = pkv_fp8_scale_for(__uint_as_float(m), kDst);
        quantize_chunk16<kSrc, kDst>(job.src.data, src + c * 16, scale, q + c * 16);
        if (c == first) scales[c * 16 / (g >= d ? d : g)] = scale;
      }
      __syncwarp();  // chunk_max is reused by this warp's next unit
    } else {
      // Any group size and alignment: groups one after another, each reduced
      // by the whole warp.
      for (int64_t g0 = 0, gi = 0; g0 < d; g0 += g, gi++) {
        const int64_t g1 = g0 + g < d ? g0 + g : d;
        uint32_t m = 0;
        for (int64_t i = g0 + lane; i < g1; i += 32) m = max(m, abs_bits(pkv_load_f32(job.src.data, src + i, kSrc)));
        m = warp_max_u32(m);
        const float scale = pkv_fp8_scale_for(__uint_as_float(m), kDst);
        for (int64_t i = g0 + lane; i < g1; i += 32)
          q[i] = pkv_fp8_quantize(pkv_load_f32(job.src.data, src + i, kSrc), scale, kDst);
        if (lane == 0) scales[gi] = scale;
      }
    }
  }
}

template <pkv_dtype kSrc, pkv_dtype kDst, bool kVec>
__global__ void __launch_bounds__(kStoreThreads) store_kernel(const __grid_constant__ StoreParams p) {
#if PKV_ARCH >= 800
  __shared__ uint32_t chunk_max[kStoreThreads / kWarp][kStoreMaxChunks];
  const int warp = threadIdx.x >> 5;
  const int64_t heads = p.job[0].cache.num_heads;
  constexpr bool kFp8 = kDst == PKV_DTYPE_FP8_E4M3 || kDst == PKV_DTYPE_FP8_E5M2;
  if constexpr (kVec && !kFp8) {
    // a warp per (job, row): the row's slot is found once, then the lanes walk (head, 8-element
    // group) pairs, all heads' loads in flight together (faster than a warp per (row, head)
    // (measured: benchmarks/README.md, "Measurements behind the CUDA kernels")). FP8 keeps a warp per (row, head): its lanes share the head's absolute maximum.
    const int lane = threadIdx.x & 31;
    const int64_t units = p.num_rows * p.num_jobs;
    for (int64_t u = static_cast<int64_t>(blockIdx.x) * (kStoreThreads / kWarp) + warp; u < units;
         u += static_cast<int64_t>(gridDim.x) * (kStoreThreads / kWarp)) {
      const StoreJob &job = p.job[u / p.num_rows];
      const int64_t row = u % p.num_rows, per_head = job.cache.head_dim / 8;
      int64_t page, slot;
      if (!store_slot(p, job.cache, row, &page, &slot)) continue;
      for (int64_t e = lane; e < heads * per_head; e += 32) {
        const int64_t head = e / per_head, c = (e - head * per_head) * 8;
        float v[8];
        load8<kSrc>(job.src.data, row * job.src.stride_row + head * job.src.stride_head + c, v);
        store8<kDst>(job.cache.data, pkv_cache_offset(&job.cache, page, slot, head) + c, v);
      }
    }
    return;
  }
  const int64_t per_job = p.num_rows * heads, units = per_job * p.num_jobs;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * (kStoreThreads / kWarp) + warp; u < units;
       u += static_cast<int64_t>(gridDim.x) * (kStoreThreads / kWarp)) {
    const int j = static_cast<int>(u / per_job);
    const int64_t r = u % per_job;
    store_unit<kSrc, kDst, kVec>(p, p.job[j], r / heads, r % heads, chunk_max[warp]);
  }
#else
  __trap();
#endif
}

// ---- opt-in (kernel option cuda_fp8_store_rows; compiled, not yet run on a GPU) ----
// FP8 stores a warp per (job, token row) over all heads, as the 16-bit path, instead of a warp per
// (job, row, head) with a quarter of its lanes busy at D 128: lane e of the row's (head, 8-element unit)
// pairs loads its unit, the lanes of one scale group (w = G / 8 or D / 8 of them, a power of two <= 32,
// lane-aligned) reduce its absolute maximum by shuffles, and each lane quantizes its 8 elements into one
// 8-byte store, the group's first lane writing the scale. The same bytes as store_unit: the same
// maximum, scale rule and clamped x / scale, converted by the hardware (sm_89+) with the rounding to
// nearest even of pkv_f32_to_e4m3 / e5m2 (NaN keeps its sign and code 0x7f, as there).

// Two clamped values -> two FP8 codes, lo in byte 0.
template <pkv_dtype kDst>
__device__ __forceinline__ uint32_t fp8_pair(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint16_t two;
  if constexpr (kDst == PKV_DTYPE_FP8_E4M3)
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(two) : "f"(hi), "f"(lo));  // a -> the upper byte
  else
    asm("cvt.rn.satfinite.e5m2x2.f32 %0, %1, %2;" : "=h"(two) : "f"(hi), "f"(lo));
  uint32_t r = two;
  if (lo != lo) r = (r & 0xff00u) | ((__float_as_uint(lo) >> 24) & 0x80u) | 0x7fu;
  if (hi != hi) r = (r & 0x00ffu) | ((((__float_as_uint(hi) >> 24) & 0x80u) | 0x7fu) << 8);
  return r;
#else
  if constexpr (kDst == PKV_DTYPE_FP8_E4M3) return pkv_f32_to_e4m3(lo) | (uint32_t(pkv_f32_to_e4m3(hi)) << 8);
  return pkv_f32_to_e5m2(lo) | (uint32_t(pkv_f32_to_e5m2(hi)) << 8);
#endif
}

template <pkv_dtype kSrc, pkv_dtype kDst>
__global__ void __launch_bounds__(kStoreThreads) store_fp8_rows_kernel(const __grid_constant__ StoreParams p,
                                                                       int group_lanes) {
#if PKV_ARCH >= 800
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t heads = p.job[0].cache.num_heads, units = p.num_rows * p.num_jobs;
  const float mx = pkv_fp8_max(kDst);
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * (kStoreThreads / kWarp) + warp; u < units;
       u += static_cast<int64_t>(gridDim.x) * (kStoreThreads / kWarp)) {
    const StoreJob &job = p.job[u / p.num_rows];
    const int64_t row = u % p.num_rows, d = job.cache.head_dim, per_head = d / 8;
    int64_t page, slot;
    if (!store_slot(p, job.cache, row, &page, &slot)) continue;  // warp-uniform
    const bool fixed = job.fixed_scale != nullptr;
    const float fixed_scale = fixed ? __ldg(job.fixed_scale) : 0.0f;
    const int64_t g = fixed || p.quant_group >= d ? d : p.quant_group;  // channels per scale
    for (int64_t e0 = 0; e0 < heads * per_head; e0 += kWarp) {
      const int64_t e = e0 + lane;
      const bool live = e < heads * per_head;
      const int64_t head = live ? e / per_head : 0, c = live ? (e - head * per_head) * 8 : 0;
      float v[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      if (live) load8<kSrc>(job.src.data, row * job.src.stride_row + head * job.src.stride_head + c, v);
      float scale = fixed_scale;
      if (!fixed) {  // every lane shuffles, live or not
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < 8; k++) m = max(m, abs_bits(v[k]));
        for (int o = group_lanes / 2; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        scale = pkv_fp8_scale_for(__uint_as_float(m), kDst);
        if (live && c % g == 0)
          static_cast<float *>(job.scales.data)[pkv_cache_offset(&job.scales, page, slot, head) + c / g] = scale;
      }
      if (!live) continue;
      uint32_t codes[2];
#pragma unroll
      for (int k = 0; k < 2; k++) {
        float q[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {  // pkv_fp8_quantize's clamp of x / scale (NaN passes)
          const float x = v[4 * k + i] / scale;
          q[i] = x > mx ? mx : (x < -mx ? -mx : x);
        }
        codes[k] = fp8_pair<kDst>(q[0], q[1]) | (fp8_pair<kDst>(q[2], q[3]) << 16);
      }
      *reinterpret_cast<uint2 *>(static_cast<uint8_t *>(job.cache.data) +
                                 pkv_cache_offset(&job.cache, page, slot, head) + c) = make_uint2(codes[0], codes[1]);
    }
  }
#else
  __trap();
#endif
}

// The lanes of one scale group in store_fp8_rows_kernel, or 0 when a job does not fit it (the vector
// path's alignment, D a multiple of 8, groups of a power of two <= 32 units that tile each head).
int fp8_rows_group_lanes(const StoreJob &j, int64_t group) {
  const int64_t d = j.cache.head_dim;
  if (d % 8 != 0 || !pkv_rows_aligned(&j.src, static_cast<int64_t>(pkv_dtype_size(j.src.dtype)), 16) ||
      !pkv_cache_aligned(&j.cache, 1, 8))
    return 0;
  if (j.fixed_scale) return 1;
  const int64_t g = group >= d ? d : group;
  if (g % 8 != 0 || d % g != 0) return 0;
  const int64_t w = g / 8;
  return w <= kWarp && (w & (w - 1)) == 0 ? static_cast<int>(w) : 0;
}

// 16-byte vector loads and stores for this job?
bool job_vectorizable(const StoreJob &j, int64_t group) {
  const int64_t d = j.cache.head_dim;
  const int64_t ses = static_cast<int64_t>(pkv_dtype_size(j.src.dtype));
  const int64_t des = static_cast<int64_t>(pkv_dtype_size(j.cache.dtype));
  if (!pkv_rows_aligned(&j.src, ses, 16)) return false;
  if (!pkv_cache_aligned(&j.cache, des, 16)) return false;
  if (pkv_dtype_is_fp8(j.cache.dtype))
    return d % 16 == 0 && d / 16 <= kStoreMaxChunks && (j.fixed_scale || group >= d || group % 16 == 0);
  return d % 8 == 0;
}

// CTAs for `units` warps' units (grid-stride beyond 65535 * 8 CTAs).
unsigned store_blocks(int64_t units) {
  const int64_t warps = kStoreThreads / kWarp, blocks = (units + warps - 1) / warps;
  return static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

template <pkv_dtype kSrc, pkv_dtype kDst>
cudaError_t launch_store(const StoreParams &p, bool vec, cudaStream_t stream) {
  constexpr bool kFp8 = kDst == PKV_DTYPE_FP8_E4M3 || kDst == PKV_DTYPE_FP8_E5M2;
  if constexpr (kFp8) {
    const int lanes = fp8_rows_group_lanes(p.job[0], p.quant_group);
    if (pkv_settings_get().cuda_fp8_store_rows && lanes > 0 &&
        (p.num_jobs < 2 || fp8_rows_group_lanes(p.job[1], p.quant_group) == lanes)) {
      const unsigned blocks = store_blocks(p.num_rows * p.num_jobs);
      if (blocks == 0) return cudaSuccess;
      store_fp8_rows_kernel<kSrc, kDst><<<blocks, kStoreThreads, 0, stream>>>(p, lanes);
      return cudaGetLastError();
    }
  }
  const int64_t units = p.num_rows * p.num_jobs * (vec && !kFp8 ? 1 : p.job[0].cache.num_heads);
  if (units == 0) return cudaSuccess;
  const unsigned blocks = store_blocks(units);
  if (vec)
    store_kernel<kSrc, kDst, true><<<blocks, kStoreThreads, 0, stream>>>(p);
  else
    store_kernel<kSrc, kDst, false><<<blocks, kStoreThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <pkv_dtype kSrc>
cudaError_t dispatch_dst(const StoreParams &p, pkv_dtype dst, bool vec, cudaStream_t stream) {
  switch (dst) {
  case PKV_DTYPE_F32: return launch_store<kSrc, PKV_DTYPE_F32>(p, vec, stream);
  case PKV_DTYPE_F16: return launch_store<kSrc, PKV_DTYPE_F16>(p, vec, stream);
  case PKV_DTYPE_BF16: return launch_store<kSrc, PKV_DTYPE_BF16>(p, vec, stream);
  case PKV_DTYPE_FP8_E4M3: return launch_store<kSrc, PKV_DTYPE_FP8_E4M3>(p, vec, stream);
  case PKV_DTYPE_FP8_E5M2: return launch_store<kSrc, PKV_DTYPE_FP8_E5M2>(p, vec, stream);
  default: return cudaErrorInvalidValue;
  }
}

cudaError_t dispatch_store(const StoreParams &p, cudaStream_t stream) {
  const bool vec = job_vectorizable(p.job[0], p.quant_group) && (p.num_jobs < 2 || job_vectorizable(p.job[1], p.quant_group));
  switch (p.job[0].src.dtype) {
  case PKV_DTYPE_F32: return dispatch_dst<PKV_DTYPE_F32>(p, p.job[0].cache.dtype, vec, stream);
  case PKV_DTYPE_F16: return dispatch_dst<PKV_DTYPE_F16>(p, p.job[0].cache.dtype, vec, stream);
  case PKV_DTYPE_BF16: return dispatch_dst<PKV_DTYPE_BF16>(p, p.job[0].cache.dtype, vec, stream);
  default: return cudaErrorInvalidValue;
  }
}

StoreJob make_job(const pkv_tensor &src, const pkv_tensor &cache, const pkv_tensor &scales) {
  StoreJob j{};
  j.src = pkv_rows_view_from(&src);
  j.cache = pkv_cache_view_from(&cache);
  if (pkv_scales_per_tensor(&scales)) j.fixed_scale = static_cast<const float *>(scales.data);
  else if (scales.defined) j.scales = pkv_cache_view_from(&scales);
  return j;
}

}  // namespace
}  // namespace pkv

extern "C" {

pkv_status pkv_cuda_store_supported(const pkv_store_args *a, pkv_error *err) {
  (void)a;
  (void)err;
  return PKV_OK;  // every dtype combination of the contract runs on CUDA
}

cudaError_t pkv_cuda_store(const pkv_store_args *a, cudaStream_t stream) {
  using namespace pkv;
  StoreParams p{};
  p.offsets = pkv_index_view_from(&a->input_row_offsets);
  p.lengths = pkv_index_view_from(&a->cache_lengths);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.num_rows = a->key.sizes[0];
  p.quant_group = a->quant_group;
  if (p.lengths.rows == 0 || p.num_rows == 0) return cudaSuccess;
  StoreJob k = make_job(a->key, a->k_cache, a->k_scales);
  p.job[0] = k;
  p.num_jobs = 1;
  if (a->v_cache.defined) {
    StoreJob v = make_job(a->value, a->v_cache, a->v_scales);
    // One launch for K and V when the kernel is the same; otherwise two.
    if (v.src.dtype == k.src.dtype && v.cache.dtype == k.cache.dtype && v.cache.num_heads == k.cache.num_heads) {
      p.job[1] = v;
      p.num_jobs = 2;
    } else {
      PKV_CUDA_TRY(dispatch_store(p, stream));
      p.job[0] = v;
    }
  }
  return dispatch_store(p, stream);
}

}  // extern "C"
