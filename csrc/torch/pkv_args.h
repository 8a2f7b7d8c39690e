// pagedkv torch shims: build the core's per-op argument structs from the
// schema's arguments. Shared by the CPU and CUDA implementations.
#pragma once

#include "pkv_torch.h"

namespace pagedkv {

// The schema's `str? kv_format` (CONTRACT v1.2).
using KvFormat = std::optional<c10::string_view>;

inline pkv_kv_format parse_kv_format(const char *op, const KvFormat &name) {
  pkv_kv_format f = PKV_KV_PLAIN;
  if (!name.has_value()) return f;
  const std::string text(name->data(), name->size());
  TORCH_CHECK(pkv_kv_format_parse(text.c_str(), &f), op,
              ": kv_format must be None, 'fp8_ds_mla' or 'fp8_rope', got '", text, "'");
  return f;
}

inline pkv_store_args store_args(const at::Tensor &key, const std::optional<at::Tensor> &value,
                                 const at::Tensor &k_cache, const std::optional<at::Tensor> &v_cache,
                                 const at::Tensor &input_row_offsets, const at::Tensor &cache_lengths,
                                 const at::Tensor &lookup_table, const std::optional<at::Tensor> &k_scales,
                                 const std::optional<at::Tensor> &v_scales, int64_t quant_group,
                                 const KvFormat &kv_format) {
  pkv_store_args a{};
  a.key = describe(key);
  a.value = describe(value);
  a.k_cache = describe(k_cache);
  a.v_cache = describe(v_cache);
  a.input_row_offsets = describe(input_row_offsets);
  a.cache_lengths = describe(cache_lengths);
  a.lookup_table = describe(lookup_table);
  a.k_scales = describe(k_scales);
  a.v_scales = describe(v_scales);
  a.quant_group = quant_group;
  a.kv_format = parse_kv_format("paged_store", kv_format);
  return a;
}

inline pkv_load_args load_args(const at::Tensor &cache, const std::optional<at::Tensor> &scales,
                               const at::Tensor &lookup_table, const at::Tensor &seq_lens,
                               const at::Tensor &output_row_offsets, const at::Tensor &out, int64_t quant_group,
                               const KvFormat &kv_format) {
  pkv_load_args a{};
  a.cache = describe(cache);
  a.scales = describe(scales);
  a.lookup_table = describe(lookup_table);
  a.seq_lens = describe(seq_lens);
  a.output_row_offsets = describe(output_row_offsets);
  a.out = describe(out);
  a.quant_group = quant_group;
  a.kv_format = parse_kv_format("paged_load", kv_format);
  return a;
}

inline pkv_attn_args attn_args(const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
                               const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths,
                               const at::Tensor &lookup_table, const std::optional<double> &scale, bool causal,
                               const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                               int64_t quant_group, int64_t window_left, double softcap,
                               const std::optional<at::Tensor> &sinks, const KvFormat &kv_format,
                               const at::Tensor &out, const at::Tensor &lse = at::Tensor()) {
  pkv_attn_args a{};
  a.q = describe(q);
  a.input_row_offsets = describe(input_row_offsets);
  a.k_cache = describe(k_cache);
  a.v_cache = describe(v_cache);
  a.cache_lengths = describe(cache_lengths);
  a.lookup_table = describe(lookup_table);
  a.k_scales = describe(k_scales);
  a.v_scales = describe(v_scales);
  a.out = out.defined() ? describe(out) : pkv_tensor{};
  a.scale = resolve_scale(scale, q);
  a.causal = causal ? 1 : 0;
  a.quant_group = quant_group;
  a.window_left = window_left;
  a.softcap = softcap;
  a.sinks = describe(sinks);
  a.lse = lse.defined() ? describe(lse) : pkv_tensor{};
  a.kv_format = parse_kv_format("flash_attn_paged", kv_format);
  return a;
}

// Output of the functional flash_attn_paged: [T, Hq, Dv] in q's dtype (Dv = 512, the latent, for packed
// MLA rows), or an undefined tensor when the shapes are wrong (the check then names the argument).
inline at::Tensor attn_output(const at::Tensor &q, const std::optional<at::Tensor> &v_cache,
                              const KvFormat &kv_format) {
  if (q.dim() != 3) return at::Tensor();
  if (kv_format.has_value()) return at::empty({q.size(0), q.size(1), PKV_MLA_LATENT_DIM}, q.options());
  if (!v_cache.has_value() || !v_cache->defined() || v_cache->dim() != 4) return at::Tensor();
  return at::empty({q.size(0), q.size(1), v_cache->size(3)}, q.options());
}

// The log-sum-exp of flash_attn_paged_lse: float32 [T, Hq] (undefined when q's shape is wrong).
inline at::Tensor attn_lse(const at::Tensor &q) {
  if (q.dim() != 3) return at::Tensor();
  return at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
}

inline pkv_merge_args merge_args(const at::Tensor &out_a, const at::Tensor &lse_a, const at::Tensor &out_b,
                                 const at::Tensor &lse_b, const at::Tensor &out, const at::Tensor &lse) {
  pkv_merge_args a{};
  a.out_a = describe(out_a);
  a.lse_a = describe(lse_a);
  a.out_b = describe(out_b);
  a.lse_b = describe(lse_b);
  a.out = out.defined() ? describe(out) : pkv_tensor{};
  a.lse = lse.defined() ? describe(lse) : pkv_tensor{};
  return a;
}

inline pkv_sparse_args sparse_args(const at::Tensor &q, const at::Tensor &k_cache,
                                   const std::optional<at::Tensor> &v_cache,
                                   const at::Tensor &indices, const std::optional<double> &scale,
                                   const std::optional<at::Tensor> &k_scales,
                                   const std::optional<at::Tensor> &v_scales, int64_t quant_group, double softcap,
                                   const std::optional<at::Tensor> &sinks, const KvFormat &kv_format,
                                   const at::Tensor &out) {
  pkv_sparse_args a{};
  a.q = describe(q);
  a.k_cache = describe(k_cache);
  a.v_cache = describe(v_cache);
  a.indices = describe(indices);
  a.k_scales = describe(k_scales);
  a.v_scales = describe(v_scales);
  a.sinks = describe(sinks);
  a.out = out.defined() ? describe(out) : pkv_tensor{};
  a.scale = resolve_scale(scale, q);
  a.quant_group = quant_group;
  a.softcap = softcap;
  a.kv_format = parse_kv_format("flash_attn_paged_sparse", kv_format);
  return a;
}

// Outputs of merge_attn_states: out_a's shape and dtype (contiguous) and float32 [T, H].
inline std::tuple<at::Tensor, at::Tensor> merge_outputs(const at::Tensor &out_a) {
  if (out_a.dim() != 3) return {at::Tensor(), at::Tensor()};
  return {at::empty(out_a.sizes(), out_a.options()),
          at::empty({out_a.size(0), out_a.size(1)}, out_a.options().dtype(at::kFloat))};
}

}  // namespace pagedkv
