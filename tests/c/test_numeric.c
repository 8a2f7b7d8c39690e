/* Unit tests of the pagedkv numeric formats (run by tests/c/run.sh under ASan + UBSan).
 *
 * - FP8 e4m3fn / e5m2: all 256 codes decode as an independent formula says; every decoded value
 *   encodes back to its code; ties round to the even code; out-of-range input saturates; and
 *   encoding matches a nearest-value search over the code table for all bfloat16-representable
 *   inputs plus random float32 bit patterns.
 * - float16 / bfloat16: all 65536 codes decode by formula, round trip, ties, overflow, and
 *   agreement with a nearest-value search. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_numeric.h"
#include "pkv_cpu_ops.h"
#include "check.h"
#include "test_util.h"

/* Numeric formats                                                                              */
/* ============================================================================================ */

/* A small float format: `man` mantissa bits, exponent bias, and its special-value rules. */
typedef struct {
  const char *name;
  int exp_bits, man_bits, bias;
  int ieee_specials; /* 1: all-ones exponent is inf/NaN (e5m2, f16); 0: only S.1111.111 is NaN (e4m3fn) */
} small_format;

static const small_format E4M3 = {"e4m3fn", 4, 3, 7, 0};
static const small_format E5M2 = {"e5m2", 5, 2, 15, 1};
static const small_format F16 = {"float16", 5, 10, 15, 1};

/* Independent decode: (-1)^s * 2^(e - bias) * (1 + m / 2^M), subnormals 2^(1 - bias) * m / 2^M. */
static double format_decode(const small_format *f, uint32_t code) {
  uint32_t man_mask = (1u << f->man_bits) - 1, exp_mask = (1u << f->exp_bits) - 1;
  uint32_t m = code & man_mask, e = (code >> f->man_bits) & exp_mask, s = code >> (f->man_bits + f->exp_bits);
  double sign = s ? -1.0 : 1.0;
  if (f->ieee_specials && e == exp_mask) return m ? NAN : sign * INFINITY;
  if (!f->ieee_specials && e == exp_mask && m == man_mask) return NAN;
  if (e == 0) return sign * ldexp((double)m, 1 - f->bias - f->man_bits);
  return sign * ldexp((double)(m + (1u << f->man_bits)), (int)e - f->bias - f->man_bits);
}

/* Largest finite value of the format. */
static double format_max(const small_format *f) {
  uint32_t exp_mask = (1u << f->exp_bits) - 1, man_mask = (1u << f->man_bits) - 1;
  uint32_t code = f->ieee_specials ? ((exp_mask - 1) << f->man_bits) | man_mask : (exp_mask << f->man_bits) | (man_mask - 1);
  return format_decode(f, code);
}

/* Reference encoder by search: the nearest finite code, ties to the even code; beyond the range
 * the format's max with the input's sign when `saturate`, else infinity (float16). */
static uint32_t format_encode_search(const small_format *f, double x, int saturate) {
  uint32_t sign_bit = 1u << (f->man_bits + f->exp_bits);
  uint32_t nan_code = f->ieee_specials ? (((1u << f->exp_bits) - 1) << f->man_bits) | (1u << (f->man_bits - 1))
                                       : sign_bit - 1;
  if (isnan(x)) return (signbit(x) ? sign_bit : 0) | nan_code;
  uint32_t s = signbit(x) ? sign_bit : 0;
  double a = fabs(x);
  /* positive finite codes are ordered like their values; hi is the largest finite one */
  uint32_t lo = 0, hi = sign_bit - 1;
  while (!isfinite(format_decode(f, hi))) hi--;
  if (a >= format_decode(f, hi)) {
    double top = format_decode(f, hi);
    if (a == top) return s | hi;
    if (saturate) return s | hi;
    /* IEEE overflow: rounds to inf at or beyond max + half an ulp (ties go to the even, i.e. inf) */
    double ulp = top - format_decode(f, hi - 1);
    if (a >= top + ulp / 2) return s | (((1u << f->exp_bits) - 1) << f->man_bits);
    return s | hi;
  }
  /* binary search: largest code with value <= a */
  uint32_t l = lo, h = hi;
  while (l < h) {
    uint32_t mid = (l + h + 1) / 2;
    if (format_decode(f, mid) <= a) l = mid;
    else h = mid - 1;
  }
  double below = format_decode(f, l), above = format_decode(f, l + 1);
  if (a - below < above - a) return s | l;
  if (a - below > above - a) return s | (l + 1);
  return s | ((l & 1) ? l + 1 : l);
}

