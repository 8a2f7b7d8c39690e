/* The attention path the CPU plan chooses per item (pkv_attn_item.path, kernels/attn_path.inc) for
 * typical shapes, on every kernel table this CPU runs: decode and prefill, 16-bit, float32 and FP8
 * caches, the cpu_decode setting. The table is chosen once per process, so each PAGEDKV_CPU_ISA cap
 * runs in a child process of its own (a cap above the CPU gets the best table it has). */
#define _POSIX_C_SOURCE 200809L /* setenv, fork, waitpid under -std=c11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_cpu.h"
#include "pkv_settings.h"
#include "check.h"
#include "test_util.h"
#include "every_cap.h"

typedef struct {
  const char *what;
  pkv_dtype q, cache;
  int64_t group_heads, kv_heads, rows, cached, dim, quant_group;
  pkv_cpu_decode decode;
  /* expected path per table: scalar, avx2, avx512 without / with AVX512-BF16 (and VBMI), amx */
  int scalar, avx2, avx512, avx512_dot, amx;
} path_case;

enum { F32 = PKV_CPU_PATH_PACKED_F32, BF16 = PKV_CPU_PATH_PACKED_BF16, PDOT = PKV_CPU_PATH_PACKED_DOT,
       DIRECT = PKV_CPU_PATH_DIRECT, DOT = PKV_CPU_PATH_DOT, AMX = PKV_CPU_PATH_AMX, AMXD = PKV_CPU_PATH_AMX_DECODE };

static const path_case CASES[] = {
    /* decode of a GQA group of 4 (8 KV heads, D 128) */
    {"bf16 decode", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_AUTO, F32, DIRECT, DIRECT, DOT,
     AMXD},
    {"bf16 decode, cpu_decode packed", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_PACKED,
     F32, F32, F32, PDOT, AMXD},
    {"bf16 decode, cpu_decode fma", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_FMA, F32,
     DIRECT, DIRECT, DIRECT, AMXD},
    {"float32 q over bf16, decode", PKV_DTYPE_F32, PKV_DTYPE_BF16, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_AUTO, F32,
     DIRECT, DIRECT, DIRECT, DIRECT},
    {"e4m3 decode, a scale per row", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_AUTO,
     F32, DIRECT, DIRECT, DOT, AMXD},
    {"e5m2 decode, scale groups of 64", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E5M2, 4, 8, 1, 300, 128, 64, PKV_CPU_DECODE_AUTO,
     F32, DIRECT, DIRECT, DOT, DOT},
    {"float16 decode", PKV_DTYPE_F16, PKV_DTYPE_F16, 4, 8, 1, 300, 128, 128, PKV_CPU_DECODE_AUTO, F32, DIRECT, DIRECT,
     DIRECT, DIRECT},
    /* 16 query vectors per KV head: past the in-place decode's bf16 limit; AMX takes one head per item */
    {"bf16 decode, GQA 16", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 16, 2, 1, 300, 128, 128, PKV_CPU_DECODE_AUTO, F32, F32, F32,
     PDOT, AMX},
    /* prefill: 64 rows x 4 heads, one KV head per item */
    {"bf16 prefill", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 2, 64, 100, 128, 128, PKV_CPU_DECODE_AUTO, F32, F32, F32, PDOT,
     AMX},
    {"e4m3 prefill, scale groups of 32", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, 4, 2, 64, 100, 128, 32,
     PKV_CPU_DECODE_AUTO, F32, F32, F32, F32, AMX},
    {"bf16 prefill, D 96 (no whole 64-column V blocks)", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 2, 64, 100, 96, 128,
     PKV_CPU_DECODE_AUTO, F32, F32, F32, BF16, AMX},
    {"float32 prefill", PKV_DTYPE_F32, PKV_DTYPE_F32, 4, 2, 64, 100, 128, 128, PKV_CPU_DECODE_AUTO, F32, F32, F32, F32,
     F32},
};

/* -1: not stated (an AVX-512 CPU with AVX512-BF16 but without VBMI: bf16 rows take the dot products there,
 * FP8 rows not) */
static int expected(const path_case *c, const char *table) {
  if (strcmp(table, "amx") == 0) return c->amx;
  if (strcmp(table, "avx512") == 0) {
    if (pkv_cpu_has_dot_bf16() != pkv_cpu_has_vbmi()) return -1;
    return pkv_cpu_has_dot_bf16() ? c->avx512_dot : c->avx512;
  }
  if (strcmp(table, "avx2") == 0) return c->avx2;
  return c->scalar;
}

