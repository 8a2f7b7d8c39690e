// pagedkv CUDA backend: device helpers shared by every kernel (PTX wrappers,
// warp reductions, 16-bit packing). Never includes torch headers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "../core/pkv_numeric.h"
#include "../core/pkv_view.h"
#include "pkv_cuda.h"

#if defined(__CUDA_ARCH__)
#define PKV_ARCH __CUDA_ARCH__
#else
#define PKV_ARCH 0
#endif

namespace pkv {

constexpr int kWarp = 32;

// Launch-error helper for launchers: report the first failure of a sequence.
#define PKV_CUDA_TRY(expr)                                                                                        \
  do {                                                                                                            \
    cudaError_t e_ = (expr);                                                                                      \
    if (e_ != cudaSuccess) return e_;                                                                             \
  } while (0)

// The dynamic shared-memory opt-in of kernel kKernel, bytes_for(device) bytes, set once per device: the
// first, eager call sets it, and a captured graph's launches then need nothing (one flag word per kernel).
template <auto kKernel, typename BytesFor>
cudaError_t shared_memory_opt_in(BytesFor bytes_for) {
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  PKV_CUDA_TRY(cudaGetDevice(&device));
  const uint64_t bit = uint64_t(1) << (device & 63);
  if (!(configured.load() & bit)) {
    PKV_CUDA_TRY(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes_for(device)));
    configured.fetch_or(bit);
  }
  return cudaSuccess;
}

__device__ __forceinline__ uint32_t smem_u32(const void *p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// The dynamic shared memory from its first 1024-byte boundary: TMA's 128-byte
// swizzle needs 1024-aligned tiles, and every tiled kernel lays them out from here.
__device__ __forceinline__ uint8_t *smem_align_1024(uint8_t *raw) {
  return raw + ((1024 - (smem_u32(raw) & 1023)) & 1023);
}

// ---- warp reductions ----
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- one key of a warp's online softmax (the portable kernels) ----
// Score s in log2 units (a NaN stays NaN): updates the running max m and sum l; corr is the factor of
// the accumulators so far, w the key's weight.
__device__ __forceinline__ void online_softmax_key(float s, float &m, float &l, float &corr, float &w) {
  const float m_new = s > m || s != s ? s : m;
  corr = m == -INFINITY ? 0.0f : exp2f(m - m_new);
  w = exp2f(s - m_new);
  l = l * corr + w;
  m = m_new;
}

// ---- 2^x for softmax probabilities ----
// One MUFU.EX2. exp2f (no fast-math) wraps the same instruction in a compare, a halving and a
// squaring so that x < -126 gives a denormal: three extra instructions per probability in the
// attention loops. Here x < -126 gives 0 (the CPU kernels' exp2 flushes those too); every other
// x, -inf (0), +inf and NaN give exactly what exp2f gives.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// ---- ragged batch: the row b whose [offsets[b], offsets[b+1]) holds `row` ----
// Returns -1 when no row holds it (padding rows, or offsets that are not
// monotone: kernels skip such rows rather than trust the values).
__device__ __forceinline__ int64_t find_batch_row(const pkv_index_view &offsets, int64_t row) {
  int64_t batch = offsets.rows - 1;
  int64_t lo = 0, hi = batch;
  while (lo < hi) {
    int64_t mid = (lo + hi) >> 1;
    if (pkv_index_at(&offsets, mid + 1) <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo >= batch) return -1;
  if (pkv_index_at(&offsets, lo) > row || pkv_index_at(&offsets, lo + 1) <= row) return -1;
  return lo;
}

// ---- cp.async (sm_80+) ----
// 16-byte copy; src_bytes == 0 zero-fills the destination without reading src.
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem, uint32_t src_bytes) {
#if PKV_ARCH >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
#else
  __trap();
#endif
}
// 4-byte copy through L1 (.ca: .cg only takes 16 bytes), for small per-row
// data such as FP8 scales; src_bytes == 0 zero-fills without reading src.
__device__ __forceinline__ void cp_async_4(void *smem, const void *gmem, uint32_t src_bytes) {
#if PKV_ARCH >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes)
               : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if PKV_ARCH >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if PKV_ARCH >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// ---- tensor-core fragments (sm_80+): ldmatrix and mma.sync m16n8k16 ----
// Four 8x8 16-bit matrices from a shared-memory address (smem_u32 form), as is or transposed.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a * b for one 16x8x16 tile, fp32 accumulators.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                         uint32_t b1) {
#if PKV_ARCH >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if PKV_ARCH >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  __trap();
#endif
}

// ---- 16-bit packing ----
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&v);
}

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}

// The core's dtype code of the 16-bit type T.
template <typename T>
__host__ __device__ constexpr pkv_dtype dtype_of();
template <>
constexpr pkv_dtype dtype_of<__nv_bfloat16>() {
  return PKV_DTYPE_BF16;
}
template <>
constexpr pkv_dtype dtype_of<__half>() {
  return PKV_DTYPE_F16;
}