static void test_fp8_format(const small_format *f, pkv_dtype dtype, float (*decode)(uint8_t),
                            uint8_t (*encode)(float)) {
  int nan_codes = 0;
  /* all 256 codes decode by the formula */
  for (uint32_t c = 0; c < 256; c++) {
    double want = format_decode(f, c);
    float got = decode((uint8_t)c);
    CHECK(same_float(got, (float)want), "%s decode(0x%02x) = %.9g, formula %.9g", f->name, c, got, want);
    if (isnan(want)) nan_codes++;
  }
  CHECK(nan_codes == (f == &E4M3 ? 2 : 6), "%s has %d NaN codes", f->name, nan_codes);
  /* every decoded (non-NaN) value encodes back to its code; infinities saturate */
  for (uint32_t c = 0; c < 256; c++) {
    float v = decode((uint8_t)c);
    if (isnan(v)) {
      CHECK(isnan(decode(encode(v))), "%s NaN code 0x%02x does not stay NaN", f->name, c);
      continue;
    }
    if (isinf(v)) {
      uint8_t sat = encode(v);
      CHECK(decode(sat) == (v > 0 ? 1 : -1) * (float)format_max(f), "%s encode(%g) = 0x%02x, not saturated",
            f->name, v, sat);
      continue;
    }
    CHECK(encode(v) == c, "%s encode(decode(0x%02x) = %.9g) = 0x%02x", f->name, c, v, encode(v));
  }
  /* ties between adjacent positive finite codes go to the even code; just off a tie goes to the nearer */
  for (uint32_t c = 0; c + 1 < 0x80; c++) {
    float a = decode((uint8_t)c), b = decode((uint8_t)(c + 1));
    if (!isfinite(a) || !isfinite(b)) continue;
    float mid = (a + b) / 2; /* exact: at most man_bits + 2 significant bits */
    uint8_t even = (c & 1) ? (uint8_t)(c + 1) : (uint8_t)c;
    CHECK(encode(mid) == even, "%s tie %.9g between 0x%02x and 0x%02x encodes to 0x%02x", f->name, mid, c, c + 1,
          encode(mid));
    CHECK(encode(-mid) == (even | 0x80), "%s tie %.9g (negative) encodes to 0x%02x", f->name, -mid, encode(-mid));
    CHECK(encode(nextafterf(mid, 0)) == c, "%s just below tie %.9g", f->name, mid);
    CHECK(encode(nextafterf(mid, INFINITY)) == c + 1, "%s just above tie %.9g", f->name, mid);
  }
  /* saturation: everything beyond the max (including inf and the would-be next binade) is +-max */
  float mx = pkv_fp8_max(dtype);
  CHECK(mx == (float)format_max(f), "%s pkv_fp8_max %g, formula %g", f->name, mx, format_max(f));
  const float big[] = {mx, nextafterf(mx, INFINITY), mx * 1.0625f, mx * 1.5f, mx * 2, 1e30f, FLT_MAX, INFINITY};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
    CHECK(decode(encode(big[i])) == mx, "%s encode(%g) does not saturate to %g", f->name, big[i], mx);
    CHECK(decode(encode(-big[i])) == -mx, "%s encode(%g) does not saturate to %g", f->name, -big[i], -mx);
  }
  /* exhaustive over bfloat16-representable float32 inputs, then random float32 bit patterns */
  for (uint32_t h = 0; h < 65536; h++) {
    float x = f32_from(h << 16);
    uint32_t want = format_encode_search(f, x, 1);
    uint8_t got = encode(x);
    if (isnan(x)) CHECK(isnan(decode(got)), "%s encode(NaN 0x%08x) = 0x%02x", f->name, h << 16, got);
    else CHECK(got == want, "%s encode(%.9g) = 0x%02x, search 0x%02x", f->name, x, got, want);
  }
  for (int i = 0; i < 200000; i++) {
    uint32_t bits = (uint32_t)rnd();
    /* bias towards the format's range: exponents near 2^0 */
    if (i & 1) bits = (bits & 0x807fffffu) | ((uint32_t)(100 + (rnd() % 60)) << 23);
    float x = f32_from(bits);
    if (isnan(x)) continue;
    uint32_t want = format_encode_search(f, x, 1);
    CHECK(encode(x) == want, "%s encode(%.9g [0x%08x]) = 0x%02x, search 0x%02x", f->name, x, bits, encode(x), want);
  }
}

