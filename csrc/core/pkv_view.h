/* pagedkv core: typed views and the shared index math.
 *
 * A view is a POD passed by value to CPU and CUDA kernels. Every layout of
 * the contract (collection, FA3 fallback, separate pools, continuous
 * batching) is just a different set of strides; no kernel knows about
 * layers. Offsets are int64 so pools over 2^31 elements work. */
#ifndef PKV_VIEW_H
#define PKV_VIEW_H

#include "pkv_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* k_cache / v_cache / scales: [num_pages, page_size, num_heads, head_dim], stride(-1) == 1.
 * For scales head_dim is the number of groups and dtype is F32. */
typedef struct {
  void *data;
  pkv_dtype dtype;
  int64_t num_pages, page_size, num_heads, head_dim;
  int64_t stride_page, stride_token, stride_head;
} pkv_cache_view;

/* Ragged token rows (key, value, q, out, load output): [num_rows, num_heads, head_dim]. */
typedef struct {
  void *data;
  pkv_dtype dtype;
  int64_t num_rows, num_heads, head_dim;
  int64_t stride_row, stride_head;
} pkv_rows_view;

/* int32 [rows, cols] with any strides (lookup_table), or [rows] (lengths, offsets). */
typedef struct {
  const int32_t *data;
  int64_t rows, cols;
  int64_t stride_row, stride_col;
} pkv_index_view;

/* ---- accessors, modelled on the seed cache types ---- */

/* Element offset of (page, slot, head, 0): the seed's block_paged_ptr. */
PKV_HD int64_t pkv_cache_offset(const pkv_cache_view *c, int64_t page, int64_t slot, int64_t head) {
  return page * c->stride_page + slot * c->stride_token + head * c->stride_head;
}

/* Token rows one page stride spans, when the cache is seen as a 2-D "[rows, Hk*D]" view
 * (a page stride that is a whole number of token rows); 0 for a zero token stride. */
PKV_HD int64_t pkv_cache_rows_per_page(const pkv_cache_view *c) {
  return c->stride_token != 0 ? c->stride_page / c->stride_token : 0;
}

/* Row count of the 2-D "[rows, Hk*D]" view a TMA map covers when a page
 * stride is a whole number of token rows: the seed's num_kv_rows. */
PKV_HD int64_t pkv_cache_num_rows(const pkv_cache_view *c) {
  return c->num_pages == 0 ? 0 : (c->num_pages - 1) * pkv_cache_rows_per_page(c) + c->page_size;
}

/* 2-D row of (page, slot) in that view: the seed's get_tma_row / row_idx. */
PKV_HD int64_t pkv_cache_row(int64_t rows_per_page, int64_t page, int64_t slot) { return page * rows_per_page + slot; }

/* Whether the view's base and its page, token and head strides (elements of `elem_bytes`)
 * are multiples of `bytes`: the condition for vector loads of that width. */
PKV_HD int pkv_cache_aligned(const pkv_cache_view *c, int64_t elem_bytes, int64_t bytes) {
  return (uintptr_t)c->data % (uintptr_t)bytes == 0 && (c->stride_page * elem_bytes) % bytes == 0 &&
         (c->stride_token * elem_bytes) % bytes == 0 && (c->stride_head * elem_bytes) % bytes == 0;
}

/* The same for token rows: base, row and head strides. */
PKV_HD int pkv_rows_aligned(const pkv_rows_view *r, int64_t elem_bytes, int64_t bytes) {
  return (uintptr_t)r->data % (uintptr_t)bytes == 0 && (r->stride_row * elem_bytes) % bytes == 0 &&
         (r->stride_head * elem_bytes) % bytes == 0;
}

PKV_HD int32_t pkv_index_at(const pkv_index_view *v, int64_t i) { return v->data[i * v->stride_row]; }

PKV_HD int32_t pkv_index_at2(const pkv_index_view *v, int64_t r, int64_t c) {
  return v->data[r * v->stride_row + c * v->stride_col];
}

/* Physical page holding logical token `pos` of row b. */
PKV_HD int32_t pkv_page_of(const pkv_index_view *lookup_table, int64_t b, int64_t pos, int64_t page_size) {
  return pkv_index_at2(lookup_table, b, pos / page_size);
}

/* A page id read from a lookup table, for reading rows: the id when it names a page of the pool,
 * else page 0. The checks proved every id a call uses valid, but the table is the caller's and may
 * change during the call (another thread, or an argument aliasing a written cache): each id is read
 * once into a local and masked where it is used, so a kernel never leaves its tensors (results are
 * then unspecified; writers skip such rows instead, pkv_page_in_pool). num_pages >= 1 wherever a row
 * is read: a call that needs a page of an empty pool fails its check. */
