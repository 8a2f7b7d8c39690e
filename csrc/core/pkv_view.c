/* pagedkv core: typed views built from validated descriptors (pkv_view.h). */
#include "pkv_view.h"

pkv_cache_view pkv_cache_view_from(const pkv_tensor *t) {
  pkv_cache_view v;
  v.data = t->data;
  v.dtype = t->dtype;
  v.num_pages = t->sizes[0];
  v.page_size = t->sizes[1];
  v.num_heads = t->sizes[2];
  v.head_dim = t->sizes[3];
  v.stride_page = t->strides[0];
  v.stride_token = t->strides[1];
  v.stride_head = t->strides[2];
  return v;
}

pkv_rows_view pkv_rows_view_from(const pkv_tensor *t) {
  pkv_rows_view v;
  v.data = t->data;
  v.dtype = t->dtype;
  v.num_rows = t->sizes[0];
  v.num_heads = t->sizes[1];
  v.head_dim = t->sizes[2];
  v.stride_row = t->strides[0];
  v.stride_head = t->strides[1];
  return v;
}

pkv_index_view pkv_index_view_from(const pkv_tensor *t) {
  pkv_index_view v;
  v.data = (const int32_t *)t->data;
  v.rows = t->sizes[0];
  v.cols = t->ndim > 1 ? t->sizes[1] : 1;
  v.stride_row = t->strides[0];
  v.stride_col = t->ndim > 1 ? t->strides[1] : 1;
  return v;
}

void pkv_scales_broadcast(pkv_tensor *s, const pkv_tensor *cache, int64_t group, const float *groups) {
  s->data = (void *)groups;
  s->ndim = 4;
  for (int d = 0; d < 3; d++) {
    s->sizes[d] = cache->sizes[d];
    s->strides[d] = 0;
  }
  s->sizes[3] = pkv_num_groups(cache->sizes[3], group);
  s->strides[3] = 1;
}
