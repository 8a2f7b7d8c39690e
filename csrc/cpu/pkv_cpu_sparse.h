/* pagedkv CPU backend: the per-ISA variants of flash_attn_paged_sparse's kernel (internal to
 * csrc/cpu). kernels/sparse_item.inc is compiled into each isa/pkv_cpu_*.c, like the attention
 * kernels; pkv_cpu_sparse_get() returns the variant of the ISA pkv_cpu_kernels_get() picked. */
#ifndef PKV_CPU_SPARSE_H
#define PKV_CPU_SPARSE_H

#include "pkv_cpu_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Same contract as pkv_sparse_cpu (pkv_cpu_ops.h). */
typedef pkv_status (*pkv_sparse_cpu_fn)(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);

pkv_status pkv_sparse_cpu_scalar(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);
pkv_status pkv_sparse_cpu_avx2(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);
pkv_status pkv_sparse_cpu_avx512(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);
pkv_status pkv_sparse_cpu_amx(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);

pkv_sparse_cpu_fn pkv_cpu_sparse_get(void);

#ifdef __cplusplus
}
#endif
#endif /* PKV_CPU_SPARSE_H */
