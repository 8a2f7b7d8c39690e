// pagedkv CUDA backend: Hopper warpgroup MMA (wgmma.mma_async, sm_90a only) for the attention kernel's
// warpgroup path. A warpgroup (4 warps, 128 threads) multiplies a 64-row A operand held in registers by a
// B operand read from shared memory through a matrix descriptor, accumulating in float32 registers.
//
// Register layouts (PTX ISA, "wgmma .m64nNk16"): warp w of the warpgroup holds rows 16w .. 16w + 15 of A
// and of the accumulator, in exactly the fragment layout of mma.sync m16n8k16 (A: a[0] row g, channels 2t,
// 2t+1; a[1] row g + 8; a[2], a[3] the same 8 channels on; accumulator d[4j .. 4j+3]: rows g, g + 8 of
// columns 8j + 2t, 8j + 2t + 1; g = lane / 4, t = lane % 4). So the scores and outputs of a warpgroup MMA
// are the same per-thread values as the mma.sync kernel's s[nt][e] and o[dt][e], and the softmax, masks
// and epilogue serve both.
//
// B operands are tiles of tile.cuh's layout ([row bytes / 128 chunks][rows][128 B], 16-byte unit j of row
// r at j ^ (r & 7), 1024-byte aligned): that is the canonical 128-byte-swizzled layout wgmma reads, K-major
// for K (keys are N, channels are the reduction, contiguous) and MN-major for V (channels are N and
// contiguous, keys are the reduction), the latter with the transpose-B flag.
#pragma once

#include <stdint.h>

#include <type_traits>

#include "common.cuh"

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define PKV_WGMMA 1
#else
#define PKV_WGMMA 0
#endif

namespace pkv {

// Whether this compilation target has wgmma (sm_90a): the warpgroup kernels are trapping stubs elsewhere.
__device__ constexpr bool wgmma_compiled() { return PKV_WGMMA != 0; }

// Shared-memory matrix descriptor of a 128-byte-swizzled operand starting at shared address `addr`:
// lbo / sbo are the byte strides the canonical layout names (14-bit fields in 16-byte units; layout type
// 1 = 128-byte swizzle in bits 62-63; base offset 0, as every swizzle atom starts 1024-byte aligned).
__host__ __device__ __forceinline__ uint64_t wgmma_desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) | static_cast<uint64_t>((lbo & 0x3FFFFu) >> 4) << 16 |
         static_cast<uint64_t>((sbo & 0x3FFFFu) >> 4) << 32 | static_cast<uint64_t>(1) << 62;
}

// K-major B of k-step kk (16 channels) of a `rows`-row tile: rows are N, 8-row groups 1024 bytes apart
// (SBO); the k-step's 32 bytes sit inside a 128-byte chunk (a start-address offset: the hardware applies
// the swizzle to the whole address), chunks `rows` x 128 bytes apart. LBO is unused in this layout.
__host__ __device__ __forceinline__ uint64_t wgmma_desc_k_major(uint32_t tile, int kk, int rows) {
  return wgmma_desc_sw128(tile + static_cast<uint32_t>((kk >> 2) * rows * 128 + (kk & 3) * 32), 16u, 1024u);
}
// MN-major B of k-step kk (16 keys) of a `rows`-row tile: 64 channels per 128-byte chunk, chunks `rows` x
// 128 bytes apart (LBO: the next 64 of N), 8-key groups 1024 bytes apart (SBO: the next 8 of the reduction).
__host__ __device__ __forceinline__ uint64_t wgmma_desc_mn_major(uint32_t tile, int kk, int rows) {
  return wgmma_desc_sw128(tile + static_cast<uint32_t>(kk * 16 * 128), static_cast<uint32_t>(rows * 128), 1024u);
}

// Orders this thread's register and shared-memory accesses before the warpgroup MMAs that follow (needed
// before the first MMA of a sequence and whenever the accumulators or A registers were written since).
__device__ __forceinline__ void wgmma_fence() {
#if PKV_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if PKV_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
// Waits until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
#if PKV_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
}
// Keeps the compiler from moving reads or writes of n accumulator registers across the MMA's issue or wait
// (the asm statements of the MMA do not tell it when the hardware writes them).
template <int kN>
__device__ __forceinline__ void wgmma_pin(float *d) {
#pragma unroll
  for (int i = 0; i < kN; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The accumulator operand lists of 32 and 64 registers.
#define PKV_WGMMA_ACC32                                                                                           \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define PKV_WGMMA_ACC64                                                                                           \
  PKV_WGMMA_ACC32 ", "                                                                                            \
                  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "              \
                  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define PKV_WGMMA_OPS32(d)                                                                                        \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define PKV_WGMMA_OPS64(d)                                                                                        \
  PKV_WGMMA_OPS32(d), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]),  \
      "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]),     \
      "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]),     \
      "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]),     \
      "+f"(d[63])
