/* pagedkv core: scalar conversions shared by the CPU kernels, the CUDA
 * kernels and the C tests. Float16/bfloat16/FP8 are handled as raw bits so
 * host and device produce identical results. */
#ifndef PKV_NUMERIC_H
#define PKV_NUMERIC_H

#include <math.h>
#include <string.h>

#include "pkv_common.h"

#if defined(__CUDA_ARCH__)
/* device pass of nvcc: the intrinsics (memcpy also works but is slower to compile) */
PKV_HD uint32_t pkv_f32_bits(float x) { return __float_as_uint(x); }
PKV_HD float pkv_f32_from_bits(uint32_t b) { return __uint_as_float(b); }
#else
PKV_HD uint32_t pkv_f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}
PKV_HD float pkv_f32_from_bits(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}
#endif

/* ---- bfloat16: the top half of a float32 ---- */
PKV_HD float pkv_bf16_to_f32(uint16_t h) { return pkv_f32_from_bits((uint32_t)h << 16); }

PKV_HD uint16_t pkv_f32_to_bf16(float x) {
  uint32_t b = pkv_f32_bits(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40u); /* quiet NaN */
  b += 0x7fffu + ((b >> 16) & 1u);                                            /* round to nearest even */
  return (uint16_t)(b >> 16);
}

/* ---- IEEE float16 ---- */
PKV_HD float pkv_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return pkv_f32_from_bits(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in float32 */
    float v = (float)man * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return pkv_f32_from_bits(sign | ((exp + 112u) << 23) | (man << 13));
}

