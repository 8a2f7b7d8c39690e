// pagedkv CUDA backend: the host-side plan and the C entry points of
// flash_attn_paged_sparse (pkv_cuda.h). From shapes only (index values live
// on the device and are never read here): whether the tiled kernel serves a
// call (tiled_refusal: dtypes, (D, Dv), FP8 groups; then its shared memory
// against the device's opt-in) or the portable kernel runs, which loader
// stages the listed rows (tma-gather4 where the device, the binary and the
// cache view allow it, else cp.async), the tiled kernel's parameters (V read
// from the K rows, FP8 groups, score scale, shared-memory layout), and why a
// forced loader does not fit. Nothing here instantiates a kernel: the tiled
// kernel and its launch are in flash_attn_paged_sparse.cu, the portable one
// in flash_attn_sparse_portable.cu, reached through flash_attn_sparse.cuh.
#include "../core/pkv_settings.h"
#include "flash_attn_sparse.cuh"

namespace pkv {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

SparseParams sparse_params(const pkv_sparse_args *a) {
  SparseParams p{};
  p.q = pkv_rows_view_from(&a->q);
  p.out = pkv_rows_view_from(&a->out);
  p.k = pkv_cache_view_from(&a->k_cache);
  p.v = pkv_cache_view_from(&a->v_cache);
  if (a->k_scales.defined) p.k_scales = pkv_cache_view_from(&a->k_scales);
  if (a->v_scales.defined) p.v_scales = pkv_cache_view_from(&a->v_scales);
  p.indices = static_cast<const int32_t *>(a->indices.data);
  p.ix_stride_t = a->indices.strides[0], p.ix_stride_h = a->indices.strides[1], p.ix_stride_k = a->indices.strides[2];
  p.ix_heads = a->indices.sizes[1], p.ix_count = a->indices.sizes[2];
  if (a->sinks.defined) {
    p.sinks = static_cast<const float *>(a->sinks.data);
    p.sinks_stride = a->sinks.strides[0];
  }
  p.heads_per_kv = a->q.sizes[1] / a->k_cache.sizes[2];
  p.quant_group = a->quant_group;
  p.score_scale = static_cast<float>(a->scale);
  p.softcap = static_cast<float>(a->softcap);
  p.k_tail_dim = a->k_tail_dim;
  p.k_tail_offset = a->k_tail_offset;
  p.k_elem_bytes = static_cast<int64_t>(pkv_dtype_size(a->k_cache.dtype));
  return p;
}

bool same_view(const pkv_cache_view &a, const pkv_cache_view &b) {
  return a.data == b.data && a.dtype == b.dtype && a.stride_page == b.stride_page &&
         a.stride_token == b.stride_token && a.stride_head == b.stride_head;
}

// V is the first Dv columns of the K rows (and, for FP8, its scales the first groups of K's):
// the K-only / MLA layout, where only K is loaded.
bool v_is_k_prefix(const SparseParams &s) {
  if (!same_view(s.k, s.v) || s.v.head_dim > s.k.head_dim) return false;
  return !pkv_dtype_is_fp8(s.k.dtype) || same_view(s.k_scales, s.v_scales);
}

// Why the tiled kernel cannot serve these arguments, or null when it can (the loader aside).
const char *tiled_refusal(const SparseParams &s) {
  const pkv_dtype kd = s.k.dtype;
  if (s.k_tail_dim != 0) {  // packed MLA rows: e4m3 latent, V from K, a 64-channel rope tail
    const bool packed = kd == PKV_DTYPE_FP8_E4M3 && s.k_tail_dim == kPackedTail && s.k.head_dim == 512 &&
                        s.v.head_dim == 512 && v_is_k_prefix(s) && s.k_tail_offset % 16 == 0;
    return packed ? nullptr : "a K tail other than packed MLA rows'";
  }
  if (kd != s.v.dtype) return "K and V of different dtypes";
  if (kd != PKV_DTYPE_BF16 && kd != PKV_DTYPE_F16 && !pkv_dtype_is_fp8(kd)) return "a float32 cache";
  bool dims = false;
  for (const auto &dd : kTiledHeadDims) dims |= dd[0] == s.k.head_dim && dd[1] == s.v.head_dim;
  if (!dims) return "this (D, Dv) pair (64, 96, 128, 256 or (576, 512))";
  if (pkv_dtype_is_fp8(kd) && s.quant_group % 8 != 0 && s.quant_group < s.k.head_dim)
    return "an FP8 quant_group that is neither a multiple of 8 nor >= D";
  return nullptr;
}

// K's tail as a bf16 view of the K rows (packed MLA rows' rope, k_tail_offset bytes into each row;
// the rows' strides are whole bf16 elements, pkv_kv_format.c checks it); head_dim 0 when none.
pkv_cache_view tail_view(const SparseParams &s) {
  pkv_cache_view t = s.k;
  t.head_dim = s.k_tail_dim;
  if (s.k_tail_dim == 0) return t;
  t.data = static_cast<char *>(s.k.data) + s.k_tail_offset;
  t.dtype = PKV_DTYPE_BF16;
  t.stride_page = s.k.stride_page * s.k_elem_bytes / 2;
  t.stride_token = s.k.stride_token * s.k_elem_bytes / 2;
  t.stride_head = s.k.stride_head * s.k_elem_bytes / 2;
  return t;
}

bool gather4_fits(const SparseParams &s, bool v_from_k) {
  if (!tma_rows_ok(s.k)) return false;
  if (s.k_tail_dim != 0) return v_from_k && tma_rows_ok(tail_view(s));
  if (v_from_k) return true;
  return tma_rows_ok(s.v) && pkv_cache_rows_per_page(&s.k) == pkv_cache_rows_per_page(&s.v);
}

cudaError_t encode_sparse_maps(const SparseParams &s, bool v_from_k, CUtensorMap *kmap, CUtensorMap *vmap) {
  PKV_CUDA_TRY(tma_map_rows(kmap, s.k));
  if (s.k_tail_dim != 0) return tma_map_rows(vmap, tail_view(s));  // V is read from K: vmap maps the tail
  if (v_from_k) {
    *vmap = *kmap;  // unused
    return cudaSuccess;
  }
  return tma_map_rows(vmap, s.v);
}

TiledParams tiled_params(const SparseParams &s) {
  TiledParams p{};
  p.s = s;
  const int64_t heads = s.heads_per_kv;
  p.heads_per_cta = static_cast<int>(heads < kMaxHeads ? heads : kMaxHeads);
  p.v_from_k = v_is_k_prefix(s);
  const bool fp8 = pkv_dtype_is_fp8(s.k.dtype);
  const int es = fp8 ? 1 : 2;
  p.tail = tail_view(s);
  p.kv_aligned = pkv_cache_aligned(&s.k, es, 16) && pkv_cache_aligned(&s.v, es, 16) &&
                 (s.k_tail_dim == 0 || pkv_cache_aligned(&p.tail, 2, 16));
  p.k_groups = fp8 ? static_cast<int>(pkv_num_groups(s.k.head_dim, s.quant_group)) : 0;
  p.v_groups = fp8 ? static_cast<int>(pkv_num_groups(s.v.head_dim, s.quant_group)) : 0;
  p.rows_per_page = pkv_cache_rows_per_page(&s.k);
  if (s.softcap > 0.0f) {
    p.score_scale = s.score_scale / s.softcap;
    p.softcap_log2 = s.softcap * kLog2e;
  } else {
    p.score_scale = s.score_scale * kLog2e;
    p.softcap_log2 = 0.0f;
  }
  p.smem = sparse_smem(static_cast<int>(s.k.head_dim), static_cast<int>(s.v.head_dim), es, p.v_from_k,
                       p.heads_per_cta, p.k_groups, p.v_groups, static_cast<int>(s.k_tail_dim));
  return p;
}

// The setting cuda_sparse = portable forces the portable kernel, so tests can compare both kernels on
// the same arguments.
bool portable_forced() { return pkv_settings_get().cuda_sparse == PKV_CUDA_SPARSE_PORTABLE; }

}  // namespace
}  // namespace pkv

