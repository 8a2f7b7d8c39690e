/* Unit tests of the pagedkv C core (run by tests/c/run.sh under ASan + UBSan).
 *
 * - FP8 e4m3fn / e5m2: all 256 codes decode as an independent formula says; every decoded value
 *   encodes back to its code; ties round to the even code; out-of-range input saturates; and
 *   encoding matches a nearest-value search over the code table for all bfloat16-representable
 *   inputs plus random float32 bit patterns.
 * - float16 / bfloat16: all 65536 codes decode by formula, round trip, ties, overflow, and
 *   agreement with a nearest-value search.
 * - Each op's checker: a valid call passes; each broken rule fails with a message of the form
 *   "<op>: <argument> ..." and the right status; index-value checks only when asked.
 * - CPU kernels on small cases against naive C loops (store and load bit-exact, attention in
 *   double within tolerance), with non-contiguous strides, GQA, masks, softcap and FP8. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_numeric.h"
#include "pkv_cpu_ops.h"
#include "check.h"

static uint32_t f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static float f32_from(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* Same value, or both NaN; +0 and -0 differ. */
static int same_float(float a, float b) { return (isnan(a) && isnan(b)) || f32_bits(a) == f32_bits(b); }

/* xorshift64*: deterministic random numbers for the tests */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 2685821657736338717ull;
}
static double rnd_unit(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static double rnd_normal(void) {
  double u = rnd_unit() + 1e-300, v = rnd_unit();
  return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* ============================================================================================ */
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

/* ============================================================================================ */
/* Descriptors                                                                                  */
/* ============================================================================================ */

static pkv_tensor tensor_strided(void *data, pkv_dtype dtype, int ndim, const int64_t *sizes,
                                 const int64_t *strides) {
  pkv_tensor t;
  memset(&t, 0, sizeof t);
  t.data = data;
  t.defined = 1;
  t.dtype = dtype;
  t.ndim = ndim;
  t.device = PKV_DEVICE_CPU;
  for (int i = 0; i < ndim; i++) {
    t.sizes[i] = sizes[i];
    t.strides[i] = strides[i];
  }
  return t;
}

static pkv_tensor tensor_contig(void *data, pkv_dtype dtype, int ndim, const int64_t *sizes) {
  int64_t strides[PKV_MAX_DIMS];
  int64_t s = 1;
  for (int i = ndim - 1; i >= 0; i--) {
    strides[i] = s;
    s *= sizes[i] > 0 ? sizes[i] : 1;
  }
  return tensor_strided(data, dtype, ndim, sizes, strides);
}

#define T1(data, dt, a) tensor_contig(data, dt, 1, (int64_t[]){a})
#define T2(data, dt, a, b) tensor_contig(data, dt, 2, (int64_t[]){a, b})
#define T3(data, dt, a, b, c) tensor_contig(data, dt, 3, (int64_t[]){a, b, c})
#define T4(data, dt, a, b, c, d) tensor_contig(data, dt, 4, (int64_t[]){a, b, c, d})

static pkv_tensor none(void) {
  pkv_tensor t;
  memset(&t, 0, sizeof t);
  return t;
}

/* Runs a checker expecting failure: status, and a message starting "<op>: " that names `arg`. */
#define EXPECT_FAIL(call, status_wanted, op, arg)                                                            \
  do {                                                                                                       \
    pkv_error err_;                                                                                          \
    memset(&err_, 0, sizeof err_);                                                                           \
    pkv_status s_ = (call);                                                                                  \
    CHECK(s_ == (status_wanted), "%s: status %d, expected %d (message: %s)", #call, (int)s_,                  \
          (int)(status_wanted), err_.message);                                                               \
    CHECK(strncmp(err_.message, op ": ", strlen(op) + 2) == 0, "message does not start with \"%s: \": %s", op, \
          err_.message);                                                                                     \
    CHECK(strstr(err_.message, arg) != NULL, "message does not name %s: %s", arg, err_.message);            \
  } while (0)

#define EXPECT_PASS(call)                                                           \
  do {                                                                              \
    pkv_error err_;                                                                 \
    memset(&err_, 0, sizeof err_);                                                  \
    pkv_status s_ = (call);                                                         \
    CHECK(s_ == PKV_OK, "%s failed: %s", #call, err_.message);                      \
  } while (0)

/* ---- a small valid paged_store setup: B = 2, P = 4, Hk = 2, D = 8, N = 6 ---- */
enum { SB = 2, SP = 4, SH = 2, SD = 8, SN = 6, SMAXP = 3, ST = 7 };
static float s_key[ST * SH * SD], s_value[ST * SH * SD];
static float s_kc[SN * SP * SH * SD], s_vc[SN * SP * SH * SD];
static uint8_t s_kq[SN * SP * SH * SD];
static float s_ks[SN * SP * SH * 1];
static int32_t s_offsets[SB + 1] = {0, 3, 7};
static int32_t s_lengths[SB] = {2, 5};
static int32_t s_table[SB * SMAXP] = {4, 1, 9, /* row 1: */ 0, 5, 3};
static int64_t s_int64[16];

static pkv_store_args store_valid(void) {
  pkv_store_args a;
  memset(&a, 0, sizeof a);
  a.key = T3(s_key, PKV_DTYPE_F32, ST, SH, SD);
  a.value = T3(s_value, PKV_DTYPE_F32, ST, SH, SD);
  a.k_cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.v_cache = T4(s_vc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.input_row_offsets = T1(s_offsets, PKV_DTYPE_I32, SB + 1);
  a.cache_lengths = T1(s_lengths, PKV_DTYPE_I32, SB);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.quant_group = 128;
  return a;
}

static void test_store_check(void) {
  const char *op = "paged_store";
  (void)op;
  pkv_store_args a = store_valid();
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));

#define STORE_FAIL(mutation, status, arg)                      \
  do {                                                         \
    pkv_store_args b = store_valid();                          \
    mutation;                                                  \
    EXPECT_FAIL(pkv_store_check(&b, 1, &err_), status, "paged_store", arg); \
  } while (0)

  STORE_FAIL(b.quant_group = 0, PKV_ERR_ARGUMENT, "quant_group");
  STORE_FAIL(b.k_cache = none(), PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.ndim = 3, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.ndim = 7, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.dtype = PKV_DTYPE_I32, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.dtype = PKV_DTYPE_OTHER, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[1] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[2] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.sizes[3] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.strides[3] = 2, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.k_cache.strides[0] = 0, PKV_ERR_ARGUMENT, "k_cache");
  STORE_FAIL(b.key = none(), PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.dtype = PKV_DTYPE_F64, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.dtype = PKV_DTYPE_FP8_E4M3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.sizes[1] = 3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.sizes[2] = 4, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.strides[2] = 3, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.key.device = 0, PKV_ERR_ARGUMENT, "key");
  STORE_FAIL(b.value = none(), PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.v_cache = none(), PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.v_cache.sizes[0] = 5, PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.v_cache.device = 1, PKV_ERR_ARGUMENT, "v_cache");
  STORE_FAIL(b.value.sizes[0] = 6, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.value.sizes[2] = 7, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.value.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "value");
  STORE_FAIL(b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F16, SN, SP, SH, 1)), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 2)), PKV_ERR_ARGUMENT, "k_scales");
  STORE_FAIL((b.k_cache.data = s_kq, b.k_cache.dtype = PKV_DTYPE_FP8_E4M3,
              b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), b.k_scales.strides[0] = 0), PKV_ERR_ARGUMENT,
             "k_scales");
  STORE_FAIL((b.value = none(), b.v_cache = none(), b.v_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1)),
             PKV_ERR_ARGUMENT, "v_scales");
  STORE_FAIL(b.lookup_table.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.cache_lengths.dtype = PKV_DTYPE_U8, PKV_ERR_ARGUMENT, "cache_lengths");
  STORE_FAIL(b.input_row_offsets.dtype = PKV_DTYPE_I16, PKV_ERR_ARGUMENT, "input_row_offsets");
  STORE_FAIL(b.lookup_table.ndim = 1, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.lookup_table.sizes[0] = 3, PKV_ERR_ARGUMENT, "lookup_table");
  STORE_FAIL(b.input_row_offsets.sizes[0] = 2, PKV_ERR_ARGUMENT, "input_row_offsets");
  STORE_FAIL(b.lookup_table.device = 0, PKV_ERR_ARGUMENT, "lookup_table");
  /* index values */
  int32_t offsets[SB + 1], lengths[SB], table[SB * SMAXP];
