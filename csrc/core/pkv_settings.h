/* pagedkv core: the process-wide kernel settings, one struct for every backend.
 *
 * Read from the environment once (on first use) for the debugging caps that keep an environment
 * variable: PAGEDKV_CHECK (host checks of CUDA index values) and PAGEDKV_CUDA_SPLITS (a forced
 * split-KV count). Every field can be changed at run time with pkv_settings_set (Python:
 * pagedkv.set_kernel_options); a value set before a call applies to that call. Kernels read the
 * settings once per call (the CPU driver in its plan, the CUDA launcher and plans per launch), never
 * per work item. PAGEDKV_CPU_ISA, the other cap, is read once by the CPU dispatcher (pkv_cpu_dispatch.c)
 * and has no setter: the kernel table is chosen once per process. */
#ifndef PKV_SETTINGS_H
#define PKV_SETTINGS_H

#include "pkv_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which decode path the CPU kernels may take (tests and A/B timing reach the others with it). */
typedef enum {
  PKV_CPU_DECODE_AUTO = 0,   /* the fastest path the item fits (decode_direct.inc, decode_dot.inc) */
  PKV_CPU_DECODE_PACKED = 1, /* the packed tiles (and AMX decode tiles) for decode too */
  PKV_CPU_DECODE_FMA = 2,    /* the direct decode, on float32 FMAs where the bf16 dot products would run */
  PKV_CPU_DECODE_COUNT
} pkv_cpu_decode;

/* Which flash_attn_paged_sparse kernel CUDA runs. */
typedef enum {
  PKV_CUDA_SPARSE_AUTO = 0,     /* the tiled kernel where it serves the call, else the portable one */
  PKV_CUDA_SPARSE_PORTABLE = 1, /* the portable kernel always (compares both on the same arguments) */
  PKV_CUDA_SPARSE_COUNT
} pkv_cuda_sparse_kernel;

/* The CUDA loaders' count (pkv_loader in csrc/cuda/pkv_cuda.h; ops_cuda.cpp asserts they agree). */
#define PKV_SETTINGS_LOADER_COUNT 3

typedef struct {
  int checks;                          /* PAGEDKV_CHECK=1: CUDA calls check index values on the host (a sync) */
  pkv_cpu_decode cpu_decode;           /* no environment variable */
  int cuda_loader;                     /* -1 auto, else a pkv_loader forced on CUDA attention (dense and sparse) */
  int cuda_splits;                     /* PAGEDKV_CUDA_SPLITS=n: 0 the plan's rule, n >= 1 forced split-KV count */
  pkv_cuda_sparse_kernel cuda_sparse;  /* no environment variable */
  int cuda_fp8_store_rows;             /* opt-in, not yet run on a GPU: FP8 paged_store a warp per row */
  int cuda_prefill_wgmma;              /* PAGEDKV_CUDA_PREFILL_WGMMA=1; opt-in, not yet run on a GPU: prefill on
                                          warpgroup MMA (sm_90a) */
} pkv_settings;

/* The current settings (the environment's on first use, then whatever pkv_settings_set stored). */
pkv_settings pkv_settings_get(void);

/* Stores all fields after checking each (an out-of-range value fails naming the field, nothing
 * stored). Fields are stored one by one: a call running concurrently may see some old, some new. */
pkv_status pkv_settings_set(const pkv_settings *s, pkv_error *err);

/* The values the environment gives (unset variables: the defaults). */
pkv_settings pkv_settings_from_env(void);

#ifdef __cplusplus
}
#endif

#endif
