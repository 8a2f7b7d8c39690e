/* pagedkv core: dtype table and error formatting. */
#include <stdarg.h>
#include <stdio.h>

#include "pkv_common.h"

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

const char *pkv_status_name(pkv_status status) {
  switch (status) {
  case PKV_OK: return "PKV_OK";
  case PKV_ERR_ARGUMENT: return "PKV_ERR_ARGUMENT";
  case PKV_ERR_INDEX: return "PKV_ERR_INDEX";
  case PKV_ERR_UNSUPPORTED: return "PKV_ERR_UNSUPPORTED";
  case PKV_ERR_OUT_OF_PAGES: return "PKV_ERR_OUT_OF_PAGES";
  case PKV_ERR_NO_SUCH_SEQUENCE: return "PKV_ERR_NO_SUCH_SEQUENCE";
  case PKV_ERR_SEQUENCE_EXISTS: return "PKV_ERR_SEQUENCE_EXISTS";
  case PKV_ERR_OUT_OF_MEMORY: return "PKV_ERR_OUT_OF_MEMORY";
  case PKV_ERR_BUSY: return "PKV_ERR_BUSY";
  case PKV_ERR_INVARIANT_VIOLATED: return "PKV_ERR_INVARIANT_VIOLATED";
  }
  return "PKV_ERR_UNKNOWN_STATUS";
}

pkv_status pkv_fail(pkv_error *err, pkv_status status, const char *fmt, ...) {
  if (err) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
  }
  return status;
}
