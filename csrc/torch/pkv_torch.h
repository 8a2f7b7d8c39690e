// pagedkv torch shims: turn at::Tensor into the core's pkv_tensor descriptors.
// The only layer that includes torch headers (besides the bindings).
#pragma once

#include <ATen/ATen.h>

#include <optional>

extern "C" {
#include "../core/pkv_ops.h"
}

namespace pagedkv {

inline pkv_dtype to_pkv_dtype(at::ScalarType t) {
  switch (t) {
  case at::kFloat: return PKV_DTYPE_F32;
  case at::kHalf: return PKV_DTYPE_F16;
  case at::kBFloat16: return PKV_DTYPE_BF16;
  case at::kFloat8_e4m3fn: return PKV_DTYPE_FP8_E4M3;
  case at::kFloat8_e5m2: return PKV_DTYPE_FP8_E5M2;
  case at::kInt: return PKV_DTYPE_I32;
  case at::kLong: return PKV_DTYPE_I64;
  case at::kShort: return PKV_DTYPE_I16;
  case at::kChar: return PKV_DTYPE_I8;
  case at::kByte: return PKV_DTYPE_U8;
  case at::kDouble: return PKV_DTYPE_F64;
  case at::kBool: return PKV_DTYPE_BOOL;
  default: return PKV_DTYPE_OTHER;
  }
}

// Device code of the core: -1 host, the CUDA index, or -100 - type for others.
inline int to_pkv_device(const at::Device &d) {
  if (d.is_cpu()) return PKV_DEVICE_CPU;
  if (d.is_cuda()) return d.index();
  return -100 - static_cast<int>(d.type());
}

inline pkv_tensor describe(const at::Tensor &t) {
  pkv_tensor d{};
  d.defined = 1;
  d.data = t.numel() > 0 ? t.data_ptr() : nullptr;
  d.dtype = to_pkv_dtype(t.scalar_type());
  d.device = to_pkv_device(t.device());
  // A rank above PKV_MAX_DIMS keeps its ndim (sizes past the sixth are not recorded): every
  // checker tests the rank before it reads a size, so the error names the argument.
  d.ndim = static_cast<int>(t.dim());
  for (int i = 0; i < d.ndim && i < PKV_MAX_DIMS; i++) {
    d.sizes[i] = t.size(i);
    d.strides[i] = t.stride(i);
  }
  return d;
}

inline pkv_tensor describe(const std::optional<at::Tensor> &t) {
  if (!t.has_value() || !t->defined()) return pkv_tensor{};
  return describe(*t);
}

// Raise the core's message as a RuntimeError (c10::Error) when a check fails.
inline void raise_if_failed(pkv_status status, const pkv_error &err) {
  TORCH_CHECK(status == PKV_OK, err.message);
}

// Index values are checked on the host: always on CPU, on CUDA when enabled.
bool checks_enabled();
void set_checks_enabled(bool on);

// 1/sqrt(D) unless the caller gave a scale.
inline double resolve_scale(const std::optional<double> &scale, const at::Tensor &q) {
  if (scale.has_value()) return *scale;
  int64_t d = q.dim() > 0 ? q.size(-1) : 1;
  return 1.0 / std::sqrt(static_cast<double>(d > 0 ? d : 1));
}

}  // namespace pagedkv