#define WITH_VALUES(stmt, status, arg)                                                     \
  do {                                                                                     \
    memcpy(offsets, s_offsets, sizeof offsets);                                            \
    memcpy(lengths, s_lengths, sizeof lengths);                                            \
    memcpy(table, s_table, sizeof table);                                                  \
    stmt;                                                                                  \
    STORE_FAIL((b.input_row_offsets.data = offsets, b.cache_lengths.data = lengths,        \
                b.lookup_table.data = table), status, arg);                                \
  } while (0)
  WITH_VALUES(offsets[0] = 1, PKV_ERR_INDEX, "input_row_offsets");
  WITH_VALUES(offsets[1] = 8, PKV_ERR_INDEX, "input_row_offsets");
  WITH_VALUES(offsets[2] = 8, PKV_ERR_INDEX, "input_row_offsets"); /* beyond T = 7 */
  WITH_VALUES(lengths[0] = -1, PKV_ERR_INDEX, "cache_lengths");
  WITH_VALUES(lengths[1] = 9, PKV_ERR_INDEX, "cache_lengths"); /* 9 + 4 > 3 pages * 4 */
  WITH_VALUES(lengths[0] = INT32_MAX, PKV_ERR_INDEX, "cache_lengths");
  WITH_VALUES(table[1] = 6, PKV_ERR_INDEX, "lookup_table");  /* row 0 writes positions 2..4: pages 0, 1 */
  WITH_VALUES(table[0] = -1, PKV_ERR_INDEX, "lookup_table");
  WITH_VALUES(table[3 + 2] = INT32_MIN, PKV_ERR_INDEX, "lookup_table");
  /* row 0 writes position 4 = page 1 slot 0; row 1 position 8 = its page 2 slot 0: same slot */
  WITH_VALUES(table[3 + 2] = 1, PKV_ERR_INDEX, "lookup_table");
  /* ... but values are not checked when not asked, and unused entries never are */
  memcpy(table, s_table, sizeof table);
  table[3 + 2] = 1;
  pkv_store_args c = store_valid();
  c.lookup_table.data = table;
  EXPECT_PASS(pkv_store_check(&c, 0, &err_));
  c = store_valid(); /* table[2] = 9 is past row 0's last page: never read */
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  /* duplicates that do not collide are fine: row 1 writes page 5 slots 1..3, row 0 page 5 slot 0? no:
   * row 0 writes positions 2, 3 (page 4) and 4 (page 1, slot 0); give row 1's page 0 (positions
   * 0..3, unwritten since it starts at 5) the id 4: read only, no collision */
  memcpy(table, s_table, sizeof table);
  table[3] = 4;
  c.lookup_table.data = table;
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  /* empty batch, zero-width table */
  int32_t zero = 0;
  c = store_valid();
  c.input_row_offsets = T1(&zero, PKV_DTYPE_I32, 1);
  c.cache_lengths = T1(NULL, PKV_DTYPE_I32, 0);
  c.lookup_table = T2(NULL, PKV_DTYPE_I32, 0, 0);
  EXPECT_PASS(pkv_store_check(&c, 1, &err_));
  (void)s_int64;
