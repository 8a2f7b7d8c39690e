/* pagedkv CPU backend: the small vector vocabulary the CPU kernels are written in.
 *
 * pkv_cpu_kernels.inc is compiled three times, once per ISA file, with one of
 * PKV_SIMD_AVX512, PKV_SIMD_AVX2 or neither (scalar) defined. This header maps
 * the vocabulary onto that ISA: PKV_W float lanes per vector, loads and stores
 * that convert between float32 and every cache dtype, exp2, a W x W transpose
 * of 32-bit words. Conversions are bit-exact with the scalar functions of
 * pkv_numeric.h (NaN payloads included), so store and load stay copies.
 *
 * Only the ISA files include this header; it must never be compiled with
 * flags the running CPU may lack outside the dispatcher's choice. */
#ifndef PKV_CPU_SIMD_H
#define PKV_CPU_SIMD_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../../core/pkv_numeric.h"

#define PKV_AI static inline __attribute__((always_inline))

/* 2^f on [-0.5, 0.5]: Taylor coefficients ln2^k / k!, degree 7 (error < 6e-9). */
#define PKV_EXP2_C1 0.6931471805599453f
#define PKV_EXP2_C2 0.2402265069591007f
#define PKV_EXP2_C3 0.05550410866482158f
#define PKV_EXP2_C4 0.009618129107628477f
#define PKV_EXP2_C5 0.0013333558146428443f
#define PKV_EXP2_C6 0.00015403530393381606f
#define PKV_EXP2_C7 1.5252733804059841e-05f

/* exp2 of scores below -PKV_EXP2_FLOOR (log2 units under the running max) is 0: see vf_exp2_split */
#define PKV_EXP2_FLOOR 125.0f

#if defined(PKV_SIMD_AVX512) || defined(PKV_SIMD_AVX2)
#include <immintrin.h>
/* r[c][x] = r[x][c]: an 8 x 8 transpose of 32-bit lanes (AVX2's v_transpose_words, the direct
 * decode's per-head FP8 scales). */
PKV_AI void v_transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 4; i++) { /* rows 2i, 2i+1: columns 0, 1 | 4, 5, then 2, 3 | 6, 7 */
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; i++) { /* rows 4i .. 4i+3 of columns c | c + 4, c = 0, 1, 2, 3 */
    r[4 * i + 0] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0x44);
    r[4 * i + 1] = _mm256_shuffle_ps(t[4 * i + 0], t[4 * i + 2], 0xee);
    r[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    r[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int c = 0; c < 4; c++) {
    t[c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x20);
    t[4 + c] = _mm256_permute2f128_ps(r[c], r[4 + c], 0x31);
  }
  for (int c = 0; c < 8; c++) r[c] = t[c];
}
#endif

#if defined(PKV_SIMD_AVX512)
/* ======================================================================= AVX-512 */
#include <immintrin.h>

#define PKV_W 16
typedef __m512 pkv_vf;

PKV_AI pkv_vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
PKV_AI void vf_store(float *p, pkv_vf v) { _mm512_storeu_ps(p, v); }
PKV_AI pkv_vf vf_set1(float x) { return _mm512_set1_ps(x); }
PKV_AI pkv_vf vf_zero(void) { return _mm512_setzero_ps(); }
PKV_AI pkv_vf vf_add(pkv_vf a, pkv_vf b) { return _mm512_add_ps(a, b); }
PKV_AI pkv_vf vf_sub(pkv_vf a, pkv_vf b) { return _mm512_sub_ps(a, b); }
PKV_AI pkv_vf vf_mul(pkv_vf a, pkv_vf b) { return _mm512_mul_ps(a, b); }
/* max that keeps NaN from either side (MAXPS alone returns b when a is NaN) */
PKV_AI pkv_vf vf_max(pkv_vf a, pkv_vf b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), _mm512_max_ps(a, b), a); }
PKV_AI pkv_vf vf_fma(pkv_vf a, pkv_vf b, pkv_vf c) { return _mm512_fmadd_ps(a, b, c); }
PKV_AI float vf_hmax(pkv_vf v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) ? NAN : _mm512_reduce_max_ps(v); }
PKV_AI float vf_hsum(pkv_vf v) { return _mm512_reduce_add_ps(v); }
/* Whether some lane is above t or NaN (not <= t): the softmax's test for moving its max, without
 * a horizontal reduction in the common case where it stays. */
PKV_AI int vf_any_above(pkv_vf v, float t) { return _mm512_cmp_ps_mask(v, _mm512_set1_ps(t), _CMP_NLE_UQ) != 0; }

