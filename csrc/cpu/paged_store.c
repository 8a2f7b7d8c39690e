/* pagedkv CPU backend: paged_store, the ISA-free driver.
 * Conversions and FP8 quantization run in the ISA table's store_vec/load_vec
 * (pkv_cpu.h), bit-exact with the scalar rules of pkv_numeric.h. */
#include <math.h>

#include "pkv_cpu.h"
#include "../core/pkv_numeric.h"

/* Convert (or quantize) the Hk head vectors of one token row into the cache.
 * Same dtype and both sides dense across heads: one copy for all heads. FP8 with a per-tensor scale
 * (`fixed_scale`, a pointer to it; NULL otherwise): quantized with it, no scale written. */
static void store_token(const pkv_cpu_kernels *k, const pkv_rows_view *src, int64_t row, const pkv_cache_view *cache,
                        const pkv_cache_view *scales, const float *fixed_scale, int64_t page, int64_t slot,
                        int64_t group) {
  int64_t d = cache->head_dim, heads = cache->num_heads;
  size_t ses = pkv_dtype_size(src->dtype), des = pkv_dtype_size(cache->dtype);
  const char *s = (const char *)src->data + row * src->stride_row * (int64_t)ses;
  char *dst = (char *)cache->data + pkv_cache_offset(cache, page, slot, 0) * (int64_t)des;
  if (src->dtype == cache->dtype && src->stride_head == d && cache->stride_head == d) {
    memcpy(dst, s, (size_t)(heads * d) * ses);
    return;
  }
  if (fixed_scale) {
    for (int64_t h = 0; h < heads; h++)
      k->store_vec_scaled(s + h * src->stride_head * (int64_t)ses, src->dtype, d,
                          (uint8_t *)dst + h * cache->stride_head, cache->dtype, *fixed_scale);
    return;
  }
  for (int64_t h = 0; h < heads; h++) {
    float *sc = scales->data ? (float *)scales->data + pkv_cache_offset(scales, page, slot, h) : NULL;
    k->store_vec(s + h * src->stride_head * (int64_t)ses, src->dtype, d, dst + h * cache->stride_head * (int64_t)des,
                 cache->dtype, sc, group);
  }
}

int64_t pkv_store_cpu_work(const pkv_store_args *a) {
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  return pkv_index_at(&offsets, offsets.rows - 1);
}

void pkv_store_cpu(const pkv_store_args *a, int64_t begin, int64_t end) {
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->cache_lengths);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  pkv_rows_view key = pkv_rows_view_from(&a->key);
  pkv_cache_view kc = pkv_cache_view_from(&a->k_cache);
  pkv_cache_view ks = {0}, vc = {0}, vs = {0};
  pkv_rows_view value = {0};
  const float *k_fixed = pkv_scales_per_tensor(&a->k_scales) ? (const float *)a->k_scales.data : NULL;
  const float *v_fixed = pkv_scales_per_tensor(&a->v_scales) ? (const float *)a->v_scales.data : NULL;
  if (a->k_scales.defined && !k_fixed) ks = pkv_cache_view_from(&a->k_scales);
  if (a->v_cache.defined) {
    vc = pkv_cache_view_from(&a->v_cache);
    value = pkv_rows_view_from(&a->value);
    if (a->v_scales.defined && !v_fixed) vs = pkv_cache_view_from(&a->v_scales);
  }
  int64_t batch = lengths.rows, page_size = kc.page_size;
  const pkv_cpu_kernels *k = pkv_cpu_kernels_get();
  /* first row b whose token range contains `begin` (binary search) */
  int64_t lo = 0, hi = batch;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    if (pkv_index_at(&offsets, mid + 1) <= begin) lo = mid + 1;
    else hi = mid;
  }
  for (int64_t b = lo, row = begin; b < batch && row < end; b++) {
    int64_t row_end = pkv_index_at(&offsets, b + 1);
    int64_t start = pkv_index_at(&offsets, b), cached = pkv_cache_length(&lengths, b);
    for (; row < row_end && row < end; row++) {
      int64_t pos = cached + (row - start);
      int32_t page = pkv_page_of(&table, b, pos, page_size);
      int64_t slot = pkv_slot_of(pos, page_size);
      /* an id changed since the check (pkv_page_for_read): the row is not written anywhere */
      if (!pkv_page_in_pool(page, kc.num_pages) || (vc.data && !pkv_page_in_pool(page, vc.num_pages))) continue;
      store_token(k, &key, row, &kc, &ks, k_fixed, page, slot, a->quant_group);
      if (vc.data) store_token(k, &value, row, &vc, &vs, v_fixed, page, slot, a->quant_group);
    }
  }
}
