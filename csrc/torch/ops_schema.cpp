// pagedkv torch shims: every op schema of the library, written by hand with
// mutations marked (each mutated tensor has its own alias set). The op files
// (ops_cpu.cpp, ops_cuda.cpp, copy_pages.cpp) only register implementations.
#include <torch/library.h>

#include "../core/pkv_settings.h"
#include "pkv_torch.h"

namespace pagedkv {

// Host checks of CUDA index values: the core settings' `checks` (PAGEDKV_CHECK=1 its initial value).
bool checks_enabled() { return pkv_settings_get().checks != 0; }
void set_checks_enabled(bool on) {
  pkv_settings s = pkv_settings_get();
  s.checks = on ? 1 : 0;
  pkv_error err{};
  TORCH_CHECK(pkv_settings_set(&s, &err) == PKV_OK, "pagedkv: ", err.message);
}

}  // namespace pagedkv

TORCH_LIBRARY(pagedkv, m) {
  m.def(
      "paged_store(Tensor key, Tensor? value, Tensor(a!) k_cache, Tensor(b!)? v_cache, "
      "Tensor input_row_offsets, Tensor cache_lengths, Tensor lookup_table, "
      "Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None, int quant_group=128, str? kv_format=None) -> ()");
  m.def(
      "paged_load(Tensor cache, Tensor? scales, Tensor lookup_table, Tensor seq_lens, "
      "Tensor output_row_offsets, Tensor(a!) out, int quant_group=128, str? kv_format=None) -> ()");
  m.def(
      "flash_attn_paged(Tensor q, Tensor input_row_offsets, Tensor k_cache, Tensor? v_cache, "
      "Tensor cache_lengths, Tensor lookup_table, float? scale=None, bool causal=True, "
      "Tensor? k_scales=None, Tensor? v_scales=None, int quant_group=128, int window_left=-1, "
      "float softcap=0.0, Tensor? sinks=None, str? kv_format=None) -> Tensor");
  m.def(
      "flash_attn_paged.out(Tensor q, Tensor input_row_offsets, Tensor k_cache, Tensor? v_cache, "
      "Tensor cache_lengths, Tensor lookup_table, float? scale=None, bool causal=True, "
      "Tensor? k_scales=None, Tensor? v_scales=None, int quant_group=128, int window_left=-1, "
      "float softcap=0.0, Tensor? sinks=None, str? kv_format=None, *, Tensor(a!) out) -> ()");
  m.def(
      "flash_attn_paged_lse(Tensor q, Tensor input_row_offsets, Tensor k_cache, Tensor? v_cache, "
      "Tensor cache_lengths, Tensor lookup_table, float? scale=None, bool causal=True, "
      "Tensor? k_scales=None, Tensor? v_scales=None, int quant_group=128, int window_left=-1, "
      "float softcap=0.0, Tensor? sinks=None, str? kv_format=None) -> (Tensor, Tensor)");
  m.def("merge_attn_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.def(
      "flash_attn_paged_sparse(Tensor q, Tensor k_cache, Tensor? v_cache, Tensor indices, float? scale=None, "
      "Tensor? k_scales=None, Tensor? v_scales=None, int quant_group=128, float softcap=0.0, "
      "Tensor? sinks=None, str? kv_format=None) -> Tensor");
  // The page manager's copy-on-write block copy (copy_pages.cpp; CPU and CUDA).
  m.def("copy_pages(Tensor(a!) pool, Tensor src_pages, Tensor dst_pages) -> ()");
  // The FP8 values vLLM's CPU cache writer stores (vllm_cpu_fp8.cpp; CPU only): a helper of pagedkv's
  // vLLM backend, not part of the contract.
  m.def("_vllm_cpu_fp8_values(Tensor x, Tensor scale, ScalarType fp8_dtype) -> Tensor");
  // The shared-memory image of one K tile as a CUDA loader writes it (ops_cuda.cpp; CUDA only).
  m.def(
      "debug_load_tile(Tensor cache, Tensor lookup_table, Tensor seq_lens, int batch, int kv_head, "
      "int first_key, int loader) -> Tensor");
}