/* Lanes i with lo <= i < hi keep v; the others become fill. */
PKV_AI pkv_vf vf_keep_range(pkv_vf v, int64_t lo, int64_t hi, float fill) {
  __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __mmask16 m = _mm512_cmpge_epi32_mask(iota, _mm512_set1_epi32((int)(lo < -1 ? -1 : (lo > 16 ? 16 : lo)))) &
                _mm512_cmplt_epi32_mask(iota, _mm512_set1_epi32((int)(hi < -1 ? -1 : (hi > 16 ? 16 : hi))));
  return _mm512_mask_blend_ps(m, _mm512_set1_ps(fill), v);
}

/* 2^x for x <= 0 (scores minus their running max); -inf and x < -PKV_EXP2_FLOOR give 0,
 * NaN stays NaN (MAXPS returns its second operand when either is NaN, so x goes
 * second: a NaN score must poison the row as in the reference, not vanish).
 * Results are never denormal: a denormal result (x below -126, which every masked -inf lane
 * of a tile reached through the old floor of -150) costs a microcode assist of ~100 cycles
 * per instruction that makes or adds it, and made a 32-key call over 64-key tiles 2x slower.
 * Terms below 2^-125 of the running max change no float32 sum that holds the max's own term. */
/* Range reduction shared by the exp2 variants: x = n + f, n integral, |f| <= 0.5; *keep: the
 * lanes whose result is not 0 (x >= -PKV_EXP2_FLOOR, or NaN). */
PKV_AI pkv_vf vf_exp2_split(pkv_vf x, pkv_vf *f, __mmask16 *keep) {
  *keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-PKV_EXP2_FLOOR), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-PKV_EXP2_FLOOR), x);
  pkv_vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  *f = _mm512_sub_ps(x, n);
  return n;
}

PKV_AI pkv_vf vf_exp2(pkv_vf x) {
  __mmask16 keep;
  pkv_vf f, n = vf_exp2_split(x, &f, &keep);
  pkv_vf p = _mm512_set1_ps(PKV_EXP2_C7);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C5));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(PKV_EXP2_C1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

/* vf_exp2 to bf16 accuracy: a degree-3 fit of 2^f on [-0.5, 0.5] (weighted least squares on
 * Chebyshev nodes, relative error < 8e-5; bf16 rounding is 2e-3), for probabilities the AMX
 * paths round to bf16 anyway. Same range and NaN rules as vf_exp2. */
PKV_AI pkv_vf vf_exp2_bf16(pkv_vf x) {
  __mmask16 keep;
  pkv_vf f, n = vf_exp2_split(x, &f, &keep);
  pkv_vf p = _mm512_set1_ps(0.05508868380751114f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.24260405145947936f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6932762416819607f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.9999289403695112f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

/* ---- float16 bits -> float32 with the scalar NaN rule (payload kept, not quieted) ---- */
PKV_AI pkv_vf vf_from_f16_bits(__m256i h) {
  pkv_vf v = _mm512_cvtph_ps(h);
  __m512i w = _mm512_cvtepu16_epi32(h);
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(w, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7c00));
  __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x8000)), 16),
                                 _mm512_or_si512(_mm512_set1_epi32(0x7f800000),
                                                 _mm512_slli_epi32(_mm512_and_si512(w, _mm512_set1_epi32(0x3ff)), 13)));
  return _mm512_mask_mov_ps(v, nan, _mm512_castsi512_ps(bits));
}

PKV_AI pkv_vf vf_load_bf16(const uint16_t *p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
PKV_AI pkv_vf vf_load_f16(const uint16_t *p) { return vf_from_f16_bits(_mm256_loadu_si256((const __m256i *)p)); }

/* e4m3 -> float32: the code's magnitude bits placed as a float16 ((c & 0x7f) << 7) are the
 * value / 256 for normals and subnormals alike; the sign moves from bit 14 to 15 by adding
 * bit 14 to itself. 0x7f/0xff (NaN) become +qNaN as in pkv_e4m3_to_f32. */
PKV_AI pkv_vf vf_load_e4m3(const uint8_t *p) {
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  __m256i t = _mm256_slli_epi16(c, 7);
  __m256i h = _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)));
  __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(c, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7f));
  h = _mm256_blendv_epi8(h, _mm256_set1_epi16(0x7e00), nan);
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
PKV_AI pkv_vf vf_load_e5m2(const uint8_t *p) {
  __m256i c = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
  return vf_from_f16_bits(_mm256_slli_epi16(c, 8));
}