#undef WITH_VALUES
#undef STORE_FAIL
}

/* ---- paged_load ---- */
static float l_out[16 * SH * SD];
static int32_t l_offsets[SB + 1] = {0, 5, 12};
static int32_t l_lens[SB] = {5, 7};

static pkv_load_args load_valid(void) {
  pkv_load_args a;
  memset(&a, 0, sizeof a);
  a.cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.seq_lens = T1(l_lens, PKV_DTYPE_I32, SB);
  a.output_row_offsets = T1(l_offsets, PKV_DTYPE_I32, SB + 1);
  a.out = T3(l_out, PKV_DTYPE_F32, 16, SH, SD);
  a.quant_group = 128;
  return a;
}

static void test_load_check(void) {
  int32_t table[SB * SMAXP];
  memcpy(table, s_table, sizeof table);
  table[2] = 2; /* row 0 needs 2 pages for 5 tokens: entry 2 still unused */
  pkv_load_args a = load_valid();
  EXPECT_PASS(pkv_load_check(&a, 1, &err_));
#define LOAD_FAIL(mutation, status, arg)                                    \
  do {                                                                      \
    pkv_load_args b = load_valid();                                         \
    mutation;                                                               \
    EXPECT_FAIL(pkv_load_check(&b, 1, &err_), status, "paged_load", arg);   \
  } while (0)
  LOAD_FAIL(b.quant_group = -1, PKV_ERR_ARGUMENT, "quant_group");
  LOAD_FAIL(b.cache.ndim = 5, PKV_ERR_ARGUMENT, "cache");
  LOAD_FAIL(b.cache.dtype = PKV_DTYPE_BOOL, PKV_ERR_ARGUMENT, "cache");
  LOAD_FAIL(b.scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "scales");
  LOAD_FAIL((b.cache.data = s_kq, b.cache.dtype = PKV_DTYPE_FP8_E5M2), PKV_ERR_ARGUMENT, "scales");
  LOAD_FAIL(b.out = none(), PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.dtype = PKV_DTYPE_FP8_E4M3, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.sizes[1] = 1, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.strides[2] = 2, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.strides[0] = 0, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.out.device = 3, PKV_ERR_ARGUMENT, "out");
  LOAD_FAIL(b.seq_lens.dtype = PKV_DTYPE_I64, PKV_ERR_ARGUMENT, "seq_lens");
  LOAD_FAIL(b.output_row_offsets.sizes[0] = 4, PKV_ERR_ARGUMENT, "output_row_offsets");
  int32_t lens[SB], offsets[SB + 1];
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[1] = -3, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[1] = 13, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(lens, l_lens, sizeof lens), lens[0] = 6, b.seq_lens.data = lens), PKV_ERR_INDEX, "seq_lens");
  LOAD_FAIL((memcpy(offsets, l_offsets, sizeof offsets), offsets[2] = 17, b.output_row_offsets.data = offsets),
            PKV_ERR_INDEX, "output_row_offsets");
  LOAD_FAIL((memcpy(offsets, l_offsets, sizeof offsets), offsets[1] = 13, b.output_row_offsets.data = offsets),
            PKV_ERR_INDEX, "output_row_offsets");
  LOAD_FAIL((table[4] = 6, b.lookup_table.data = table), PKV_ERR_INDEX, "lookup_table");
  /* broadcast caches are fine to read */
  pkv_load_args c = load_valid();
  c.cache.strides[0] = 0;
  EXPECT_PASS(pkv_load_check(&c, 1, &err_));
#undef LOAD_FAIL
}

/* ---- flash_attn_paged ---- */
static float a_q[ST * 4 * SD], a_out[ST * 4 * SD];

