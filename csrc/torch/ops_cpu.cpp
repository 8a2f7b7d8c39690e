// pagedkv torch shims: CPU implementations. Validate through the core (index
// values always), then split the core kernel's work range over torch's
// thread pool.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../cpu/pkv_cpu_ops.h"
#include "pkv_args.h"

namespace pagedkv {
namespace {

// The index tensors the kernels read again and again (row offsets, lengths), copied once: the ops
// release the GIL, so another thread may rewrite the caller's tensors during a call, and so may the
// call itself where one aliases a cache it writes. The checks run on the caller's descriptors (shapes,
// and the overlaps they refuse), then the values are checked as copied, and the kernels read the copy:
// a value is never used unchecked. The lookup table is not copied (it may be large); kernels read each
// page id once and mask it (pkv_page_for_read).
class IndexSnapshot {
 public:
  // t: a checked 1-D int32 CPU descriptor; points it at the copy of its distinct elements
  void take(pkv_tensor &t) {
    if (!t.defined || t.ndim != 1) return;
    const int64_t n = t.strides[0] == 0 ? std::min<int64_t>(t.sizes[0], 1) : t.sizes[0];
    values_.resize(static_cast<size_t>(n));
    const int32_t *src = static_cast<const int32_t *>(t.data);
    for (int64_t i = 0; i < n; i++) values_[i] = src[i * t.strides[0]];
    t.data = values_.data();
    if (n > 0 && t.strides[0] != 0) t.strides[0] = 1;
  }

 private:
  std::vector<int32_t> values_;
};

// A per-tensor FP8 scale (pkv_scales_per_tensor), copied once like the index tensors: the checks
// read the copy's value, then readers get it as a broadcast per-token view (pkv_scales_broadcast) over
// one copy per group, and paged_store reads the copy.
class ScaleSnapshot {
 public:
  // s: a checked scales descriptor of `cache`; a per-tensor one is pointed at the copy
  void take(pkv_tensor &s, const pkv_tensor &cache, int64_t group) {
    if (!pkv_scales_per_tensor(&s)) return;
    values_.assign(static_cast<size_t>(pkv_num_groups(cache.sizes[3], group)), *static_cast<const float *>(s.data));
    s.data = values_.data();
  }
  // after the value checks: the readers' form of a per-tensor scale
  void broadcast(pkv_tensor &s, const pkv_tensor &cache, int64_t group) const {
    if (pkv_scales_per_tensor(&s)) pkv_scales_broadcast(&s, &cache, group, values_.data());
  }

 private:
  std::vector<float> values_;
};

// Work items per task: enough bytes per task to amortise scheduling.
int64_t grain_for(int64_t bytes_per_item) {
  constexpr int64_t kBytesPerTask = 64 * 1024;
  return std::max<int64_t>(1, kBytesPerTask / std::max<int64_t>(1, bytes_per_item));
}

// One plain store or load (a packed call is two, pkv_store_unpack / pkv_load_unpack): its checks
// and snapshots first, for every part, then the kernels, so a failed check writes nothing.
struct StorePart {
  pkv_store_args a;
  IndexSnapshot offsets, lengths;
  ScaleSnapshot k_scale, v_scale;

  void check() {
    pkv_error err{};
    raise_if_failed(pkv_store_check(&a, /*check_values=*/0, &err), err);
    offsets.take(a.input_row_offsets);
    lengths.take(a.cache_lengths);
    k_scale.take(a.k_scales, a.k_cache, a.quant_group);
    v_scale.take(a.v_scales, a.v_cache, a.quant_group);
    raise_if_failed(pkv_store_check(&a, /*check_values=*/1, &err), err);
  }
  void run() {
    at::parallel_for(0, pkv_store_cpu_work(&a), grain_for(a.key.sizes[1] * a.key.sizes[2] * 4),
                     [&](int64_t begin, int64_t end) { pkv_store_cpu(&a, begin, end); });
  }
};

struct LoadPart {
  pkv_load_args a;
  IndexSnapshot lengths, offsets;
  ScaleSnapshot scale;