PKV_HD int64_t pkv_page_for_read(int32_t page, int64_t num_pages) { return page >= 0 && page < num_pages ? page : 0; }

PKV_HD int pkv_page_in_pool(int32_t page, int64_t num_pages) { return page >= 0 && page < num_pages; }

/* Slot (token row within its page) of logical token `pos`. */
PKV_HD int64_t pkv_slot_of(int64_t pos, int64_t page_size) { return pos % page_size; }

/* Encoded tokens of a cache, N * P, saturated at INT64_MAX: an expanded (stride 0) view may have a
 * product too large for int64, and every int32 token index is below the saturated value, as
 * pkv_sparse_check's bound. */
PKV_HD int64_t pkv_cache_tokens(const pkv_cache_view *c) {
  return c->page_size > 0 && c->num_pages > INT64_MAX / c->page_size ? INT64_MAX : c->num_pages * c->page_size;
}

/* Element offset of an encoded token `page * P + slot` (the seeds' get_tma_row encoding, as
 * flash_attn_paged_sparse's indices hold it), head h. */
PKV_HD int64_t pkv_cache_token_offset(const pkv_cache_view *c, int64_t token, int64_t head) {
  return pkv_cache_offset(c, token / c->page_size, pkv_slot_of(token, c->page_size), head);
}

/* pkv_cache_token_offset for pages of 1 << shift slots, without a division (the sparse kernel's row
 * loop). */
PKV_HD int64_t pkv_cache_token_offset_pow2(const pkv_cache_view *c, int64_t token, int64_t head, int shift) {
  return pkv_cache_offset(c, token >> shift, token & (((int64_t)1 << shift) - 1), head);
}

/* Seed accessor: tokens already cached for row b. */
PKV_HD int64_t pkv_cache_length(const pkv_index_view *cache_lengths, int64_t b) {
  return pkv_index_at(cache_lengths, b);
}

/* New tokens of row b this step. */
PKV_HD int64_t pkv_new_tokens(const pkv_index_view *offsets, int64_t b) {
  return (int64_t)pkv_index_at(offsets, b + 1) - pkv_index_at(offsets, b);
}

/* Groups (scales per token and head) for head size d and group g. */
PKV_HD int64_t pkv_num_groups(int64_t d, int64_t g) { return d / g + (d % g != 0); } /* no d + g overflow */

/* Number of pages covering `tokens` tokens. */
PKV_HD int64_t pkv_pages_for(int64_t tokens, int64_t page_size) {
  return tokens / page_size + (tokens % page_size != 0); /* no tokens + page_size overflow */
}

/* Attention masks: the keys [lo, hi) query position p may see in a row of
 * `total` keys (bottom-right causal, optional left window). */
PKV_HD void pkv_visible_keys(int64_t p, int64_t total, int causal, int64_t window_left, int64_t *lo, int64_t *hi) {
  int64_t h = causal ? (p + 1 < total ? p + 1 : total) : total;
  int64_t l = window_left >= 0 ? p - window_left : 0;
  *lo = l > 0 ? l : 0;
  *hi = h;
}

/* A per-tensor FP8 scale (CONTRACT v1.2): one float32 element, shape [] or [1], for every token,
 * head and channel of its cache. paged_store quantizes with it and writes no scale. */
PKV_HD int pkv_scales_per_tensor(const pkv_tensor *s) {
  return s->defined && (s->ndim == 0 || (s->ndim == 1 && s->sizes[0] == 1));
}

/* Builders from descriptors (descriptors already validated). */
pkv_cache_view pkv_cache_view_from(const pkv_tensor *t);
pkv_rows_view pkv_rows_view_from(const pkv_tensor *t);
pkv_index_view pkv_index_view_from(const pkv_tensor *t);

/* The readers' form of a per-tensor scale: rewrites `s` (validated, pkv_scales_per_tensor) into the
 * per-token scales view f32 [N, P, Hk, ceil(D/G)] of `cache` with page, token and head strides 0 over
 * `groups`, which holds ceil(D/G) copies of the scale (stride(-1) == 1, as every reader indexes a
 * token's groups). Every reader then takes the same scale for each token, head and group with no
 * path of its own. Reader kernels take only this form; paged_store takes the one-element form. */
void pkv_scales_broadcast(pkv_tensor *s, const pkv_tensor *cache, int64_t group, const float *groups);

#ifdef __cplusplus
}
#endif
#endif /* PKV_VIEW_H */
