// pagedkv torch shims: CUDA implementations. Same core checks as the CPU
// (descriptor checks always; index values on the host only when
// PAGEDKV_CHECK=1 / pagedkv.set_checks(True), which costs a device->host
// copy and therefore a sync), then one launch on the current stream
// (c10::cuda::getCurrentCUDAStream, the stream at::cuda hands out; ATen's
// CUDAContext.h is avoided because it pulls in cuSPARSE/cuBLAS headers). No
// host synchronisation otherwise, so the ops are CUDA-graph capturable.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <atomic>
#include <initializer_list>
#include <utility>
#include <vector>

#include "../core/pkv_settings.h"
#include "../cuda/pkv_cuda.h"
#include "pkv_args.h"
#include "pkv_cuda_shim.h"

namespace pagedkv {

static_assert(PKV_LOADER_COUNT == PKV_SETTINGS_LOADER_COUNT, "pkv_settings.h counts the CUDA loaders");

// The forced loader: the core settings' `cuda_loader`.
void set_cuda_loader(int loader) {
  pkv_settings s = pkv_settings_get();
  s.cuda_loader = loader;
  pkv_error err{};
  TORCH_CHECK(pkv_settings_set(&s, &err) == PKV_OK, "pagedkv: ", err.message);
}
int cuda_loader() { return pkv_settings_get().cuda_loader; }
bool cuda_loader_available(int device, int loader) {
  if (loader < 0 || loader >= PKV_LOADER_COUNT) return false;
  return pkv_cuda_loader_available(device, static_cast<pkv_loader>(loader)) != 0;
}
bool cuda_wgmma_available(int device) { return pkv_cuda_wgmma_available(device) != 0; }

namespace {

// A host copy of an index tensor, described with the original device so the
// core's same-device rules still hold; `keep` owns the memory.
pkv_tensor host_index(const at::Tensor &t, std::vector<at::Tensor> &keep) {
  keep.push_back(t.cpu());
  pkv_tensor d = describe(keep.back());
  d.device = to_pkv_device(t.device());
  return d;
}

void raise_cuda(cudaError_t e) { C10_CUDA_CHECK(e); }

// The device an op runs on: its first CUDA tensor (the dispatcher sent the call here because one
// is). Guarding on a fixed argument would make a CPU tensor there fail inside the guard with a
// message naming no argument; this way the core's same-device check names it.
c10::Device cuda_device(std::initializer_list<const at::Tensor *> tensors) {
  for (const at::Tensor *t : tensors)
    if (t->is_cuda()) return t->device();
  TORCH_CHECK(false, "pagedkv: none of the op's tensors is on a CUDA device");
}

// The core's check of an op's arguments: descriptors always; index values (which live on the
// device) only when host checks are enabled, on host copies of `index_tensors` (pairs of the
// args field and the tensor it describes; a null tensor is skipped).
template <typename Args>
using CheckFn = pkv_status (*)(const Args *, int, pkv_error *);
template <typename Args>
using IndexTensors = std::initializer_list<std::pair<pkv_tensor Args::*, const at::Tensor *>>;

template <typename Args>
void check_args(const Args &a, CheckFn<Args> check, IndexTensors<Args> index_tensors) {
  pkv_error err{};
  raise_if_failed(check(&a, /*check_values=*/0, &err), err);
  if (!checks_enabled()) return;
  std::vector<at::Tensor> keep;
  Args h = a;
  for (const auto &[field, tensor] : index_tensors)
    if (tensor) h.*field = host_index(*tensor, keep);
  raise_if_failed(check(&h, /*check_values=*/1, &err), err);
}

// A per-tensor FP8 scale (one element), whose value the checks read on the host; null otherwise
// (per-token scales are never copied).
const at::Tensor *per_tensor_scale(const std::optional<at::Tensor> &scales) {
  return scales.has_value() && scales->defined() && scales->numel() == 1 && scales->dim() <= 1 ? &*scales : nullptr;
}

// The readers' form of a per-tensor scale (pkv_scales_broadcast) over ceil(D/G) copies of it on the
// device: the scale tensor itself for one group, else a stream-ordered copy (no host sync, capturable).
// `keep` owns the copy until the launch is queued.
void broadcast_scale(pkv_tensor &s, const pkv_tensor &cache, int64_t group, const std::optional<at::Tensor> &scales,
                     at::Tensor &keep) {
  if (!pkv_scales_per_tensor(&s)) return;
  const int64_t groups = pkv_num_groups(cache.sizes[3], group);
  if (groups == 1) {
    pkv_scales_broadcast(&s, &cache, group, static_cast<const float *>(s.data));
    return;
  }
  keep = scales->reshape({1}).expand({groups}).contiguous();
  pkv_scales_broadcast(&s, &cache, group, keep.data_ptr<float>());
}

// The tensor behind an unpacked call's V scales: for packed rows V is the K rows' latent, scaled by
// K's scales (the caller's k_scales for fp8_rope; views of the rows for fp8_ds_mla).
const std::optional<at::Tensor> &unpacked_v_scales(pkv_kv_format format, const std::optional<at::Tensor> &k_scales,
                                                   const std::optional<at::Tensor> &v_scales) {
  return format == PKV_KV_PLAIN ? v_scales : k_scales;
}

void paged_store_cuda(const at::Tensor &key, const std::optional<at::Tensor> &value, const at::Tensor &k_cache,
                      const std::optional<at::Tensor> &v_cache, const at::Tensor &input_row_offsets,
                      const at::Tensor &cache_lengths, const at::Tensor &lookup_table,
                      const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                      int64_t quant_group, KvFormat kv_format) {
  c10::cuda::CUDAGuard guard(cuda_device({&k_cache, &key, &input_row_offsets, &cache_lengths, &lookup_table}));
  pkv_store_args call = store_args(key, value, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table,
                                   k_scales, v_scales, quant_group, kv_format);
  // a packed call is two plain ones (latent, rope): every part is checked before any runs
  pkv_store_args parts[2];
  int num_parts = 0;
  pkv_error err{};
  raise_if_failed(pkv_store_unpack(&call, parts, &num_parts, &err), err);
  for (int i = 0; i < num_parts; i++) {
    check_args<pkv_store_args>(parts[i], pkv_store_check,
                               {{&pkv_store_args::input_row_offsets, &input_row_offsets},
                                {&pkv_store_args::cache_lengths, &cache_lengths},
                                {&pkv_store_args::lookup_table, &lookup_table},
                                {&pkv_store_args::k_scales,
                                 pkv_scales_per_tensor(&parts[i].k_scales) ? per_tensor_scale(k_scales) : nullptr},
                                {&pkv_store_args::v_scales, per_tensor_scale(v_scales)}});
    raise_if_failed(pkv_cuda_store_supported(&parts[i], &err), err);
  }
  for (int i = 0; i < num_parts; i++) raise_cuda(pkv_cuda_store(&parts[i], c10::cuda::getCurrentCUDAStream()));
}

void paged_load_cuda(const at::Tensor &cache, const std::optional<at::Tensor> &scales,
                     const at::Tensor &lookup_table, const at::Tensor &seq_lens,
                     const at::Tensor &output_row_offsets, const at::Tensor &out, int64_t quant_group,
                     KvFormat kv_format) {
  c10::cuda::CUDAGuard guard(cuda_device({&cache, &out, &lookup_table, &seq_lens, &output_row_offsets}));
  pkv_load_args call = load_args(cache, scales, lookup_table, seq_lens, output_row_offsets, out, quant_group,
                                 kv_format);
  pkv_load_args parts[2];
  int num_parts = 0;
  pkv_error err{};
  raise_if_failed(pkv_load_unpack(&call, parts, &num_parts, &err), err);
  at::Tensor scale_groups[2];
  for (int i = 0; i < num_parts; i++) {
    pkv_load_args &a = parts[i];
    check_args<pkv_load_args>(a, pkv_load_check,
                              {{&pkv_load_args::lookup_table, &lookup_table},
                               {&pkv_load_args::seq_lens, &seq_lens},
                               {&pkv_load_args::output_row_offsets, &output_row_offsets},
                               {&pkv_load_args::scales, pkv_scales_per_tensor(&a.scales) ? per_tensor_scale(scales)
                                                                                         : nullptr}});
    broadcast_scale(a.scales, a.cache, a.quant_group, scales, scale_groups[i]);
    raise_if_failed(pkv_cuda_load_supported(&a, &err), err);
  }
  for (int i = 0; i < num_parts; i++) raise_cuda(pkv_cuda_load(&parts[i], c10::cuda::getCurrentCUDAStream()));
}

void attn_cuda(const pkv_attn_args &call, const at::Tensor &q, const at::Tensor &out, const at::Tensor &k_cache,
               const at::Tensor &input_row_offsets, const at::Tensor &cache_lengths, const at::Tensor &lookup_table,
               const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales) {
  pkv_attn_args a;
  pkv_error unpack_err{};
  raise_if_failed(pkv_attn_unpack(&call, &a, &unpack_err), unpack_err);
  const std::optional<at::Tensor> &v_scales_of = unpacked_v_scales(call.kv_format, k_scales, v_scales);
  check_args<pkv_attn_args>(a, pkv_attn_check,
                            {{&pkv_attn_args::input_row_offsets, &input_row_offsets},
                             {&pkv_attn_args::cache_lengths, &cache_lengths},
                             {&pkv_attn_args::lookup_table, &lookup_table},
                             {&pkv_attn_args::k_scales, per_tensor_scale(k_scales)},
                             {&pkv_attn_args::v_scales, per_tensor_scale(v_scales_of)}});
  at::Tensor k_scale_groups, v_scale_groups;
  broadcast_scale(a.k_scales, a.k_cache, a.quant_group, k_scales, k_scale_groups);
  broadcast_scale(a.v_scales, a.v_cache, a.quant_group, v_scales_of, v_scale_groups);
  // The kernels attend with 16-bit queries. Float32 ones (checked above as the caller gave them) run
  // through a 16-bit copy in the cache's dtype (bf16 for FP8 caches), and the output comes back in
  // float32: CUDA's accuracy is then that of 16-bit queries. Float32 caches stay unsupported.
  at::Tensor q16, out16;
  const auto cache_type = k_cache.scalar_type();
  if (q.scalar_type() == at::kFloat && cache_type != at::kFloat) {
    const auto type = cache_type == at::kHalf ? at::kHalf : at::kBFloat16;
    q16 = q.to(type);
    out16 = at::empty(out.sizes(), out.options().dtype(type));
    a.q = describe(q16);
    a.out = describe(out16);
  }
  pkv_error err{};
  pkv_cuda_attn_plan plan{};
  raise_if_failed(pkv_cuda_attn_plan_make(&a, q.get_device(), cuda_loader(), &plan, &err), err);
  // Split-KV scratch from torch's caching allocator (stream-ordered, and the
  // graph's private pool under capture).
  at::Tensor partial_out, partial_lse;
  if (plan.num_splits > 1) {
    partial_out = at::empty({plan.partial_out_floats}, q.options().dtype(at::kFloat));
    partial_lse = at::empty({plan.partial_lse_floats}, q.options().dtype(at::kFloat));
  }
  raise_cuda(pkv_cuda_attn(&a, &plan, plan.num_splits > 1 ? partial_out.data_ptr<float>() : nullptr,
                           plan.num_splits > 1 ? partial_lse.data_ptr<float>() : nullptr,
                           c10::cuda::getCurrentCUDAStream()));
  if (out16.defined()) out.copy_(out16);
}

at::Tensor flash_attn_paged_cuda(const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
                                 const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths,
                                 const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
                                 const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                                 int64_t quant_group, int64_t window_left, double softcap,
                                 const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  c10::cuda::CUDAGuard guard(cuda_device({&q, &k_cache, &input_row_offsets, &cache_lengths, &lookup_table}));
  at::Tensor out = attn_output(q, v_cache, kv_format);
  attn_cuda(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                      v_scales, quant_group, window_left, softcap, sinks, kv_format, out),
            q, out, k_cache, input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales);
  return out;
}

void flash_attn_paged_out_cuda(const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
                               const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths,
                               const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
                               const std::optional<at::Tensor> &k_scales,
                               const std::optional<at::Tensor> &v_scales, int64_t quant_group, int64_t window_left,
                               double softcap, const std::optional<at::Tensor> &sinks, KvFormat kv_format,
                               const at::Tensor &out) {
  c10::cuda::CUDAGuard guard(cuda_device({&q, &out, &k_cache, &input_row_offsets, &cache_lengths, &lookup_table}));
  attn_cuda(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                      v_scales, quant_group, window_left, softcap, sinks, kv_format, out),
            q, out, k_cache, input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales);
}

