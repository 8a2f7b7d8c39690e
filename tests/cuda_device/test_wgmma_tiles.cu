// Device check (needs an sm_90a GPU: benchmarks/gpu_run.sh's `wgmma` stage builds and runs it) of the
// warpgroup MMAs of csrc/cuda/wgmma.cuh on the attention kernel's shared-memory tiles (tile.cuh's layout):
// S = Q K^T with Q's fragments read by ldmatrix and K through the K-major descriptor, and O = P V with P's
// fragments built in registers and V through the MN-major descriptor, at head sizes 64 and 128, in bf16
// and fp16, against a float64 product on the host. Each product is also tried with the descriptor's two byte strides swapped,
// so a failure says whether the strides or something else is wrong. Exit 0 when the kernel's own
// descriptors give the products (relative error < 1e-3: float32 accumulation of 16-bit inputs).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "tile.cuh"
#include "wgmma.cuh"

namespace {

constexpr int kRows = 64;  // query rows, keys (the attention kernel's BM and BN at D <= 128)

// q, k, v: [64][D] 16-bit values (T's bits); p: [64][64]; s: [64][64] and o: [64][D] float outputs. swap_k /
// swap_v exchange the LBO and SBO fields of that operand's descriptors.
template <int D, typename T>
__global__ void wgmma_tiles_kernel(const uint16_t *q, const uint16_t *k, const uint16_t *v, const uint16_t *p,
                                   float *s_out, float *o_out, int swap_k, int swap_v) {
  if constexpr (pkv::wgmma_compiled()) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = pkv::smem_align_1024(smem_raw);
    constexpr int kTileBytes = kRows * pkv::tile_row_bytes(D, 2);
    uint8_t *sq = smem, *sk = smem + kTileBytes, *sv = smem + 2 * kTileBytes;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    for (int u = tid; u < kRows * D / 8; u += 128) {  // 16-byte units into the swizzled tiles
      const int r = u / (D / 8), j = u % (D / 8);
      *reinterpret_cast<uint4 *>(sq + pkv::tile_unit_offset(r, j, kRows)) = reinterpret_cast<const uint4 *>(q)[u];
      *reinterpret_cast<uint4 *>(sk + pkv::tile_unit_offset(r, j, kRows)) = reinterpret_cast<const uint4 *>(k)[u];
      *reinterpret_cast<uint4 *>(sv + pkv::tile_unit_offset(r, j, kRows)) = reinterpret_cast<const uint4 *>(v)[u];
    }
    pkv::fence_proxy_async_smem();
    __syncthreads();
    auto swapped = [](uint64_t desc, int swap) {  // LBO (bits 16-29) <-> SBO (bits 32-45)
      if (!swap) return desc;
      const uint64_t lbo = (desc >> 16) & 0x3FFF, sbo = (desc >> 32) & 0x3FFF;
      return (desc & ~((uint64_t(0x3FFF) << 16) | (uint64_t(0x3FFF) << 32))) | (sbo << 16) | (lbo << 32);
    };
    // S = Q K^T
    uint32_t qf[D / 16][4];
    const int m = lane >> 3;
    const uint32_t q_lane = pkv::swizzle_lane_base(pkv::smem_u32(sq), warp * 16 + (m & 1) * 8 + (lane & 7), m >> 1);
    for (int kk = 0; kk < D / 16; kk++) pkv::ldmatrix_x4(qf[kk], pkv::swizzle_step(q_lane, 2 * kk, kRows));
    float s[kRows / 2] = {};
    pkv::wgmma_product<kRows, T, 0>(
        s, qf, [&](int kk) { return swapped(pkv::wgmma_desc_k_major(pkv::smem_u32(sk), kk, kRows), swap_k); });
    for (int i = 0; i < kRows / 2; i++) {  // accumulator i: n8 block i / 4, row g (+ 8), column 2t (+ 1)
      const int nt = i / 4, e = i % 4;
      s_out[(warp * 16 + g + 8 * (e >> 1)) * kRows + nt * 8 + 2 * t + (e & 1)] = s[i];
    }
    // O = P V, P's A fragments from global memory in the mma.sync layout
    float o[D / 2] = {};
    uint32_t pf[kRows / 16][4];
    for (int kk = 0; kk < kRows / 16; kk++)
      for (int x = 0; x < 4; x++) {
        const int r = warp * 16 + g + 8 * (x & 1), c = kk * 16 + 2 * t + 8 * (x >> 1);
        pf[kk][x] = static_cast<uint32_t>(p[r * kRows + c]) | static_cast<uint32_t>(p[r * kRows + c + 1]) << 16;
      }
    pkv::wgmma_product<D, T, 1>(
        o, pf, [&](int kk) { return swapped(pkv::wgmma_desc_mn_major(pkv::smem_u32(sv), kk, kRows), swap_v); });
    for (int i = 0; i < D / 2; i++) {
      const int dt = i / 4, e = i % 4;
      o_out[(warp * 16 + g + 8 * (e >> 1)) * D + dt * 8 + 2 * t + (e & 1)] = o[i];
    }
  } else {
    __trap();
  }
}

