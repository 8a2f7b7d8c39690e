/* pagedkv CPU backend: the per-ISA variants of flash_attn_paged_sparse's kernel (internal to
 * csrc/cpu). kernels/sparse_item.inc is compiled into each isa/pkv_cpu_*.c, like the attention
 * kernels; pkv_cpu_sparse_get() returns the table of the ISA pkv_cpu_kernels_get() picked. */
#ifndef PKV_CPU_SPARSE_H
#define PKV_CPU_SPARSE_H

#include "pkv_cpu_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* How the items of a sparse call run (pkv_sparse_plan.path): chosen once per call by the plan, through the
 * table's sparse_path (kernels/sparse_item.inc). */
typedef enum {
  PKV_CPU_SPARSE_GATHER = 0, /* rows converted to float32 scratch, float32 FMAs (every table) */
  PKV_CPU_SPARSE_DIRECT,     /* rows read in place, widened in registers by decode_direct.inc's products */
} pkv_cpu_sparse_path;

typedef struct {
  /* The path of every item of the call. */
  pkv_cpu_sparse_path (*sparse_path)(const pkv_sparse_args *a);
  /* Items [begin, end) on that path; same contract as pkv_sparse_cpu (pkv_cpu_ops.h). */
  pkv_status (*sparse_items)(const pkv_sparse_args *a, pkv_cpu_sparse_path path, int64_t begin, int64_t end,
                             pkv_error *err);
} pkv_cpu_sparse_kernels;

extern const pkv_cpu_sparse_kernels pkv_cpu_sparse_scalar;
extern const pkv_cpu_sparse_kernels pkv_cpu_sparse_avx2;
extern const pkv_cpu_sparse_kernels pkv_cpu_sparse_avx512;
extern const pkv_cpu_sparse_kernels pkv_cpu_sparse_amx;

/* The sparse table of the ISA pkv_cpu_kernels_get() picked. */
const pkv_cpu_sparse_kernels *pkv_cpu_sparse_get(void);

#ifdef __cplusplus
}
#endif
#endif /* PKV_CPU_SPARSE_H */