std::tuple<at::Tensor, at::Tensor> flash_attn_paged_lse_cuda(
    const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
    const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths, const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
    const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales, int64_t quant_group,
    int64_t window_left, double softcap, const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  c10::cuda::CUDAGuard guard(cuda_device({&q, &k_cache, &input_row_offsets, &cache_lengths, &lookup_table}));
  at::Tensor out = attn_output(q, v_cache, kv_format), lse = attn_lse(q);
  attn_cuda(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                      v_scales, quant_group, window_left, softcap, sinks, kv_format, out, lse),
            q, out, k_cache, input_row_offsets, cache_lengths, lookup_table, k_scales, v_scales);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attn_states_cuda(const at::Tensor &out_a, const at::Tensor &lse_a,
                                                           const at::Tensor &out_b, const at::Tensor &lse_b) {
  c10::cuda::CUDAGuard guard(cuda_device({&out_a, &out_b, &lse_a, &lse_b}));
  auto [out, lse] = merge_outputs(out_a);
  pkv_merge_args a = merge_args(out_a, lse_a, out_b, lse_b, out, lse);
  pkv_error err{};
  raise_if_failed(pkv_merge_check(&a, &err), err);
  raise_cuda(pkv_cuda_merge(&a, c10::cuda::getCurrentCUDAStream()));
  return {out, lse};
}

