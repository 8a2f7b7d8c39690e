/* pagedkv CPU backend: the CPU kernels for AVX-512 (F, BW, VL) with AVX512_BF16 dot
 * products. Built alone with -mavx512f -mavx512bw -mavx512vl -mavx512bf16
 * -mfma -mf16c (setup.py); run only when cpuid says so. The bf16 dot-product
 * path is taken only when the CPU also has AVX512_BF16 (pkv_cpu_has_dot_bf16). */
#define PKV_SIMD_AVX512 1
#define PKV_CPU_DOT_BF16 1
#define PKV_CPU_TABLE pkv_cpu_kernels_avx512
#define PKV_CPU_NAME "avx512"
#include "../kernels/pkv_cpu_kernels.inc"
#include "../pkv_cpu_sparse.h"
#define PKV_SPARSE_TABLE pkv_cpu_sparse_avx512
#include "../kernels/sparse_item.inc"
