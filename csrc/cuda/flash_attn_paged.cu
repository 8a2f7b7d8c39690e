// pagedkv CUDA backend: flash_attn_paged (decode, prefill, chunked prefill).
//
// One CTA = (tile of packed query rows of one batch row, KV head, KV split).
// Packed rows are (query row, query head of this KV head) pairs, so all query
// heads that share a KV head use one K/V tile (GQA): K/V are read once per
// tile, not once per query head. 4 warps each own 16 packed rows; QK^T and
// PV use mma.sync m16n8k16 with fp32 accumulators and an online softmax in
// the log2 domain. A tile of <= 16 packed rows (decode) is a key split
// instead: every warp takes those rows over a quarter of each K/V tile, and
// the four softmax states are folded at the end (fold_warp_states). K/V tiles
// are double-buffered; the loader (cp.async, TMA box per page chunk, TMA
// gather4) only changes how a tile is filled.
//
// Decode-like calls with too few tiles to fill the GPU split the keys of each
// tile over num_splits CTAs; each writes a normalised partial output and its
// log-sum-exp to scratch, and a combine kernel merges them. The host-side
// plan (loader choice, split count) is in flash_attn_plan.cu.
//
// Files: flash_attn_paged_params.cuh (parameters, shared-memory layout, tile location, the key
// split's fold), flash_attn_paged_kernel.cuh (the kernel body, the kernel, the split-KV combine),
// this file (the launcher: the opt-in paths' settings, loader / head size / tile rows dispatch, the C
// entry point). The headers are included here only, so the kernels are one translation unit.
//
// Bounds: index values are never trusted. Rows are clamped to [0, T), page
// ids outside [0, N) and keys past the lookup table are masked (never read),
// the tail of a row's last page is zeroed in shared memory before PV, so
// garbage or NaN in unused cache slots never reaches the output.
#include "flash_attn_mla.cuh"
#include "flash_attn_paged_kernel.cuh"

namespace pkv {
namespace {

// Merges the split-KV partials that p names (one warp per (row, query head)).
template <typename T>
cudaError_t launch_combine(const AttnParams &p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.num_rows * p.q.num_heads + 3) / 4);
  if (blocks > 0) attn_combine_kernel<T><<<blocks, 128, 0, stream>>>(p);
  return cudaGetLastError();
}

template <int D, typename T, bool kFp8, int kLoader, int kBM, bool kWgmma = false>
cudaError_t launch_attn(const AttnParams &p, const CUtensorMap &kmap, const CUtensorMap &vmap, dim3 grid,
                        cudaStream_t stream) {
  using L = AttnLayout<D, kFp8, kBM>;
  constexpr auto kernel = attn_kernel<D, T, kFp8, kLoader, kBM, kWgmma>;
  PKV_CUDA_TRY(shared_memory_opt_in<kernel>([](int) { return L::kAllocBytes; }));
  kernel<<<grid, kAttnThreads, L::kAllocBytes, stream>>>(p, kmap, vmap);
  PKV_CUDA_TRY(cudaGetLastError());
  return p.num_splits > 1 ? launch_combine<T>(p, stream) : cudaSuccess;
}

template <int D, typename T, bool kFp8, int kBM>
cudaError_t dispatch_loader(const AttnParams &p, pkv_loader loader, const CUtensorMap &kmap,
                            const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  switch (loader) {
  case PKV_LOADER_CP_ASYNC: return launch_attn<D, T, kFp8, PKV_LOADER_CP_ASYNC, kBM>(p, kmap, vmap, grid, stream);
  case PKV_LOADER_TMA_PAGES: return launch_attn<D, T, kFp8, PKV_LOADER_TMA_PAGES, kBM>(p, kmap, vmap, grid, stream);
  case PKV_LOADER_TMA_GATHER4:
    return launch_attn<D, T, kFp8, PKV_LOADER_TMA_GATHER4, kBM>(p, kmap, vmap, grid, stream);
  default: return cudaErrorInvalidValue;
  }
}