at::Tensor flash_attn_paged_sparse_cuda(const at::Tensor &q, const at::Tensor &k_cache,
                                        const std::optional<at::Tensor> &v_cache, const at::Tensor &indices,
                                        std::optional<double> scale, const std::optional<at::Tensor> &k_scales,
                                        const std::optional<at::Tensor> &v_scales, int64_t quant_group,
                                        double softcap, const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  c10::cuda::CUDAGuard guard(cuda_device({&q, &k_cache, &indices}));
  at::Tensor out = attn_output(q, v_cache, kv_format);
  pkv_sparse_args call = sparse_args(q, k_cache, v_cache, indices, scale, k_scales, v_scales, quant_group, softcap,
                                     sinks, kv_format, out);
  pkv_sparse_args a;
  pkv_error unpack_err{};
  raise_if_failed(pkv_sparse_unpack(&call, &a, &unpack_err), unpack_err);
  const std::optional<at::Tensor> &v_scales_of = unpacked_v_scales(call.kv_format, k_scales, v_scales);
  check_args<pkv_sparse_args>(a, pkv_sparse_check,
                              {{&pkv_sparse_args::indices, &indices},
                               {&pkv_sparse_args::k_scales, per_tensor_scale(k_scales)},
                               {&pkv_sparse_args::v_scales, per_tensor_scale(v_scales_of)}});
  at::Tensor k_scale_groups, v_scale_groups;
  broadcast_scale(a.k_scales, a.k_cache, a.quant_group, k_scales, k_scale_groups);
  broadcast_scale(a.v_scales, a.v_cache, a.quant_group, v_scales_of, v_scale_groups);
  pkv_error err{};
  raise_if_failed(pkv_cuda_sparse_supported(&a, &err), err);
  // the forced loader (set_cuda_loader) applies here too: cp.async or tma-gather4 for the tiled kernel
  pkv_cuda_sparse_plan plan{};
  raise_if_failed(pkv_cuda_sparse_plan_make(&a, q.get_device(), cuda_loader(), &plan, &err), err);
  raise_cuda(pkv_cuda_sparse_run(&a, &plan, c10::cuda::getCurrentCUDAStream()));
  return out;
}