/* ---- float32 -> cache dtypes, bit-exact with pkv_f32_to_* ---- */
PKV_AI __m512i vi_bf16_bits(pkv_vf x) {
  __m512i b = _mm512_castps_si512(x);
  __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
  __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000));
  __m512i r = _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                                   _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x40)));
}
PKV_AI void v_store_bf16(uint16_t *p, pkv_vf x) {
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(vi_bf16_bits(x)));
}
PKV_AI void v_store_f16(uint16_t *p, pkv_vf x) {
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512i b = _mm512_castps_si512(x);
  __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff)),
                                          _mm512_set1_epi32(0x7f800000));
  __m512i q = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(0x8000)),
                              _mm512_set1_epi32(0x7e00));
  __m512i w = _mm512_mask_mov_epi32(_mm512_cvtepu16_epi32(h), nan, q);
  _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(w));
}

/* FP8 code of x (any float32; saturating RNE like pkv_f32_to_e4m3 / _e5m2). */
PKV_AI __m512i vi_fp8_code(pkv_vf x, int e4m3) {
  const int man = e4m3 ? 3 : 2, bias_shift = e4m3 ? 120 : 112, max_code = e4m3 ? 0x7e : 0x7b;
  const int max_bits = e4m3 ? 0x43e00000 : 0x47600000, sub_bits = e4m3 ? 0x3c800000 : 0x38800000;
  const float sub_mul = e4m3 ? 512.0f : 65536.0f;
  __m512i b = _mm512_castps_si512(x);
  __m512i sign = _mm512_and_si512(_mm512_srli_epi32(b, 24), _mm512_set1_epi32(0x80));
  __m512i a = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
  const int sh = 23 - man;
  __m512i r = _mm512_add_epi32(a, _mm512_add_epi32(_mm512_set1_epi32((1 << (sh - 1)) - 1),
                                                   _mm512_and_si512(_mm512_srli_epi32(a, sh), _mm512_set1_epi32(1))));
  __m512i code = _mm512_srli_epi32(_mm512_sub_epi32(r, _mm512_set1_epi32(bias_shift << 23)), sh);
  code = _mm512_min_epu32(code, _mm512_set1_epi32(max_code));
  __m512i sub = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(sub_mul)));
  code = _mm512_mask_mov_epi32(code, _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(sub_bits)), sub);
  code = _mm512_mask_mov_epi32(code, _mm512_cmpge_epi32_mask(a, _mm512_set1_epi32(max_bits)),
                               _mm512_set1_epi32(max_code));
  code = _mm512_mask_mov_epi32(code, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7f800000)),
                               _mm512_set1_epi32(0x7f));
  return _mm512_or_si512(code, sign);
}
PKV_AI void v_store_fp8(uint8_t *p, pkv_vf x, int e4m3) {
  _mm_storeu_si128((__m128i *)p, _mm512_cvtepi32_epi8(vi_fp8_code(x, e4m3)));
}
PKV_AI int vf_any_nan(pkv_vf x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0; }
/* The contract's clamp (NaN passes through). */
PKV_AI pkv_vf vf_clamp_sym(pkv_vf v, float mx) {
  v = _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_set1_ps(mx), _CMP_GT_OQ), _mm512_set1_ps(mx));
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, _mm512_set1_ps(-mx), _CMP_LT_OQ), _mm512_set1_ps(-mx));
}
PKV_AI pkv_vf vf_div(pkv_vf a, pkv_vf b) { return _mm512_div_ps(a, b); }
PKV_AI pkv_vf vf_abs(pkv_vf a) { return _mm512_abs_ps(a); }

/* Transpose n (<= W) columns of W rows of 32-bit words: dst[c * ld + r] = rows[r][c]. */
PKV_AI void v_transpose_words(const uint32_t *const *rows, int64_t n, uint32_t *dst, int64_t ld) {
  __m512i r[16], t[16];
  __mmask16 m = n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
  for (int i = 0; i < 16; i++) r[i] = _mm512_maskz_loadu_epi32(m, rows[i]);
  for (int i = 0; i < 8; i++) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; i++) {
    r[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i + 0], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  /* r[4i + c] lane L now holds rows 4i..4i+3 of column 4L + c */
  for (int c = 0; c < 4; c++) {
    __m512i a0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), a1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xee);
    __m512i b0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44), b1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xee);
    t[c] = _mm512_shuffle_i32x4(a0, b0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0xdd);
    t[8 + c] = _mm512_shuffle_i32x4(a1, b1, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(a1, b1, 0xdd);
  }
  for (int c = 0; c < n && c < 16; c++) _mm512_storeu_si512((void *)(dst + c * ld), t[c]);
}

