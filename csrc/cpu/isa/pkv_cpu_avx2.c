/* pagedkv CPU backend: the CPU kernels for AVX2 + FMA + F16C.
 * Built alone with -mavx2 -mfma -mf16c (setup.py); run only when cpuid says so. */
#define PKV_SIMD_AVX2 1
#define PKV_CPU_TABLE pkv_cpu_kernels_avx2
#define PKV_CPU_NAME "avx2"
#include "../kernels/pkv_cpu_kernels.inc"
#include "../pkv_cpu_sparse.h"
#define PKV_SPARSE_TABLE pkv_cpu_sparse_avx2
#include "../kernels/sparse_item.inc"
