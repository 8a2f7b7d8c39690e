// pagedkv CUDA backend: the host-side plan of flash_attn_paged. From shapes
// only (index values live on the device and are never read here): which K/V
// tile loader runs (what the device and the fat binary support, and what the
// cache view fits), the tensor maps of the TMA loaders, and how many KV
// splits a decode-like call needs to fill the SMs. The kernel is in
// flash_attn_paged_kernel.cuh, its launcher in flash_attn_paged.cu.
#include <mutex>

#include "../core/pkv_settings.h"
#include "flash_attn.cuh"

namespace pkv {
namespace {

// What the plan needs from a device: its compute capability, SM count and
// which loaders were compiled for it. None of it changes while the process
// runs, and querying it (device count, attributes, cudaFuncGetAttributes
// under a device switch) cost tens of microseconds of host time on every
// decode step, so it is read once per device.
struct DeviceInfo {
  bool present = false;  // a device with this index exists and answered
  int major = 0, sms = 0;
  bool loader_ok[PKV_LOADER_COUNT] = {};
  bool wgmma_ok = false;  // cc 9.x running code built for sm_90a (the warpgroup-MMA kernels)
};

bool loader_runs(pkv_loader loader, int major, int ptx) {
  switch (loader) {
  case PKV_LOADER_CP_ASYNC: return major >= 8 && ptx >= 80;
  case PKV_LOADER_TMA_PAGES: return major == 9 && ptx >= 90 && ptx < 100;
  case PKV_LOADER_TMA_GATHER4: return major == 10 && ptx >= 100;
  default: return false;
  }
}

DeviceInfo query_device(int device) {
  DeviceInfo info;
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count ||
      cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    (void)cudaGetLastError();
    return DeviceInfo{};
  }
  info.present = true;
  // cudaFuncGetAttributes answers for the current device: switch to it for
  // the probe and back, so the caller's current device is untouched.
  int previous = 0;
  cudaGetDevice(&previous);
  if (previous != device) cudaSetDevice(device);
  for (int l = 0; l < PKV_LOADER_COUNT; l++) {
    const pkv_loader loader = static_cast<pkv_loader>(l);
    info.loader_ok[l] = loader_runs(loader, info.major, loader_kernel_ptx_version(loader));
  }
  info.wgmma_ok = info.major == 9 && wgmma_kernels_compiled() == 1;
  if (previous != device) cudaSetDevice(previous);
  return info;
}

constexpr int kCachedDevices = 64;  // device indices past this are queried on every call
DeviceInfo g_device_info[kCachedDevices];
std::once_flag g_device_once[kCachedDevices];

DeviceInfo device_info(int device) {
  if (device < 0 || device >= kCachedDevices) return query_device(device);
  std::call_once(g_device_once[device], [device] { g_device_info[device] = query_device(device); });
  return g_device_info[device];
}

// The plan of a tiled kernel (the dense one or the MLA one) from its split rule's count: the setting
// cuda_splits = n (PAGEDKV_CUDA_SPLITS=n) forces n splits (1: none), for tests (the rule spreads keys so
// thin that a CTA rarely runs more than two key tiles, which leaves the pipeline's buffer reuse and
// barrier parity flips untested); then at most one split per key tile and kMaxSplits.
void fill_split_plan(pkv_cuda_attn_plan *plan, int device, int sms, pkv_loader loader, int64_t splits,
                     int64_t max_key_tiles, const pkv_attn_args *a) {
  const pkv_settings settings = pkv_settings_get();
  if (settings.cuda_splits >= 1) splits = settings.cuda_splits;
  if (splits > max_key_tiles) splits = max_key_tiles;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits < 1) splits = 1;
  const int64_t t = a->q.sizes[0], hq = a->q.sizes[1], dv = a->v_cache.sizes[3];
  *plan = pkv_cuda_attn_plan{};
  plan->device = device;
  plan->num_sms = sms;
  plan->loader = loader;
  plan->num_splits = static_cast<int>(splits);
  plan->partial_out_floats = splits > 1 ? splits * t * hq * dv : 0;
  plan->partial_lse_floats = splits > 1 ? splits * t * hq : 0;
}

}  // namespace

bool loader_fits(pkv_loader loader, const pkv_cache_view &k, const pkv_cache_view &v) {
  switch (loader) {
  case PKV_LOADER_CP_ASYNC: return true;
  case PKV_LOADER_TMA_PAGES:
    return tma_view_ok(k) && tma_view_ok(v) && tma_box_rows(k.page_size, tile_keys_for(k.head_dim)) > 0;
  case PKV_LOADER_TMA_GATHER4:
    return tma_rows_ok(k) && tma_rows_ok(v) && pkv_cache_rows_per_page(&k) == pkv_cache_rows_per_page(&v);
  default: return false;
  }
}

