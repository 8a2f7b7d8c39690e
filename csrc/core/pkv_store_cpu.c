/* pagedkv core: paged_store and paged_load on the CPU, the ISA-free drivers.
 * Conversions and FP8 quantization run in the ISA table's store_vec/load_vec
 * (pkv_cpu.h), bit-exact with the scalar rules of pkv_numeric.h. */
#include <math.h>

#include "pkv_cpu.h"
#include "pkv_numeric.h"

/* Convert (or quantize) the Hk head vectors of one token row into the cache.
 * Same dtype and both sides dense across heads: one copy for all heads. */
static void store_token(const pkv_cpu_kernels *k, const pkv_rows_view *src, int64_t row, const pkv_cache_view *cache,
                        const pkv_cache_view *scales, int64_t page, int64_t slot, int64_t group) {
  int64_t d = cache->head_dim, heads = cache->num_heads;
  size_t ses = pkv_dtype_size(src->dtype), des = pkv_dtype_size(cache->dtype);
  const char *s = (const char *)src->data + row * src->stride_row * (int64_t)ses;
  char *dst = (char *)cache->data + pkv_cache_offset(cache, page, slot, 0) * (int64_t)des;
  if (src->dtype == cache->dtype && src->stride_head == d && cache->stride_head == d) {
    memcpy(dst, s, (size_t)(heads * d) * ses);
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
  if (a->k_scales.defined) ks = pkv_cache_view_from(&a->k_scales);
  if (a->v_cache.defined) {
    vc = pkv_cache_view_from(&a->v_cache);
    value = pkv_rows_view_from(&a->value);
    if (a->v_scales.defined) vs = pkv_cache_view_from(&a->v_scales);
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
      int64_t page = pkv_page_of(&table, b, pos, page_size), slot = pos % page_size;
      store_token(k, &key, row, &kc, &ks, page, slot, a->quant_group);
      if (vc.data) store_token(k, &value, row, &vc, &vs, page, slot, a->quant_group);
    }
  }
}

/* ---- paged_load: work items are (row b, page j) pairs ---- */

/* Table columns any row reads: a table may be far wider than its rows need
 * (even broadcast to 2^40 columns), so work items never walk the unused ones. */
static int64_t load_cols(const pkv_load_args *a) {
  pkv_index_view lengths = pkv_index_view_from(&a->seq_lens);
  int64_t rows = a->lookup_table.sizes[0], cols = a->lookup_table.sizes[1], page_size = a->cache.sizes[1], need = 0;
  for (int64_t b = 0; b < rows; b++) {
    int64_t len = pkv_index_at(&lengths, b), pages = len > 0 ? pkv_pages_for(len, page_size) : 0;
    if (pages > need) need = pages;
  }
  return need < cols ? need : cols;
}

int64_t pkv_load_cpu_work(const pkv_load_args *a) { return a->lookup_table.sizes[0] * load_cols(a); }

void pkv_load_cpu(const pkv_load_args *a, int64_t begin, int64_t end) {
  pkv_index_view offsets = pkv_index_view_from(&a->output_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->seq_lens);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  pkv_cache_view c = pkv_cache_view_from(&a->cache);
  pkv_cache_view s = {0};
  if (a->scales.defined) s = pkv_cache_view_from(&a->scales);
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  int64_t cols = load_cols(a), d = c.head_dim, heads = c.num_heads, group = a->quant_group;
  size_t es = pkv_dtype_size(out.dtype), ces = pkv_dtype_size(c.dtype);
  const pkv_cpu_kernels *k = pkv_cpu_kernels_get();
  /* same dtype, dense heads and tokens on both sides: a page run is one copy */
  int dense_heads = c.dtype == out.dtype && c.stride_head == d && out.stride_head == d;
  int dense_tokens = dense_heads && c.stride_token == heads * d && out.stride_row == heads * d;
  for (int64_t item = begin; item < end; item++) {
    int64_t b = item / cols, j = item % cols;
    int64_t len = pkv_index_at(&lengths, b), t0 = j * c.page_size;
    if (t0 >= len) continue;
    int64_t t1 = t0 + c.page_size < len ? t0 + c.page_size : len;
    int64_t page = pkv_index_at2(&table, b, j), base_row = pkv_index_at(&offsets, b);
    if (dense_tokens) {
      memcpy((char *)out.data + (base_row + t0) * out.stride_row * (int64_t)es,
             (const char *)c.data + pkv_cache_offset(&c, page, 0, 0) * (int64_t)ces, (size_t)((t1 - t0) * heads * d) * es);
      continue;
    }
    for (int64_t t = t0; t < t1; t++) {
      char *dst_row = (char *)out.data + (base_row + t) * out.stride_row * (int64_t)es;
      const char *src_row = (const char *)c.data + pkv_cache_offset(&c, page, t - t0, 0) * (int64_t)ces;
      if (dense_heads) {
        memcpy(dst_row, src_row, (size_t)(heads * d) * es);
        continue;
      }
      for (int64_t h = 0; h < heads; h++) {
        const float *sc = s.data ? (const float *)s.data + pkv_cache_offset(&s, page, t - t0, h) : NULL;
        k->load_vec(src_row + h * c.stride_head * (int64_t)ces, c.dtype, sc, group, d,
                    dst_row + h * out.stride_head * (int64_t)es, out.dtype);
      }
    }
  }
}
