/* pagedkv core: shared types. C11, no torch, no CUDA runtime.
 *
 * Every backend describes its tensors with pkv_tensor (a framework-free
 * descriptor), validates a call with the op's pkv_*_check function and then
 * runs a kernel on typed views built from the descriptors. */
#ifndef PKV_COMMON_H
#define PKV_COMMON_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define PKV_HD __host__ __device__ __forceinline__
#else
#define PKV_HD static inline
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  PKV_DTYPE_F32 = 0,
  PKV_DTYPE_F16,
  PKV_DTYPE_BF16,
  PKV_DTYPE_FP8_E4M3,
  PKV_DTYPE_FP8_E5M2,
  PKV_DTYPE_I32,
  PKV_DTYPE_I64,
  PKV_DTYPE_I16,
  PKV_DTYPE_I8,
  PKV_DTYPE_U8,
  PKV_DTYPE_F64,
  PKV_DTYPE_BOOL,
  PKV_DTYPE_OTHER,
} pkv_dtype;

/* Descriptors hold up to 6 dims: the collection layout [N, 2, L, P, Hk, D]
 * is the largest shape the contract names. Ops only take views of <= 4. */
#define PKV_MAX_DIMS 6

/* device: -1 for host memory, otherwise the accelerator's index. */
#define PKV_DEVICE_CPU (-1)

typedef struct {
  void *data;     /* first element; may be NULL when numel == 0 */
  int defined;    /* 0 for an absent optional argument */
  pkv_dtype dtype;
  int ndim;       /* may exceed PKV_MAX_DIMS: only the rank is recorded then, and checks reject it */
  int device;
  int64_t sizes[PKV_MAX_DIMS];
  int64_t strides[PKV_MAX_DIMS]; /* in elements */
} pkv_tensor;

/* The one status convention of the C library: ops, checks and the page manager return these,
 * with the message in a pkv_error. */
typedef enum {
  PKV_OK = 0,
  PKV_ERR_ARGUMENT = 1,           /* shape, dtype, stride, device, option, an argument out of range */
  PKV_ERR_INDEX = 2,              /* an index value (page id, length, offset) */
  PKV_ERR_UNSUPPORTED = 3,        /* valid, but this backend cannot run it */
  PKV_ERR_OUT_OF_PAGES = 4,       /* page manager: not enough free pages; nothing changed */
  PKV_ERR_NO_SUCH_SEQUENCE = 5,   /* page manager: the sequence id is not in the manager */
  PKV_ERR_SEQUENCE_EXISTS = 6,    /* page manager: add_sequence/fork target id is already in use */
  PKV_ERR_OUT_OF_MEMORY = 7,      /* a host allocation failed; nothing changed */
  PKV_ERR_BUSY = 8,               /* page manager: another call on this manager is in progress */
  PKV_ERR_INVARIANT_VIOLATED = 9, /* page manager: check_invariants found corrupt state */
} pkv_status;

/* Error text for the caller; the core never aborts. */
#define PKV_ERROR_CAPACITY 512
typedef struct {
  char message[PKV_ERROR_CAPACITY];
} pkv_error;

const char *pkv_dtype_name(pkv_dtype dtype);
/* Short constant name of a status ("PKV_ERR_OUT_OF_PAGES"). */
const char *pkv_status_name(pkv_status status);
size_t pkv_dtype_size(pkv_dtype dtype);
int pkv_dtype_is_float_input(pkv_dtype dtype); /* f32, f16, bf16 */
int pkv_dtype_is_fp8(pkv_dtype dtype);
int pkv_dtype_is_cache(pkv_dtype dtype); /* float inputs or fp8 */

/* Writes a printf-style message and returns status (for `return pkv_fail(...)`). */
pkv_status pkv_fail(pkv_error *err, pkv_status status, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#ifdef __cplusplus
}
#endif
#endif /* PKV_COMMON_H */
