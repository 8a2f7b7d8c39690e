// pagedkv CUDA backend: what the files of flash_attn_paged_sparse share.
//
// flash_attn_paged_sparse.cu holds the tiled kernel (one CTA per query row
// and KV head; listed K/V rows staged in shared memory by cp.async or TMA
// gather4) and its launch; flash_attn_sparse_portable.cu holds the portable
// warp-per-(row, head) kernel that serves what the tiled one does not
// (float32 caches, other head sizes, too little shared memory);
// flash_attn_sparse_plan.cu holds the host plan (which of the two runs, with
// which loader) and the C entry points, and instantiates no kernel. Shared
// here: the arguments of both kernels (SparseParams), the tiled kernel's
// parameters and shared-memory layout (the plan builds them, the kernel reads
// them) and the launch entry points the plan calls.
#pragma once

#include "tile.cuh"

namespace pkv {

struct SparseParams {
  pkv_rows_view q, out;               // [T, Hq, D], [T, Hq, Dv]
  pkv_cache_view k, v;                // [N, P, Hk, D], [N, P, Hk, Dv]
  pkv_cache_view k_scales, v_scales;  // f32 [N, P, Hk, ceil(D/G)] (FP8) or zeros
  const int32_t *indices;             // [T, Hk or 1, K]
  int64_t ix_stride_t, ix_stride_h, ix_stride_k, ix_heads, ix_count;
  const float *sinks;  // [Hq] or null
  int64_t sinks_stride;
  int64_t heads_per_kv, quant_group;  // Hq / Hk; channels per FP8 scale
  float score_scale, softcap;  // scale; softcap (0: off)
  // packed MLA rows (portable kernel only): keys have k_tail_dim more bfloat16 channels than k's D,
  // k_tail_offset bytes after each K row's start (pkv_attn_args.k_tail_dim)
  int64_t k_tail_dim, k_tail_offset, k_elem_bytes;
};

// ---------------------------------------------------------------- the tiled kernel

// Query heads per CTA: bounds the per-thread score partials and P V
// accumulators (registers). Larger groups run several CTAs per (row, KV
// head), each reading the listed rows again.
constexpr int kMaxHeads = 16;

// (D, Dv) pairs with a tiled instantiation (launch_sparse_tiled): the dense kernel's head sizes
// and MLA's 576-wide latent rows with V as their first 512 columns. Packed MLA rows (kv_format) are
// (512, 512) e4m3 with V from K and a 64-channel bf16 K tail (kPackedTail), loaded as a second tile
// through its own byte-offset view of the rows.
constexpr int kTiledHeadDims[][2] = {{64, 64}, {96, 96}, {128, 128}, {256, 256}, {576, 512}};
constexpr int kPackedTail = 64;

// Byte offsets into the (1024-aligned) dynamic shared memory; sized per call
// on the host (heads per CTA, FP8 groups, V from K), used as is by the kernel.
// kTileRows, kWarps and kRowBuffers are flash_attn_paged_sparse.cu's.
struct SparseSmem {
  int stage_bytes;  // one stage: K tile, then the V tile (none when V is read from the K rows)
  int v_tile;       // offset of the V tile within a stage
  int tail_tile;    // offset of K's tail tile within a stage (packed rows' rope), after K and V
  int q;            // float [heads][D + tail]: the CTA's query rows
  int scores;       // float [kWarps][heads][kTileRows]: score partials, one per warp's slice of D
  int probs;        // float [heads][kTileRows]: this tile's 2^(s - m)
  int alpha;        // float [heads]: this tile's rescale of the accumulators
  int inv;          // float [heads]: the softmax normaliser (epilogue)
  int unit_group;   // int [D / 8]: FP8 scale group of each 8-channel unit
  int rows;         // TileRows [kRowBuffers][kTileRows]
  int bars;         // uint64_t [2]: TMA stage barriers
  int k_scales;     // float [2][kTileRows][k_groups] (FP8)
  int v_scales;     // float [2][kTileRows][v_groups] (FP8, separate V)
  int bytes;        // total
};

struct TiledParams {
  SparseParams s;
  SparseSmem smem;
  float score_scale;    // scale * log2(e); scale / softcap with a softcap
  float softcap_log2;   // softcap * log2(e); 0: no softcap
  int heads_per_cta;    // min(Hq / Hk, kMaxHeads)
  int v_from_k;         // V is the first Dv columns of the K rows (K-only / MLA): only K is loaded
  int kv_aligned;       // 16-byte bases and strides: cp.async, else plain loads
  int k_groups, v_groups;  // FP8 scales per row of K, V
  int64_t rows_per_page;   // gather4: 2-D map rows per page (pkv_cache_rows_per_page)
  pkv_cache_view tail;     // K's tail as a bf16 view of the rows (packed rows' rope); head_dim 0: none
};

// The CTA's shared-memory layout for these sizes (flash_attn_paged_sparse.cu).
SparseSmem sparse_smem(int d, int dv, int es, bool v_from_k, int heads, int k_groups, int v_groups, int tail);
// Largest dynamic shared memory a kernel of `device` may opt into, read once per device
// (flash_attn_paged_sparse.cu).
int device_smem_optin(int device);
// Launches the tiled kernel for p's (D, Dv) and cache dtype with `loader` (cp.async, or
// tma-gather4 through the maps kmap / vmap, which cp.async ignores) on a grid of (query rows,
// KV heads, chunks of kMaxHeads query heads); cudaErrorInvalidConfiguration past the grid's
// limits (flash_attn_paged_sparse.cu).
cudaError_t launch_sparse_tiled(const TiledParams &p, pkv_loader loader, const CUtensorMap &kmap,
                                const CUtensorMap &vmap, cudaStream_t stream);

// ---------------------------------------------------------------- the portable kernel

// The portable kernel (flash_attn_sparse_portable.cu): any dtypes, head sizes
// up to kSparsePortableMaxDv, plain global loads.
constexpr int kSparsePortableMaxDv = 576;
cudaError_t launch_sparse_portable(const SparseParams &p, cudaStream_t stream);

}  // namespace pkv
