/* Exhaustive check of the AVX-512 e4m3 -> bf16 register conversions (pkv_cpu_simd.h) that the
 * AMX decode uses for FP8 K rows and V key pairs, against the scalar decoder of pkv_numeric.h:
 * - vi_e4m3_to_bf16_32 (AVX-512 BW) and vi_e4m3_to_bf16_64 (VBMI): all 256 codes, in order;
 * - vi_e4m3_pairs_64 (VBMI): two rows interleaved as (a[c], b[c]) words, all 256 codes in each;
 * - the short tail (n = 32 of 64): the unread half comes out as zero codes and nothing past
 *   n bytes is read (the rows sit at the very end of their allocation, under ASan).
 * Skipped (exit 0, "skipped" printed) where the CPU lacks AVX-512 BW/VL/BF16 or VBMI. */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi")
#define PKV_SIMD_AVX512 1
#include <stdio.h>
#include <stdlib.h>

#include "pkv_cpu_simd.h"
#include "check.h"

/* the bf16 bits the scalar decoder's value has (e4m3 values are exact in bf16) */
static uint16_t want_bits(uint8_t code) { return pkv_f32_to_bf16(pkv_e4m3_to_f32(code)); }

/* equal bits, or both NaN (the vector path's NaN keeps the sign, the scalar one need not) */
static int same(uint16_t got, uint16_t want) {
  int nan_got = (got & 0x7f80) == 0x7f80 && (got & 0x7f), nan_want = (want & 0x7f80) == 0x7f80 && (want & 0x7f);
  return nan_got || nan_want ? nan_got && nan_want : got == want;
}

static void test_rows(void) {
  uint8_t codes[256];
  uint16_t out[64];
  for (int i = 0; i < 256; i++) codes[i] = (uint8_t)(i * 37 + 11); /* every code once, not in order */
  for (int c0 = 0; c0 < 256; c0 += 32) {
    _mm512_storeu_si512((void *)out, vi_e4m3_to_bf16_32(codes + c0));
    for (int i = 0; i < 32; i++)
      CHECK(same(out[i], want_bits(codes[c0 + i])), "32-wide code 0x%02x: got 0x%04x want 0x%04x", codes[c0 + i],
            out[i], want_bits(codes[c0 + i]));
  }
  for (int c0 = 0; c0 < 256; c0 += 64) {
    __m512i x, y;
    vi_e4m3_to_bf16_64(codes + c0, 64, &x, &y);
    _mm512_storeu_si512((void *)out, x);
    _mm512_storeu_si512((void *)(out + 32), y);
    for (int i = 0; i < 64; i++)
      CHECK(same(out[i], want_bits(codes[c0 + i])), "64-wide code 0x%02x at %d: got 0x%04x want 0x%04x",
            codes[c0 + i], i, out[i], want_bits(codes[c0 + i]));
  }
}

static void test_pairs(void) {
  uint8_t a[256], b[256];
  uint32_t out[64];
  for (int i = 0; i < 256; i++) {
    a[i] = (uint8_t)i;
    b[i] = (uint8_t)(255 - i * 7);
  }
  for (int c0 = 0; c0 < 256; c0 += 64) {
    __m512i v[4];
    vi_e4m3_pairs_64(a + c0, b + c0, 64, v);
    for (int x = 0; x < 4; x++) _mm512_storeu_si512((void *)(out + 16 * x), v[x]);
    for (int c = 0; c < 64; c++) {
      uint16_t lo = (uint16_t)(out[c] & 0xffff), hi = (uint16_t)(out[c] >> 16);
      CHECK(same(lo, want_bits(a[c0 + c])), "pair column %d row a code 0x%02x: got 0x%04x", c0 + c, a[c0 + c], lo);
      CHECK(same(hi, want_bits(b[c0 + c])), "pair column %d row b code 0x%02x: got 0x%04x", c0 + c, b[c0 + c], hi);
    }
  }
}

/* n = 32: rows of 32 codes at the end of their own allocations (ASan flags any read past them) */
static void test_tail(void) {
  uint8_t *a = malloc(32), *b = malloc(32);
  for (int i = 0; i < 32; i++) a[i] = (uint8_t)(0x38 + i), b[i] = (uint8_t)(0xb8 + i);
  __m512i x, y, v[4];
  uint16_t out[64];
  vi_e4m3_to_bf16_64(a, 32, &x, &y);
  _mm512_storeu_si512((void *)out, x);
  _mm512_storeu_si512((void *)(out + 32), y);
  for (int i = 0; i < 32; i++) CHECK(same(out[i], want_bits(a[i])), "tail code 0x%02x: got 0x%04x", a[i], out[i]);
  for (int i = 32; i < 64; i++) CHECK(out[i] == 0, "tail lane %d past n: got 0x%04x, want 0", i, out[i]);
  uint32_t pairs[64];
  vi_e4m3_pairs_64(a, b, 32, v);
  for (int k = 0; k < 4; k++) _mm512_storeu_si512((void *)(pairs + 16 * k), v[k]);
  for (int c = 0; c < 32; c++) {
    CHECK(same((uint16_t)(pairs[c] & 0xffff), want_bits(a[c])), "tail pair column %d row a", c);
    CHECK(same((uint16_t)(pairs[c] >> 16), want_bits(b[c])), "tail pair column %d row b", c);
  }
  for (int c = 32; c < 64; c++) CHECK(pairs[c] == 0, "tail pair column %d past n: got 0x%08x", c, pairs[c]);
  free(a);
  free(b);
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl") ||
      !__builtin_cpu_supports("avx512vbmi") || !__builtin_cpu_supports("avx512bf16")) {
    printf("e4m3 simd: skipped (no AVX-512 BW/VL/BF16/VBMI on this CPU)\n");
    return 0;
  }
  test_rows();
  test_pairs();
  test_tail();
  printf("e4m3 simd: %d checks, %d failures\n", g_checks, g_failures);
  return g_failures ? 1 : 0;
}
