/* Is a shift cheaper than the table lookups that widen e4m3 codes to bf16 in the CPU dot decode?
 * (issue 26 suggests "a table or shift-based widening".) The decode's inner loops, alone in L1, one
 * core, TSC ticks per key and KV head (4 query vectors, D 128, 32 keys 1 KB apart as one head's rows of
 * 8-head token-major pages), four ways of widening, each checked first against the core's scalar
 * conversion (pkv_e4m3_to_f32):
 *
 *   cc -O2 -march=native benchmarks/probes/fp8_widen.c -o /tmp/fp8_widen && /tmp/fp8_widen [reps=5]
 *
 *   table   the kernel's own: two vpermi2b lookups per 64 codes (high and low byte of the bf16 bits)
 *           and the sign or-ed back (pkv_cpu_simd.h's vi_fp8_bf16_bytes), exact for all 256 codes.
 *   shift   the code in a word's high byte, an arithmetic shift right by 4 and one ternary-logic op:
 *           sign | 0x3800 | (code & 0x7f) << 4, which is the code's value times 2^-8 for every normal
 *           code (exponent field 1..15; q would take the 2^8) and wrong for zero, the subnormals
 *           (exponent field 0) and NaN (0x7f, 0xff): timing only, no exact decode can use it as is.
 *   shift+check  the same plus what makes it usable: a mask of the codes it gets wrong, or-ed over the
 *           tile so it could fall back to the table where one occurs. code + 1 has bits 4..6 clear
 *           exactly for NaN, zero, the subnormals and the smallest normals (exponent field 1, mantissa
 *           below 7: a harmless false alarm), so one add, one vptestnmb and one korq per 64 codes.
 *   exact+check  the shift with the exponent bias added instead of or-ed (an and, then a 16-bit add of
 *           0x3c00: the code's own value, nothing for q to undo; one op more), and the same check.
 *
 * QK is dot_qk8_fp8's loop (keys in pairs: 32 codes of each of two keys per vector), PV dot_pv64_fp8's
 * (two keys' codes interleaved, 64 columns per step); QK leaves its score reduction out and PV keeps
 * its probabilities fixed, so the figures are the products and the widening only. Neither spills a
 * register (objdump), as in the kernel.
 * On the 2-core Zen 4 EPYC (2026-11-27, 4 rounds): table QK 17.6-17.8, PV 13.6-13.7; shift QK 13.4-13.6,
 * PV 13.0-13.5; shift+check QK 15.7-16.0, PV 14.6-14.7; exact+check QK 17.2-17.3, PV 16.1-16.3. The
 * lookups are the costly ops here, but an exact widening needs the check, and every vector op counts
 * (the loop issues about 1.4 zmm operations per cycle): in QK the scaled shift with its check saves ~2
 * ticks of the 60-67 an e4m3 decode takes per key and KV head, warm or in DRAM (~3%, for q scaled by
 * 2^8, a guard against |q| >= 2^119 and a fallback to the table), in PV it loses ~1, and the exact
 * shift gains nothing anywhere. In the kernel (dot_qk8_fp8 with the scaled shift, q times 2^8, a
 * temporary switch, one process, 15 rounds) not even that: with the check 0.99-1.01x the time of the
 * table, without it 0.98-1.05x (warm and in DRAM), so what bounds the kernel's QK is not its lookups.
 * The decode keeps the table. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <x86intrin.h>

/* the kernel's own lookup (vi_fp8_bf16_bytes, pkv_fp8_bf16_bytes) and the core's scalar conversion */
#define PKV_SIMD_AVX512 1
#include "../../csrc/cpu/kernels/pkv_cpu_simd.h"

#define AI static inline __attribute__((always_inline))
enum { TABLE, SHIFT, SHIFT_CHECK, EXACT_CHECK, MODES };
static const char *mode_name[MODES] = {"table", "shift", "shift+check", "exact+check"};
enum { ROWS = 4, D = 128, KEYS = 32, KEY_STRIDE = 1024, QP_WORDS = 160 };

/* decode_dot.inc's dot_fp8_64: the kernel's two lookups, then the bytes interleaved into words */
AI void widen_table(__m512i c, __m512i *first, __m512i *second) {
  __m512i hi, lo;
  vi_fp8_bf16_bytes(c, pkv_fp8_bf16_bytes[PKV_FP8_E4M3], &hi, &lo);
  *first = _mm512_unpacklo_epi8(lo, hi);
  *second = _mm512_unpackhi_epi8(lo, hi);
}

/* the same word order as widen_table: per 128-bit lane codes 0..7, then 8..15. (x >> 4, arithmetic) keeps
 * the sign in bit 15 and the code's 7 bits from bit 4 on; `exact`: + 0x3c00 (the bias 120 in the exponent
 * field: the code's value), else | 0x3800 (the field's top bits: the value times 2^-8) */