static void check_case(const path_case *c) {
  int64_t P = 16, Hk = c->kv_heads, Hq = Hk * c->group_heads, D = c->dim, T = c->rows;
  int64_t pages = (c->cached + c->rows + P - 1) / P, N = pages + 1, G = c->quant_group, ng = pkv_num_groups(D, G);
  size_t es = pkv_dtype_size(c->cache);
  void *kc = calloc((size_t)(N * P * Hk * D), es), *vc = calloc((size_t)(N * P * Hk * D), es);
  float *ks = calloc((size_t)(N * P * Hk * ng), sizeof(float)), *vs = calloc((size_t)(N * P * Hk * ng), sizeof(float));
  void *q = calloc((size_t)(T * Hq * D), pkv_dtype_size(c->q));
  void *out = calloc((size_t)(T * Hq * D), pkv_dtype_size(c->q));
  int32_t *table = malloc((size_t)pages * sizeof(int32_t)), lens[1] = {(int32_t)c->cached}, offs[2] = {0, (int32_t)T};
  for (int64_t j = 0; j < pages; j++) table[j] = (int32_t)j;
  pkv_attn_args a;
  memset(&a, 0, sizeof a);
  a.q = tensor_contig(q, c->q, 3, (int64_t[]){T, Hq, D});
  a.out = tensor_contig(out, c->q, 3, (int64_t[]){T, Hq, D});
  a.input_row_offsets = tensor_contig(offs, PKV_DTYPE_I32, 1, (int64_t[]){2});
  a.cache_lengths = tensor_contig(lens, PKV_DTYPE_I32, 1, (int64_t[]){1});
  a.lookup_table = tensor_contig(table, PKV_DTYPE_I32, 2, (int64_t[]){1, pages});
  a.k_cache = tensor_contig(kc, c->cache, 4, (int64_t[]){N, P, Hk, D});
  a.v_cache = tensor_contig(vc, c->cache, 4, (int64_t[]){N, P, Hk, D});
  if (pkv_dtype_is_fp8(c->cache)) {
    a.k_scales = tensor_contig(ks, PKV_DTYPE_F32, 4, (int64_t[]){N, P, Hk, ng});
    a.v_scales = tensor_contig(vs, PKV_DTYPE_F32, 4, (int64_t[]){N, P, Hk, ng});
  }
  a.scale = 0.1;
  a.causal = 1;
  a.quant_group = G;
  a.window_left = -1;
  pkv_settings s = pkv_settings_get();
  s.cpu_decode = c->decode;
  pkv_error err;
  CHECK(pkv_settings_set(&s, &err) == PKV_OK, "settings: %s", err.message);
  CHECK(pkv_attn_check(&a, 1, &err) == PKV_OK, "%s: rejected: %s", c->what, err.message);
  pkv_attn_plan plan;
  if (pkv_attn_cpu_plan(&a, &plan, &err) == PKV_OK) {
    const char *name = pkv_cpu_kernels_get()->name;
    int want = expected(c, name);
    CHECK(plan.num_items > 0, "%s: no items", c->what);
    for (int64_t i = 0; want >= 0 && i < plan.num_items; i++)
      CHECK(plan.items[i].path == want, "%s on %s: item %lld takes path %d, expected %d", c->what, name, (long long)i,
            plan.items[i].path, want);
    /* the AMX prefill tiles take one KV head per item: the plan asks attn_path before grouping heads */
    for (int64_t i = 0; i < plan.num_items; i++)
      CHECK(plan.items[i].path != AMX || plan.items[i].num_kv_heads == 1, "%s on %s: AMX item %lld has %lld KV heads",
            c->what, name, (long long)i, (long long)plan.items[i].num_kv_heads);
    pkv_attn_plan_free(&plan);
  } else {
    CHECK(0, "%s: plan failed: %s", c->what, err.message);
  }
  s.cpu_decode = PKV_CPU_DECODE_AUTO;
  pkv_settings_set(&s, &err);
  free(kc), free(vc), free(ks), free(vs), free(q), free(out), free(table);
}

static void check_all_cases(void) {
  for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) check_case(&CASES[i]);
}

int main(void) { return check_on_every_cap(check_all_cases, "attention paths"); }
