/* pagedkv CPU backend: the CPU kernels for AVX-512 + AVX512_BF16 with AMX tiles
 * (AMX-TILE, AMX-BF16). Built alone with -mamx-tile -mamx-bf16 -mavx512vbmi and the
 * AVX-512 flags (setup.py); chosen only when cpuid reports AMX-BF16, XCR0
 * enables the tile state and Linux grants it (arch_prctl, pkv_cpu_dispatch.c).
 * Items with bf16/f16 queries and enough query vectors (prefill) run QK^T and
 * PV on tiles; everything else runs the AVX-512 code of the same source. */
#define PKV_SIMD_AVX512 1
#define PKV_CPU_DOT_BF16 1
#define PKV_CPU_AMX 1
#define PKV_CPU_TABLE pkv_cpu_kernels_amx
#define PKV_CPU_NAME "amx"
#include "../kernels/pkv_cpu_kernels.inc"
#include "../pkv_cpu_sparse.h"
#define PKV_SPARSE_TABLE pkv_cpu_sparse_amx
#include "../kernels/sparse_item.inc"
