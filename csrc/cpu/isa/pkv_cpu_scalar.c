/* pagedkv CPU backend: the CPU kernels for any x86-64 (or other) CPU, no vector ISA flags. */
#define PKV_CPU_TABLE pkv_cpu_kernels_scalar
#define PKV_CPU_NAME "scalar"
#include "../kernels/pkv_cpu_kernels.inc"
#include "../pkv_cpu_sparse.h"
#define PKV_SPARSE_TABLE pkv_cpu_sparse_scalar
#include "../kernels/sparse_item.inc"