static pkv_attn_args attn_valid(void) {
  pkv_attn_args a;
  memset(&a, 0, sizeof a);
  a.q = T3(a_q, PKV_DTYPE_F32, ST, 4, SD);
  a.out = T3(a_out, PKV_DTYPE_F32, ST, 4, SD);
  a.input_row_offsets = T1(s_offsets, PKV_DTYPE_I32, SB + 1);
  a.k_cache = T4(s_kc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.v_cache = T4(s_vc, PKV_DTYPE_F32, SN, SP, SH, SD);
  a.cache_lengths = T1(s_lengths, PKV_DTYPE_I32, SB);
  a.lookup_table = T2(s_table, PKV_DTYPE_I32, SB, SMAXP);
  a.scale = 0.35;
  a.causal = 1;
  a.quant_group = 128;
  a.window_left = -1;
  return a;
}

static void test_attn_check(void) {
  int32_t table[SB * SMAXP] = {4, 1, 2, 0, 5, 3};
  pkv_attn_args a = attn_valid();
  a.lookup_table.data = table;
  EXPECT_PASS(pkv_attn_check(&a, 1, &err_));
#define ATTN_FAIL(mutation, status, arg)                                         \
  do {                                                                           \
    pkv_attn_args b = attn_valid();                                              \
    b.lookup_table.data = table;                                                 \
    mutation;                                                                    \
    EXPECT_FAIL(pkv_attn_check(&b, 1, &err_), status, "flash_attn_paged", arg);  \
  } while (0)
  ATTN_FAIL(b.q.sizes[1] = 3, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.sizes[1] = 0, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.sizes[2] = 4, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.dtype = PKV_DTYPE_F64, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.q.device = 0, PKV_ERR_ARGUMENT, "q");
  ATTN_FAIL(b.v_cache.sizes[2] = 1, PKV_ERR_ARGUMENT, "v_cache");
  ATTN_FAIL(b.v_cache.dtype = PKV_DTYPE_I8, PKV_ERR_ARGUMENT, "v_cache");
  ATTN_FAIL(b.k_cache.strides[3] = 0, PKV_ERR_ARGUMENT, "k_cache");
  ATTN_FAIL(b.out = none(), PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.dtype = PKV_DTYPE_F16, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.sizes[0] = 6, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.out.strides[1] = 0, PKV_ERR_ARGUMENT, "out");
  ATTN_FAIL(b.window_left = -2, PKV_ERR_ARGUMENT, "window_left");
  ATTN_FAIL(b.softcap = -1, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.softcap = NAN, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.softcap = INFINITY, PKV_ERR_ARGUMENT, "softcap");
  ATTN_FAIL(b.scale = NAN, PKV_ERR_ARGUMENT, "scale");
  ATTN_FAIL(b.scale = -INFINITY, PKV_ERR_ARGUMENT, "scale");
  ATTN_FAIL(b.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1), PKV_ERR_ARGUMENT, "k_scales");
  ATTN_FAIL(b.cache_lengths.ndim = 2, PKV_ERR_ARGUMENT, "cache_lengths");
  int32_t lengths[SB] = {2, 5};
  ATTN_FAIL((lengths[0] = -5, b.cache_lengths.data = lengths), PKV_ERR_INDEX, "cache_lengths");
  /* row 1 reads pages 0..2 of its row (positions 0..8): a bad id in any of them fails */
  int32_t bad[SB * SMAXP] = {4, 1, 2, 0, -1, 3};
  ATTN_FAIL(b.lookup_table.data = bad, PKV_ERR_INDEX, "lookup_table");
#undef ATTN_FAIL
}

/* ============================================================================================ */
/* CPU kernels against naive loops                                                              */
/* ============================================================================================ */

static float load_elem(const void *base, int64_t off, pkv_dtype dt) { return pkv_load_f32(base, off, dt); }

/* Fill with a recognisable sentinel byte pattern. */
static void poison(void *p, size_t bytes) { memset(p, 0xA5, bytes); }