cudaError_t encode_maps(pkv_loader loader, const pkv_cache_view &k, const pkv_cache_view &v, CUtensorMap *kmap,
                        CUtensorMap *vmap) {
  if (loader == PKV_LOADER_TMA_PAGES) {
    const int rows = tma_box_rows(k.page_size, tile_keys_for(k.head_dim));
    PKV_CUDA_TRY(tma_map_pages(kmap, k, rows));
    return tma_map_pages(vmap, v, rows);
  }
  if (loader == PKV_LOADER_TMA_GATHER4) {
    PKV_CUDA_TRY(tma_map_rows(kmap, k));
    return tma_map_rows(vmap, v);
  }
  return cudaSuccess;
}

}  // namespace pkv

extern "C" {

const char *pkv_loader_name(pkv_loader loader) {
  switch (loader) {
  case PKV_LOADER_CP_ASYNC: return "cp.async";
  case PKV_LOADER_TMA_PAGES: return "tma-pages";
  case PKV_LOADER_TMA_GATHER4: return "tma-gather4";
  default: return "unknown";
  }
}

int pkv_cuda_loader_available(int device, pkv_loader loader) {
  if (loader < 0 || loader >= PKV_LOADER_COUNT) return 0;
  return pkv::device_info(device).loader_ok[loader] ? 1 : 0;
}

int pkv_cuda_wgmma_available(int device) { return pkv::device_info(device).wgmma_ok ? 1 : 0; }

pkv_status pkv_cuda_attn_plan_make(const pkv_attn_args *a, int device, int force_loader, pkv_cuda_attn_plan *plan,
                                   pkv_error *err) {
  const char *op = "flash_attn_paged";
  const pkv_dtype qd = a->q.dtype, kd = a->k_cache.dtype, vd = a->v_cache.dtype;
  // a float32 cache first: with it the shim passes float32 queries on as they are, and the q message
  // below would blame them
  if (kd == PKV_DTYPE_F32 || vd == PKV_DTYPE_F32)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "%s: float32 caches are not supported on CUDA (float16, bfloat16, float8_e4m3fn or "
                    "float8_e5m2)",
                    op);
  if (qd != PKV_DTYPE_BF16 && qd != PKV_DTYPE_F16)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: q dtype %s is not supported on CUDA (use float16 or bfloat16)", op,
                    pkv_dtype_name(qd));
  if (kd != vd)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "%s: k_cache (%s) and v_cache (%s) of different dtypes are not supported on CUDA", op,
                    pkv_dtype_name(kd), pkv_dtype_name(vd));
  if (!pkv_dtype_is_fp8(kd) && kd != qd)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "%s: a %s cache with %s queries is not supported on CUDA (the cache must have q's dtype or be "
                    "float8_e4m3fn/float8_e5m2)",
                    op, pkv_dtype_name(kd), pkv_dtype_name(qd));
  const int64_t d = a->k_cache.sizes[3], dv = a->v_cache.sizes[3];
  // The tiled kernels take D == Dv of 64, 96, 128 or 256 without a K tail; the portable one the rest
  // (MLA's 576 / 512 and packed rows) up to 576
  const bool portable = a->k_tail_dim != 0 || d != dv || (d != 64 && d != 96 && d != 128 && d != 256);
  if (portable && !pkv::attn_portable_fits(a))
    return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                    "%s: head sizes D = %lld, Dv = %lld are not supported on CUDA (D == Dv of 64, 96, 128 or 256, "
                    "or any D and Dv up to 576)",
                    op, (long long)a->q.sizes[2], (long long)dv);
  if (a->q.sizes[0] > (int64_t(1) << 31) / 2)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: more than 2^30 query rows are not supported on CUDA", op);

  pkv_cache_view k = pkv_cache_view_from(&a->k_cache), v = pkv_cache_view_from(&a->v_cache);
  const pkv::DeviceInfo info = pkv::device_info(device);
  if (!info.present) return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: cannot query CUDA device %d", op, device);
  const int major = info.major, sms = info.sms;
  if (major < 8)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: compute capability %d.x is not supported on CUDA (needs sm_80+)",
                    op, major);
  const bool mla = portable && pkv::attn_mla_fits(a);
  if (mla) {  // one latent head read once per tile for 16 query heads (cp.async tiles)
    if (force_loader >= 0 && force_loader != PKV_LOADER_CP_ASYNC)
      return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                      "%s: loader %s does not fit this call on CUDA (it runs on the MLA kernel, which loads with "
                      "cp.async)",
                      op, pkv_loader_name(static_cast<pkv_loader>(force_loader)));
    const int64_t t = a->q.sizes[0], hq = a->q.sizes[1], hk = a->k_cache.sizes[2];
    const int64_t ctas = t * hk * ((hq / hk + pkv::kMlaPlanRows - 1) / pkv::kMlaPlanRows);
    const int64_t max_key_tiles =
        (a->lookup_table.sizes[1] * a->k_cache.sizes[1] + pkv::kMlaPlanKeys - 1) / pkv::kMlaPlanKeys;
    // splits while (token, head block) CTAs leave SMs without two CTAs each (two fit by shared memory),
    // rounded down: one wave of CTAs, not a second one nearly empty
    const int64_t splits = ctas > 0 && ctas < 2 * (int64_t)sms ? 2 * (int64_t)sms / ctas : 1;
    pkv::fill_split_plan(plan, device, sms, PKV_LOADER_CP_ASYNC, splits, max_key_tiles, a);
    plan->mla = 1;
    return PKV_OK;
  }
  if (portable) {
    // (a forced loader is a test's request for tiles: the portable kernel loads none)
    if (force_loader >= 0)
      return pkv_fail(err, PKV_ERR_UNSUPPORTED,
                      "%s: loader %s does not fit this call on CUDA (it runs on the portable kernel, which loads "
                      "no tiles)",
                      op, pkv_loader_name(static_cast<pkv_loader>(force_loader)));
    *plan = pkv_cuda_attn_plan{};
    plan->device = device;
    plan->num_sms = sms;
    plan->loader = PKV_LOADER_CP_ASYNC;
    plan->num_splits = 1;
    plan->portable = 1;
    return PKV_OK;
  }

  pkv_loader loader = PKV_LOADER_CP_ASYNC;
  CUtensorMap kmap, vmap;
  if (force_loader >= 0) {
    loader = static_cast<pkv_loader>(force_loader);
    if (force_loader >= PKV_LOADER_COUNT || !pkv_cuda_loader_available(device, loader))
      return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader %s is not available on CUDA device %d", op,
                      pkv_loader_name(loader), device);
    if (!pkv::loader_fits(loader, k, v) || pkv::encode_maps(loader, k, v, &kmap, &vmap) != cudaSuccess)
      return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader %s does not fit this cache view on CUDA", op,
                      pkv_loader_name(loader));
  } else {
    const pkv_loader order[2] = {PKV_LOADER_TMA_GATHER4, PKV_LOADER_TMA_PAGES};
    for (pkv_loader l : order)
      if (pkv_cuda_loader_available(device, l) && pkv::loader_fits(l, k, v) &&
          pkv::encode_maps(l, k, v, &kmap, &vmap) == cudaSuccess) {
        loader = l;
        break;
      }
  }

  // Split-KV only when (estimated) tiles x KV heads leave SMs idle. Estimated
  // from shapes: index values live on the device and are never read here.
  const int64_t t = a->q.sizes[0], hq = a->q.sizes[1], hk = a->k_cache.sizes[2];
  const int64_t batch = a->cache_lengths.sizes[0], heads_per_kv = hq / hk;
  int64_t tiles = (t * heads_per_kv + pkv::kAttnRowsM - 1) / pkv::kAttnRowsM;
  tiles = tiles > batch ? tiles : batch;
  const int64_t ctas = (tiles > 0 ? tiles : 1) * hk;
  const int64_t max_key_tiles =
      (a->lookup_table.sizes[1] * a->k_cache.sizes[1] + pkv::tile_keys_for(d) - 1) / pkv::tile_keys_for(d);
  int64_t splits = 1;
  if (ctas < sms) splits = (2 * (int64_t)sms + ctas - 1) / ctas;
  pkv::fill_split_plan(plan, device, sms, loader, splits, max_key_tiles, a);
  // the warpgroup-MMA kernels (opt-in, not yet run on a GPU): calls whose packed rows fill their 64-row
  // query tiles (prefill, chunked prefill, several new tokens per row with GQA) at D 64 or 128, on an
  // sm_90a build running on a cc 9.x device, with the loaders such a device has
  plan->wgmma = pkv_settings_get().cuda_prefill_wgmma && info.wgmma_ok && (d == 64 || d == 128) &&
                (loader == PKV_LOADER_CP_ASYNC || loader == PKV_LOADER_TMA_PAGES) &&
                pkv::fills_query_tiles(t, heads_per_kv, batch, pkv::kAttnRowsM);
  return PKV_OK;
}

}  // extern "C"