PKV_AI void v_prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }

/* bf16 bits of e4m3 magnitudes 0..127 (exact; 0x7f is NaN), F applied to each:
 * the tables of the in-register lookups below. */
#define PKV_E4M3_SUB(m) (uint16_t)((m) == 0 ? 0 : ((m) == 1 ? 0x3b00 : ((m) < 4 ? 0x3b80 | (((m) & 1) << 6) : 0x3c00 | (((m) & 3) << 5))))
#define PKV_E4M3_NORM(e, m) (uint16_t)((((e) + 120) << 7) | ((m) << 4))
#define PKV_E4M3_ROW(F, e) F(PKV_E4M3_NORM(e, 0)), F(PKV_E4M3_NORM(e, 1)), F(PKV_E4M3_NORM(e, 2)), \
    F(PKV_E4M3_NORM(e, 3)), F(PKV_E4M3_NORM(e, 4)), F(PKV_E4M3_NORM(e, 5)), F(PKV_E4M3_NORM(e, 6)), F(PKV_E4M3_NORM(e, 7))
#define PKV_E4M3_BF16(F) \
    F(PKV_E4M3_SUB(0)), F(PKV_E4M3_SUB(1)), F(PKV_E4M3_SUB(2)), F(PKV_E4M3_SUB(3)), \
    F(PKV_E4M3_SUB(4)), F(PKV_E4M3_SUB(5)), F(PKV_E4M3_SUB(6)), F(PKV_E4M3_SUB(7)), \
    PKV_E4M3_ROW(F, 1), PKV_E4M3_ROW(F, 2), PKV_E4M3_ROW(F, 3), PKV_E4M3_ROW(F, 4), PKV_E4M3_ROW(F, 5), \
    PKV_E4M3_ROW(F, 6), PKV_E4M3_ROW(F, 7), PKV_E4M3_ROW(F, 8), PKV_E4M3_ROW(F, 9), PKV_E4M3_ROW(F, 10), \
    PKV_E4M3_ROW(F, 11), PKV_E4M3_ROW(F, 12), PKV_E4M3_ROW(F, 13), PKV_E4M3_ROW(F, 14), \
    F(PKV_E4M3_NORM(15, 0)), F(PKV_E4M3_NORM(15, 1)), F(PKV_E4M3_NORM(15, 2)), F(PKV_E4M3_NORM(15, 3)), \
    F(PKV_E4M3_NORM(15, 4)), F(PKV_E4M3_NORM(15, 5)), F(PKV_E4M3_NORM(15, 6)), F(0x7fc0)
#define PKV_WORD(x) (x)
static const uint16_t pkv_e4m3_bf16_table[128] = {PKV_E4M3_BF16(PKV_WORD)};
#undef PKV_WORD

/* 32 e4m3 codes -> their exact bf16 bits: a 128-entry table lookup held in four
 * registers (two vpermi2w and a blend on bit 6), then the sign bit. */
PKV_AI __m512i vi_e4m3_to_bf16_32(const uint8_t *p) {
  const __m512i *t = (const __m512i *)pkv_e4m3_bf16_table;
  __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
  __m512i lo = _mm512_permutex2var_epi16(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t + 1));
  __m512i hi = _mm512_permutex2var_epi16(_mm512_loadu_si512(t + 2), c, _mm512_loadu_si512(t + 3));
  __m512i v = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40)), lo, hi);
  return _mm512_or_si512(v, _mm512_slli_epi16(_mm512_and_si512(c, _mm512_set1_epi16(0x80)), 8));
}
PKV_AI void v_e4m3_to_bf16_32(const uint8_t *p, uint16_t *dst) {
  _mm512_storeu_si512((void *)dst, vi_e4m3_to_bf16_32(p));
}

/* Byte lookups with AVX512_VBMI, 64 codes at a time: vpermi2b is one uop where vpermi2w is
 * three, and FP8 conversion was the largest cost of FP8 decode (tables: the high and low bytes
 * of the bf16 bits). The AMX build has VBMI throughout; the AVX-512 build (which also runs on
 * CPUs without it) compiles the functions that use it with PKV_VBMI and calls them only when
 * cpuid reports VBMI (pkv_cpu_has_vbmi). */