AI __m512i widen_words(const int exact, __m512i high_bytes) {
  const __m512i keep = _mm512_set1_epi16((short)0x87f0);
  __m512i w = _mm512_srai_epi16(high_bytes, 4);
  if (exact) return _mm512_add_epi16(_mm512_and_si512(w, keep), _mm512_set1_epi16(0x3c00));
  return _mm512_ternarylogic_epi32(w, keep, _mm512_set1_epi16(0x3800), 0xea); /* (w & keep) | 0x3800 */
}

AI void widen_shift(const int exact, __m512i c, __m512i *first, __m512i *second) {
  const __m512i zero = _mm512_setzero_si512();
  *first = widen_words(exact, _mm512_unpacklo_epi8(zero, c));
  *second = widen_words(exact, _mm512_unpackhi_epi8(zero, c));
}

AI __mmask64 shift_misses(__m512i c) {
  return _mm512_testn_epi8_mask(_mm512_add_epi8(c, _mm512_set1_epi8(1)), _mm512_set1_epi8(0x70));
}

AI void widen(const int mode, __m512i c, __m512i *first, __m512i *second, __mmask64 *misses) {
  if (mode == TABLE) {
    widen_table(c, first, second);
  } else {
    widen_shift(mode == EXACT_CHECK, c, first, second);
    if (mode != SHIFT) *misses = _kor_mask64(*misses, shift_misses(c));
  }
}

/* dot_qk8_fp8's products over one head's KEYS keys (pairs p, p + 4 of each block of 8); the
 * accumulators summed into *sink instead of reduced per key */
AI void qk(const int mode, const uint16_t *qp, const uint8_t *k, float *sink, __mmask64 *misses) {
  __m512 total = _mm512_setzero_ps();
  for (int j = 0; j < KEYS; j += 8) {
    __m512 acc[ROWS][4];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) acc[r][p] = _mm512_setzero_ps();
#pragma GCC unroll 1 /* as in the kernel (d is not known there): unrolled, q's loads spill */
    for (int x = 0; x < D / 32; x++) {
      int y = x + 1 < D / 32 ? x + 1 : 0;
      __m512i qf[ROWS], qs[ROWS];
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; r++) {
        qf[r] = _mm512_loadu_si512(qp + r * QP_WORDS + 16 * x);
        qs[r] = _mm512_loadu_si512(qp + r * QP_WORDS + QP_WORDS / 2 + 16 * x);
      }
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(k + (j + p) * KEY_STRIDE + 32 * x));
        __m256i b = _mm256_loadu_si256((const __m256i *)(k + (j + p + 4) * KEY_STRIDE + 32 * y));
        __m512i first, second;
        widen(mode, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1), &first, &second, misses);
#pragma GCC unroll 4
        for (int r = 0; r < ROWS; r++) {
          acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)qf[r], (__m512bh)first);
          acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)qs[r], (__m512bh)second);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
      for (int p = 0; p < 4; p++) total = _mm512_add_ps(total, acc[r][p]);
  }
  *sink += _mm512_reduce_add_ps(total);
}

/* dot_pv64_fp8's products over one head's KEYS keys, both 64-column blocks of D */
AI void pv(const int mode, const uint16_t *pb, const uint8_t *v, float *acc, __mmask64 *misses) {
  for (int c0 = 0; c0 < D; c0 += 64) {
    __m512 a[ROWS][4];
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) a[r][c] = _mm512_loadu_ps(acc + r * D + c0 + 16 * c);
    for (int jp = 0; jp < KEYS; jp += 2) {
      __m512i cx = _mm512_loadu_si512(v + jp * KEY_STRIDE + c0), cy = _mm512_loadu_si512(v + (jp + 1) * KEY_STRIDE + c0);
      __m512i pairs[4];
      if (mode == TABLE) { /* the codes interleaved first: one lookup serves both rows */
        widen(mode, _mm512_unpacklo_epi8(cx, cy), &pairs[0], &pairs[1], misses);
        widen(mode, _mm512_unpackhi_epi8(cx, cy), &pairs[2], &pairs[3], misses);
      } else { /* each row widened, then its words interleaved */
        __m512i x0, x1, y0, y1;
        widen(mode, cx, &x0, &x1, misses);
        widen(mode, cy, &y0, &y1, misses);
        pairs[0] = _mm512_unpacklo_epi16(x0, y0), pairs[1] = _mm512_unpackhi_epi16(x0, y0);
        pairs[2] = _mm512_unpacklo_epi16(x1, y1), pairs[3] = _mm512_unpackhi_epi16(x1, y1);
      }
#pragma GCC unroll 4
      for (int r = 0; r < ROWS; r++) {
        int32_t two;
        memcpy(&two, pb + r * KEYS + jp, sizeof two);
        __m512i p = _mm512_set1_epi32(two);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)p, (__m512bh)pairs[c]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < ROWS; r++)
#pragma GCC unroll 4
      for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * D + c0 + 16 * c, a[r][c]);
  }
}