  void check() {
    pkv_error err{};
    raise_if_failed(pkv_load_check(&a, /*check_values=*/0, &err), err);
    lengths.take(a.seq_lens);
    offsets.take(a.output_row_offsets);
    scale.take(a.scales, a.cache, a.quant_group);
    raise_if_failed(pkv_load_check(&a, /*check_values=*/1, &err), err);
    scale.broadcast(a.scales, a.cache, a.quant_group);
  }
  void run() {
    at::parallel_for(0, pkv_load_cpu_work(&a), grain_for(a.cache.sizes[1] * a.cache.sizes[2] * a.cache.sizes[3] * 4),
                     [&](int64_t begin, int64_t end) { pkv_load_cpu(&a, begin, end); });
  }
};

// A call as its plain parts (one, or two for packed rows: pkv_store_unpack / pkv_load_unpack): every
// part checked, then every part run.
template <typename Part, typename Args>
void run_parts(const Args &call, pkv_status (*unpack)(const Args *, Args *, int *, pkv_error *)) {
  Args plain[2];
  int num_parts = 0;
  pkv_error err{};
  raise_if_failed(unpack(&call, plain, &num_parts, &err), err);
  Part parts[2];
  for (int i = 0; i < num_parts; i++) {
    parts[i].a = plain[i];
    parts[i].check();
  }
  for (int i = 0; i < num_parts; i++) parts[i].run();
}

void paged_store_cpu(const at::Tensor &key, const std::optional<at::Tensor> &value, const at::Tensor &k_cache,
                     const std::optional<at::Tensor> &v_cache, const at::Tensor &input_row_offsets,
                     const at::Tensor &cache_lengths, const at::Tensor &lookup_table,
                     const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                     int64_t quant_group, KvFormat kv_format) {
  pkv_store_args a = store_args(key, value, k_cache, v_cache, input_row_offsets, cache_lengths, lookup_table,
                                k_scales, v_scales, quant_group, kv_format);
  run_parts<StorePart>(a, pkv_store_unpack);
}

void paged_load_cpu(const at::Tensor &cache, const std::optional<at::Tensor> &scales, const at::Tensor &lookup_table,
                    const at::Tensor &seq_lens, const at::Tensor &output_row_offsets, const at::Tensor &out,
                    int64_t quant_group, KvFormat kv_format) {
  pkv_load_args a = load_args(cache, scales, lookup_table, seq_lens, output_row_offsets, out, quant_group, kv_format);
  run_parts<LoadPart>(a, pkv_load_unpack);
}

void attn_cpu(const pkv_attn_args &call) {
  pkv_error err{};
  pkv_attn_args a;
  raise_if_failed(pkv_attn_unpack(&call, &a, &err), err);
  raise_if_failed(pkv_attn_check(&a, /*check_values=*/0, &err), err);
  IndexSnapshot offsets, lengths;
  offsets.take(a.input_row_offsets);
  lengths.take(a.cache_lengths);
  ScaleSnapshot k_scale, v_scale;
  k_scale.take(a.k_scales, a.k_cache, a.quant_group);
  v_scale.take(a.v_scales, a.v_cache, a.quant_group);
  raise_if_failed(pkv_attn_check(&a, /*check_values=*/1, &err), err);
  k_scale.broadcast(a.k_scales, a.k_cache, a.quant_group);
  v_scale.broadcast(a.v_scales, a.v_cache, a.quant_group);
  pkv_attn_plan plan{};
  raise_if_failed(pkv_attn_cpu_plan(&a, &plan, &err), err);
  // One task per thread, each claiming items until none is left (pkv_attn_cpu_claim): a fixed split
  // of the items left the other thread waiting whenever one core ran slower.
  std::atomic<int> failed{0};
  pkv_error item_err{};
  int64_t tasks = std::min<int64_t>(at::get_num_threads(), plan.num_items);
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; t++) {
      pkv_error local{};
      if (pkv_attn_cpu_claim(&a, &plan, &local) != PKV_OK && failed.exchange(1) == 0) item_err = local;
    }
  });
  pkv_attn_plan_free(&plan);
  TORCH_CHECK(failed.load() == 0, item_err.message);
}

at::Tensor flash_attn_paged_cpu(const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
                                const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths,
                                const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
                                const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                                int64_t quant_group, int64_t window_left, double softcap,
                                const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  at::Tensor out = attn_output(q, v_cache, kv_format);
  attn_cpu(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                     v_scales, quant_group, window_left, softcap, sinks, kv_format, out));
  return out;
}

void flash_attn_paged_out_cpu(const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
                              const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths,
                              const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
                              const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales,
                              int64_t quant_group, int64_t window_left, double softcap,
                              const std::optional<at::Tensor> &sinks, KvFormat kv_format, const at::Tensor &out) {
  attn_cpu(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                     v_scales, quant_group, window_left, softcap, sinks, kv_format, out));
}