#define PKV_VBMI __attribute__((target("avx512vbmi")))
/* bf16 bits of e5m2 magnitudes 0..127 (exact: subnormals M * 2^-16, then inf and NaN), F applied */
#define PKV_E5M2_NORM(e, m) (uint16_t)((((e) + 112) << 7) | ((m) << 5))
#define PKV_E5M2_ROW(F, e) F(PKV_E5M2_NORM(e, 0)), F(PKV_E5M2_NORM(e, 1)), F(PKV_E5M2_NORM(e, 2)), F(PKV_E5M2_NORM(e, 3))
#define PKV_E5M2_BF16(F) \
    F(0), F(0x3780), F(0x3800), F(0x3840), PKV_E5M2_ROW(F, 1), PKV_E5M2_ROW(F, 2), PKV_E5M2_ROW(F, 3), \
    PKV_E5M2_ROW(F, 4), PKV_E5M2_ROW(F, 5), PKV_E5M2_ROW(F, 6), PKV_E5M2_ROW(F, 7), PKV_E5M2_ROW(F, 8), \
    PKV_E5M2_ROW(F, 9), PKV_E5M2_ROW(F, 10), PKV_E5M2_ROW(F, 11), PKV_E5M2_ROW(F, 12), PKV_E5M2_ROW(F, 13), \
    PKV_E5M2_ROW(F, 14), PKV_E5M2_ROW(F, 15), PKV_E5M2_ROW(F, 16), PKV_E5M2_ROW(F, 17), PKV_E5M2_ROW(F, 18), \
    PKV_E5M2_ROW(F, 19), PKV_E5M2_ROW(F, 20), PKV_E5M2_ROW(F, 21), PKV_E5M2_ROW(F, 22), PKV_E5M2_ROW(F, 23), \
    PKV_E5M2_ROW(F, 24), PKV_E5M2_ROW(F, 25), PKV_E5M2_ROW(F, 26), PKV_E5M2_ROW(F, 27), PKV_E5M2_ROW(F, 28), \
    PKV_E5M2_ROW(F, 29), PKV_E5M2_ROW(F, 30), F(0x7f80), F(0x7fc0), F(0x7fc0), F(0x7fc0)
#define PKV_HI_BYTE(x) (uint8_t)((x) >> 8)
#define PKV_LO_BYTE(x) (uint8_t)((x) & 0xff)
/* per FP8 dtype (PKV_FP8_E4M3, PKV_FP8_E5M2): the high bytes of the 128 magnitudes' bf16 bits, then the low */
enum { PKV_FP8_E4M3 = 0, PKV_FP8_E5M2 = 1 };
static const uint8_t pkv_fp8_bf16_bytes[2][256] = {
    {PKV_E4M3_BF16(PKV_HI_BYTE), PKV_E4M3_BF16(PKV_LO_BYTE)},
    {PKV_E5M2_BF16(PKV_HI_BYTE), PKV_E5M2_BF16(PKV_LO_BYTE)},
};
#undef PKV_HI_BYTE
#undef PKV_LO_BYTE

/* bf16 bytes of 64 FP8 codes (tab: a pkv_fp8_bf16_bytes row) already in register c: *hi (with the
 * sign) and *lo. */
PKV_AI PKV_VBMI void vi_fp8_bf16_bytes(__m512i c, const uint8_t *tab, __m512i *hi, __m512i *lo) {
  const __m512i *th = (const __m512i *)tab, *tl = (const __m512i *)(tab + 128);
  /* the index's bit 7 (the sign) is ignored by the lookup and or-ed back after it */
  __m512i h = _mm512_permutex2var_epi8(_mm512_loadu_si512(th), c, _mm512_loadu_si512(th + 1));
  *hi = _mm512_ternarylogic_epi32(h, c, _mm512_set1_epi8((char)0x80), 0xf8); /* h | (c & 0x80) */
  *lo = _mm512_permutex2var_epi8(_mm512_loadu_si512(tl), c, _mm512_loadu_si512(tl + 1));
}

PKV_AI PKV_VBMI void vi_e4m3_bf16_bytes(__m512i c, __m512i *hi, __m512i *lo) {
  vi_fp8_bf16_bytes(c, pkv_fp8_bf16_bytes[PKV_FP8_E4M3], hi, lo);
}

#if defined(__AVX512VBMI__)
/* the first n (<= 64) bytes of p, zeros after them; nothing past p + n is read */
PKV_AI __m512i vi_load_bytes(const uint8_t *p, int n) {
  return _mm512_maskz_loadu_epi8(n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1), p);
}

/* Up to 64 codes (n in (0, 64], nothing read past p + n) -> bf16 bits of codes
 * 0..31 (*first) and 32..63 (*second). The codes are reordered first so the
 * in-lane byte interleave comes out in order: byte 16L + j takes code 8L + j
 * and byte 16L + 8 + j code 32 + 8L + j (lane L, j < 8). */
