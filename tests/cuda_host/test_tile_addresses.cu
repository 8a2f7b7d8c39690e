// Host check (no GPU needed) of the tile layout's index math in csrc/cuda/tile.cuh: the ldmatrix
// addresses the attention kernel forms with swizzle_lane_base / swizzle_step (one XOR per k-step)
// are the bytes tile_unit_offset names, for every lane row, both starting units, every even step
// of D up to 256 (16-bit rows: 32 units), the tile heights in use, tile bases at any 128-byte
// boundary, and the whole-row-group offsets the kernel adds (+ 8 or 16 rows per MMA block).
// Built and run by .ci/cuda_build_check.sh; exits 1 on the first mismatch.
#include <cstdio>

#include "tile.cuh"

int main() {
  long checked = 0;
  const int heights[] = {16, 32, 64, 128, 256};
  const uint32_t bases[] = {0u, 1024u, 8192u + 128u, 0x10000u + 0x380u};
  for (uint32_t base : bases)
    for (int rows : heights)
      for (int r = 0; r < rows; r++)
        for (int u0 = 0; u0 < 2; u0++) {
          const uint32_t lane = pkv::swizzle_lane_base(base, r, u0);
          for (int step = 0; step + u0 < 32; step += 2)
            for (int extra = 0; r + extra < rows; extra += 8) {  // rows further on by whole groups of 8
              const uint32_t got = pkv::swizzle_step(lane, step, rows) + static_cast<uint32_t>(extra) * 128u;
              const uint32_t want = base + pkv::tile_unit_offset(r + extra, u0 + step, rows);
              checked++;
              if (got != want) {
                std::printf("FAIL: base %u rows %d row %d (+%d) unit %d + %d: %u, tile_unit_offset gives %u\n", base,
                            rows, r, extra, u0, step, got, want);
                return 1;
              }
            }
        }
  std::printf("test_tile_addresses: %ld addresses equal tile_unit_offset's\n", checked);
  return 0;
}