// The shared-memory image of one K tile as a loader writes it: uint8 [rows, row_bytes].
at::Tensor debug_load_tile_cuda(const at::Tensor &cache, const at::Tensor &lookup_table, const at::Tensor &seq_lens,
                                int64_t batch, int64_t kv_head, int64_t first_key, int64_t loader) {
  c10::cuda::CUDAGuard guard(cache.device());
  TORCH_CHECK(loader >= 0 && loader < PKV_LOADER_COUNT, "debug_load_tile: loader must be 0, 1 or 2, got ", loader);
  TORCH_CHECK(lookup_table.device() == cache.device() && seq_lens.device() == cache.device(),
              "debug_load_tile: lookup_table and seq_lens must be on the cache's device");
  pkv_tensor c = describe(cache), t = describe(lookup_table), l = describe(seq_lens);
  pkv_cuda_tile_geometry g{};
  pkv_error err{};
  raise_if_failed(pkv_cuda_debug_tile_plan(&c, &t, &l, batch, kv_head, first_key, cache.get_device(),
                                           static_cast<pkv_loader>(loader), &g, &err),
                  err);
  at::Tensor out = at::empty({g.rows, g.row_bytes}, cache.options().dtype(at::kByte));
  raise_cuda(pkv_cuda_debug_load_tile(&c, &t, &l, batch, kv_head, first_key, static_cast<pkv_loader>(loader),
                                      out.data_ptr(), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) {
  m.impl("paged_store", &pagedkv::paged_store_cuda);
  m.impl("paged_load", &pagedkv::paged_load_cuda);
  m.impl("flash_attn_paged", &pagedkv::flash_attn_paged_cuda);
  m.impl("flash_attn_paged.out", &pagedkv::flash_attn_paged_out_cuda);
  m.impl("flash_attn_paged_lse", &pagedkv::flash_attn_paged_lse_cuda);
  m.impl("merge_attn_states", &pagedkv::merge_attn_states_cuda);
  m.impl("flash_attn_paged_sparse", &pagedkv::flash_attn_paged_sparse_cuda);
  m.impl("debug_load_tile", &pagedkv::debug_load_tile_cuda);
}