PKV_AI void vi_e4m3_to_bf16_64(const uint8_t *p, int n, __m512i *first, __m512i *second) {
  const __m512i order = _mm512_set_epi8(63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24,
                                        55, 54, 53, 52, 51, 50, 49, 48, 23, 22, 21, 20, 19, 18, 17, 16,
                                        47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12, 11, 10, 9, 8,
                                        39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i hi, lo;
  vi_e4m3_bf16_bytes(_mm512_permutexvar_epi8(order, vi_load_bytes(p, n)), &hi, &lo);
  *first = _mm512_unpacklo_epi8(lo, hi);
  *second = _mm512_unpackhi_epi8(lo, hi);
}

/* Up to 64 columns of two code rows a, b -> vb words (a[c], b[c]) for columns
 * 0..15, 16..31, 32..47, 48..63 in out[0..3]. The rows are interleaved as codes
 * first (one lookup serves both rows), after a dword reorder that puts code
 * 16g + 4L + i at byte 16L + 4g + i, so the in-lane interleaves end in column order. */
PKV_AI void vi_e4m3_pairs_64(const uint8_t *a, const uint8_t *b, int n, __m512i out[4]) {
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  __m512i ra = _mm512_permutexvar_epi32(order, vi_load_bytes(a, n));
  __m512i rb = _mm512_permutexvar_epi32(order, vi_load_bytes(b, n));
  __m512i h0, l0, h1, l1;
  vi_e4m3_bf16_bytes(_mm512_unpacklo_epi8(ra, rb), &h0, &l0); /* bytes: a, b of columns g = 0, 1 */
  vi_e4m3_bf16_bytes(_mm512_unpackhi_epi8(ra, rb), &h1, &l1); /* g = 2, 3 */
  out[0] = _mm512_unpacklo_epi8(l0, h0);
  out[1] = _mm512_unpackhi_epi8(l0, h0);
  out[2] = _mm512_unpacklo_epi8(l1, h1);
  out[3] = _mm512_unpackhi_epi8(l1, h1);
}
#endif

#elif defined(PKV_SIMD_AVX2)
/* ========================================================================== AVX2 */
#include <immintrin.h>

#define PKV_W 8
typedef __m256 pkv_vf;

PKV_AI pkv_vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
PKV_AI void vf_store(float *p, pkv_vf v) { _mm256_storeu_ps(p, v); }
PKV_AI pkv_vf vf_set1(float x) { return _mm256_set1_ps(x); }
PKV_AI pkv_vf vf_zero(void) { return _mm256_setzero_ps(); }
PKV_AI pkv_vf vf_add(pkv_vf a, pkv_vf b) { return _mm256_add_ps(a, b); }
PKV_AI pkv_vf vf_sub(pkv_vf a, pkv_vf b) { return _mm256_sub_ps(a, b); }
PKV_AI pkv_vf vf_mul(pkv_vf a, pkv_vf b) { return _mm256_mul_ps(a, b); }
/* max that keeps NaN from either side (MAXPS alone returns b when a is NaN) */
PKV_AI pkv_vf vf_max(pkv_vf a, pkv_vf b) { return _mm256_blendv_ps(_mm256_max_ps(a, b), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
PKV_AI pkv_vf vf_fma(pkv_vf a, pkv_vf b, pkv_vf c) { return _mm256_fmadd_ps(a, b, c); }
PKV_AI float vf_hmax(pkv_vf v) {
  if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) return NAN;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
PKV_AI float vf_hsum(pkv_vf v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
PKV_AI int vf_any_above(pkv_vf v, float t) {
  return _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(t), _CMP_NLE_UQ)) != 0;
}
PKV_AI pkv_vf vf_keep_range(pkv_vf v, int64_t lo, int64_t hi, float fill) {
  __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int l = (int)(lo < -1 ? -1 : (lo > 8 ? 8 : lo)), h = (int)(hi < -1 ? -1 : (hi > 8 ? 8 : hi));
  __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(iota, _mm256_set1_epi32(l - 1)),
                                  _mm256_cmpgt_epi32(_mm256_set1_epi32(h), iota));
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(keep));
}
PKV_AI pkv_vf vf_exp2(pkv_vf x) {
  pkv_vf in = x, nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q); /* the integer exponent below loses NaN: put it back */
  /* x < -PKV_EXP2_FLOOR (-inf too) gives 0, and no result is denormal (see the AVX-512 vf_exp2) */
  pkv_vf tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-PKV_EXP2_FLOOR), _CMP_LT_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-PKV_EXP2_FLOOR));
  pkv_vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  pkv_vf f = _mm256_sub_ps(x, n);
  pkv_vf p = _mm256_set1_ps(PKV_EXP2_C7);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C6));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C5));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(PKV_EXP2_C1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_blendv_ps(_mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e))), in, nan);
}