extern "C" {

pkv_status pkv_cuda_sparse_supported(const pkv_sparse_args *a, pkv_error *err) {
  if (a->v_cache.sizes[3] > pkv::kSparsePortableMaxDv)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "flash_attn_paged_sparse: value head size %lld is not supported on CUDA (at most %d)",
                    (long long)a->v_cache.sizes[3], pkv::kSparsePortableMaxDv);
  return PKV_OK;
}

pkv_status pkv_cuda_sparse_plan_make(const pkv_sparse_args *a, int device, int force_loader,
                                     pkv_cuda_sparse_plan *plan, pkv_error *err) {
  using namespace pkv;
  const char *op = "flash_attn_paged_sparse";
  *plan = pkv_cuda_sparse_plan{};
  plan->loader = PKV_LOADER_CP_ASYNC;
  const SparseParams s = sparse_params(a);
  const bool forced = force_loader >= 0;
  if (forced && force_loader != PKV_LOADER_CP_ASYNC && force_loader != PKV_LOADER_TMA_GATHER4)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader %s does not fit this call on CUDA (the sparse kernel "
                    "loads listed rows with cp.async or tma-gather4)", op,
                    pkv_loader_name(static_cast<pkv_loader>(force_loader)));
  if (!forced && portable_forced()) return PKV_OK;

  const char *why = tiled_refusal(s);
  const TiledParams p = tiled_params(s);
  if (why == nullptr && p.smem.bytes + 1024 > device_smem_optin(device)) why = "too little shared memory per block";
  if (why != nullptr) {
    if (!forced) return PKV_OK;  // the portable kernel
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader %s does not fit this call on CUDA (the tiled kernel does "
                    "not serve %s)", op, pkv_loader_name(static_cast<pkv_loader>(force_loader)), why);
  }
  // gather4: what the dense plan asks of it (cc 10.x and sm_100a code in the binary, probed on
  // flash_attn_paged's gather4 kernel: every .cu is built for the same targets; 16-byte strides,
  // whole 128-byte head rows, rows < 2^31), else cp.async
  pkv_loader loader = PKV_LOADER_CP_ASYNC;
  const bool want_gather4 = forced ? force_loader == PKV_LOADER_TMA_GATHER4 : true;
  if (want_gather4) {
    CUtensorMap kmap, vmap;
    const bool ok = pkv_cuda_loader_available(device, PKV_LOADER_TMA_GATHER4) && gather4_fits(s, p.v_from_k) &&
                    encode_sparse_maps(s, p.v_from_k, &kmap, &vmap) == cudaSuccess;
    if (ok)
      loader = PKV_LOADER_TMA_GATHER4;
    else if (forced)
      return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader tma-gather4 %s on CUDA device %d", op,
                      pkv_cuda_loader_available(device, PKV_LOADER_TMA_GATHER4) ? "does not fit this cache view"
                                                                                : "is not available",
                      device);
  }
  if (loader == PKV_LOADER_CP_ASYNC && !pkv_cuda_loader_available(device, PKV_LOADER_CP_ASYNC)) {
    if (!forced) return PKV_OK;
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader cp.async is not available on CUDA device %d", op, device);
  }
  plan->tiled = 1;
  plan->loader = loader;
  plan->smem_bytes = p.smem.bytes + 1024;
  return PKV_OK;
}

cudaError_t pkv_cuda_sparse_run(const pkv_sparse_args *a, const pkv_cuda_sparse_plan *plan, cudaStream_t stream) {
  using namespace pkv;
  const SparseParams s = sparse_params(a);
  if (s.q.num_rows == 0) return cudaSuccess;
  if (!plan->tiled) return launch_sparse_portable(s, stream);
  const TiledParams p = tiled_params(s);
  CUtensorMap kmap{}, vmap{};
  if (plan->loader == PKV_LOADER_TMA_GATHER4) PKV_CUDA_TRY(encode_sparse_maps(s, p.v_from_k, &kmap, &vmap));
  return launch_sparse_tiled(p, plan->loader, kmap, vmap, stream);
}

cudaError_t pkv_cuda_sparse(const pkv_sparse_args *a, cudaStream_t stream) {
  int device = 0;
  PKV_CUDA_TRY(cudaGetDevice(&device));
  pkv_cuda_sparse_plan plan;
  pkv_error err{};
  if (pkv_cuda_sparse_plan_make(a, device, -1, &plan, &err) != PKV_OK) plan = pkv_cuda_sparse_plan{};
  return pkv_cuda_sparse_run(a, &plan, stream);
}

}  // extern "C"