#define MODE_FUNCTIONS(M, name)                                                                                        \
  __attribute__((noinline)) static void qk_##name(const uint16_t *qp, const uint8_t *k, float *sink, __mmask64 *ms) { \
    qk(M, qp, k, sink, ms);                                                                                            \
  }                                                                                                                    \
  __attribute__((noinline)) static void pv_##name(const uint16_t *pb, const uint8_t *v, float *acc, __mmask64 *ms) {  \
    pv(M, pb, v, acc, ms);                                                                                             \
  }
MODE_FUNCTIONS(TABLE, table)
MODE_FUNCTIONS(SHIFT, shift)
MODE_FUNCTIONS(SHIFT_CHECK, check)
MODE_FUNCTIONS(EXACT_CHECK, exact)
typedef void (*qk_fn)(const uint16_t *, const uint8_t *, float *, __mmask64 *);
typedef void (*pv_fn)(const uint16_t *, const uint8_t *, float *, __mmask64 *);
static const qk_fn qk_fns[MODES] = {qk_table, qk_shift, qk_check, qk_exact};
static const pv_fn pv_fns[MODES] = {pv_table, pv_shift, pv_check, pv_exact};

static float bf16_value(uint16_t bits) {
  uint32_t b = (uint32_t)bits << 16;
  float v;
  memcpy(&v, &b, sizeof v);
  return v;
}

/* Each widening against the core's scalar conversion (pkv_e4m3_to_f32) on all 256 codes: the table
 * everywhere (NaN as NaN), the shifts on the normal codes (the scaled one times 2^8), the check flagging
 * every code they get wrong. */
static int check_widening(void) {
  uint8_t codes[256];
  for (int i = 0; i < 256; i++) codes[i] = (uint8_t)i;
  int bad = 0;
  for (int base = 0; base < 256; base += 64) {
    __m512i c = _mm512_loadu_si512(codes + base), v[6];
    widen_table(c, &v[0], &v[1]);
    widen_shift(0, c, &v[2], &v[3]);
    widen_shift(1, c, &v[4], &v[5]);
    __mmask64 misses = shift_misses(c);
    uint16_t words[6][32];
    for (int x = 0; x < 6; x++) _mm512_storeu_si512(words[x], v[x]);
    for (int w = 0; w < 64; w++) {
      int half = w / 32, lane = w % 32 / 8, slot = w % 8 + 8 * half; /* word w holds code 16 lane + slot */
      uint8_t code = (uint8_t)(base + 16 * lane + slot);
      int special = ((code >> 3) & 15) == 0 || (code & 0x7f) == 0x7f;
      float truth = pkv_e4m3_to_f32(code), table = bf16_value(words[half][w % 32]);
      if (isnan(truth) ? !isnan(table) : table != truth) bad++, printf("table: code 0x%02x wrong\n", code);
      if (!special && bf16_value(words[2 + half][w % 32]) * 256.0f != truth)
        bad++, printf("shift: code 0x%02x wrong\n", code);
      if (!special && bf16_value(words[4 + half][w % 32]) != truth) bad++, printf("exact: code 0x%02x wrong\n", code);
      if (special && !((misses >> (16 * lane + slot)) & 1)) bad++, printf("check: code 0x%02x not flagged\n", code);
    }
  }
  return bad;
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 5, calls = 20000;
  if (check_widening()) return 1;
  uint8_t *rows = aligned_alloc(64, KEYS * KEY_STRIDE);
  srand(1);
  for (int i = 0; i < KEYS * KEY_STRIDE; i++) rows[i] = (uint8_t)(rand() & 0xff);
  uint16_t *qp = aligned_alloc(64, ROWS * QP_WORDS * 2), *pb = aligned_alloc(64, ROWS * KEYS * 2);
  for (int i = 0; i < ROWS * QP_WORDS; i++) qp[i] = 0x3f80; /* 1.0 */
  for (int i = 0; i < ROWS * KEYS; i++) pb[i] = 0x3c00;     /* 2^-7 */
  float sink = 0, *acc = aligned_alloc(64, ROWS * D * sizeof(float));
  memset(acc, 0, ROWS * D * sizeof(float));
  __mmask64 misses = 0;
  printf("TSC ticks per key and KV head (4 query vectors, D %d), modes interleaved, %d reps:\n", D, reps);
  for (int rep = 0; rep < reps; rep++)
    for (int m = 0; m < MODES; m++) {
      uint64_t t0 = __rdtsc();
      for (int i = 0; i < calls; i++) qk_fns[m](qp, rows, &sink, &misses);
      uint64_t t1 = __rdtsc();
      for (int i = 0; i < calls; i++) pv_fns[m](pb, rows, acc, &misses);
      uint64_t t2 = __rdtsc();
      printf("  %-12s QK %6.2f  PV %6.2f\n", mode_name[m], (double)(t1 - t0) / calls / KEYS,
             (double)(t2 - t1) / calls / KEYS);
    }
  printf("(checksum %g, %d misses flagged)\n", sink + acc[0], misses != 0);
  return 0;
}