// kBM = kAttnRowsM32 (128-row query tiles, two m-blocks per warp) is launched for 16-bit caches with
// D <= 128 only: D 256's output fragments alone would take 256 registers per thread, and FP8's
// conversion buffers would not leave room for two CTAs per SM
template <typename T, bool kFp8, int kBM = kAttnRowsM>
cudaError_t dispatch_head_dim(const AttnParams &p, int64_t d, pkv_loader loader, const CUtensorMap &kmap,
                              const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  switch (d) {
  case 64: return dispatch_loader<64, T, kFp8, kBM>(p, loader, kmap, vmap, grid, stream);
  case 96: return dispatch_loader<96, T, kFp8, kBM>(p, loader, kmap, vmap, grid, stream);
  case 128: return dispatch_loader<128, T, kFp8, kBM>(p, loader, kmap, vmap, grid, stream);
  case 256:
    if constexpr (kBM == kAttnRowsM) return dispatch_loader<256, T, kFp8, kBM>(p, loader, kmap, vmap, grid, stream);
    return cudaErrorInvalidValue;
  default: return cudaErrorInvalidValue;
  }
}

// The warpgroup-MMA kernels (plan->wgmma: sm_90a, prefill-like calls, D 64 or 128; the plan picks only
// the cp.async or tma-pages loader for them, the loaders of a cc 9.x device).
template <int D, typename T, bool kFp8>
cudaError_t launch_wgmma(const AttnParams &p, pkv_loader loader, const CUtensorMap &kmap, const CUtensorMap &vmap,
                         dim3 grid, cudaStream_t stream) {
  if (loader == PKV_LOADER_TMA_PAGES)
    return launch_attn<D, T, kFp8, PKV_LOADER_TMA_PAGES, kAttnRowsM, true>(p, kmap, vmap, grid, stream);
  if (loader == PKV_LOADER_CP_ASYNC)
    return launch_attn<D, T, kFp8, PKV_LOADER_CP_ASYNC, kAttnRowsM, true>(p, kmap, vmap, grid, stream);
  return cudaErrorInvalidValue;
}
template <typename T, bool kFp8>
cudaError_t dispatch_wgmma(const AttnParams &p, int64_t d, pkv_loader loader, const CUtensorMap &kmap,
                           const CUtensorMap &vmap, dim3 grid, cudaStream_t stream) {
  if (d == 64) return launch_wgmma<64, T, kFp8>(p, loader, kmap, vmap, grid, stream);
  if (d == 128) return launch_wgmma<128, T, kFp8>(p, loader, kmap, vmap, grid, stream);
  return cudaErrorInvalidValue;
}

// 1 in the code built for a target with wgmma (sm_90a), else 0: the plan reads the copy of the module the
// device runs (wgmma_kernels_compiled), since the kernels of other targets are trapping stubs.
__device__ int g_wgmma_compiled = PKV_WGMMA;

}  // namespace