static uint8_t enc_e4m3(float x) { return pkv_f32_to_e4m3(x); }
static uint8_t enc_e5m2(float x) { return pkv_f32_to_e5m2(x); }
static float dec_e4m3(uint8_t c) { return pkv_e4m3_to_f32(c); }
static float dec_e5m2(uint8_t c) { return pkv_e5m2_to_f32(c); }

static void test_fp8(void) {
  test_fp8_format(&E4M3, PKV_DTYPE_FP8_E4M3, dec_e4m3, enc_e4m3);
  test_fp8_format(&E5M2, PKV_DTYPE_FP8_E5M2, dec_e5m2, enc_e5m2);
  /* the contract's scale rule and clamp-then-cast */
  CHECK(pkv_fp8_scale_for(0.0f, PKV_DTYPE_FP8_E4M3) == 1.0f, "scale of amax 0 must be 1");
  CHECK(pkv_fp8_scale_for(448.0f, PKV_DTYPE_FP8_E4M3) == 1.0f, "scale of amax 448 (e4m3)");
  CHECK(pkv_fp8_scale_for(57344.0f, PKV_DTYPE_FP8_E5M2) == 1.0f, "scale of amax 57344 (e5m2)");
  CHECK(pkv_fp8_scale_for(1.0f, PKV_DTYPE_FP8_E4M3) == 1.0f / 448.0f, "scale of amax 1 (e4m3)");
  CHECK(pkv_fp8_quantize(1000.0f, 1.0f, PKV_DTYPE_FP8_E4M3) == 0x7e, "clamp to +448");
  CHECK(pkv_fp8_quantize(-1000.0f, 1.0f, PKV_DTYPE_FP8_E4M3) == 0xfe, "clamp to -448");
  CHECK(pkv_fp8_quantize(1e6f, 1.0f, PKV_DTYPE_FP8_E5M2) == 0x7b, "clamp to +57344");
  /* group amax at the max maps to the max code exactly */
  float scale = pkv_fp8_scale_for(3.5f, PKV_DTYPE_FP8_E4M3);
  CHECK(pkv_fp8_quantize(3.5f, scale, PKV_DTYPE_FP8_E4M3) == 0x7e, "amax element must quantize to 448");
}

