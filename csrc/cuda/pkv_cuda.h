/* pagedkv CUDA backend: host entry points with C linkage.
 *
 * Included by the torch shim (csrc/torch/ops_cuda.cpp) and by the .cu files.
 * No torch types: launchers take the core's validated argument structs and a
 * stream and return cudaError_t. Anything the kernels cannot run is reported
 * before launch by the *_supported / plan functions as PKV_ERR_UNSUPPORTED
 * with a message that says "not supported on CUDA".
 *
 * Launchers never allocate device memory and never synchronise: the shim
 * hands in scratch buffers from torch's caching allocator, so every launch
 * is CUDA-graph capturable. */
#ifndef PKV_CUDA_H
#define PKV_CUDA_H

#include <cuda_runtime_api.h>

#include "../core/pkv_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* K/V tile loaders of flash_attn_paged (cp.async and gather4 also load
 * flash_attn_paged_sparse's listed rows). All fill the same shared-memory image
 * (see tile.cuh); the host picks one from the device's compute capability and
 * from what the fat binary really holds for that device. */
typedef enum {
  PKV_LOADER_CP_ASYNC = 0,    /* sm_80+: 16-byte cp.async per row */
  PKV_LOADER_TMA_PAGES = 1,   /* sm_90: one TMA box per page chunk (4-D map) */
  PKV_LOADER_TMA_GATHER4 = 2, /* sm_100: TMA tile::gather4, 4 rows per instruction (2-D map) */
  PKV_LOADER_COUNT = 3
} pkv_loader;

const char *pkv_loader_name(pkv_loader loader);

/* 1 when `loader` was compiled for `device`'s architecture and the device
 * can run it (cudaFuncGetAttributes on the loader's kernel: the PTX it was
 * built from must be new enough, so a body that would only trap is never
 * picked). 0 otherwise, also when no device is present. */
int pkv_cuda_loader_available(int device, pkv_loader loader);
/* 1 when `device` (cc 9.x) runs code built for sm_90a, which holds the warpgroup-MMA attention kernels
 * (kernel option cuda_prefill_wgmma); 0 otherwise, also when no device is present. */
int pkv_cuda_wgmma_available(int device);

/* ---- paged_store ---- */
pkv_status pkv_cuda_store_supported(const pkv_store_args *a, pkv_error *err);
cudaError_t pkv_cuda_store(const pkv_store_args *a, cudaStream_t stream);

/* ---- paged_load ---- */
pkv_status pkv_cuda_load_supported(const pkv_load_args *a, pkv_error *err);
cudaError_t pkv_cuda_load(const pkv_load_args *a, cudaStream_t stream);

/* ---- flash_attn_paged ----
 * The plan is made on the host from shapes only (never from index values,
 * which live on the device): the loader, and the number of KV splits for
 * decode-like calls with too few (row, KV head) tiles to fill the SMs. With
 * num_splits > 1 the launcher needs float scratch buffers of the given sizes. */
typedef struct {
  int device;
  int num_sms;
  pkv_loader loader;
  int num_splits;            /* 1: no split-KV */
  int64_t partial_out_floats; /* [num_splits, T, Hq, Dv] */
  int64_t partial_lse_floats; /* [num_splits, T, Hq] */
  int portable;               /* 1: the portable kernel (flash_attn_paged_portable.cu: K tails, other heads) */
  int mla;                    /* 1: the MLA kernel (flash_attn_mla.cuh: D 576, Dv 512, V the latent of K) */
  int wgmma;                  /* 1: the warpgroup-MMA kernel (sm_90a; kernel option cuda_prefill_wgmma) */
} pkv_cuda_attn_plan;

/* force_loader: -1 picks the best available; otherwise that loader or an error. */
pkv_status pkv_cuda_attn_plan_make(const pkv_attn_args *a, int device, int force_loader, pkv_cuda_attn_plan *plan,
                                   pkv_error *err);
cudaError_t pkv_cuda_attn(const pkv_attn_args *a, const pkv_cuda_attn_plan *plan, float *partial_out,
                          float *partial_lse, cudaStream_t stream);

/* ---- flash_attn_paged_sparse (validated args) ----
 * Two kernels: the tiled one (listed K/V rows staged in shared memory by
 * cp.async or, on sm_100a, TMA gather4; one CTA per query row and KV head)
 * and the portable one (warp per row and query head, plain loads) for what
 * the tiled one does not serve. pkv_cuda_sparse plans with the best loader
 * on the current device and launches. */
pkv_status pkv_cuda_sparse_supported(const pkv_sparse_args *a, pkv_error *err);
cudaError_t pkv_cuda_sparse(const pkv_sparse_args *a, cudaStream_t stream);

typedef struct {
  int tiled;          /* 1: the tiled kernel with `loader`; 0: the portable kernel */
  pkv_loader loader;  /* PKV_LOADER_CP_ASYNC or PKV_LOADER_TMA_GATHER4 */
  int64_t smem_bytes; /* dynamic shared memory of the tiled kernel */
} pkv_cuda_sparse_plan;

/* From shapes only. force_loader: -1 picks the best (gather4 where it fits, else cp.async, else the
 * portable kernel; the setting cuda_sparse = portable forces the portable one); 0 or 2 the tiled
 * kernel with that loader, or PKV_ERR_UNSUPPORTED ("does not fit" / "is not available") when it
 * cannot run this call; 1 (tma-pages) is not a sparse loader: PKV_ERR_UNSUPPORTED. */
pkv_status pkv_cuda_sparse_plan_make(const pkv_sparse_args *a, int device, int force_loader,
                                     pkv_cuda_sparse_plan *plan, pkv_error *err);
cudaError_t pkv_cuda_sparse_run(const pkv_sparse_args *a, const pkv_cuda_sparse_plan *plan, cudaStream_t stream);

/* ---- merge_attn_states (validated args; element-wise, any head size) ---- */
cudaError_t pkv_cuda_merge(const pkv_merge_args *a, cudaStream_t stream);

/* ---- debug: the shared-memory image of one K tile ----
 * Loads keys [first_key, first_key + rows) of (batch, kv_head) with `loader`
 * into the common tile layout, zeroes masked rows exactly as attention does
 * (rows past seq_lens[batch], page ids outside [0, N)), and copies the raw
 * image (cache dtype, 128-byte-swizzled chunks) to out. */
typedef struct {
  int64_t rows;      /* keys per tile (attention's BN for this head size) */
  int64_t row_bytes; /* bytes per smem row: head size * element size rounded up to 128 */
  int64_t bytes;     /* rows * row_bytes */
} pkv_cuda_tile_geometry;

pkv_status pkv_cuda_debug_tile_plan(const pkv_tensor *cache, const pkv_tensor *lookup_table,
                                    const pkv_tensor *seq_lens, int64_t batch, int64_t kv_head, int64_t first_key,
                                    int device, pkv_loader loader, pkv_cuda_tile_geometry *geometry, pkv_error *err);
cudaError_t pkv_cuda_debug_load_tile(const pkv_tensor *cache, const pkv_tensor *lookup_table,
                                     const pkv_tensor *seq_lens, int64_t batch, int64_t kv_head, int64_t first_key,
                                     pkv_loader loader, void *out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* PKV_CUDA_H */
