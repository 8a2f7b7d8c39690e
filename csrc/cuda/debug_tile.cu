// pagedkv CUDA backend: a debug kernel that fills one K tile with a chosen
// loader and copies the shared-memory image out, so tests can check that
// cp.async, TMA-per-page and TMA-gather4 write the same bytes (the layout in
// tile.cuh) and that masked rows come out as zeros.
#include "tile.cuh"

namespace pkv {

namespace {

constexpr int kDebugThreads = 128;

struct DebugParams {
  pkv_cache_view cache;
  pkv_index_view table, lengths;
  int64_t batch, head, first_key;
  int64_t rows_per_page;
  int row_bytes, units_per_row, es, box_rows, aligned;
  uint8_t *out;
};

template <int kRows, int kLoader>
__device__ void debug_body(const DebugParams &p, const CUtensorMap *map, uint8_t *smem) {
  TileRows *rows = reinterpret_cast<TileRows *>(smem + kRows * p.row_bytes);
  uint64_t *bar = reinterpret_cast<uint64_t *>(rows + kRows);
  int64_t keys = pkv_index_at(&p.lengths, p.batch);
  const int64_t table_keys = p.table.cols * p.cache.page_size;
  keys = keys < table_keys ? keys : table_keys;
  // bytes never written by a loader (e.g. the unused half of a 64-byte row) read as zero
  for (int i = threadIdx.x; i < kRows * p.row_bytes / 16; i += kDebugThreads)
    reinterpret_cast<uint4 *>(smem)[i] = make_uint4(0, 0, 0, 0);
  if (threadIdx.x < kRows)
    fill_tile_row(rows, threadIdx.x, p.first_key, 0, keys, p.table, p.batch, p.cache.page_size, p.cache.num_pages);
  if constexpr (kLoader != PKV_LOADER_CP_ASYNC) {
    if (threadIdx.x == 0) {
      mbar_init(bar, 1);
      fence_mbar_init();
    }
    fence_proxy_async_smem();  // the zeroing above precedes the TMA writes
  }
  __syncthreads();
  const int chunks = p.row_bytes / kChunkBytes;
  if constexpr (kLoader == PKV_LOADER_CP_ASYNC) {
    load_tile_cp_async<kRows, kDebugThreads>(smem, p.cache, rows, p.head, p.units_per_row, p.es, p.aligned);
    cp_async_commit();
    cp_async_wait<0>();
  } else {
    if (threadIdx.x == 0) {
      if constexpr (kLoader == PKV_LOADER_TMA_PAGES) {
        mbar_arrive_expect_tx(bar, count_tile_pages<kRows>(rows, p.box_rows, chunks));
        issue_tile_pages<kRows>(smem, map, bar, rows, static_cast<int>(p.head), p.box_rows, chunks, p.es);
      } else {
        mbar_arrive_expect_tx(bar, count_tile_gather4<kRows>(rows, chunks));
        issue_tile_gather4<kRows>(smem, map, bar, rows, p.head * p.cache.stride_head, p.rows_per_page, chunks, p.es);
      }
    }
    mbar_wait(bar, 0);
    __syncthreads();
    zero_masked_rows<kRows, kDebugThreads>(smem, rows, p.units_per_row);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * p.row_bytes / 16; i += kDebugThreads)
    reinterpret_cast<uint4 *>(p.out)[i] = reinterpret_cast<const uint4 *>(smem)[i];
}

template <int kRows, int kLoader>
__global__ void __launch_bounds__(kDebugThreads)
    debug_tile_kernel(const __grid_constant__ DebugParams p, const __grid_constant__ CUtensorMap map) {
  if constexpr (loader_compiled<kLoader>()) {
    extern __shared__ uint8_t smem_raw[];
    uint8_t *smem = smem_align_1024(smem_raw);
    debug_body<kRows, kLoader>(p, &map, smem);
  } else {
    __trap();
  }
}

template <int kRows>
cudaError_t launch_debug(const DebugParams &p, pkv_loader loader, const CUtensorMap &map, cudaStream_t stream) {
  const int smem = kRows * p.row_bytes + kRows * static_cast<int>(sizeof(TileRows)) + 16 + 1024;
  switch (loader) {
  case PKV_LOADER_CP_ASYNC:
    PKV_CUDA_TRY(cudaFuncSetAttribute(debug_tile_kernel<kRows, PKV_LOADER_CP_ASYNC>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    debug_tile_kernel<kRows, PKV_LOADER_CP_ASYNC><<<1, kDebugThreads, smem, stream>>>(p, map);
    break;
  case PKV_LOADER_TMA_PAGES:
    PKV_CUDA_TRY(cudaFuncSetAttribute(debug_tile_kernel<kRows, PKV_LOADER_TMA_PAGES>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    debug_tile_kernel<kRows, PKV_LOADER_TMA_PAGES><<<1, kDebugThreads, smem, stream>>>(p, map);
    break;
  case PKV_LOADER_TMA_GATHER4:
    PKV_CUDA_TRY(cudaFuncSetAttribute(debug_tile_kernel<kRows, PKV_LOADER_TMA_GATHER4>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    debug_tile_kernel<kRows, PKV_LOADER_TMA_GATHER4><<<1, kDebugThreads, smem, stream>>>(p, map);
    break;
  default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace
}  // namespace pkv

extern "C" {

pkv_status pkv_cuda_debug_tile_plan(const pkv_tensor *cache, const pkv_tensor *lookup_table,
                                    const pkv_tensor *seq_lens, int64_t batch, int64_t kv_head, int64_t first_key,
                                    int device, pkv_loader loader, pkv_cuda_tile_geometry *g, pkv_error *err) {
  const char *op = "debug_load_tile";
  if (cache->ndim != 4 || lookup_table->ndim != 2 || seq_lens->ndim != 1 || lookup_table->dtype != PKV_DTYPE_I32 ||
      seq_lens->dtype != PKV_DTYPE_I32)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: expects cache [N, P, Hk, D], int32 lookup_table [B, max_pages] and "
                    "int32 seq_lens [B]", op);
  const int64_t es = static_cast<int64_t>(pkv_dtype_size(cache->dtype));
  if (cache->dtype == PKV_DTYPE_F32)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: float32 caches are not supported on CUDA", op);
  const int64_t d = cache->sizes[3];
  if (d < 16 || d > 256 || (d * es) % 16 != 0 || cache->strides[3] != 1)
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: head size %lld is not supported on CUDA", op, (long long)d);
  if (batch < 0 || batch >= seq_lens->sizes[0] || lookup_table->sizes[0] != seq_lens->sizes[0] || kv_head < 0 ||
      kv_head >= cache->sizes[2])
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: batch %lld or kv_head %lld out of range", op, (long long)batch,
                    (long long)kv_head);
  const int64_t rows = pkv::attn_tile_keys(static_cast<int>(d));
  if (first_key < 0 || first_key % rows != 0)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: first_key must be a non-negative multiple of the tile size %lld", op,
                    (long long)rows);
  if (!pkv_cuda_loader_available(device, loader))
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: loader %s is not available on CUDA device %d", op,
                    pkv_loader_name(loader), device);
  pkv_cache_view c = pkv_cache_view_from(cache);
  if (loader == PKV_LOADER_TMA_PAGES && (!pkv::tma_view_ok(c) || pkv::tma_box_rows(c.page_size, rows) == 0))
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: page size %lld does not fit the %s loader", op,
                    (long long)c.page_size, pkv_loader_name(loader));
  if (loader == PKV_LOADER_TMA_GATHER4 && !pkv::tma_rows_ok(c))
    return pkv_fail(err, PKV_ERR_UNSUPPORTED, "%s: the cache view does not fit the %s loader", op,
                    pkv_loader_name(loader));
  g->rows = rows;
  g->row_bytes = pkv::tile_row_bytes(static_cast<int>(d), static_cast<int>(es));
  g->bytes = g->rows * g->row_bytes;
  return PKV_OK;
}

cudaError_t pkv_cuda_debug_load_tile(const pkv_tensor *cache, const pkv_tensor *lookup_table,
                                     const pkv_tensor *seq_lens, int64_t batch, int64_t kv_head, int64_t first_key,
                                     pkv_loader loader, void *out, cudaStream_t stream) {
  using namespace pkv;
  DebugParams p{};
  p.cache = pkv_cache_view_from(cache);
  p.table = pkv_index_view_from(lookup_table);
  p.lengths = pkv_index_view_from(seq_lens);
  p.batch = batch;
  p.head = kv_head;
  p.first_key = first_key;
  p.es = static_cast<int>(pkv_dtype_size(p.cache.dtype));
  p.row_bytes = tile_row_bytes(static_cast<int>(p.cache.head_dim), p.es);
  p.units_per_row = static_cast<int>(p.cache.head_dim * p.es / 16);
  const int rows = attn_tile_keys(static_cast<int>(p.cache.head_dim));
  p.box_rows = tma_box_rows(p.cache.page_size, rows);
  p.rows_per_page = pkv_cache_rows_per_page(&p.cache);
  p.aligned = pkv_cache_aligned(&p.cache, p.es, 16);
  p.out = static_cast<uint8_t *>(out);
  CUtensorMap map{};
  if (loader == PKV_LOADER_TMA_PAGES) PKV_CUDA_TRY(tma_map_pages(&map, p.cache, p.box_rows));
  if (loader == PKV_LOADER_TMA_GATHER4) PKV_CUDA_TRY(tma_map_rows(&map, p.cache));
  return rows == 64 ? launch_debug<64>(p, loader, map, stream) : launch_debug<32>(p, loader, map, stream);
}

}  // extern "C"
