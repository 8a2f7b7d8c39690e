/* pagedkv CPU: the FP8 values vLLM's CPU cache writer stores, for pagedkv's vLLM attention backend
 * (python/pagedkv/vllm_backend.py), whose FP8 caches must hold the codes vLLM's own CPU backend holds.
 *
 * vLLM's CPU writer (cpu_attn_reshape_and_cache) multiplies by the float32 reciprocal of the per-tensor
 * scale, saturates to the format's largest finite value (NaN to +max), gives an exact zero +0, and rounds
 * toward zero, where paged_store (and vLLM's CUDA writer) round to nearest even. Below e4m3's normal range
 * it takes the code off v * 2^-120 as a float32, a float32 subnormal: v is first rounded to nearest (even)
 * on the 2^-29 grid. The values come out as bfloat16, which holds every FP8 value exactly, so paged_store
 * with a scale of one then stores exactly these codes. One pass over x, where the same rule in torch
 * operations takes about ten (figures: docs/vllm.md, FP8 caches). */
#include "pkv_cpu_ops.h"

#include "../core/pkv_numeric.h"

/* The value of the code the writer stores for x. Selections are on the float32 bits (integer compares),
 * so the loops below compile to straight-line vector code (float compares would keep branches). */
static inline float vllm_cpu_fp8_value(float x, float inv_scale, const int e4m3) {
  const uint32_t max_bits = e4m3 ? 0x43e00000u : 0x47600000u;      /* 448, 57344 */
  const uint32_t normal_bits = e4m3 ? 0x3c800000u : 0x38800000u;   /* 2^-6, 2^-14: the smallest normal */
  const uint32_t b = pkv_f32_bits(x * inv_scale);
  uint32_t mag = b & 0x7fffffffu;
  /* NaN -> +max; the exact zero -0 -> +0 */
  const uint32_t sign = (mag > 0x7f800000u || mag == 0) ? 0u : (b & 0x80000000u);
  mag = mag > max_bits ? max_bits : mag; /* saturate (inf and NaN too) */
  /* a normal code: the float32 bits of its 3 (e4m3) or 2 (e5m2) mantissa bits, the rest dropped */
  const uint32_t normal = mag & (e4m3 ? 0xfff00000u : 0xffe00000u);
  /* a mask rather than selects: with a select the compiler computes sub only on its side, a branch around
   * float operations it will not speculate (they may trap), and the loop stays scalar */
  const uint32_t is_sub = 0u - (uint32_t)(mag < normal_bits);
  const float a = pkv_f32_from_bits(mag);
  float sub;
  if (e4m3) {
    /* subnormal codes 2^-9 apart: a + 2^-6 lies in [2^-6, 2^-5], where float32 values are 2^-29 apart, so
     * the sum rounds a to nearest (even) on the 2^-29 grid, as the writer's float32 subnormal does; keeping
     * its 3 mantissa bits truncates that to the 2^-9 grid */
    sub = pkv_f32_from_bits(pkv_f32_bits(a + 0x1p-6f) & 0xfff00000u) - 0x1p-6f;
  } else {
    /* subnormal codes 2^-16 apart: a * 2^16 < 4 here, truncated by the int conversion (0 in the lanes that
     * take the normal code, keeping the conversion in range) */
    sub = (float)(int32_t)(pkv_f32_from_bits(mag & is_sub) * 0x1p16f) * 0x1p-16f;
  }
  return pkv_f32_from_bits(sign | (pkv_f32_bits(sub) & is_sub) | (normal & ~is_sub));
}

/* An FP8 value as bfloat16: its float32 bits' top half (at most 3 mantissa bits, so the rest are zero). */
static inline uint16_t fp8_value_bf16(float v) { return (uint16_t)(pkv_f32_bits(v) >> 16); }

/* One loop per input dtype and format, so that each compiles to straight-line (vectorized) code. */
#define VLLM_CPU_FP8_LOOP(LOAD, E4M3) \
  for (int64_t i = begin; i < end; i++) out[i] = fp8_value_bf16(vllm_cpu_fp8_value(LOAD, inv_scale, E4M3))

void pkv_vllm_cpu_fp8_values(const void *x, pkv_dtype x_dtype, float scale, pkv_dtype fp8_dtype, uint16_t *out,
                             int64_t begin, int64_t end) {
  const float inv_scale = 1.0f / scale;
  const float *f32 = (const float *)x;
  const uint16_t *u16 = (const uint16_t *)x;
  const int e4m3 = fp8_dtype == PKV_DTYPE_FP8_E4M3;
  if (x_dtype == PKV_DTYPE_F32 && e4m3) VLLM_CPU_FP8_LOOP(f32[i], 1);
  else if (x_dtype == PKV_DTYPE_F32) VLLM_CPU_FP8_LOOP(f32[i], 0);
  else if (x_dtype == PKV_DTYPE_BF16 && e4m3) VLLM_CPU_FP8_LOOP(pkv_bf16_to_f32(u16[i]), 1);
  else if (x_dtype == PKV_DTYPE_BF16) VLLM_CPU_FP8_LOOP(pkv_bf16_to_f32(u16[i]), 0);
  else if (e4m3) VLLM_CPU_FP8_LOOP(pkv_f16_to_f32(u16[i]), 1); /* PKV_DTYPE_F16: the shim admits these three */
  else VLLM_CPU_FP8_LOOP(pkv_f16_to_f32(u16[i]), 0);
}
