// pagedkv CUDA backend: the one shared-memory K/V tile layout and the three
// loaders that fill it (cp.async, TMA box per page chunk, TMA gather4).
//
// Tile image of `rows` cache rows, each `row_bytes` bytes (head size times
// element size, rounded up to 128):
//
//   [row_bytes / 128 column chunks][rows][128 bytes], 128-byte swizzled:
//   16-byte unit j of row r lives at unit j ^ (r & 7) of that row.
//
// This is exactly what TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and a
// 128-byte box width when every chunk starts 1024-byte aligned, so all
// loaders produce the same bytes and one consumer (ldmatrix + mma.sync)
// reads them. FP8 tiles use the same image with 1-byte elements and are
// converted into a 16-bit tile of the same form before the matrix products.
#pragma once

#include "common.cuh"
#include "tma.cuh"

namespace pkv {

constexpr int kChunkBytes = 128;  // one swizzle span = one TMA box width

// Keys per attention tile for head size d: two stages of K and V plus the Q
// tile stay under ~100 KB of shared memory (2 CTAs per SM on sm_90).
__host__ __device__ constexpr int attn_tile_keys(int d) { return d <= 128 ? 64 : 32; }
// Bytes of one tile row holding d elements of es bytes (whole 128-byte chunks).
__host__ __device__ constexpr int tile_row_bytes(int d, int es) {
  return (d * es + kChunkBytes - 1) / kChunkBytes * kChunkBytes;
}
// Smallest page chunk worth a TMA box: tiny pages mean many tiny boxes, and
// cp.async is faster there (shared/notes/TMA.md, section 3).
constexpr int kMinTmaBoxRows = 16;

// Rows per TMA box of the page loader for a tile of `tile_keys` keys, or 0 when
// the page size does not fit (a box never leaves its page and starts 1024-byte
// aligned: a multiple of 8 rows).
inline int tma_box_rows(int64_t page_size, int64_t tile_keys) {
  int64_t sub = 0;
  if (page_size % tile_keys == 0)
    sub = tile_keys;
  else if (tile_keys % page_size == 0)
    sub = page_size;
  if (sub < kMinTmaBoxRows || sub % 8 != 0) return 0;
  return static_cast<int>(sub);
}

// Which loaders a target really compiles: anything else is a trapping stub,
// and the host never launches it (pkv_cuda_loader_available checks the PTX
// version the device's binary was built from).
template <int kLoader>
__device__ constexpr bool loader_compiled() {
#if defined(__CUDA_ARCH__)
  return kLoader == PKV_LOADER_CP_ASYNC   ? __CUDA_ARCH__ >= 800
         : kLoader == PKV_LOADER_TMA_PAGES ? (__CUDA_ARCH__ >= 900 && __CUDA_ARCH__ < 1000)
                                           : __CUDA_ARCH__ >= 1000;
#else
  return false;
#endif
}

// Byte offset of 16-byte unit `unit` of row `r` in a tile of `rows` rows.
__host__ __device__ __forceinline__ uint32_t tile_unit_offset(int r, int unit, int rows) {
  const int chunk = unit >> 3, j = unit & 7;
  return static_cast<uint32_t>(((chunk * rows + r) << 7) + ((j ^ (r & 7)) << 4));
}

// Byte offset of element `col` (a multiple of 8 for 16-bit data) of row r.
template <int kElemBytes>
__device__ __forceinline__ uint32_t tile_elem_offset(int r, int col, int rows) {
  return tile_unit_offset(r, (col * kElemBytes) >> 4, rows) + ((col * kElemBytes) & 15);
}

// ldmatrix addresses of one lane walking a row's 16-byte units u0 + step (u0 = 0 or 1, step even) in a
// tile image of `rows` rows whose base is 128-byte aligned: with j = step % 8, the unit's place in its
// chunk is (step & 6) ^ u0 ^ (r & 7), so its address is the lane's address for step 0 with bits 4-6
// flipped by (step & 6) << 4, plus the chunk's offset. One XOR per load instead of the whole
// tile_unit_offset (whose per-step results a compiler otherwise keeps in registers across the tile
// loop). tests/cuda_host/test_tile_addresses.cu checks both give the same bytes.
__host__ __device__ __forceinline__ uint32_t swizzle_lane_base(uint32_t tile, int r, int u0) {
  return tile + (static_cast<uint32_t>(r) << 7) + (static_cast<uint32_t>(u0 ^ (r & 7)) << 4);
}
__host__ __device__ __forceinline__ uint32_t swizzle_step(uint32_t lane_base, int step, int rows) {
  return (lane_base ^ (static_cast<uint32_t>(step & 6) << 4)) + static_cast<uint32_t>((step >> 3) * rows) * 128u;
}

// Page-table entries of one tile, read once and shared by the K and V loads,
// the FP8 scale reads and the masks. page < 0 marks a masked row: past the
// row's keys (the table entry is then never read), an id outside [0, N), or
// (page <= -2, see hidden_page) a key before every query row's window.
struct TileRows {
  int32_t page;
  int32_t slot;
};

// A key before the window of every query row of the tile is masked like any other (zeroed, never
// in a score), because its page may be recycled and hold anything, NaN included, and 0 * NaN in
// the P V product would poison the rows. It keeps its page as -2 - page, so that a TMA box which
// starts on such a key can still load the visible keys after it in the same page. Page 2^31 - 1 (a pool
// of 2^31 pages: cp.async only, the TMA loaders refuse such pools) has no such code: it is masked as -1.
__device__ __forceinline__ int32_t hidden_page(int32_t page) { return page < 0x7fffffff ? -2 - page : -1; }

// Entry t of a tile for `key`, whose table entry `id` (read only when key < num_keys) and `slot` the
// caller found; keys outside [first_key, num_keys) and ids outside [0, num_pages) are masked. Returns 1
// when masked.
__device__ __forceinline__ int set_tile_row(TileRows *rows, int t, int64_t key, int32_t id, int32_t slot,
                                            int64_t first_key, int64_t num_keys, int64_t num_pages) {
  int32_t page = -1;
  if (key < num_keys && id >= 0 && id < num_pages)
    page = key < first_key ? hidden_page(id) : id;
  rows[t].page = page;
  rows[t].slot = page == -1 ? 0 : slot;
  return page < 0;
}

// Thread t < rows fills entry t for key k0 + t (set_tile_row). Returns 1 when masked.
__device__ __forceinline__ int fill_tile_row(TileRows *rows, int t, int64_t k0, int64_t first_key,
                                             int64_t num_keys, const pkv_index_view &table, int64_t batch,
                                             int64_t page_size, int64_t num_pages) {
  const int64_t key = k0 + t;
  if (key >= num_keys) return set_tile_row(rows, t, key, -1, 0, first_key, num_keys, num_pages);
  return set_tile_row(rows, t, key, pkv_page_of(&table, batch, key, page_size),
                      static_cast<int32_t>(pkv_slot_of(key, page_size)), first_key, num_keys, num_pages);
}

// ---- loader 1: cp.async, any page size, any arch >= sm_80 ----
// Every thread copies 16-byte units; masked rows are zero-filled without a
// read. `aligned` == false (base or strides not 16-byte multiples) uses
// plain element loads into the same image.
template <int kRows, int kThreads>
__device__ __forceinline__ void load_tile_cp_async(uint8_t *tile, const pkv_cache_view &c, const TileRows *rows,
                                                   int64_t head, int units_per_row, int es, bool aligned) {
  const uint8_t *base = static_cast<const uint8_t *>(c.data);
  for (int u = threadIdx.x; u < kRows * units_per_row; u += kThreads) {
    const int r = u / units_per_row, j = u - r * units_per_row;
    uint8_t *dst = tile + tile_unit_offset(r, j, kRows);
    const TileRows tr = rows[r];
    if (aligned) {
      const uint8_t *src = tr.page >= 0 ? base + pkv_cache_offset(&c, tr.page, tr.slot, head) * es + j * 16 : base;
      cp_async_16(dst, src, tr.page >= 0 ? 16u : 0u);
    } else {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (tr.page >= 0) {
        const uint8_t *src = base + pkv_cache_offset(&c, tr.page, tr.slot, head) * es + j * 16;
        uint8_t bytes[16];
        if (es == 2) {
#pragma unroll
          for (int i = 0; i < 8; i++) {
            const uint16_t x = reinterpret_cast<const uint16_t *>(src)[i];
            bytes[2 * i] = static_cast<uint8_t>(x & 0xff);
            bytes[2 * i + 1] = static_cast<uint8_t>(x >> 8);
          }
        } else {
#pragma unroll
          for (int i = 0; i < 16; i++) bytes[i] = src[i];
        }
        v = *reinterpret_cast<const uint4 *>(bytes);
      }
      *reinterpret_cast<uint4 *>(dst) = v;
    }
  }
}

// ---- loader 2: TMA, one 4-D box per page chunk (sm_90) ----
// box_rows = min(P, kRows) rows never leave their page (the host only picks
// this loader when P % kRows == 0 or kRows % P == 0, with box_rows % 8 == 0
// so each box starts 1024-byte aligned). Boxes of masked pages are skipped;
// rows past the keys inside a loaded box are zeroed later (zero_masked_rows).
// count_tile_pages gives the bytes the issuing thread asks the barrier to expect.
//
// The box of rows s .. s + box_rows - 1, or false when it holds no visible row. A box whose first
// rows are hidden (before every window, page <= -2) but which has a visible row after them is
// loaded whole from its first row's page; the hidden rows are zeroed afterwards.
__device__ __forceinline__ bool tile_box(const TileRows *rows, int s, int box_rows, TileRows *box) {
  *box = rows[s];
  if (box->page >= 0) return true;
  if (box->page == -1) return false;  // past the keys or a bad id: so is the rest of the box
  for (int r = s + 1; r < s + box_rows; r++)
    if (rows[r].page >= 0) {
      box->page = hidden_page(box->page);
      return true;
    }
  return false;
}
template <int kRows>
__device__ __forceinline__ uint32_t count_tile_pages(const TileRows *rows, int box_rows, int chunks) {
  uint32_t bytes = 0;
  TileRows box;
  for (int s = 0; s < kRows; s += box_rows)
    if (tile_box(rows, s, box_rows, &box)) bytes += static_cast<uint32_t>(chunks * box_rows * kChunkBytes);
  return bytes;
}
template <int kRows>
__device__ __forceinline__ void issue_tile_pages(uint8_t *tile, const CUtensorMap *map, uint64_t *bar,
                                                 const TileRows *rows, int head, int box_rows, int chunks, int es) {
  const int cols_per_chunk = kChunkBytes / es;
  for (int s = 0; s < kRows; s += box_rows) {
    TileRows tr;
    if (!tile_box(rows, s, box_rows, &tr)) continue;
    for (int c = 0; c < chunks; c++)
      tma_load_4d(tile + (c * kRows + s) * kChunkBytes, map, bar, c * cols_per_chunk, head, tr.slot, tr.page);
  }
}

// ---- loader 3: TMA tile::gather4 (sm_100) ----
// 2-D map over token rows; row of (page, slot) = pkv_cache_row (pkv_view.h)
// with rows_per_page = pkv_cache_rows_per_page of the view. Groups of 4 masked rows are
// skipped; a masked row inside a loaded group gets the legal coordinate 0
// and is zeroed afterwards, like the tail of a page.
template <int kRows>
__device__ __forceinline__ uint32_t count_tile_gather4(const TileRows *rows, int chunks) {
  uint32_t bytes = 0;
  for (int g = 0; g < kRows; g += 4)
    if (rows[g].page >= 0 || rows[g + 1].page >= 0 || rows[g + 2].page >= 0 || rows[g + 3].page >= 0)
      bytes += static_cast<uint32_t>(chunks * 4 * kChunkBytes);
  return bytes;
}
template <int kRows>
__device__ __forceinline__ void issue_tile_gather4(uint8_t *tile, const CUtensorMap *map, uint64_t *bar,
                                                   const TileRows *rows, int64_t head_col, int64_t rows_per_page,
                                                   int chunks, int es) {
  static_assert(kRows % 4 == 0, "gather4 moves 4 rows per instruction");
  const int cols_per_chunk = kChunkBytes / es;
  for (int g = 0; g < kRows; g += 4) {
    int r[4];
    bool any = false;
#pragma unroll
    for (int i = 0; i < 4; i++) {
      const TileRows tr = rows[g + i];
      r[i] = tr.page >= 0 ? static_cast<int>(pkv_cache_row(rows_per_page, tr.page, tr.slot)) : 0;
      any |= tr.page >= 0;
    }
    if (!any) continue;
    for (int c = 0; c < chunks; c++)
      tma_gather4(tile + (c * kRows + g) * kChunkBytes, map, bar, static_cast<int>(head_col + c * cols_per_chunk),
                  r[0], r[1], r[2], r[3]);
  }
}

// Zero the units of masked rows (TMA paths load whole boxes / groups), by the block's kThreads threads.
template <int kRows, int kThreads>
__device__ __forceinline__ void zero_masked_rows(uint8_t *tile, const TileRows *rows, int units_per_row) {
  for (int u = threadIdx.x; u < kRows * units_per_row; u += kThreads) {
    const int r = u / units_per_row, j = u % units_per_row;
    if (rows[r].page < 0)
      *reinterpret_cast<uint4 *>(tile + tile_unit_offset(r, j, kRows)) = make_uint4(0, 0, 0, 0);
  }
}

// 0xFFFF in each 16-bit half of w that holds NaN or inf (bf16 or f16: an exponent of all ones), else 0.
template <typename T>
__device__ __forceinline__ uint32_t nonfinite_halves(uint32_t w) {
  constexpr uint32_t e = dtype_of<T>() == PKV_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  return ((w & e) == e ? 0x0000FFFFu : 0u) | (((w >> 16) & e) == e ? 0xFFFF0000u : 0u);
}

// The rows of a 16-bit tile image (kRows rows, units_per_row 16-byte units of data) for keys key0 + r
// in [a0, a1) or [b0, b1), with `thread` of kThreads: true when one holds NaN or inf; with `zero`, those
// values become 0.
template <typename T, int kRows, int kThreads>
__device__ __forceinline__ bool rows_nonfinite(uint8_t *tile, int units_per_row, int64_t key0, int64_t a0,
                                               int64_t a1, int64_t b0, int64_t b1, bool zero,
                                               int thread = threadIdx.x) {
  bool bad = false;
  for (int u = thread; u < kRows * units_per_row; u += kThreads) {
    const int r = u / units_per_row, j = u - r * units_per_row;
    const int64_t key = key0 + r;
    if (!((key >= a0 && key < a1) || (key >= b0 && key < b1))) continue;
    uint4 *unit = reinterpret_cast<uint4 *>(tile + tile_unit_offset(r, j, kRows));
    const uint4 v = *unit;
    const uint32_t m0 = nonfinite_halves<T>(v.x), m1 = nonfinite_halves<T>(v.y);
    const uint32_t m2 = nonfinite_halves<T>(v.z), m3 = nonfinite_halves<T>(v.w);
    if ((m0 | m1 | m2 | m3) == 0u) continue;
    bad = true;
    if (zero) *unit = make_uint4(v.x & ~m0, v.y & ~m1, v.z & ~m2, v.w & ~m3);
  }
  return bad;
}

// Whether row r of a 16-bit tile image of kRows rows holds NaN or inf in its units_per_row units.
template <typename T, int kRows>
__device__ __forceinline__ bool row_nonfinite(const uint8_t *tile, int units_per_row, int r) {
  uint32_t any = 0;
  for (int j = 0; j < units_per_row; j++) {
    const uint4 v = *reinterpret_cast<const uint4 *>(tile + tile_unit_offset(r, j, kRows));
    any |= nonfinite_halves<T>(v.x) | nonfinite_halves<T>(v.y) | nonfinite_halves<T>(v.z) | nonfinite_halves<T>(v.w);
  }
  return any != 0u;
}

// ---- FP8 -> 16-bit tile, dequantized with the (token, head, group) scales ----
// src: FP8 image (1-byte elements); dst: 16-bit image of the same rows.
// Masked rows become zeros. group >= head_dim reads one scale per row: from row_scales[r] when the
// caller staged them in shared memory ahead of time (a global load here sits on the tile's critical
// path), else from the scales view.
template <typename T, int kRows, int kThreads>
__device__ __forceinline__ void convert_fp8_tile(uint8_t *dst, const uint8_t *src, const TileRows *rows,
                                                 const pkv_cache_view &scales, int64_t head, int head_dim,
                                                 int64_t group, bool e4m3, const float *row_scales = nullptr) {
  const int units_per_row = head_dim / 16;  // 16 FP8 elements per unit
  const float *sbase = static_cast<const float *>(scales.data);
  for (int u = threadIdx.x; u < kRows * units_per_row; u += kThreads) {
    const int r = u / units_per_row, j = u - r * units_per_row;
    const TileRows tr = rows[r];
    uint4 out0 = make_uint4(0, 0, 0, 0), out1 = make_uint4(0, 0, 0, 0);
    if (tr.page >= 0) {
      const uint4 raw = *reinterpret_cast<const uint4 *>(src + tile_unit_offset(r, j, kRows));
      const float *srow = sbase + pkv_cache_offset(&scales, tr.page, tr.slot, head);
      const int col0 = j * 16;
      float one_scale = group < head_dim ? 0.0f : row_scales ? row_scales[r] : __ldg(srow);
      const uint16_t *pairs = reinterpret_cast<const uint16_t *>(&raw);
      uint32_t packed[8];
#pragma unroll
      for (int i = 0; i < 8; i++) {
        float2 f = e4m3 ? e4m3x2_to_float2(pairs[i]) : e5m2x2_to_float2(pairs[i]);
        float s0 = one_scale, s1 = one_scale;
        if (group < head_dim) {
          s0 = __ldg(srow + (col0 + 2 * i) / group);
          s1 = __ldg(srow + (col0 + 2 * i + 1) / group);
        }
        packed[i] = pack2<T>(f.x * s0, f.y * s1);
      }
      out0 = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      out1 = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
    *reinterpret_cast<uint4 *>(dst + tile_unit_offset(r, 2 * j, kRows)) = out0;
    *reinterpret_cast<uint4 *>(dst + tile_unit_offset(r, 2 * j + 1, kRows)) = out1;
  }
}

// The same conversion for one scale per row already staged in shared memory (row_scales[r]), with
// the tile's shape and the FP8 format fixed at compile time: each thread's units are known
// statically (no divisions, no per-pair branches) and the pairs convert through fp8x2_to_float2's
// hardware path. Masked rows become zeros. Rows [row0, row0 + kRows) of a kTileRows-row tile, by kThreads
// threads numbered `thread` (the whole tile by the block, or one warp's own rows).
template <typename T, int kRows, int kThreads, int kD, bool kE4m3, int kTileRows = kRows>
__device__ __forceinline__ void convert_fp8_tile_row_scaled(uint8_t *dst, const uint8_t *src,
                                                            const TileRows *rows, const float *row_scales,
                                                            int row0 = 0, int thread = threadIdx.x) {
  constexpr int kUnits = kD / 16;  // 16 FP8 elements per unit
  static_assert(kRows * kUnits % kThreads == 0, "whole units per thread");
#pragma unroll
  for (int k = 0; k < kRows * kUnits / kThreads; k++) {
    const int u = thread + k * kThreads;
    const int r = row0 + u / kUnits, j = u % kUnits;
    uint4 out0 = make_uint4(0, 0, 0, 0), out1 = make_uint4(0, 0, 0, 0);
    if (rows[r].page >= 0) {
      const float s = row_scales[r];
      const uint4 raw = *reinterpret_cast<const uint4 *>(src + tile_unit_offset(r, j, kTileRows));
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t packed[8];
#pragma unroll
      for (int i = 0; i < 8; i++) {
        const uint16_t pair = static_cast<uint16_t>(words[i / 2] >> (16 * (i % 2)));
        const float2 f = fp8x2_to_float2<kE4m3>(pair);
        packed[i] = pack2<T>(f.x * s, f.y * s);
      }
      out0 = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      out1 = make_uint4(packed[4], packed[5], packed[6], packed[7]);
    }
    *reinterpret_cast<uint4 *>(dst + tile_unit_offset(r, 2 * j, kTileRows)) = out0;
    *reinterpret_cast<uint4 *>(dst + tile_unit_offset(r, 2 * j + 1, kTileRows)) = out1;
  }
}

}  // namespace pkv