// The bits of x rounded to T (nearest even) and the value of such bits (host conversions of cuda_fp16.h /
// cuda_bf16.h).
template <typename T>
uint16_t bits_of(float x) {
  const T h = static_cast<T>(x);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}
template <typename T>
double value_of(uint16_t b) {
  T h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

// Relative errors (max |got - want| / max |want|) of S and O for one stride choice; false on a CUDA error.
template <int D, typename T>
bool run(int swap_k, int swap_v, double *err_s, double *err_o) {
  std::vector<uint16_t> q(kRows * D), k(kRows * D), v(kRows * D), p(kRows * kRows);
  uint32_t seed = 12345u + D;
  auto uniform = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return static_cast<float>(seed >> 8) / 16777216.0f * 2.0f - 1.0f;
  };
  for (auto *a : {&q, &k, &v})
    for (auto &x : *a) x = bits_of<T>(uniform());
  for (auto &x : p) x = bits_of<T>(0.5f + 0.5f * uniform());
  uint16_t *dq, *dk, *dv, *dp;
  float *ds, *dout;
  cudaMalloc(&dq, q.size() * 2), cudaMalloc(&dk, k.size() * 2), cudaMalloc(&dv, v.size() * 2);
  cudaMalloc(&dp, p.size() * 2), cudaMalloc(&ds, kRows * kRows * 4), cudaMalloc(&dout, kRows * D * 4);
  cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice);
  const int smem = 3 * kRows * pkv::tile_row_bytes(D, 2) + 1024;
  cudaFuncSetAttribute(wgmma_tiles_kernel<D, T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  wgmma_tiles_kernel<D, T><<<1, 128, smem>>>(dq, dk, dv, dp, ds, dout, swap_k, swap_v);
  const cudaError_t e = cudaDeviceSynchronize();
  std::vector<float> s(kRows * kRows), o(kRows * D);
  cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(o.data(), dout, o.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dq), cudaFree(dk), cudaFree(dv), cudaFree(dp), cudaFree(ds), cudaFree(dout);
  if (e != cudaSuccess) {
    std::printf("D %d swap_k %d swap_v %d: CUDA error %s\n", D, swap_k, swap_v, cudaGetErrorString(e));
    return false;
  }
  double ms = 0, mo = 0, es = 0, eo = 0;
  for (int r = 0; r < kRows; r++) {
    for (int c = 0; c < kRows; c++) {
      double want = 0;
      for (int d = 0; d < D; d++) want += value_of<T>(q[r * D + d]) * value_of<T>(k[c * D + d]);
      ms = std::fmax(ms, std::fabs(want)), es = std::fmax(es, std::fabs(s[r * kRows + c] - want));
    }
    for (int c = 0; c < D; c++) {
      double want = 0;
      for (int j = 0; j < kRows; j++) want += value_of<T>(p[r * kRows + j]) * value_of<T>(v[j * D + c]);
      mo = std::fmax(mo, std::fabs(want)), eo = std::fmax(eo, std::fabs(o[r * D + c] - want));
    }
  }
  *err_s = es / ms;
  *err_o = eo / mo;
  return true;
}

template <int D, typename T>
bool check(const char *type) {
  bool ok = true;
  for (int swap = 0; swap < 2; swap++) {
    double es = 0, eo = 0;
    if (!run<D, T>(swap, swap, &es, &eo)) return false;
    const bool good = es < 1e-3 && eo < 1e-3;
    std::printf("D %3d %s, %s strides: S = Q K^T rel. error %.2e, O = P V rel. error %.2e%s\n", D, type,
                swap ? "swapped" : "kernel's", es, eo, swap ? "" : (good ? "  ok" : "  FAIL"));
    if (!swap) ok = good;
  }
  return ok;
}

}  // namespace

int main() {
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) != cudaSuccess || major != 9) {
    std::printf("SKIP: needs a cc 9.x device (sm_90a)\n");
    return 0;
  }
  const bool ok = check<64, __nv_bfloat16>("bf16") & check<128, __nv_bfloat16>("bf16") & check<64, __half>("fp16") &
                  check<128, __half>("fp16");
  std::printf("%s\n", ok ? "wgmma tiles: passed" : "wgmma tiles: FAILED");
  return ok ? 0 : 1;
}