PKV_AI pkv_vf vf_from_f16_bits(__m128i h) {
  pkv_vf v = _mm256_cvtph_ps(h);
  __m256i w = _mm256_cvtepu16_epi32(h);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7fff)), _mm256_set1_epi32(0x7c00));
  __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x8000)), 16),
                                 _mm256_or_si256(_mm256_set1_epi32(0x7f800000),
                                                 _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x3ff)), 13)));
  return _mm256_blendv_ps(v, _mm256_castsi256_ps(bits), _mm256_castsi256_ps(nan));
}
PKV_AI pkv_vf vf_load_bf16(const uint16_t *p) {
  __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
PKV_AI pkv_vf vf_load_f16(const uint16_t *p) { return vf_from_f16_bits(_mm_loadu_si128((const __m128i *)p)); }
PKV_AI pkv_vf vf_load_e4m3(const uint8_t *p) {
  __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
  __m128i t = _mm_slli_epi16(c, 7);
  __m128i h = _mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000)));
  __m128i nan = _mm_cmpeq_epi16(_mm_and_si128(c, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));
  h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan);
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
PKV_AI pkv_vf vf_load_e5m2(const uint8_t *p) {
  __m128i c = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
  return vf_from_f16_bits(_mm_slli_epi16(c, 8));
}

/* 8 x 32-bit lanes -> their low 16 bits, in order. */
PKV_AI __m128i vi_narrow16(__m256i w) {
  __m256i lo16 = _mm256_and_si256(w, _mm256_set1_epi32(0xffff));
  return _mm_packus_epi32(_mm256_castsi256_si128(lo16), _mm256_extracti128_si256(lo16, 1));
}
PKV_AI __m256i vi_bf16_bits(pkv_vf x) {
  __m256i b = _mm256_castps_si256(x);
  __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
  __m256i r = _mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                                   _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1))));
  r = _mm256_srli_epi32(r, 16);
  return _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40)), nan);
}
PKV_AI void v_store_bf16(uint16_t *p, pkv_vf x) { _mm_storeu_si128((__m128i *)p, vi_narrow16(vi_bf16_bits(x))); }
PKV_AI void v_store_f16(uint16_t *p, pkv_vf x) {
  __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256i b = _mm256_castps_si256(x);
  __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  __m256i q = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x8000)),
                              _mm256_set1_epi32(0x7e00));
  __m256i w = _mm256_blendv_epi8(_mm256_cvtepu16_epi32(h), q, nan);
  _mm_storeu_si128((__m128i *)p, vi_narrow16(w));
}
PKV_AI __m256i vi_fp8_code(pkv_vf x, int e4m3) {
  const int man = e4m3 ? 3 : 2, bias_shift = e4m3 ? 120 : 112, max_code = e4m3 ? 0x7e : 0x7b;
  const int max_bits = e4m3 ? 0x43e00000 : 0x47600000, sub_bits = e4m3 ? 0x3c800000 : 0x38800000;
  const float sub_mul = e4m3 ? 512.0f : 65536.0f;
  __m256i b = _mm256_castps_si256(x);
  __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 24), _mm256_set1_epi32(0x80));
  __m256i a = _mm256_and_si256(b, _mm256_set1_epi32(0x7fffffff));
  const int sh = 23 - man;
  __m256i r = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32((1 << (sh - 1)) - 1),
                                                   _mm256_and_si256(_mm256_srli_epi32(a, sh), _mm256_set1_epi32(1))));
  __m256i code = _mm256_srli_epi32(_mm256_sub_epi32(r, _mm256_set1_epi32(bias_shift << 23)), sh);
  code = _mm256_min_epu32(code, _mm256_set1_epi32(max_code));
  __m256i sub = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(sub_mul)));
  code = _mm256_blendv_epi8(code, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(sub_bits), a));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(max_code), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(max_bits - 1)));
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7f), _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
  return _mm256_or_si256(code, sign);
}
PKV_AI void v_store_fp8(uint8_t *p, pkv_vf x, int e4m3) {
  __m128i w = vi_narrow16(vi_fp8_code(x, e4m3));
  _mm_storel_epi64((__m128i *)p, _mm_packus_epi16(w, w));
}
PKV_AI int vf_any_nan(pkv_vf x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0; }
PKV_AI pkv_vf vf_clamp_sym(pkv_vf v, float mx) {
  v = _mm256_blendv_ps(v, _mm256_set1_ps(mx), _mm256_cmp_ps(v, _mm256_set1_ps(mx), _CMP_GT_OQ));
  return _mm256_blendv_ps(v, _mm256_set1_ps(-mx), _mm256_cmp_ps(v, _mm256_set1_ps(-mx), _CMP_LT_OQ));
}
PKV_AI pkv_vf vf_div(pkv_vf a, pkv_vf b) { return _mm256_div_ps(a, b); }
PKV_AI pkv_vf vf_abs(pkv_vf a) { return _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff))); }