// ---- FP8 -> float, two at a time (byte 0 -> .x) ----
// e4m3: sign | exponent-mantissa moved into a float16 and rescaled by 2^8
// (the bias difference 15 - 7). 0x7f/0xff are NaN in e4m3fn.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint16_t two) {
  uint32_t x = two;
  uint32_t h = ((x & 0x80u) << 8) | ((x & 0x7fu) << 7) | ((x & 0x8000u) << 16) | ((x & 0x7f00u) << 15);
  __half2 hv = *reinterpret_cast<__half2 *>(&h);
  float2 f = __half22float2(hv);
  f.x *= 256.0f;
  f.y *= 256.0f;
  if ((x & 0x7fu) == 0x7fu) f.x = __int_as_float(0x7fc00000);
  if ((x & 0x7f00u) == 0x7f00u) f.y = __int_as_float(0x7fc00000);
  return f;
}
// e5m2 is float16 with the low mantissa byte dropped.
__device__ __forceinline__ float2 e5m2x2_to_float2(uint16_t two) {
  uint32_t x = two;
  uint32_t h = ((x & 0xffu) << 8) | ((x & 0xff00u) << 16);
  __half2 hv = *reinterpret_cast<__half2 *>(&h);
  return __half22float2(hv);
}

// The same two conversions by the hardware where it has them (sm_89+: one cvt to f16x2, in which every
// e4m3/e5m2 value, NaN included, is exact; byte 0 -> the low half -> .x), else the bit-level ones.
template <bool kE4m3>
__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t two) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h;
  if constexpr (kE4m3)
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(two));
  else
    asm("cvt.rn.f16x2.e5m2x2 %0, %1;" : "=r"(h) : "h"(two));
  return __half22float2(*reinterpret_cast<const __half2 *>(&h));
#else
  return kE4m3 ? e4m3x2_to_float2(two) : e5m2x2_to_float2(two);
#endif
}

// ---- 8 elements as floats <-> memory, vectorised (8- or 16-byte aligned at element i) ----
// load8: f32/f16/bf16 or FP8 codes (unscaled) starting at element i.
template <pkv_dtype kSrc>
__device__ __forceinline__ void load8(const void *base, int64_t i, float (&v)[8]) {
  if constexpr (kSrc == PKV_DTYPE_F32) {
    const float4 a = __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i));
    const float4 b = __ldg(reinterpret_cast<const float4 *>(static_cast<const float *>(base) + i + 4));
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else if constexpr (kSrc == PKV_DTYPE_BF16 || kSrc == PKV_DTYPE_F16) {
    const uint4 a = __ldg(reinterpret_cast<const uint4 *>(static_cast<const uint16_t *>(base) + i));
    const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const uint16_t lo = static_cast<uint16_t>(w[k] & 0xffff), hi = static_cast<uint16_t>(w[k] >> 16);
      v[2 * k] = kSrc == PKV_DTYPE_BF16 ? pkv_bf16_to_f32(lo) : pkv_f16_to_f32(lo);
      v[2 * k + 1] = kSrc == PKV_DTYPE_BF16 ? pkv_bf16_to_f32(hi) : pkv_f16_to_f32(hi);
    }
  } else {
    const uint2 a = __ldg(reinterpret_cast<const uint2 *>(static_cast<const uint8_t *>(base) + i));
    const uint32_t w[2] = {a.x, a.y};
#pragma unroll
    for (int k = 0; k < 8; k++) {
      const uint8_t c = static_cast<uint8_t>(w[k / 4] >> (8 * (k % 4)));
      v[k] = kSrc == PKV_DTYPE_FP8_E4M3 ? pkv_e4m3_to_f32(c) : pkv_e5m2_to_f32(c);
    }
  }
}

// store8: f32 (two 16-byte stores) or f16/bf16 (one) starting at element i.
template <pkv_dtype kDst>
__device__ __forceinline__ void store8(void *base, int64_t i, const float (&v)[8]) {
  if constexpr (kDst == PKV_DTYPE_F32) {
    float *d = static_cast<float *>(base) + i;
    reinterpret_cast<float4 *>(d)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4 *>(d)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
      const uint16_t lo = kDst == PKV_DTYPE_BF16 ? pkv_f32_to_bf16(v[2 * k]) : pkv_f32_to_f16(v[2 * k]);
      const uint16_t hi = kDst == PKV_DTYPE_BF16 ? pkv_f32_to_bf16(v[2 * k + 1]) : pkv_f32_to_f16(v[2 * k + 1]);
      w[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
    }
    *reinterpret_cast<uint4 *>(static_cast<uint16_t *>(base) + i) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

}  // namespace pkv
