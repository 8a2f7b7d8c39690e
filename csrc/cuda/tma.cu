// pagedkv CUDA backend: TMA tensor-map encoding on the host.
//
// cuTensorMapEncodeTiled is a driver API; it is reached through the
// runtime's cudaGetDriverEntryPointByVersion so the extension never links
// libcuda. Encoded maps are cached by their full key (encoding costs host
// time on every call otherwise); a map is passed to kernels by value as a
// __grid_constant__ parameter, so a captured CUDA graph keeps its copy.
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled_v12000

#include <cstring>
#include <mutex>

#include "tma.cuh"

namespace pkv {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void *p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    // 12000: the driver ABI version that introduced cuTensorMapEncodeTiled.
    cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &q);
    if (e != cudaSuccess || q != cudaDriverEntryPointSuccess) p = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

struct MapKey {
  void *base;
  uint32_t rank, elem_bytes;
  uint64_t dims[4], strides[3];
  uint32_t box[4];
  bool operator==(const MapKey &o) const { return std::memcmp(this, &o, sizeof *this) == 0; }
};

struct MapEntry {
  MapKey key;
  CUtensorMap map;
};

// A small ring: a model has a few (layer, K/V) pools per device; entries are
// overwritten oldest first.
constexpr int kMapCacheSize = 256;
std::mutex g_map_mutex;
MapEntry g_maps[kMapCacheSize];
int g_map_count = 0, g_map_next = 0;

// Each thread also keeps the maps it used last (a decode step asks for the
// same K and V maps of every layer again), so the common hit takes no lock.
constexpr int kThreadMapCacheSize = 8;
thread_local MapEntry t_maps[kThreadMapCacheSize];
thread_local int t_map_count = 0, t_map_next = 0;

void remember_in_thread(const MapKey &key, const CUtensorMap &map) {
  MapEntry &slot = t_maps[t_map_next];
  slot.key = key;
  slot.map = map;
  t_map_next = (t_map_next + 1) % kThreadMapCacheSize;
  if (t_map_count < kThreadMapCacheSize) t_map_count++;
}

cudaError_t encode_cached(CUtensorMap *out, const MapKey &key) {
  for (int i = 0; i < t_map_count; i++)
    if (t_maps[i].key == key) {
      *out = t_maps[i].map;
      return cudaSuccess;
    }
  std::lock_guard<std::mutex> lock(g_map_mutex);
  for (int i = 0; i < g_map_count; i++)
    if (g_maps[i].key == key) {
      *out = g_maps[i].map;
      remember_in_thread(key, *out);
      return cudaSuccess;
    }
  PFN_cuTensorMapEncodeTiled_v12000 enc = encode_fn();
  if (!enc) return cudaErrorNotSupported;
  CUtensorMap map;
  cuuint32_t elem_strides[4] = {1, 1, 1, 1};
  CUtensorMapDataType type = key.elem_bytes == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16;
  CUresult r = enc(&map, type, key.rank, key.base, key.dims, key.strides, key.box, elem_strides,
                   CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                   CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
  MapEntry &slot = g_maps[g_map_next];
  slot.key = key;
  slot.map = map;
  g_map_next = (g_map_next + 1) % kMapCacheSize;
  if (g_map_count < kMapCacheSize) g_map_count++;
  *out = map;
  remember_in_thread(key, map);
  return cudaSuccess;
}

}  // namespace

bool tma_view_ok(const pkv_cache_view &c) {
  const int64_t es = static_cast<int64_t>(pkv_dtype_size(c.dtype));
  if (es != 1 && es != 2) return false;
  if (!pkv_cache_aligned(&c, es, 16)) return false;  // base and strides
  if ((c.head_dim * es) % kSwizzleBytes != 0) return false;
  // positive strides below 2^40 bytes, nested (each dim fits in the next stride)
  const int64_t strides[3] = {c.stride_head * es, c.stride_token * es, c.stride_page * es};
  for (int64_t s : strides)
    if (s <= 0 || s >= (int64_t(1) << 40)) return false;
  if (c.num_heads > 1 && strides[0] < c.head_dim * es) return false;
  if (c.page_size > 1 && strides[1] < strides[0] * c.num_heads) return false;
  if (c.num_pages > 1 && strides[2] < strides[1] * c.page_size) return false;
  if (c.num_pages < 1 || c.num_pages > (int64_t(1) << 31) - 1) return false;
  return true;
}

bool tma_rows_ok(const pkv_cache_view &c) {
  if (!tma_view_ok(c)) return false;
  if (c.stride_page % c.stride_token != 0) return false;
  const int64_t cols = (c.num_heads - 1) * c.stride_head + c.head_dim;
  if (cols > c.stride_token) return false;
  return pkv_cache_num_rows(&c) < (int64_t(1) << 31);
}

cudaError_t tma_map_rows(CUtensorMap *map, const pkv_cache_view &c) {
  if (!tma_rows_ok(c)) return cudaErrorNotSupported;
  const uint32_t es = static_cast<uint32_t>(pkv_dtype_size(c.dtype));
  MapKey key{};
  key.base = c.data;
  key.rank = 2;
  key.elem_bytes = es;
  key.dims[0] = static_cast<uint64_t>((c.num_heads - 1) * c.stride_head + c.head_dim);
  key.dims[1] = static_cast<uint64_t>(pkv_cache_num_rows(&c));
  key.strides[0] = static_cast<uint64_t>(c.stride_token) * es;
  key.box[0] = kSwizzleBytes / es;
  key.box[1] = 1;  // gather4: dimension-1 box must be one row
  return encode_cached(map, key);
}

cudaError_t tma_map_pages(CUtensorMap *map, const pkv_cache_view &c, int box_rows) {
  if (!tma_view_ok(c) || box_rows < 1 || box_rows > 256 || box_rows > c.page_size) return cudaErrorNotSupported;
  const uint32_t es = static_cast<uint32_t>(pkv_dtype_size(c.dtype));
  MapKey key{};
  key.base = c.data;
  key.rank = 4;
  key.elem_bytes = es;
  key.dims[0] = static_cast<uint64_t>(c.head_dim);
  key.dims[1] = static_cast<uint64_t>(c.num_heads);
  key.dims[2] = static_cast<uint64_t>(c.page_size);
  key.dims[3] = static_cast<uint64_t>(c.num_pages);
  key.strides[0] = static_cast<uint64_t>(c.stride_head) * es;
  key.strides[1] = static_cast<uint64_t>(c.stride_token) * es;
  key.strides[2] = static_cast<uint64_t>(c.stride_page) * es;
  key.box[0] = kSwizzleBytes / es;
  key.box[1] = 1;
  key.box[2] = static_cast<uint32_t>(box_rows);
  key.box[3] = 1;
  return encode_cached(map, key);
}

}  // namespace pkv