PKV_AI void v_transpose_words(const uint32_t *const *rows, int64_t n, uint32_t *dst, int64_t ld) {
  __m256 r[8];
  __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n > 8 ? 8 : n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int i = 0; i < 8; i++) r[i] = _mm256_castsi256_ps(_mm256_maskload_epi32((const int *)rows[i], m));
  v_transpose8x8(r); /* moves bits only: words, not floats */
  for (int c = 0; c < n && c < 8; c++) _mm256_storeu_si256((__m256i *)(dst + c * ld), _mm256_castps_si256(r[c]));
}

PKV_AI void v_prefetch(const void *p) { _mm_prefetch((const char *)p, _MM_HINT_T1); }

#else
/* ======================================================================== scalar */
#define PKV_W 1
typedef float pkv_vf;

PKV_AI pkv_vf vf_load(const float *p) { return *p; }
PKV_AI void vf_store(float *p, pkv_vf v) { *p = v; }
PKV_AI pkv_vf vf_set1(float x) { return x; }
PKV_AI pkv_vf vf_zero(void) { return 0.0f; }
PKV_AI pkv_vf vf_add(pkv_vf a, pkv_vf b) { return a + b; }
PKV_AI pkv_vf vf_sub(pkv_vf a, pkv_vf b) { return a - b; }
PKV_AI pkv_vf vf_mul(pkv_vf a, pkv_vf b) { return a * b; }
PKV_AI pkv_vf vf_max(pkv_vf a, pkv_vf b) { return (a > b || a != a) ? a : b; } /* NaN from either side */
PKV_AI pkv_vf vf_fma(pkv_vf a, pkv_vf b, pkv_vf c) { return a * b + c; }
PKV_AI float vf_hmax(pkv_vf v) { return v; }
PKV_AI float vf_hsum(pkv_vf v) { return v; }
PKV_AI int vf_any_above(pkv_vf v, float t) { return !(v <= t); }
PKV_AI pkv_vf vf_keep_range(pkv_vf v, int64_t lo, int64_t hi, float fill) { return (lo <= 0 && 0 < hi) ? v : fill; }
PKV_AI pkv_vf vf_exp2(pkv_vf x) { return exp2f(x); }
PKV_AI pkv_vf vf_load_bf16(const uint16_t *p) { return pkv_bf16_to_f32(*p); }
PKV_AI pkv_vf vf_load_f16(const uint16_t *p) { return pkv_f16_to_f32(*p); }
PKV_AI pkv_vf vf_load_e4m3(const uint8_t *p) { return pkv_e4m3_to_f32(*p); }
PKV_AI pkv_vf vf_load_e5m2(const uint8_t *p) { return pkv_e5m2_to_f32(*p); }
PKV_AI void v_store_bf16(uint16_t *p, pkv_vf x) { *p = pkv_f32_to_bf16(x); }
PKV_AI void v_store_f16(uint16_t *p, pkv_vf x) { *p = pkv_f32_to_f16(x); }
PKV_AI void v_store_fp8(uint8_t *p, pkv_vf x, int e4m3) { *p = e4m3 ? pkv_f32_to_e4m3(x) : pkv_f32_to_e5m2(x); }
PKV_AI int vf_any_nan(pkv_vf x) { return x != x; }
PKV_AI pkv_vf vf_clamp_sym(pkv_vf v, float mx) { return v > mx ? mx : (v < -mx ? -mx : v); }
PKV_AI pkv_vf vf_div(pkv_vf a, pkv_vf b) { return a / b; }
PKV_AI pkv_vf vf_abs(pkv_vf a) { return fabsf(a); }
PKV_AI void v_transpose_words(const uint32_t *const *rows, int64_t n, uint32_t *dst, int64_t ld) {
  (void)ld;
  if (n > 0) dst[0] = rows[0][0];
}
PKV_AI void v_prefetch(const void *p) { (void)p; }
#endif

#endif /* PKV_CPU_SIMD_H */
