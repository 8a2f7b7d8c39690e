/* The path the CPU plan of flash_attn_paged_sparse chooses for a call's items (pkv_sparse_plan.path,
 * kernels/sparse_item.inc's sparse_path) for typical shapes, on every kernel table this CPU runs: 16-bit,
 * float32 and FP8 caches, scale groups, GQA groups, head dims, packed MLA rows. The table is chosen once
 * per process, so each PAGEDKV_CPU_ISA cap runs in a child process of its own (a cap above the CPU gets
 * the best table it has). Every planned call also runs, so the plan's path is one the kernel takes. */
#define _POSIX_C_SOURCE 200809L /* setenv, fork, waitpid under -std=c11 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_cpu.h"
#include "pkv_cpu_sparse.h"
#include "pkv_kv_format.h"
#include "check.h"
#include "test_util.h"
#include "every_cap.h"

typedef struct {
  const char *what;
  pkv_dtype q, cache;
  int64_t group_heads, dim, quant_group;
  pkv_kv_format format; /* PKV_KV_FP8_DS_MLA: the packed rows (dim, cache and quant_group unused) */
  /* expected path per table: scalar, avx2, avx512, amx */
  int scalar, avx2, avx512, amx;
} path_case;

enum { GATHER = PKV_CPU_SPARSE_GATHER, DIRECT = PKV_CPU_SPARSE_DIRECT };

static const path_case CASES[] = {
    {"bf16, GQA 4", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 128, 128, PKV_KV_PLAIN, GATHER, DIRECT, DIRECT, DIRECT},
    {"float16, GQA 8", PKV_DTYPE_F16, PKV_DTYPE_F16, 8, 128, 128, PKV_KV_PLAIN, GATHER, DIRECT, DIRECT, DIRECT},
    {"float32 q over bf16, GQA 1", PKV_DTYPE_F32, PKV_DTYPE_BF16, 1, 64, 64, PKV_KV_PLAIN, GATHER, DIRECT, DIRECT,
     DIRECT},
    {"e4m3, a scale per row", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, 4, 128, 128, PKV_KV_PLAIN, GATHER, DIRECT, DIRECT,
     DIRECT},
    {"e5m2, scale groups of 64", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E5M2, 4, 128, 64, PKV_KV_PLAIN, GATHER, DIRECT, DIRECT,
     DIRECT},
    /* groups of 8: whole AVX2 vectors, not whole AVX-512 ones */
    {"e4m3, scale groups of 8", PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3, 4, 128, 8, PKV_KV_PLAIN, GATHER, DIRECT, GATHER,
     GATHER},
    {"bf16, D 72", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 4, 72, 72, PKV_KV_PLAIN, GATHER, DIRECT, GATHER, GATHER},
    {"float32 cache", PKV_DTYPE_F32, PKV_DTYPE_F32, 4, 128, 128, PKV_KV_PLAIN, GATHER, GATHER, GATHER, GATHER},
    {"bf16, GQA 16 (past the direct products' 8)", PKV_DTYPE_BF16, PKV_DTYPE_BF16, 16, 128, 128, PKV_KV_PLAIN, GATHER,
     GATHER, GATHER, GATHER},
    {"fp8_ds_mla rows (a K tail), 16 heads", PKV_DTYPE_BF16, PKV_DTYPE_U8, 16, 0, 0, PKV_KV_FP8_DS_MLA, GATHER, GATHER,
     GATHER, GATHER},
};

static int expected(const path_case *c, const char *table) {
  if (strcmp(table, "amx") == 0) return c->amx;
  if (strcmp(table, "avx512") == 0) return c->avx512;
  if (strcmp(table, "avx2") == 0) return c->avx2;
  return c->scalar;
}

enum { PAGES = 4, PAGE = 16, TOKENS = 2, LISTED = 24, MLA_ROW = 656, MLA_D = 576, MLA_DV = 512 };

static void check_case(const path_case *c) {
  const int mla = c->format == PKV_KV_FP8_DS_MLA;
  int64_t Hk = mla ? 1 : 2, Hq = Hk * c->group_heads, D = mla ? MLA_D : c->dim, Dv = mla ? MLA_DV : c->dim;
  int64_t row = mla ? MLA_ROW : c->dim, G = mla ? 128 : c->quant_group, ng = mla ? 1 : pkv_num_groups(D, G);
  size_t es = mla ? 1 : pkv_dtype_size(c->cache);
  /* uint32 storage keeps packed rows 4-byte aligned, as their float32 scales need */
  uint32_t *kc = calloc((size_t)(PAGES * PAGE * Hk * row) * es / 4 + 1, 4);
  uint32_t *vc = calloc((size_t)(PAGES * PAGE * Hk * row) * es / 4 + 1, 4);
  float *ks = calloc((size_t)(PAGES * PAGE * Hk * ng), sizeof(float));
  float *vs = calloc((size_t)(PAGES * PAGE * Hk * ng), sizeof(float));
  void *q = calloc((size_t)(TOKENS * Hq * D), pkv_dtype_size(c->q));
  void *out = calloc((size_t)(TOKENS * Hq * Dv), pkv_dtype_size(c->q));
  int32_t ix[TOKENS * LISTED];
  for (int i = 0; i < TOKENS * LISTED; i++) ix[i] = i % 5 == 4 ? -1 : (int32_t)((i * 7) % (PAGES * PAGE));
  for (int64_t i = 0; i < PAGES * PAGE * Hk * ng; i++) ks[i] = vs[i] = 1.0f;
  pkv_sparse_args a;
  memset(&a, 0, sizeof a);
  a.q = T3(q, c->q, TOKENS, Hq, D);
  a.out = T3(out, c->q, TOKENS, Hq, Dv);
  a.indices = T3(ix, PKV_DTYPE_I32, TOKENS, 1, LISTED);
  a.scale = 0.1;
  a.quant_group = G;
  if (mla) {
    a.k_cache = T4(kc, PKV_DTYPE_U8, PAGES, PAGE, 1, MLA_ROW);
    a.kv_format = PKV_KV_FP8_DS_MLA;
  } else {
    a.k_cache = T4(kc, c->cache, PAGES, PAGE, Hk, D);
    a.v_cache = T4(vc, c->cache, PAGES, PAGE, Hk, Dv);
    if (pkv_dtype_is_fp8(c->cache)) {
      a.k_scales = T4(ks, PKV_DTYPE_F32, PAGES, PAGE, Hk, ng);
      a.v_scales = T4(vs, PKV_DTYPE_F32, PAGES, PAGE, Hk, ng);
    }
  }
  pkv_error err;
  pkv_sparse_args plain;
  CHECK(pkv_sparse_unpack(&a, &plain, &err) == PKV_OK, "%s: unpack: %s", c->what, err.message);
  CHECK(pkv_sparse_check(&plain, 1, &err) == PKV_OK, "%s: rejected: %s", c->what, err.message);
  if (g_failures == 0) {
    const char *name = pkv_cpu_kernels_get()->name;
    pkv_sparse_plan plan = pkv_sparse_cpu_plan(&plain);
    CHECK(plan.path == expected(c, name), "%s on %s: path %d, expected %d", c->what, name, plan.path,
          expected(c, name));
    CHECK(pkv_sparse_cpu(&plain, &plan, 0, pkv_sparse_cpu_work(&plain), &err) == PKV_OK, "%s: run: %s", c->what,
          err.message);
  }
  free(kc), free(vc), free(ks), free(vs), free(q), free(out);
}

static void check_all_cases(void) {
  for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) check_case(&CASES[i]);
}

int main(void) { return check_on_every_cap(check_all_cases, "sparse attention paths"); }
