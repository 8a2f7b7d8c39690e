/* Helpers shared by the C unit tests (tests/c/run.sh): float bit patterns, a deterministic random
 * number generator and pkv_tensor descriptors over plain C arrays. Header-only and `static inline`
 * so each test binary takes what it uses. */
#ifndef PKV_TEST_UTIL_H
#define PKV_TEST_UTIL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "pkv_common.h"

static inline uint32_t f32_bits(float x) {
  uint32_t b;
  memcpy(&b, &x, sizeof b);
  return b;
}

static inline float f32_from(uint32_t b) {
  float x;
  memcpy(&x, &b, sizeof x);
  return x;
}

/* Same value, or both NaN; +0 and -0 differ. */
static inline int same_float(float a, float b) { return (isnan(a) && isnan(b)) || f32_bits(a) == f32_bits(b); }

/* xorshift64*: deterministic random numbers for the tests */
static uint64_t g_rng = 0x9E3779B97F4A7C15ull;
static inline uint64_t rnd(void) {
  g_rng ^= g_rng >> 12;
  g_rng ^= g_rng << 25;
  g_rng ^= g_rng >> 27;
  return g_rng * 2685821657736338717ull;
}
static inline double rnd_unit(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static inline double rnd_normal(void) {
  double u = rnd_unit() + 1e-300, v = rnd_unit();
  return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

/* ---- descriptors ---- */

static inline pkv_tensor tensor_strided(void *data, pkv_dtype dtype, int ndim, const int64_t *sizes,
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

static inline pkv_tensor tensor_contig(void *data, pkv_dtype dtype, int ndim, const int64_t *sizes) {
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

static inline pkv_tensor none(void) {
  pkv_tensor t;
  memset(&t, 0, sizeof t);
  return t;
}

#endif