std::tuple<at::Tensor, at::Tensor> flash_attn_paged_lse_cpu(
    const at::Tensor &q, const at::Tensor &input_row_offsets, const at::Tensor &k_cache,
    const std::optional<at::Tensor> &v_cache, const at::Tensor &cache_lengths, const at::Tensor &lookup_table, std::optional<double> scale, bool causal,
    const std::optional<at::Tensor> &k_scales, const std::optional<at::Tensor> &v_scales, int64_t quant_group,
    int64_t window_left, double softcap, const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  at::Tensor out = attn_output(q, v_cache, kv_format), lse = attn_lse(q);
  attn_cpu(attn_args(q, input_row_offsets, k_cache, v_cache, cache_lengths, lookup_table, scale, causal, k_scales,
                     v_scales, quant_group, window_left, softcap, sinks, kv_format, out, lse));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor> merge_attn_states_cpu(const at::Tensor &out_a, const at::Tensor &lse_a,
                                                          const at::Tensor &out_b, const at::Tensor &lse_b) {
  auto [out, lse] = merge_outputs(out_a);
  pkv_merge_args a = merge_args(out_a, lse_a, out_b, lse_b, out, lse);
  pkv_error err{};
  raise_if_failed(pkv_merge_check(&a, &err), err);
  at::parallel_for(0, pkv_merge_cpu_work(&a), grain_for(out_a.size(1) * out_a.size(2) * 12),
                   [&](int64_t begin, int64_t end) { pkv_merge_cpu(&a, begin, end); });
  return {out, lse};
}

at::Tensor flash_attn_paged_sparse_cpu(const at::Tensor &q, const at::Tensor &k_cache,
                                       const std::optional<at::Tensor> &v_cache, const at::Tensor &indices,
                                       std::optional<double> scale, const std::optional<at::Tensor> &k_scales,
                                       const std::optional<at::Tensor> &v_scales, int64_t quant_group, double softcap,
                                       const std::optional<at::Tensor> &sinks, KvFormat kv_format) {
  at::Tensor out = attn_output(q, v_cache, kv_format);
  pkv_sparse_args call = sparse_args(q, k_cache, v_cache, indices, scale, k_scales, v_scales, quant_group, softcap,
                                     sinks, kv_format, out);
  pkv_sparse_args a;
  {
    pkv_error err{};
    raise_if_failed(pkv_sparse_unpack(&call, &a, &err), err);
  }
  pkv_error err{};
  raise_if_failed(pkv_sparse_check(&a, /*check_values=*/0, &err), err);
  ScaleSnapshot k_scale, v_scale;
  k_scale.take(a.k_scales, a.k_cache, a.quant_group);
  v_scale.take(a.v_scales, a.v_cache, a.quant_group);
  raise_if_failed(pkv_sparse_check(&a, /*check_values=*/1, &err), err);
  k_scale.broadcast(a.k_scales, a.k_cache, a.quant_group);
  v_scale.broadcast(a.v_scales, a.v_cache, a.quant_group);
  std::atomic<int> failed{0};
  pkv_error item_err{};
  // an item gathers up to K rows of K and V: a few of them per task
  const pkv_sparse_plan plan = pkv_sparse_cpu_plan(&a);
  at::parallel_for(0, pkv_sparse_cpu_work(&a), 4, [&](int64_t begin, int64_t end) {
    pkv_error local{};
    if (pkv_sparse_cpu(&a, &plan, begin, end, &local) != PKV_OK && failed.exchange(1) == 0) item_err = local;
  });
  TORCH_CHECK(failed.load() == 0, item_err.message);
  return out;
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) {
  m.impl("paged_store", &pagedkv::paged_store_cpu);
  m.impl("paged_load", &pagedkv::paged_load_cpu);
  m.impl("flash_attn_paged", &pagedkv::flash_attn_paged_cpu);
  m.impl("flash_attn_paged.out", &pagedkv::flash_attn_paged_out_cpu);
  m.impl("flash_attn_paged_lse", &pagedkv::flash_attn_paged_lse_cpu);
  m.impl("merge_attn_states", &pagedkv::merge_attn_states_cpu);
  m.impl("flash_attn_paged_sparse", &pagedkv::flash_attn_paged_sparse_cpu);
}