/* paged_store: random geometry with page-strided, token-transposed caches, all cache dtypes. */
static void test_store_kernel(void) {
  const pkv_dtype dtypes[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, PKV_DTYPE_FP8_E5M2};
  const pkv_dtype key_dtypes[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
  for (int iter = 0; iter < 300; iter++) {
    int64_t P = 1 + (int64_t)(rnd() % 5), H = 1 + (int64_t)(rnd() % 3), D = 1 + (int64_t)(rnd() % 9);
    int64_t G = 1 + (int64_t)(rnd() % (D + 1));
    pkv_dtype cd = dtypes[rnd() % 5], kd = key_dtypes[rnd() % 3];
    int64_t B = (int64_t)(rnd() % 4), T = 0;
    int64_t lens[4], news[4], offs[5] = {0};
    for (int64_t b = 0; b < B; b++) {
      lens[b] = (int64_t)(rnd() % 7);
      news[b] = (int64_t)(rnd() % 6);
      offs[b + 1] = offs[b] + news[b];
    }
    T = offs[B] + (int64_t)(rnd() % 2);
    int64_t cols = 0, pages_total = 0;
    for (int64_t b = 0; b < B; b++) {
      int64_t n = (lens[b] + news[b] + P - 1) / P;
      cols = n > cols ? n : cols;
      pages_total += n;
    }
    int64_t N = pages_total + 1;
    /* layout: storage [N, H, P, D + pad] viewed as [N, P, H, D] (stride_token < stride_head) */
    int64_t pad = (int64_t)(rnd() % 3), row = D + pad;
    size_t es = pkv_dtype_size(cd), cache_elems = (size_t)(N * H * P * row);
    void *cache = malloc(cache_elems * es + 1), *expect = malloc(cache_elems * es + 1);
    int64_t G_count = pkv_num_groups(D, G);
    size_t scale_elems = (size_t)(N * P * H * G_count);
    float *scales = malloc(scale_elems * sizeof(float) + 4), *expect_scales = malloc(scale_elems * sizeof(float) + 4);
    poison(cache, cache_elems * es);
    poison(scales, scale_elems * sizeof(float));
    memcpy(expect, cache, cache_elems * es);
    memcpy(expect_scales, scales, scale_elems * sizeof(float));
    size_t kes = pkv_dtype_size(kd);
    void *key = malloc((size_t)(T * H * D) * kes + 1);
    for (int64_t i = 0; i < T * H * D; i++) {
      float x = (float)(rnd_normal() * (rnd() % 4 == 0 ? 100.0 : 1.0));
      if (rnd() % 50 == 0) x = 0.0f;
      pkv_store_f32(key, i, kd, x);
    }
    int32_t *table = malloc((size_t)(B * cols + 1) * sizeof(int32_t));
    int32_t lens32[4], offs32[5];
    int64_t next = 0;
    for (int64_t b = 0; b < B; b++) {
      int64_t n = (lens[b] + news[b] + P - 1) / P;
      for (int64_t j = 0; j < cols; j++) table[b * cols + j] = j < n ? (int32_t)(N - 1 - next++) : -7;
      lens32[b] = (int32_t)lens[b];
    }
    for (int64_t b = 0; b <= B; b++) offs32[b] = (int32_t)offs[b];

    pkv_store_args a;
    memset(&a, 0, sizeof a);
    a.key = T3(key, kd, T, H, D);
    a.k_cache = tensor_strided(cache, cd, 4, (int64_t[]){N, P, H, D}, (int64_t[]){H * P * row, row, P * row, 1});
    if (pkv_dtype_is_fp8(cd)) a.k_scales = T4(scales, PKV_DTYPE_F32, N, P, H, G_count);
    a.input_row_offsets = T1(offs32, PKV_DTYPE_I32, B + 1);
    a.cache_lengths = T1(lens32, PKV_DTYPE_I32, B);
    a.lookup_table = T2(table, PKV_DTYPE_I32, B, cols);
    a.quant_group = G;
    pkv_error err;
    pkv_status st = pkv_store_check(&a, 1, &err);
    CHECK(st == PKV_OK, "store setup rejected: %s", err.message);
    if (st != PKV_OK) goto next_iter;
    /* run in two ranges to exercise the work split */
    int64_t work = pkv_store_cpu_work(&a), mid = work ? (int64_t)(rnd() % (uint64_t)(work + 1)) : 0;
    pkv_store_cpu(&a, 0, mid);
    pkv_store_cpu(&a, mid, work);
    /* naive */
    for (int64_t b = 0; b < B; b++)
      for (int64_t i = 0; i < news[b]; i++) {
        int64_t pos = lens[b] + i, page = table[b * cols + pos / P], slot = pos % P, r = offs[b] + i;
        for (int64_t h = 0; h < H; h++) {
          int64_t dst = page * H * P * row + h * P * row + slot * row;
          const int64_t src = (r * H + h) * D;
          if (!pkv_dtype_is_fp8(cd)) {
            for (int64_t d = 0; d < D; d++) pkv_store_f32(expect, dst + d, cd, load_elem(key, src + d, kd));
            continue;
          }
          float mx = pkv_fp8_max(cd);
          for (int64_t g = 0; g < G_count; g++) {
            float amax = 0;
            for (int64_t d = g * G; d < D && d < (g + 1) * G; d++) amax = fmaxf(amax, fabsf(load_elem(key, src + d, kd)));
            float s = amax == 0 ? 1.0f : amax / mx;
            expect_scales[((page * P + slot) * H + h) * G_count + g] = s;
            for (int64_t d = g * G; d < D && d < (g + 1) * G; d++) {
              float v = load_elem(key, src + d, kd) / s;
              v = v > mx ? mx : v < -mx ? -mx : v;
              ((uint8_t *)expect)[dst + d] = cd == PKV_DTYPE_FP8_E4M3 ? pkv_f32_to_e4m3(v) : pkv_f32_to_e5m2(v);
            }
          }
        }
      }
    CHECK(memcmp(cache, expect, cache_elems * es) == 0, "store kernel differs from naive (iter %d, dtype %s)", iter,
          pkv_dtype_name(cd));
    CHECK(memcmp(scales, expect_scales, scale_elems * sizeof(float)) == 0, "store scales differ (iter %d)", iter);
  next_iter:
    free(cache);
    free(expect);
    free(scales);
    free(expect_scales);
    free(key);
    free(table);
  }
}

/* paged_load: gather with a page-strided cache, strided out rows, all dtype pairs. */
static void test_load_kernel(void) {
  const pkv_dtype dtypes[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, PKV_DTYPE_FP8_E5M2};
  const pkv_dtype out_dtypes[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
  for (int iter = 0; iter < 300; iter++) {
    int64_t P = 1 + (int64_t)(rnd() % 5), H = 1 + (int64_t)(rnd() % 3), D = 1 + (int64_t)(rnd() % 9);
    int64_t G = 1 + (int64_t)(rnd() % (D + 1)), G_count = pkv_num_groups(D, G);
    pkv_dtype cd = dtypes[rnd() % 5], od = out_dtypes[rnd() % 3];
    int64_t B = (int64_t)(rnd() % 4), lens[4], offs[5] = {0}, cols = 0, pages = 0;
    for (int64_t b = 0; b < B; b++) {
      lens[b] = (int64_t)(rnd() % 11);
      offs[b + 1] = offs[b] + lens[b] + (int64_t)(rnd() % 2);
      int64_t n = (lens[b] + P - 1) / P;
      cols = n > cols ? n : cols;
      pages += n;
    }
    int64_t N = pages + 2, Tout = offs[B] + 1, page_stride = 2 * P * H * D; /* every other page slot */
    size_t es = pkv_dtype_size(cd), oes = pkv_dtype_size(od);
    size_t cache_bytes = (size_t)(N * page_stride) * es;
    uint8_t *cache = malloc(cache_bytes + 1);
    for (size_t i = 0; i < cache_bytes; i++) cache[i] = (uint8_t)rnd();
    float *scales = malloc((size_t)(N * P * H * G_count) * sizeof(float) + 4);
    for (int64_t i = 0; i < N * P * H * G_count; i++) scales[i] = (float)(rnd_unit() * 4 - 1);
    int64_t out_row = H * (D + 1); /* out rows padded by one element per head */
    size_t out_elems = (size_t)(Tout * out_row);
    void *out = malloc(out_elems * oes + 1), *expect = malloc(out_elems * oes + 1);
    poison(out, out_elems * oes);
    memcpy(expect, out, out_elems * oes);
    int32_t *table = malloc((size_t)(B * cols + 1) * sizeof(int32_t)), lens32[4], offs32[5];
    /* used entries count down from the last page; unused entries are garbage (never read) */
    int64_t next = 0;
    for (int64_t b = 0; b < B; b++) {
      int64_t n = (lens[b] + P - 1) / P;
      for (int64_t j = 0; j < cols; j++) table[b * cols + j] = j < n ? (int32_t)(N - 1 - next++) : INT32_MAX;
      lens32[b] = (int32_t)lens[b];
    }
    for (int64_t b = 0; b <= B; b++) offs32[b] = (int32_t)offs[b];
    pkv_load_args a;
    memset(&a, 0, sizeof a);
    a.cache = tensor_strided(cache, cd, 4, (int64_t[]){N, P, H, D}, (int64_t[]){page_stride, H * D, D, 1});
    if (pkv_dtype_is_fp8(cd)) a.scales = T4(scales, PKV_DTYPE_F32, N, P, H, G_count);
    a.lookup_table = T2(table, PKV_DTYPE_I32, B, cols);
    a.seq_lens = T1(lens32, PKV_DTYPE_I32, B);
    a.output_row_offsets = T1(offs32, PKV_DTYPE_I32, B + 1);
    a.out = tensor_strided(out, od, 3, (int64_t[]){Tout, H, D}, (int64_t[]){out_row, D + 1, 1});
    a.quant_group = G;
    pkv_error err;
    pkv_status st = pkv_load_check(&a, 1, &err);
    CHECK(st == PKV_OK, "load setup rejected: %s", err.message);
    if (st == PKV_OK) {
      int64_t work = pkv_load_cpu_work(&a), mid = work ? (int64_t)(rnd() % (uint64_t)(work + 1)) : 0;
      pkv_load_cpu(&a, mid, work);
      pkv_load_cpu(&a, 0, mid);
      for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < lens[b]; t++) {
          int64_t page = table[b * cols + t / P], slot = t % P;
          for (int64_t h = 0; h < H; h++)
            for (int64_t d = 0; d < D; d++) {
              int64_t src = page * page_stride + slot * H * D + h * D + d;
              int64_t dst = (offs[b] + t) * out_row + h * (D + 1) + d;
              if (cd == od) {
                memcpy((char *)expect + dst * (int64_t)oes, cache + src * (int64_t)es, es);
                continue;
              }
              float v = load_elem(cache, src, cd);
              if (pkv_dtype_is_fp8(cd)) v *= scales[((page * P + slot) * H + h) * G_count + d / G];
              pkv_store_f32(expect, dst, od, v);
            }
        }
      /* NaN payloads may differ in conversions: compare values, NaN == NaN */
      int same = 1;
      for (size_t i = 0; i < out_elems && same; i++) {
        float x = load_elem(out, (int64_t)i, od), y = load_elem(expect, (int64_t)i, od);
        same = same_float(x, y) || memcmp((char *)out + i * oes, (char *)expect + i * oes, oes) == 0;
      }
      CHECK(same, "load kernel differs from naive (iter %d, %s -> %s)", iter, pkv_dtype_name(cd), pkv_dtype_name(od));
    }
    free(cache);
    free(scales);
    free(out);
    free(expect);
    free(table);
  }
}

/* attention: naive in double over the same cache (dequantized in double). */
static void test_attn_kernel(void) {
  const pkv_dtype dtypes[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, PKV_DTYPE_FP8_E5M2};
  double worst = 0;
  for (int iter = 0; iter < 200; iter++) {
    int64_t P = 1 + (int64_t)(rnd() % 6), Hk = 1 + (int64_t)(rnd() % 2), group_heads = 1 + (int64_t)(rnd() % 3);
    int64_t Hq = Hk * group_heads, D = 1 + (int64_t)(rnd() % 12), Dv = rnd() % 3 ? D : 1 + (int64_t)(rnd() % 6);
    int64_t G = 1 + (int64_t)(rnd() % (D + 1));
    pkv_dtype kd = dtypes[rnd() % 5];
    int causal = (int)(rnd() % 4 != 0);
    int64_t window = rnd() % 3 ? -1 : (int64_t)(rnd() % 5);
    double softcap = rnd() % 3 ? 0.0 : 5.0, scale = 0.2 + rnd_unit();
    int64_t B = 1 + (int64_t)(rnd() % 3), lens[3], news[3], offs[4] = {0}, cols = 0, pages = 0;
    for (int64_t b = 0; b < B; b++) {
      lens[b] = (int64_t)(rnd() % 80);
      news[b] = (int64_t)(rnd() % 40); /* > 32 rows: several work items per row */
      offs[b + 1] = offs[b] + news[b];
      int64_t n = (lens[b] + news[b] + P - 1) / P;
      cols = n > cols ? n : cols;
      pages += n;
    }
    int64_t T = offs[B] + (int64_t)(rnd() % 3), N = pages + 1;
    int64_t Gk = pkv_num_groups(D, G), Gv = pkv_num_groups(Dv, G);
    size_t es = pkv_dtype_size(kd);
    void *kc = malloc((size_t)(N * P * Hk * D) * es + 1), *vc = malloc((size_t)(N * P * Hk * Dv) * es + 1);
    float *ks = malloc((size_t)(N * P * Hk * Gk) * 4 + 4), *vs = malloc((size_t)(N * P * Hk * Gv) * 4 + 4);
    for (int64_t i = 0; i < N * P * Hk * D; i++) {
      float x = (float)rnd_normal();
      if (pkv_dtype_is_fp8(kd)) ((uint8_t *)kc)[i] = kd == PKV_DTYPE_FP8_E4M3 ? pkv_f32_to_e4m3(x * 100) : pkv_f32_to_e5m2(x * 100);
      else pkv_store_f32(kc, i, kd, x);
    }
    for (int64_t i = 0; i < N * P * Hk * Dv; i++) {
      float x = (float)rnd_normal();
      if (pkv_dtype_is_fp8(kd)) ((uint8_t *)vc)[i] = kd == PKV_DTYPE_FP8_E4M3 ? pkv_f32_to_e4m3(x * 100) : pkv_f32_to_e5m2(x * 100);
      else pkv_store_f32(vc, i, kd, x);
    }
    for (int64_t i = 0; i < N * P * Hk * Gk; i++) ks[i] = (float)(0.005 + 0.01 * rnd_unit());
    for (int64_t i = 0; i < N * P * Hk * Gv; i++) vs[i] = (float)(0.005 + 0.01 * rnd_unit());
    /* q as a strided view: [T, Hq, D] inside [T, Hq + 1, D] */
    float *q = malloc((size_t)(T * (Hq + 1) * D) * 4 + 4), *out = malloc((size_t)(T * Hq * Dv) * 4 + 4);
    for (int64_t i = 0; i < T * (Hq + 1) * D; i++) q[i] = (float)rnd_normal();
    poison(out, (size_t)(T * Hq * Dv) * 4);
    int32_t *table = malloc((size_t)(B * cols + 1) * 4), lens32[3], offs32[4];
    /* pages in reverse, so logical order differs from physical */
    int64_t next = 0;
    for (int64_t b = 0; b < B; b++) {
      int64_t n = (lens[b] + news[b] + P - 1) / P;
      for (int64_t j = 0; j < cols; j++) table[b * cols + j] = j < n ? (int32_t)(N - 1 - next++) : -1;
      lens32[b] = (int32_t)lens[b];
    }
    for (int64_t b = 0; b <= B; b++) offs32[b] = (int32_t)offs[b];
    pkv_attn_args a;
    memset(&a, 0, sizeof a);
    a.q = tensor_strided(q, PKV_DTYPE_F32, 3, (int64_t[]){T, Hq, D}, (int64_t[]){(Hq + 1) * D, D, 1});
    a.out = T3(out, PKV_DTYPE_F32, T, Hq, Dv);
    a.input_row_offsets = T1(offs32, PKV_DTYPE_I32, B + 1);
    a.k_cache = T4(kc, kd, N, P, Hk, D);
    a.v_cache = T4(vc, kd, N, P, Hk, Dv);
    if (pkv_dtype_is_fp8(kd)) {
      a.k_scales = T4(ks, PKV_DTYPE_F32, N, P, Hk, Gk);
      a.v_scales = T4(vs, PKV_DTYPE_F32, N, P, Hk, Gv);
    }
    a.cache_lengths = T1(lens32, PKV_DTYPE_I32, B);
    a.lookup_table = T2(table, PKV_DTYPE_I32, B, cols);
    a.scale = scale;
    a.causal = causal;
    a.quant_group = G;
    a.window_left = window;
    a.softcap = softcap;
    pkv_error err;
    pkv_status st = pkv_attn_check(&a, 1, &err);
    CHECK(st == PKV_OK, "attn setup rejected: %s", err.message);
    pkv_attn_plan plan;
    if (st == PKV_OK && pkv_attn_cpu_plan(&a, &plan, &err) == PKV_OK) {
      CHECK(pkv_attn_cpu(&a, &plan, 0, plan.num_items, &err) == PKV_OK, "attn kernel failed: %s", err.message);
      pkv_attn_plan_free(&plan);
      double *sc = malloc(sizeof(double) * 200);
      for (int64_t row = 0; row < T; row++) {
        int64_t b = -1;
        for (int64_t bb = 0; bb < B; bb++)
          if (row >= offs[bb] && row < offs[bb + 1]) b = bb;
        for (int64_t h = 0; h < Hq; h++) {
          double acc[16] = {0}, denom = 0, mx = -INFINITY;
          int64_t lo = 0, hi = 0, kh = h / group_heads;
          if (b >= 0) {
            int64_t p = lens[b] + row - offs[b], total = lens[b] + news[b];
            hi = causal ? (p + 1 < total ? p + 1 : total) : total;
            lo = window >= 0 && p - window > 0 ? p - window : 0;
          }
          for (int64_t k = lo; k < hi; k++) {
            int64_t page = table[b * cols + k / P], slot = k % P;
            double s = 0;
            for (int64_t d = 0; d < D; d++) {
              int64_t off = ((page * P + slot) * Hk + kh) * D + d;
              double kv = load_elem(kc, off, kd);
              if (pkv_dtype_is_fp8(kd)) kv *= ks[((page * P + slot) * Hk + kh) * Gk + d / G];
              s += (double)q[row * (Hq + 1) * D + h * D + d] * kv;
            }
            s *= scale;
            if (softcap > 0) s = softcap * tanh(s / softcap);
            sc[k - lo] = s;
            mx = s > mx ? s : mx;
          }
          for (int64_t k = lo; k < hi; k++) {
            int64_t page = table[b * cols + k / P], slot = k % P;
            double w = exp(sc[k - lo] - mx);
            denom += w;
            for (int64_t d = 0; d < Dv; d++) {
              int64_t off = ((page * P + slot) * Hk + kh) * Dv + d;
              double vv = load_elem(vc, off, kd);
              if (pkv_dtype_is_fp8(kd)) vv *= vs[((page * P + slot) * Hk + kh) * Gv + d / G];
              acc[d] += w * vv;
            }
          }
          for (int64_t d = 0; d < Dv; d++) {
            double want = denom > 0 ? acc[d] / denom : 0.0, got = out[(row * Hq + h) * Dv + d];
            double e = fabs(got - want);
            worst = e > worst ? e : worst;
            CHECK(e <= 2e-5 * (1 + fabs(want)) && (denom > 0 || got == 0.0),
                  "attn iter %d row %lld head %lld ch %lld: got %.9g, naive %.9g", iter, (long long)row, (long long)h,
                  (long long)d, got, want);
          }
        }
      }
      free(sc);
    }
    free(kc);
    free(vc);
    free(ks);
    free(vs);
    free(q);
    free(out);
    free(table);
  }
  printf("  attention: worst abs error vs double %.3g\n", worst);
}

/* Edge values found by the fuzzer: integer overflow in the shared index math and the checks,
 * and descriptors with negative strides (which a framework never makes, a caller could). */
static void test_overflow_edges(void) {
  CHECK(pkv_num_groups(INT64_MAX, 2) == INT64_MAX / 2 + 1, "num_groups(INT64_MAX, 2)");
  CHECK(pkv_num_groups(4, INT64_MAX) == 1, "num_groups(4, INT64_MAX)");
  CHECK(pkv_num_groups(128, 128) == 1 && pkv_num_groups(129, 128) == 2, "num_groups basics");
  CHECK(pkv_pages_for(5, INT64_MAX) == 1 && pkv_pages_for(0, INT64_MAX) == 0, "pages_for with a huge page");
  CHECK(pkv_pages_for(INT64_MAX, 1) == INT64_MAX, "pages_for(INT64_MAX, 1)");
  /* quant_group = INT64_MAX: one scale group per head */
  pkv_store_args a = store_valid();
  a.k_cache.data = s_kq;
  a.k_cache.dtype = PKV_DTYPE_FP8_E4M3;
  a.k_scales = T4(s_ks, PKV_DTYPE_F32, SN, SP, SH, 1);
  a.quant_group = INT64_MAX;
  EXPECT_PASS(pkv_store_check(&a, 1, &err_));
  /* a broadcast table of 2^62 columns over a broadcast page of 2^40 tokens: capacity overflows */
  pkv_attn_args b = attn_valid();
  int32_t table[SB] = {2, 3};
  b.lookup_table = tensor_strided(table, PKV_DTYPE_I32, 2, (int64_t[]){SB, (int64_t)1 << 62}, (int64_t[]){1, 0});
  b.k_cache.sizes[1] = b.v_cache.sizes[1] = (int64_t)1 << 40;
  b.k_cache.strides[1] = b.v_cache.strides[1] = 0;
  EXPECT_PASS(pkv_attn_check(&b, 1, &err_));
  /* negative strides are rejected by name before any index value is read */
  pkv_store_args c = store_valid();
  c.input_row_offsets.strides[0] = -1;
  EXPECT_FAIL(pkv_store_check(&c, 1, &err_), PKV_ERR_ARGUMENT, "paged_store", "input_row_offsets");
  c = store_valid();
  c.k_cache.strides[0] = -SP * SH * SD;
  EXPECT_FAIL(pkv_store_check(&c, 1, &err_), PKV_ERR_ARGUMENT, "paged_store", "k_cache");
  pkv_load_args d = load_valid();
  d.lookup_table.strides[1] = -1;
  EXPECT_FAIL(pkv_load_check(&d, 1, &err_), PKV_ERR_ARGUMENT, "paged_load", "lookup_table");
  d = load_valid();
  d.out.sizes[0] = -1;
  EXPECT_FAIL(pkv_load_check(&d, 1, &err_), PKV_ERR_ARGUMENT, "paged_load", "out");
  /* a size-1 dim's stride is never used: any value is fine */
  d = load_valid();
  d.out.sizes[1] = 1;
  d.out.strides[1] = -7;
  d.cache.sizes[2] = 1;
  EXPECT_PASS(pkv_load_check(&d, 1, &err_));
}

int main(void) {
  test_fp8();
  printf("fp8: %d checks\n", g_checks);
  test_f16();
  test_bf16();
  printf("f16/bf16: %d checks\n", g_checks);
  test_store_check();
  test_load_check();
  test_attn_check();
  test_overflow_edges();
  printf("checkers: %d checks\n", g_checks);
  test_store_kernel();
  test_load_kernel();
  test_attn_kernel();
  printf("kernels: %d checks\n", g_checks);
  if (g_failures) {
    fprintf(stderr, "%d of %d checks failed\n", g_failures, g_checks);
    return 1;
  }
  printf("all %d checks passed\n", g_checks);
  return 0;
}
