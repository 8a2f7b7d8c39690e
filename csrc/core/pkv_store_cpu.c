/* pagedkv core: paged_store and paged_load on the CPU. */
#include <math.h>

#include "pkv_numeric.h"
#include "pkv_ops.h"

/* Quantize or convert one head vector x[0..d) into the cache at dst. */
static void store_head(const pkv_rows_view *src, int64_t row, int64_t head, const pkv_cache_view *cache,
                       int64_t dst, const pkv_cache_view *scales, int64_t scale_dst, int64_t group) {
  const char *base = (const char *)src->data;
  int64_t src_off = row * src->stride_row + head * src->stride_head;
  int64_t d = cache->head_dim;
  if (!pkv_dtype_is_fp8(cache->dtype)) {
    if (src->dtype == cache->dtype) {
      size_t es = pkv_dtype_size(src->dtype);
      memcpy((char *)cache->data + dst * (int64_t)es, base + src_off * (int64_t)es, (size_t)d * es);
      return;
    }
    for (int64_t i = 0; i < d; i++)
      pkv_store_f32(cache->data, dst + i, cache->dtype, pkv_load_f32(base, src_off + i, src->dtype));
    return;
  }
  uint8_t *q = (uint8_t *)cache->data + dst;
  float *s = (float *)scales->data + scale_dst;
  for (int64_t g0 = 0, gi = 0; g0 < d; g0 += group, gi++) {
    int64_t g1 = g0 + group < d ? g0 + group : d;
    float amax = 0.0f;
    for (int64_t i = g0; i < g1; i++) {
      float v = fabsf(pkv_load_f32(base, src_off + i, src->dtype));
      if (v != v) { /* NaN makes the group's scale NaN, as torch's amax does */
        amax = v;
        break;
      }
      if (v > amax) amax = v;
    }
    float scale = pkv_fp8_scale_for(amax, cache->dtype);
    for (int64_t i = g0; i < g1; i++) q[i] = pkv_fp8_quantize(pkv_load_f32(base, src_off + i, src->dtype), scale, cache->dtype);
    s[gi] = scale;
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
      for (int64_t h = 0; h < kc.num_heads; h++) {
        store_head(&key, row, h, &kc, pkv_cache_offset(&kc, page, slot, h), &ks,
                   ks.data ? pkv_cache_offset(&ks, page, slot, h) : 0, a->quant_group);
        if (vc.data)
          store_head(&value, row, h, &vc, pkv_cache_offset(&vc, page, slot, h), &vs,
                     vs.data ? pkv_cache_offset(&vs, page, slot, h) : 0, a->quant_group);
      }
    }
  }
}

/* ---- paged_load: work items are (row b, page j) pairs ---- */

int64_t pkv_load_cpu_work(const pkv_load_args *a) { return a->lookup_table.sizes[0] * a->lookup_table.sizes[1]; }

void pkv_load_cpu(const pkv_load_args *a, int64_t begin, int64_t end) {
  pkv_index_view offsets = pkv_index_view_from(&a->output_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->seq_lens);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  pkv_cache_view c = pkv_cache_view_from(&a->cache);
  pkv_cache_view s = {0};
  if (a->scales.defined) s = pkv_cache_view_from(&a->scales);
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  int64_t cols = table.cols, d = c.head_dim, group = a->quant_group;
  size_t es = pkv_dtype_size(out.dtype);
  for (int64_t item = begin; item < end; item++) {
    int64_t b = item / cols, j = item % cols;
    int64_t len = pkv_index_at(&lengths, b), t0 = j * c.page_size;
    if (t0 >= len) continue;
    int64_t t1 = t0 + c.page_size < len ? t0 + c.page_size : len;
    int64_t page = pkv_index_at2(&table, b, j), base_row = pkv_index_at(&offsets, b);
    for (int64_t t = t0; t < t1; t++) {
      for (int64_t h = 0; h < c.num_heads; h++) {
        int64_t src = pkv_cache_offset(&c, page, t - t0, h);
        int64_t dst = (base_row + t) * out.stride_row + h * out.stride_head;
        if (c.dtype == out.dtype) {
          memcpy((char *)out.data + dst * (int64_t)es, (const char *)c.data + src * (int64_t)es, (size_t)d * es);
        } else if (pkv_dtype_is_fp8(c.dtype)) {
          const float *sc = (const float *)s.data + pkv_cache_offset(&s, page, t - t0, h);
          for (int64_t i = 0; i < d; i++)
            pkv_store_f32(out.data, dst + i, out.dtype, pkv_load_f32(c.data, src + i, c.dtype) * sc[i / group]);
        } else {
          for (int64_t i = 0; i < d; i++)
            pkv_store_f32(out.data, dst + i, out.dtype, pkv_load_f32(c.data, src + i, c.dtype));
        }
      }
    }
  }
}
