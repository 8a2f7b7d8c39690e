/* pagedkv CPU backend: paged_load, the ISA-free driver. Conversions and FP8
 * dequantization run in the ISA table's load_vec (pkv_cpu.h), bit-exact with the
 * scalar rules of pkv_numeric.h. */
#include <string.h>

#include "pkv_cpu.h"

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
    int64_t page = pkv_page_for_read(pkv_index_at2(&table, b, j), c.num_pages), base_row = pkv_index_at(&offsets, b);
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