static void test_f16(void) {
  for (uint32_t c = 0; c < 65536; c++) {
    double want = format_decode(&F16, c);
    float got = pkv_f16_to_f32((uint16_t)c);
    CHECK(same_float(got, (float)want), "f16 decode(0x%04x) = %.9g, formula %.9g", c, got, want);
    if (!isnan(got)) CHECK(pkv_f32_to_f16(got) == c, "f16 round trip 0x%04x -> %.9g -> 0x%04x", c, got,
                           pkv_f32_to_f16(got));
    else CHECK(isnan(pkv_f16_to_f32(pkv_f32_to_f16(got))), "f16 NaN 0x%04x does not stay NaN", c);
  }
  for (uint32_t c = 0; c + 1 < 0x7c00; c++) {
    float a = pkv_f16_to_f32((uint16_t)c), b = pkv_f16_to_f32((uint16_t)(c + 1));
    float mid = (a + b) / 2; /* exact in float32 */
    uint16_t even = (c & 1) ? (uint16_t)(c + 1) : (uint16_t)c;
    CHECK(pkv_f32_to_f16(mid) == even, "f16 tie %.9g -> 0x%04x", mid, pkv_f32_to_f16(mid));
    CHECK(pkv_f32_to_f16(-mid) == (even | 0x8000), "f16 negative tie %.9g", -mid);
  }
  /* overflow: 65520 (max + half ulp) is a tie that goes to inf; just below stays 65504 */
  CHECK(pkv_f32_to_f16(65520.0f) == 0x7c00, "65520 -> inf");
  CHECK(pkv_f32_to_f16(nextafterf(65520.0f, 0)) == 0x7bff, "just below 65520 -> 65504");
  CHECK(pkv_f32_to_f16(-1e30f) == 0xfc00, "-1e30 -> -inf");
  CHECK(pkv_f32_to_f16(INFINITY) == 0x7c00, "inf -> inf");
  for (int i = 0; i < 400000; i++) {
    uint32_t bits = (uint32_t)rnd();
    if (i & 1) bits = (bits & 0x807fffffu) | ((uint32_t)(96 + (rnd() % 50)) << 23);
    float x = f32_from(bits);
    if (isnan(x)) {
      CHECK(isnan(pkv_f16_to_f32(pkv_f32_to_f16(x))), "f16 NaN input 0x%08x", bits);
      continue;
    }
    uint32_t want = format_encode_search(&F16, x, 0);
    CHECK(pkv_f32_to_f16(x) == want, "f16 encode(%.9g [0x%08x]) = 0x%04x, search 0x%04x", x, bits,
          pkv_f32_to_f16(x), want);
  }
}

/* bfloat16 reference: round the float32 to 8 significant bits, ties to even, in double. */
static uint16_t bf16_search(float x) {
  if (isnan(x)) return 0x7fc0;
  uint32_t b = f32_bits(x);
  uint16_t down = (uint16_t)(b >> 16), up = (uint16_t)(down + 1);
  double v = x, lo = f32_from((uint32_t)down << 16), hi = f32_from((uint32_t)up << 16);
  if (isinf(x)) return down;
  /* `up` may be inf (0x7f80) past the max: its distance is then the ulp of the max */
  if (isinf(hi)) hi = (double)f32_from((uint32_t)down << 16) * 2 - (double)f32_from((uint32_t)(down - 1) << 16);
  double dl = fabs(v - lo), dh = fabs(hi - v);
  if (dl < dh) return down;
  if (dl > dh) return up;
  return (down & 1) ? up : down;
}

static void test_bf16(void) {
  for (uint32_t c = 0; c < 65536; c++) {
    float got = pkv_bf16_to_f32((uint16_t)c);
    CHECK(f32_bits(got) == c << 16, "bf16 decode(0x%04x)", c);
    if (!isnan(got)) CHECK(pkv_f32_to_bf16(got) == c, "bf16 round trip 0x%04x -> 0x%04x", c, pkv_f32_to_bf16(got));
    else CHECK(isnan(pkv_bf16_to_f32(pkv_f32_to_bf16(got))), "bf16 NaN 0x%04x does not stay NaN", c);
  }
  for (int i = 0; i < 400000; i++) {
    uint32_t bits = (uint32_t)rnd();
    if (i % 4 == 0) bits = (bits & 0xffff0000u) | 0x8000u; /* exact ties */
    float x = f32_from(bits);
    if (isnan(x)) {
      CHECK(isnan(pkv_bf16_to_f32(pkv_f32_to_bf16(x))), "bf16 NaN input 0x%08x", bits);
      continue;
    }
    CHECK(pkv_f32_to_bf16(x) == bf16_search(x), "bf16 encode(%.9g [0x%08x]) = 0x%04x, search 0x%04x", x, bits,
          pkv_f32_to_bf16(x), bf16_search(x));
  }
}

int main(void) {
  test_fp8();
  printf("fp8: %d checks\n", g_checks);
  test_f16();
  test_bf16();
  printf("f16/bf16: %d checks\n", g_checks);
  return check_report("numeric formats");
}