int wgmma_kernels_compiled() {
  int compiled = 0;
  if (cudaMemcpyFromSymbol(&compiled, g_wgmma_compiled, sizeof(compiled)) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return compiled;
}

int attn_mla_fits(const pkv_attn_args *a) {
  const pkv_tensor &q = a->q, &k = a->k_cache, &v = a->v_cache, &ks = a->k_scales, &vs = a->v_scales;
  if ((q.dtype != PKV_DTYPE_BF16 && q.dtype != PKV_DTYPE_F16) || q.sizes[2] != kMlaD || v.sizes[3] != kMlaDv)
    return 0;
  const bool fp8 = pkv_dtype_is_fp8(k.dtype);
  if (fp8 ? (k.sizes[3] != kMlaLatent || a->k_tail_dim != kMlaRope || !ks.defined)
          : (k.dtype != q.dtype || k.sizes[3] != kMlaD || a->k_tail_dim != 0))
    return 0;
  if (fp8 && a->quant_group < kMlaLatent && a->quant_group % 8 != 0) return 0;  // a scale per 8 channels
  // V must be the latent of K's rows (the kernel reads V from the K tile): same memory, same scales
  if (v.data != k.data || v.dtype != k.dtype) return 0;
  for (int i = 0; i < 3; i++)
    if (v.sizes[i] != k.sizes[i] || v.strides[i] != k.strides[i]) return 0;
  if (ks.defined != vs.defined || (ks.defined && ks.data != vs.data)) return 0;
  if (ks.defined)
    for (int i = 0; i < 4; i++)
      if (vs.sizes[i] != ks.sizes[i] || vs.strides[i] != ks.strides[i]) return 0;
  // 16-byte rows: Q and K (cp.async, vector loads), the rope's start
  const pkv_rows_view qv = pkv_rows_view_from(&q);
  const pkv_cache_view kv = pkv_cache_view_from(&k);
  const int64_t es = fp8 ? 1 : 2;
  return pkv_rows_aligned(&qv, 2, 16) && pkv_cache_aligned(&kv, es, 16) && a->k_tail_offset % 16 == 0 &&
         k.strides[3] == 1;
}

namespace {
template <typename T, bool kFp8, bool kE4m3>
cudaError_t launch_mla_kernel(const MlaParams &p, dim3 grid, cudaStream_t stream) {
  constexpr int kAlloc = MlaLayout<kFp8>::kBytes + 1024;  // + the 1024-byte alignment of smem_align_1024
  constexpr auto kernel = attn_mla_kernel<T, kFp8, kE4m3>;
  PKV_CUDA_TRY(shared_memory_opt_in<kernel>([](int) { return kAlloc; }));
  kernel<<<grid, kMlaThreads, kAlloc, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_mla_for(const pkv_attn_args *a, const MlaParams &p, dim3 grid, cudaStream_t stream) {
  switch (a->k_cache.dtype) {
  case PKV_DTYPE_FP8_E4M3: return launch_mla_kernel<T, true, true>(p, grid, stream);
  case PKV_DTYPE_FP8_E5M2: return launch_mla_kernel<T, true, false>(p, grid, stream);
  default: return launch_mla_kernel<T, false, false>(p, grid, stream);
  }
}
}  // namespace

cudaError_t launch_attn_mla(const pkv_attn_args *a, int num_splits, float *partial_out, float *partial_lse,
                            cudaStream_t stream) {
  MlaParams p{};
  p.q = pkv_rows_view_from(&a->q);
  p.out = pkv_rows_view_from(&a->out);
  p.k = pkv_kv_cache_from(&a->k_cache, &a->k_scales, a->quant_group, a->k_tail_dim, a->k_tail_offset);
  p.offsets = pkv_index_view_from(&a->input_row_offsets);
  p.lengths = pkv_index_view_from(&a->cache_lengths);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.num_rows = a->q.sizes[0];
  p.heads_per_kv = a->q.sizes[1] / a->k_cache.sizes[2];
  p.head_blocks = (p.heads_per_kv + kMlaRows - 1) / kMlaRows;
  p.window_left = a->window_left;
  p.softcap_log2 = a->softcap > 0.0 ? static_cast<float>(a->softcap) * 1.4426950408889634f : 0.0f;
  p.score_scale = a->softcap > 0.0 ? static_cast<float>(a->scale / a->softcap)
                                   : static_cast<float>(a->scale) * 1.4426950408889634f;
  p.causal = a->causal;
  p.num_splits = num_splits;
  p.out_aligned = pkv_rows_aligned(&p.out, 2, 4);
  p.partial_out = partial_out;
  p.partial_lse = partial_lse;
  set_sinks_and_lse(p, a);
  if (p.num_rows == 0) return cudaSuccess;
  if (num_splits > 1 && (partial_out == nullptr || partial_lse == nullptr)) return cudaErrorInvalidValue;
  const int64_t blocks_y = a->k_cache.sizes[2] * p.head_blocks;
  if (p.num_rows > 0x7fffffff || blocks_y > 65535) return cudaErrorInvalidConfiguration;
  const dim3 grid(static_cast<unsigned>(p.num_rows), static_cast<unsigned>(blocks_y), static_cast<unsigned>(num_splits));
  const bool bf16 = a->q.dtype == PKV_DTYPE_BF16;
  PKV_CUDA_TRY(bf16 ? launch_mla_for<__nv_bfloat16>(a, p, grid, stream) : launch_mla_for<__half>(a, p, grid, stream));
  if (num_splits == 1) return cudaSuccess;
  // the splits' partials merged by flash_attn_paged's combine kernel, which reads these fields
  AttnParams c{};
  c.q = p.q;
  c.out = p.out;
  c.v = pkv_cache_view_from(&a->v_cache);  // head_dim: Dv
  c.offsets = p.offsets;
  c.num_rows = p.num_rows;
  c.num_splits = num_splits;
  c.partial_out = partial_out;
  c.partial_lse = partial_lse;
  set_sinks_and_lse(c, a);
  return bf16 ? launch_combine<__nv_bfloat16>(c, stream) : launch_combine<__half>(c, stream);
}

// Kernels probed for "was this loader compiled for the device": the bf16,
// D = 128 instantiation stands for all (same #if guards).
int loader_kernel_ptx_version(pkv_loader loader) {
  cudaFuncAttributes attr{};
  cudaError_t e = cudaErrorInvalidValue;
  switch (loader) {
  case PKV_LOADER_CP_ASYNC:
    e = cudaFuncGetAttributes(&attr, attn_kernel<128, __nv_bfloat16, false, PKV_LOADER_CP_ASYNC>);
    break;
  case PKV_LOADER_TMA_PAGES:
    e = cudaFuncGetAttributes(&attr, attn_kernel<128, __nv_bfloat16, false, PKV_LOADER_TMA_PAGES>);
    break;
  case PKV_LOADER_TMA_GATHER4:
    e = cudaFuncGetAttributes(&attr, attn_kernel<128, __nv_bfloat16, false, PKV_LOADER_TMA_GATHER4>);
    break;
  default: break;
  }
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return attr.ptxVersion;
}

}  // namespace pkv

extern "C" {

cudaError_t pkv_cuda_attn(const pkv_attn_args *a, const pkv_cuda_attn_plan *plan, float *partial_out,
                          float *partial_lse, cudaStream_t stream) {
  using namespace pkv;
  if (plan->portable) return launch_attn_portable(a, stream);
  if (plan->mla) return launch_attn_mla(a, plan->num_splits, partial_out, partial_lse, stream);
  AttnParams p{};
  p.q = pkv_rows_view_from(&a->q);
  p.out = pkv_rows_view_from(&a->out);
  p.k = pkv_cache_view_from(&a->k_cache);
  p.v = pkv_cache_view_from(&a->v_cache);
  if (a->k_scales.defined) p.k_scales = pkv_cache_view_from(&a->k_scales);
  if (a->v_scales.defined) p.v_scales = pkv_cache_view_from(&a->v_scales);
  p.offsets = pkv_index_view_from(&a->input_row_offsets);
  p.lengths = pkv_index_view_from(&a->cache_lengths);
  p.table = pkv_index_view_from(&a->lookup_table);
  p.num_rows = a->q.sizes[0];
  p.heads_per_kv = a->q.sizes[1] / a->k_cache.sizes[2];
  p.quant_group = a->quant_group;
  p.window_left = a->window_left;
  p.rows_per_page = pkv_cache_rows_per_page(&p.k);
  if (a->softcap > 0.0) {
    p.score_scale = static_cast<float>(a->scale / a->softcap);
    p.softcap_log2 = static_cast<float>(a->softcap) * kLog2e;
  } else {
    p.score_scale = static_cast<float>(a->scale) * kLog2e;
    p.softcap_log2 = 0.0f;
  }
  p.causal = a->causal;
  p.num_splits = plan->num_splits;
  p.e4m3 = a->k_cache.dtype == PKV_DTYPE_FP8_E4M3;
  const int64_t kv_es = pkv_dtype_is_fp8(a->k_cache.dtype) ? 1 : 2;
  p.q_aligned = pkv_rows_aligned(&p.q, 2, 16);
  p.out_aligned = pkv_rows_aligned(&p.out, 2, 4);  // 16-bit pairs stored as one word
  p.kv_aligned = pkv_cache_aligned(&p.k, kv_es, 16) && pkv_cache_aligned(&p.v, kv_es, 16);
  p.box_rows = tma_box_rows(p.k.page_size, tile_keys_for(p.k.head_dim));
  p.partial_out = partial_out;
  p.partial_lse = partial_lse;
  set_sinks_and_lse(p, a);
  if (p.num_rows == 0) return cudaSuccess;
  if (plan->num_splits > 1 && (partial_out == nullptr || partial_lse == nullptr)) return cudaErrorInvalidValue;

  CUtensorMap kmap{}, vmap{};
  PKV_CUDA_TRY(encode_maps(plan->loader, p.k, p.v, &kmap, &vmap));

  const int64_t batch = p.lengths.rows;
  const int64_t d = p.k.head_dim;
  const bool fp8 = pkv_dtype_is_fp8(a->k_cache.dtype);
  // 128-row query tiles, 32 rows per warp in two m-blocks, for prefill-like calls (decode rows keep the
  // 64-row tiles and their key split) on 16-bit caches with D <= 128, faster there than 64-row tiles
  // (measured: benchmarks/README.md, "Measurements behind the CUDA kernels"); the warpgroup kernels take 64-row tiles
  const bool rows32 =
      !plan->wgmma && !fp8 && d <= 128 && fills_query_tiles(p.num_rows, p.heads_per_kv, batch, kAttnRowsM32);
  const int64_t rows_m = rows32 ? kAttnRowsM32 : kAttnRowsM;
  // (16-row query tiles for decode, three CTAs per SM, were slower than these 64-row ones with the key
  // split: benchmarks/README.md, "Tried and not kept")
  const int64_t tiles_upper = (p.num_rows * p.heads_per_kv + rows_m - 1) / rows_m + batch;
  if (tiles_upper > 0x7fffffff || p.k.num_heads > 65535) return cudaErrorInvalidConfiguration;
  dim3 grid(static_cast<unsigned>(tiles_upper), static_cast<unsigned>(p.k.num_heads),
            static_cast<unsigned>(plan->num_splits));
  if (plan->wgmma) {
    if (a->q.dtype == PKV_DTYPE_BF16)
      return fp8 ? dispatch_wgmma<__nv_bfloat16, true>(p, d, plan->loader, kmap, vmap, grid, stream)
                 : dispatch_wgmma<__nv_bfloat16, false>(p, d, plan->loader, kmap, vmap, grid, stream);
    return fp8 ? dispatch_wgmma<__half, true>(p, d, plan->loader, kmap, vmap, grid, stream)
               : dispatch_wgmma<__half, false>(p, d, plan->loader, kmap, vmap, grid, stream);
  }
  if (rows32)
    return a->q.dtype == PKV_DTYPE_BF16
               ? dispatch_head_dim<__nv_bfloat16, false, kAttnRowsM32>(p, d, plan->loader, kmap, vmap, grid, stream)
               : dispatch_head_dim<__half, false, kAttnRowsM32>(p, d, plan->loader, kmap, vmap, grid, stream);
  if (a->q.dtype == PKV_DTYPE_BF16)
    return fp8 ? dispatch_head_dim<__nv_bfloat16, true>(p, d, plan->loader, kmap, vmap, grid, stream)
               : dispatch_head_dim<__nv_bfloat16, false>(p, d, plan->loader, kmap, vmap, grid, stream);
  return fp8 ? dispatch_head_dim<__half, true>(p, d, plan->loader, kmap, vmap, grid, stream)
             : dispatch_head_dim<__half, false>(p, d, plan->loader, kmap, vmap, grid, stream);
}

}  // extern "C"
