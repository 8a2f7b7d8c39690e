// pagedkv torch shims: _vllm_cpu_fp8_values, the FP8 values vLLM's CPU cache writer stores (csrc/cpu/
// vllm_cpu_fp8.c), for pagedkv's vLLM backend (python/pagedkv/vllm_backend.py). Not part of the contract:
// a helper of that backend, CPU only (schema in ops_schema.cpp).
//
//   _vllm_cpu_fp8_values(Tensor x, Tensor scale, ScalarType fp8_dtype) -> Tensor
//   x: float32 / float16 / bfloat16, any shape and strides; scale: one float32 element, finite and > 0
//   (vLLM's per-tensor k_scale / v_scale); fp8_dtype: torch.float8_e4m3fn or torch.float8_e5m2.
//   Returns bfloat16 of x's shape (contiguous): each element the value of the code vLLM's writer stores.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "../cpu/pkv_cpu_ops.h"
#include "pkv_torch.h"

namespace pagedkv {
namespace {

at::Tensor vllm_cpu_fp8_values(const at::Tensor &x, const at::Tensor &scale, at::ScalarType fp8_dtype) {
  const auto xt = x.scalar_type();
  TORCH_CHECK(xt == at::kFloat || xt == at::kHalf || xt == at::kBFloat16,
              "_vllm_cpu_fp8_values: x must be float32, float16 or bfloat16, got ", xt);
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == at::kFloat && scale.device().is_cpu(),
              "_vllm_cpu_fp8_values: scale must be one float32 element on the CPU (a per-tensor scale), got ",
              scale.scalar_type(), " of shape ", scale.sizes(), " on ", scale.device());
  TORCH_CHECK(fp8_dtype == at::kFloat8_e4m3fn || fp8_dtype == at::kFloat8_e5m2,
              "_vllm_cpu_fp8_values: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", fp8_dtype);
  const float s = scale.item<float>();
  TORCH_CHECK(std::isfinite(s) && s > 0.0f, "_vllm_cpu_fp8_values: scale must be finite and > 0, got ", s);
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  const pkv_dtype in_dtype = to_pkv_dtype(xt), fp8 = to_pkv_dtype(fp8_dtype);
  const void *src = in.numel() > 0 ? in.data_ptr() : nullptr;
  uint16_t *dst = out.numel() > 0 ? static_cast<uint16_t *>(out.data_ptr()) : nullptr;
  at::parallel_for(0, in.numel(), 32 * 1024, [&](int64_t begin, int64_t end) {
    pkv_vllm_cpu_fp8_values(src, in_dtype, s, fp8, dst, begin, end);
  });
  return out;
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("_vllm_cpu_fp8_values", &pagedkv::vllm_cpu_fp8_values); }