PKV_HD uint16_t pkv_f32_to_f16(float x) {
  uint32_t b = pkv_f32_bits(x);
  uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
  uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {
    /* below the smallest normal (2^-14): round a * 2^24 to an integer, RNE */
    float v = pkv_f32_from_bits(a) * 16777216.0f;
    return (uint16_t)(sign | (uint16_t)rintf(v));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  return (uint16_t)(sign | (uint16_t)((r - (112u << 23)) >> 13));
}

/* ---- FP8 (OCP e4m3fn and e5m2) ---- */
#define PKV_FP8_E4M3_MAX 448.0f
#define PKV_FP8_E5M2_MAX 57344.0f

PKV_HD float pkv_fp8_max(pkv_dtype dtype) {
  return dtype == PKV_DTYPE_FP8_E4M3 ? PKV_FP8_E4M3_MAX : PKV_FP8_E5M2_MAX;
}

PKV_HD float pkv_e4m3_to_f32(uint8_t c) {
  uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
  float v;
  if ((c & 0x7fu) == 0x7fu) return pkv_f32_from_bits(0x7fc00000u);
  if (e == 0)
    v = (float)m * 0.001953125f; /* m * 2^-9 */
  else
    v = pkv_f32_from_bits(((e + 120u) << 23) | (m << 20));
  return (c & 0x80u) ? -v : v;
}

PKV_HD float pkv_e5m2_to_f32(uint8_t c) {
  /* e5m2 is float16 with the low mantissa byte dropped */
  return pkv_f16_to_f32((uint16_t)((uint16_t)c << 8));
}

/* Round to nearest even, saturating to +-max (the contract clamps before
 * the cast, so saturation only decides what out-of-range input becomes). */
PKV_HD uint8_t pkv_f32_to_e4m3(float x) {
  uint32_t b = pkv_f32_bits(x);
  uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
  uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  if (a >= 0x43e00000u) return (uint8_t)(sign | 0x7eu); /* >= 448 */
  if (a < 0x3c800000u) {                                 /* < 2^-6: subnormal step 2^-9 */
    float v = pkv_f32_from_bits(a) * 512.0f;
    return (uint8_t)(sign | (uint8_t)rintf(v));
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  uint32_t code = (r - (120u << 23)) >> 20;
  if (code > 0x7eu) code = 0x7eu;
  return (uint8_t)(sign | code);
}

PKV_HD uint8_t pkv_f32_to_e5m2(float x) {
  uint32_t b = pkv_f32_bits(x);
  uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
  uint32_t a = b & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  if (a >= 0x47600000u) return (uint8_t)(sign | 0x7bu); /* >= 57344 */
  if (a < 0x38800000u) {                                 /* < 2^-14: subnormal step 2^-16 */
    float v = pkv_f32_from_bits(a) * 65536.0f;
    return (uint8_t)(sign | (uint8_t)rintf(v));
  }
  uint32_t r = a + 0xfffffu + ((a >> 21) & 1u);
  uint32_t code = (r - (112u << 23)) >> 21;
  if (code > 0x7bu) code = 0x7bu;
  return (uint8_t)(sign | code);
}

/* Scale rule of the contract: scale = amax / FP8_MAX, or 1 when amax == 0.
 * A NaN amax gives a NaN scale (the group's values are NaN, as in torch). */
PKV_HD float pkv_fp8_scale_for(float amax, pkv_dtype dtype) {
  return amax == 0.0f ? 1.0f : amax / pkv_fp8_max(dtype);
}

/* Quantize one element with its group's scale (clamp, then RNE cast). */
PKV_HD uint8_t pkv_fp8_quantize(float x, float scale, pkv_dtype dtype) {
  float mx = pkv_fp8_max(dtype);
  float v = x / scale;
  v = v > mx ? mx : (v < -mx ? -mx : v);
  return dtype == PKV_DTYPE_FP8_E4M3 ? pkv_f32_to_e4m3(v) : pkv_f32_to_e5m2(v);
}

/* Load element i of a buffer of `dtype` as float (FP8 unscaled). */
PKV_HD float pkv_load_f32(const void *p, int64_t i, pkv_dtype dtype) {
  switch (dtype) {
  case PKV_DTYPE_F32: return ((const float *)p)[i];
  case PKV_DTYPE_F16: return pkv_f16_to_f32(((const uint16_t *)p)[i]);
  case PKV_DTYPE_BF16: return pkv_bf16_to_f32(((const uint16_t *)p)[i]);
  case PKV_DTYPE_FP8_E4M3: return pkv_e4m3_to_f32(((const uint8_t *)p)[i]);
  case PKV_DTYPE_FP8_E5M2: return pkv_e5m2_to_f32(((const uint8_t *)p)[i]);
  default: return 0.0f;
  }
}

/* Store a float into element i of a float-typed buffer (f32/f16/bf16). */
PKV_HD void pkv_store_f32(void *p, int64_t i, pkv_dtype dtype, float v) {
  switch (dtype) {
  case PKV_DTYPE_F32: ((float *)p)[i] = v; break;
  case PKV_DTYPE_F16: ((uint16_t *)p)[i] = pkv_f32_to_f16(v); break;
  case PKV_DTYPE_BF16: ((uint16_t *)p)[i] = pkv_f32_to_bf16(v); break;
  default: break;
  }
}

/* ---- the end of an online softmax ----
 * A row's running max m (log2 units: scores were scaled by log2(e)) and sum l of 2^(x - m), plus an
 * optional sink logit (natural units; -inf for none) that joins the denominator with no value.
 * Gives the factor for the row's accumulator (out = acc * inv) and the natural-log denominator:
 *  - a NaN sum (a NaN or +inf score) stays NaN in both, never dropped;
 *  - no visible key (l == 0): zeros out, lse = the sink (-inf without one);
 *  - otherwise lse = ln(2^m l + e^sink), formed around max(m, sink) so neither term overflows. */
#define PKV_LOG2E 1.4426950408889634f
#define PKV_LN2 0.6931471805599453f
PKV_HD void pkv_softmax_finish(float m, float l, float sink, float *inv, float *lse) {
  if (l != l) {
    *inv = NAN;
    *lse = NAN;
    return;
  }
  if (!(l > 0.0f)) {
    *inv = 0.0f;
    *lse = sink;
    return;
  }
  float s2 = sink * PKV_LOG2E;
  if (s2 == -INFINITY) {
    *inv = 1.0f / l;
    *lse = (m + log2f(l)) * PKV_LN2;
    return;
  }
  float top = m > s2 ? m : s2, keys = l * exp2f(m - top), den = keys + exp2f(s2 - top);
  *inv = exp2f(m - top) / den;
  *lse = (top + log2f(den)) * PKV_LN2;
}

/* ---- merging two attention states over disjoint key sets ----
 * lse = ln(e^la + e^lb), out = wa * out_a + wb * out_b with wa = e^(la - lse), wb = e^(lb - lse).
 * The weights come from the difference d = la - lb alone (the larger part gets 1 / (1 + e^-|d|),
 * the smaller e^-|d| / (1 + e^-|d|)): exp(la - lse) with lse rounded to float32 is off by up to
 * half an ulp of lse in the exponent, 0.5 at |lse| ~ 1e7. Both parts empty (-inf): lse = -inf and
 * zero weights (out = 0). A NaN part gives NaN; a +inf part gives lse = inf and weight NaN
 * (e^(inf - inf)), a finite or empty part beside it weight 0. */
PKV_HD void pkv_merge_weights(float la, float lb, float *wa, float *wb, float *lse) {
  if (la != la || lb != lb) {
    *wa = *wb = *lse = NAN;
    return;
  }
  float top = la > lb ? la : lb;
  if (top == -INFINITY) {
    *wa = *wb = 0.0f;
    *lse = -INFINITY;
    return;
  }
  if (top == INFINITY) {
    *wa = la == INFINITY ? NAN : 0.0f;
    *wb = lb == INFINITY ? NAN : 0.0f;
    *lse = INFINITY;
    return;
  }
  float small = expf(-fabsf(la - lb)); /* e^-|d| in [0, 1]; la - lb may round, never to NaN */
  float big_weight = 1.0f / (1.0f + small), small_weight = small / (1.0f + small);
  *lse = top + log1pf(small);
  *wa = la >= lb ? big_weight : small_weight;
  *wb = la >= lb ? small_weight : big_weight;
}

#endif /* PKV_NUMERIC_H */
