/* The softmax's vector exp2 (pkv_cpu_simd.h, AVX-512: vf_exp2 and the bf16-accurate
 * vf_exp2_bf16) over scores minus their running max, x <= 0:
 * - accurate against exp2 in double where the result is kept (x >= -PKV_EXP2_FLOOR);
 * - exactly 0 below that and for -inf (the masked lanes of a tile);
 * - never a denormal result: each one costs a microcode assist in the instruction that makes it
 *   and in the sums that add it (a 32-key call over 64-key tiles ran 2x slower);
 * - NaN stays NaN (a NaN score must poison its row).
 * Skipped (exit 0, "skipped" printed) where the CPU lacks AVX-512 F. */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16")
#define PKV_SIMD_AVX512 1
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "pkv_cpu_simd.h"
#include "check.h"

typedef pkv_vf (*exp2_fn)(pkv_vf);

/* one vector of 16 inputs through f */
static void run16(exp2_fn f, const float *in, float *out) { vf_store(out, f(vf_load(in))); }

static void check_one(const char *name, float x, float got, double tol) {
  if (isnan(x)) {
    CHECK(isnan(got), "%s(NaN) = %g, want NaN", name, got);
    return;
  }
  CHECK(got == 0.0f || got >= FLT_MIN, "%s(%.9g) = %g is denormal", name, x, got);
  if (!(x >= -PKV_EXP2_FLOOR)) {
    CHECK(got == 0.0f, "%s(%.9g) = %g, want 0 below the floor", name, x, got);
    return;
  }
  double want = exp2((double)x);
  CHECK(fabs(got - want) <= tol * want, "%s(%.9g) = %.9g, want %.9g (relative tolerance %g)", name, x, got, want,
        tol);
}

static void test_fn(const char *name, exp2_fn f, double tol) {
  float in[16], out[16];
  /* a sweep over [-200, 0] with steps that hit fractions of every kind */
  for (float x0 = -200.0f; x0 <= 0.0f; x0 += 16 * 0.0371f) {
    for (int i = 0; i < 16; i++) in[i] = x0 + 0.0371f * (float)i > 0.0f ? 0.0f : x0 + 0.0371f * (float)i;
    run16(f, in, out);
    for (int i = 0; i < 16; i++) check_one(name, in[i], out[i], tol);
  }
  /* the edges: the floor and its neighbours, the denormal range of the old floor, specials */
  const float edges[16] = {-INFINITY, NAN, -PKV_EXP2_FLOOR, nextafterf(-PKV_EXP2_FLOOR, 0.0f),
                           nextafterf(-PKV_EXP2_FLOOR, -INFINITY), -125.5f, -126.0f, -126.5f,
                           -127.0f, -149.0f, -150.0f, -1e30f, -0.0f, 0.0f, -0.5f, -1.0f};
  memcpy(in, edges, sizeof in);
  run16(f, in, out);
  for (int i = 0; i < 16; i++) check_one(name, in[i], out[i], tol);
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) {
    printf("exp2 simd: skipped (no AVX-512 F on this CPU)\n");
    return 0;
  }
  test_fn("vf_exp2", vf_exp2, 2e-6);
  test_fn("vf_exp2_bf16", vf_exp2_bf16, 2e-4);
  return check_report("exp2 simd");
}
