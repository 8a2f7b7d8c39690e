/* pagedkv core: dtype table, error formatting, view builders. */
#include <stdarg.h>
#include <stdio.h>

#include "pkv_common.h"
#include "pkv_view.h"

const char *pkv_dtype_name(pkv_dtype dtype) {
  switch (dtype) {
  case PKV_DTYPE_F32: return "float32";
  case PKV_DTYPE_F16: return "float16";
  case PKV_DTYPE_BF16: return "bfloat16";
  case PKV_DTYPE_FP8_E4M3: return "float8_e4m3fn";
  case PKV_DTYPE_FP8_E5M2: return "float8_e5m2";
  case PKV_DTYPE_I32: return "int32";
  case PKV_DTYPE_I64: return "int64";
  case PKV_DTYPE_I16: return "int16";
  case PKV_DTYPE_I8: return "int8";
  case PKV_DTYPE_U8: return "uint8";
  case PKV_DTYPE_F64: return "float64";
  case PKV_DTYPE_BOOL: return "bool";
  default: return "an unsupported dtype";
  }
}

size_t pkv_dtype_size(pkv_dtype dtype) {
  switch (dtype) {
  case PKV_DTYPE_F32: case PKV_DTYPE_I32: return 4;
  case PKV_DTYPE_F16: case PKV_DTYPE_BF16: case PKV_DTYPE_I16: return 2;
  case PKV_DTYPE_FP8_E4M3: case PKV_DTYPE_FP8_E5M2: case PKV_DTYPE_I8: case PKV_DTYPE_U8:
  case PKV_DTYPE_BOOL: return 1;
  case PKV_DTYPE_I64: case PKV_DTYPE_F64: return 8;
  default: return 0;
  }
}

int pkv_dtype_is_float_input(pkv_dtype d) {
  return d == PKV_DTYPE_F32 || d == PKV_DTYPE_F16 || d == PKV_DTYPE_BF16;
}

int pkv_dtype_is_fp8(pkv_dtype d) { return d == PKV_DTYPE_FP8_E4M3 || d == PKV_DTYPE_FP8_E5M2; }

int pkv_dtype_is_cache(pkv_dtype d) { return pkv_dtype_is_float_input(d) || pkv_dtype_is_fp8(d); }

pkv_status pkv_fail(pkv_error *err, pkv_status status, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
  }
  return status;
}

pkv_cache_view pkv_cache_view_from(const pkv_tensor *t) {
  pkv_cache_view v;
  v.data = t->data;
  v.dtype = t->dtype;
  v.num_pages = t->sizes[0];
  v.page_size = t->sizes[1];
  v.num_heads = t->sizes[2];
  v.head_dim = t->sizes[3];
  v.stride_page = t->strides[0];
  v.stride_token = t->strides[1];
  v.stride_head = t->strides[2];
  return v;
}

pkv_rows_view pkv_rows_view_from(const pkv_tensor *t) {
  pkv_rows_view v;
  v.data = t->data;
  v.dtype = t->dtype;
  v.num_rows = t->sizes[0];
  v.num_heads = t->sizes[1];
  v.head_dim = t->sizes[2];
  v.stride_row = t->strides[0];
  v.stride_head = t->strides[1];
  return v;
}

pkv_index_view pkv_index_view_from(const pkv_tensor *t) {
  pkv_index_view v;
  v.data = (const int32_t *)t->data;
  v.rows = t->sizes[0];
  v.cols = t->ndim > 1 ? t->sizes[1] : 1;
  v.stride_row = t->strides[0];
  v.stride_col = t->ndim > 1 ? t->strides[1] : 1;
  return v;
}
