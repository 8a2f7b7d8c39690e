/* Unit tests of the CPU kernels of the pagedkv C core (run by tests/c/run.sh under ASan + UBSan).
 *
 * Small cases against naive C loops (store and load bit-exact, attention in double within
 * tolerance), with non-contiguous strides, GQA, masks, softcap and FP8. */
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
      /* every other case through the claiming entry (the torch op's), the others through ranges */
      static int claim;
      claim = !claim;
      CHECK((claim ? pkv_attn_cpu_claim(&a, &plan, &err) : pkv_attn_cpu(&a, &plan, 0, plan.num_items, &err)) == PKV_OK,
            "attn kernel failed: %s", err.message);
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

int main(void) {
  test_store_kernel();
  test_load_kernel();
  test_attn_kernel();
  return check_report("CPU kernels");
}
