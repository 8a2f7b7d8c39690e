// Host check (no GPU needed) of the warpgroup path's shared-memory matrix descriptors (csrc/cuda/wgmma.cuh)
// against the tile layout (csrc/cuda/tile.cuh). Each descriptor the kernel builds is decoded field by field
// (start address, leading and stride byte offsets, base offset, layout type) and every element of the B
// operand it describes is located the way the hardware reads the canonical 128-byte-swizzled layouts:
//
//   K-major  (K tile, N = keys, k = channels):  ((8,n),2):((8,SBO),1)      in 16-byte units
//   MN-major (V tile, N = channels, k = keys):  ((8,n),(8,k)):((1,LBO),(8,SBO))
//
// then the swizzle (16-byte unit bits 4-6 XOR address bits 7-9) over the absolute address. These are the
// canonical forms of the PTX ISA's wgmma shared-memory layouts, in the notation of CUTLASS 4.2's
// make_gmma_desc (cute/atom/mma_traits_sm90_gmma.hpp; read for the facts, not copied). The located byte
// must be the one tile_unit_offset gives for that (row, channel): a swapped LBO/SBO, a wrong k-step offset
// or a wrong chunk stride fails here before any GPU run. The check also runs itself on a descriptor with
// LBO and SBO swapped and requires it to fail, so it cannot pass vacuously.
// Built and run by .ci/cuda_build_check.sh; exits 1 on the first mismatch.
#include <cstdio>

#include "tile.cuh"
#include "wgmma.cuh"

namespace {

struct Fields {
  uint32_t start, lbo, sbo, base_offset, layout;
};

Fields decode(uint64_t d) {
  return {static_cast<uint32_t>(d & 0x3FFF) << 4, static_cast<uint32_t>((d >> 16) & 0x3FFF) << 4,
          static_cast<uint32_t>((d >> 32) & 0x3FFF) << 4, static_cast<uint32_t>((d >> 49) & 7),
          static_cast<uint32_t>(d >> 62)};
}

uint32_t swizzle128(uint32_t a) { return a ^ (((a >> 7) & 7u) << 4); }

// Byte the hardware reads for element (n, k) of a 16-bit K-major B operand (N x 16).
uint32_t k_major_byte(const Fields &f, int n, int k) {
  return swizzle128(f.start + (n / 8) * f.sbo + (n % 8) * 128 + (k / 8) * 16 + (k % 8) * 2);
}
// Byte the hardware reads for element (k, n) of a 16-bit MN-major B operand (16 x N).
uint32_t mn_major_byte(const Fields &f, int k, int n) {
  return swizzle128(f.start + (n / 64) * f.lbo + ((n % 64) / 8) * 16 + (n % 8) * 2 + (k / 8) * f.sbo + (k % 8) * 128);
}

// Byte of 16-bit element `col` of tile row r (tile.cuh's layout) in a tile at `base`.
uint32_t tile_byte(uint32_t base, int r, int col, int rows) {
  return base + pkv::tile_unit_offset(r, col / 8, rows) + (col % 8) * 2;
}

bool fields_ok(const Fields &f, const char *what) {
  if (f.layout == 1 && f.base_offset == 0) return true;  // 1: 128-byte swizzle; atoms start 1024-aligned
  std::printf("FAIL: %s descriptor: layout type %u (want 1), base offset %u (want 0)\n", what, f.layout,
              f.base_offset);
  return false;
}

// Every element of every k-step of the kernel's S = Q K^T (K-major) and O += P V (MN-major) products over
// a tile of `rows` keys and d channels at `base`; returns the number of mismatches (0: all agree).
long check_tile(uint32_t base, int d, int rows, bool swap_lbo_sbo, long *checked) {
  long bad = 0;
  for (int kk = 0; kk < d / 16; kk++) {  // K: k-steps over channels, N = the tile's keys
    Fields f = decode(pkv::wgmma_desc_k_major(base, kk, rows));
    if (swap_lbo_sbo) std::swap(f.lbo, f.sbo);
    if (!fields_ok(f, "K-major")) return 1;
    for (int n = 0; n < rows; n++)
      for (int k = 0; k < 16; k++, ++*checked)
        if (k_major_byte(f, n, k) != tile_byte(base, n, kk * 16 + k, rows)) {
          if (!swap_lbo_sbo && bad == 0)
            std::printf("FAIL: K-major d %d rows %d k-step %d key %d channel %d: byte %u, tile has it at %u\n", d,
                        rows, kk, n, kk * 16 + k, k_major_byte(f, n, k), tile_byte(base, n, kk * 16 + k, rows));
          bad++;
        }
  }
  for (int kk = 0; kk < rows / 16; kk++) {  // V: k-steps over keys, N = the d channels
    Fields f = decode(pkv::wgmma_desc_mn_major(base, kk, rows));
    if (swap_lbo_sbo) std::swap(f.lbo, f.sbo);
    if (!fields_ok(f, "MN-major")) return 1;
    for (int k = 0; k < 16; k++)
      for (int n = 0; n < d; n++, ++*checked)
        if (mn_major_byte(f, k, n) != tile_byte(base, kk * 16 + k, n, rows)) {
          if (!swap_lbo_sbo && bad == 0)
            std::printf("FAIL: MN-major d %d rows %d k-step %d key %d channel %d: byte %u, tile has it at %u\n", d,
                        rows, kk, kk * 16 + k, n, mn_major_byte(f, k, n), tile_byte(base, kk * 16 + k, n, rows));
          bad++;
        }
  }
  return bad;
}

}  // namespace

int main() {
  long checked = 0;
  // The warpgroup kernel's tiles: 64 keys, D 64 or 128; other heights keep the strides honest.
  const uint32_t bases[] = {0u, 1024u, 0x8000u + 3 * 1024u, 0x30000u};  // tile images start 1024-aligned
  const int heights[] = {64, 32, 128};
  for (uint32_t base : bases)
    for (int rows : heights)
      for (int d : {64, 128}) {
        if (check_tile(base, d, rows, false, &checked) != 0) return 1;
        long ignored = 0;  // the swapped descriptors must misplace bytes (K-major's SBO becomes 16 bytes)
        if (check_tile(base, d, rows, true, &ignored) == 0) {
          std::printf("FAIL: d %d rows %d: swapping LBO and SBO still matched; the check cannot tell them apart\n",
                      d, rows);
          return 1;
        }
      }
  std::printf("test_wgmma_descriptors: %ld operand elements at the bytes tile_unit_offset names\n", checked);
  return 0;
}