// One m64nNk16 MMA: ACC / OPS the accumulator list, A_REGS / DESC / SCALE the operand numbers after it.
// scale_d = 0 ignores the accumulator's old values (D = A B), 1 adds to them.
#define PKV_WGMMA_RS(SHAPE, TYPE, TRANS_B, ACC, OPS, A_REGS, DESC, SCALE)                                         \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SCALE ", 0;\n"                                                 \
               "wgmma.mma_async.sync.aligned." SHAPE ".f32." TYPE "." TYPE " {" ACC "}, {" A_REGS "}, " DESC       \
               ", p, 1, 1, " TRANS_B ";\n}\n"                                                                     \
               : OPS                                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d))
#define PKV_WGMMA_N64(TYPE, TRANS_B)                                                                              \
  PKV_WGMMA_RS("m64n64k16", TYPE, TRANS_B, PKV_WGMMA_ACC32, PKV_WGMMA_OPS32(d), "%32, %33, %34, %35", "%36", "%37")
#define PKV_WGMMA_N128(TYPE, TRANS_B)                                                                             \
  PKV_WGMMA_RS("m64n128k16", TYPE, TRANS_B, PKV_WGMMA_ACC64, PKV_WGMMA_OPS64(d), "%64, %65, %66, %67", "%68",     \
               "%69")

// d[N / 2] (+)= A B for the warpgroup's 64 x 16 A (this thread's fragment a) and the 16 x N B that b_desc
// describes (kTransB: MN-major B). N = 64 or 128; T = __nv_bfloat16 or __half (A and B).
template <int N, typename T, int kTransB>
__device__ __forceinline__ void wgmma_rs(float *d, const uint32_t (&a)[4], uint64_t b_desc, int scale_d) {
  static_assert(N == 64 || N == 128, "wgmma_rs: N 64 or 128");
  static_assert(kTransB == 0 || kTransB == 1, "wgmma_rs: transpose flag");
#if PKV_WGMMA
  constexpr bool kBf16 = std::is_same<T, __nv_bfloat16>::value;
  if constexpr (N == 64 && kBf16 && kTransB == 0) PKV_WGMMA_N64("bf16", "0");
  else if constexpr (N == 64 && kBf16) PKV_WGMMA_N64("bf16", "1");
  else if constexpr (N == 64 && kTransB == 0) PKV_WGMMA_N64("f16", "0");
  else if constexpr (N == 64) PKV_WGMMA_N64("f16", "1");
  else if constexpr (kBf16 && kTransB == 0) PKV_WGMMA_N128("bf16", "0");
  else if constexpr (kBf16) PKV_WGMMA_N128("bf16", "1");
  else if constexpr (kTransB == 0) PKV_WGMMA_N128("f16", "0");
  else PKV_WGMMA_N128("f16", "1");
#else
  (void)d, (void)a, (void)b_desc, (void)scale_d;
  __trap();
#endif
}

#undef PKV_WGMMA_N128
#undef PKV_WGMMA_N64
#undef PKV_WGMMA_RS
#undef PKV_WGMMA_OPS64
#undef PKV_WGMMA_OPS32
#undef PKV_WGMMA_ACC64
#undef PKV_WGMMA_ACC32

// acc[N / 2] += A B over kSteps k-steps of 16: step kk's A fragment a[kk] and B descriptor desc_of(kk),
// issued as one group and waited for (the accumulators are ready when this returns).
template <int N, typename T, int kTransB, int kSteps, typename DescOf>
__device__ __forceinline__ void wgmma_product(float *acc, const uint32_t (&a)[kSteps][4], DescOf desc_of) {
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kSteps; kk++) wgmma_rs<N, T, kTransB>(acc, a[kk], desc_of(kk), 1);
  wgmma_commit();
  wgmma_wait<0>();
  wgmma_pin<N / 2>(acc);
}

}  // namespace pkv
