// pagedkv CUDA backend: what flash_attn_paged's kernel (flash_attn_paged.cu)
// and its host-side plan (flash_attn_plan.cu) share.
#pragma once

#include "tile.cuh"

namespace pkv {

constexpr int kAttnRowsM = 64;    // packed (query row, query head) rows per CTA
constexpr int kAttnRowsM32 = 128;  // the same with 32 rows per warp (prefill on 16-bit caches, D <= 128)
constexpr int kMaxSplits = 32;  // the combine kernel keeps one split per lane

// The sinks and LSE output of an attention call into a kernel's parameters (AttnParams, MlaParams,
// PortableParams: the same field names).
template <typename Params>
void set_sinks_and_lse(Params &p, const pkv_attn_args *a) {
  if (a->sinks.defined) {
    p.sinks = static_cast<const float *>(a->sinks.data);
    p.sinks_stride = a->sinks.strides[0];
  }
  if (a->lse.defined) {
    p.lse = static_cast<float *>(a->lse.data);
    p.lse_stride_row = a->lse.strides[0];
    p.lse_stride_head = a->lse.strides[1];
  }
}

// Whether a call's packed (query row, query head) rows fill query tiles of `tile_rows` rows: at least that
// many per batch row on average. Prefill and chunked prefill fill the 128-row tiles; speculative-decoding
// verification (several new tokens per row, GQA) fills 64-row ones; decode (a few per row) neither.
inline bool fills_query_tiles(int64_t rows, int64_t heads_per_kv, int64_t batch, int64_t tile_rows) {
  return rows * heads_per_kv >= tile_rows * batch;
}
// 1 when the code the current device runs has the warpgroup-MMA kernels (sm_90a), else 0 (flash_attn_paged.cu).
int wgmma_kernels_compiled();

// Keys per K/V tile of the attention kernel for head size d.
inline int64_t tile_keys_for(int64_t d) { return attn_tile_keys(static_cast<int>(d)); }

// Whether `loader` can load tiles of these K and V views (flash_attn_plan.cu).
bool loader_fits(pkv_loader loader, const pkv_cache_view &k, const pkv_cache_view &v);
// The tensor maps the TMA loaders read K and V through; nothing for cp.async (flash_attn_plan.cu).
cudaError_t encode_maps(pkv_loader loader, const pkv_cache_view &k, const pkv_cache_view &v, CUtensorMap *kmap,
                        CUtensorMap *vmap);
// The portable kernel (flash_attn_paged_portable.cu): whether it takes these head sizes (q's D and Dv up
// to 576), and its launch (one warp per query row and head; K tails, any D and Dv).
int attn_portable_fits(const pkv_attn_args *a);
cudaError_t launch_attn_portable(const pkv_attn_args *a, cudaStream_t stream);
// The MLA kernel (flash_attn_mla.cuh, launched from flash_attn_paged.cu): whether it takes the call (D 576,
// Dv 512, V the latent of K's rows, 16-byte aligned rows), and its launch with the plan's splits.
int attn_mla_fits(const pkv_attn_args *a);
constexpr int kMlaPlanRows = 16, kMlaPlanKeys = 32;  // its query heads per CTA and keys per tile
cudaError_t launch_attn_mla(const pkv_attn_args *a, int num_splits, float *partial_out, float *partial_lse,
                            cudaStream_t stream);
// PTX version the device's binary holds for the loader's kernel, 0 when none (flash_attn_paged.cu).
int loader_kernel_ptx_version(pkv_loader loader);

}  // namespace pkv
