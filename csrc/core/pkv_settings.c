/* pagedkv core: the process-wide kernel settings (pkv_settings.h). */
#include "pkv_settings.h"

#include <stdlib.h>

/* 0: the environment not read yet; 1: one thread reading it; 2: g_settings holds values. */
static int g_state;
static pkv_settings g_settings;

pkv_settings pkv_settings_from_env(void) {
  pkv_settings s = {0, PKV_CPU_DECODE_AUTO, -1, 0, PKV_CUDA_SPARSE_AUTO, 0, 0};
  const char *checks = getenv("PAGEDKV_CHECK");
  s.checks = checks != NULL && checks[0] != '\0' && checks[0] != '0';
  /* the opt-in warpgroup path for a whole process (e.g. the existing op tests run on it) */
  const char *wgmma = getenv("PAGEDKV_CUDA_PREFILL_WGMMA");
  s.cuda_prefill_wgmma = wgmma != NULL && wgmma[0] != '\0' && wgmma[0] != '0';
  const char *splits = getenv("PAGEDKV_CUDA_SPLITS");
  if (splits != NULL) {
    const long n = strtol(splits, NULL, 10);
    if (n >= 1 && n <= 0x7fffffffL) s.cuda_splits = (int)n;
  }
  return s;
}

static void settings_ready(void) {
  if (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) == 2) return;
  int expected = 0;
  if (__atomic_compare_exchange_n(&g_state, &expected, 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    g_settings = pkv_settings_from_env();
    __atomic_store_n(&g_state, 2, __ATOMIC_RELEASE);
    return;
  }
  /* another thread is reading the environment: a few getenv calls */
  while (__atomic_load_n(&g_state, __ATOMIC_ACQUIRE) != 2) {
  }
}

#define PKV_SETTINGS_FIELDS(X)                                                                                    \
  X(checks) X(cpu_decode) X(cuda_loader) X(cuda_splits) X(cuda_sparse) X(cuda_fp8_store_rows) X(cuda_prefill_wgmma)

pkv_settings pkv_settings_get(void) {
  settings_ready();
  pkv_settings s;
#define PKV_LOAD(f) s.f = __atomic_load_n(&g_settings.f, __ATOMIC_RELAXED);
  PKV_SETTINGS_FIELDS(PKV_LOAD)
#undef PKV_LOAD
  return s;
}

pkv_status pkv_settings_set(const pkv_settings *s, pkv_error *err) {
  if (s->checks != 0 && s->checks != 1) return pkv_fail(err, PKV_ERR_ARGUMENT, "checks must be 0 or 1, got %d", s->checks);
  if ((int)s->cpu_decode < 0 || s->cpu_decode >= PKV_CPU_DECODE_COUNT)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "cpu_decode must be 0 (auto), 1 (packed) or 2 (fma), got %d",
                    (int)s->cpu_decode);
  if (s->cuda_loader < -1 || s->cuda_loader >= PKV_SETTINGS_LOADER_COUNT)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "cuda_loader must be -1 (auto), 0 (cp.async), 1 (tma-pages) or 2 (tma-gather4), got %d",
                    s->cuda_loader);
  if (s->cuda_splits < 0)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "cuda_splits must be 0 (the plan's rule) or >= 1, got %d", s->cuda_splits);
  if ((int)s->cuda_sparse < 0 || s->cuda_sparse >= PKV_CUDA_SPARSE_COUNT)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "cuda_sparse_kernel must be 0 (auto) or 1 (portable), got %d",
                    (int)s->cuda_sparse);
  if (s->cuda_fp8_store_rows != 0 && s->cuda_fp8_store_rows != 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "cuda_fp8_store_rows must be 0 or 1, got %d", s->cuda_fp8_store_rows);
  if (s->cuda_prefill_wgmma != 0 && s->cuda_prefill_wgmma != 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "cuda_prefill_wgmma must be 0 or 1, got %d", s->cuda_prefill_wgmma);
  settings_ready();
#define PKV_STORE(f) __atomic_store_n(&g_settings.f, s->f, __ATOMIC_RELAXED);
  PKV_SETTINGS_FIELDS(PKV_STORE)
#undef PKV_STORE
  return PKV_OK;
}
