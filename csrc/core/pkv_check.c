/* pagedkv core: the one checker per op (copy_pages included). Every backend calls these before
 * writing anything; messages name the argument and the expected value. */
#include <stdio.h>
#include <stdlib.h>

#include "pkv_ops.h"

/* ---- descriptor checks ---- */

static const char *device_name(int device, char *buf, size_t n) {
  if (device == PKV_DEVICE_CPU) return "cpu";
  snprintf(buf, n, "cuda:%d", device);
  return buf;
}

static pkv_status need_defined(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  if (!t->defined) return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s is required, got None", op, name);
  return PKV_OK;
}

/* The rank, then (every tensor passes here first) strides: kernels and the value checks index
 * with non-negative strides only; a framework may not produce others, a descriptor can. */
static pkv_status need_dims(const pkv_tensor *t, int ndim, const char *op, const char *name, const char *shape,
                            pkv_error *err) {
  if (t->ndim != ndim)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be %d-D %s, got %d-D", op, name, ndim, shape, t->ndim);
  for (int d = 0; d < ndim; d++)
    if (t->sizes[d] < 0 || (t->sizes[d] > 1 && t->strides[d] < 0))
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must have non-negative sizes and strides, got size(%d) = %lld, "
                      "stride(%d) = %lld", op, name, d, (long long)t->sizes[d], d, (long long)t->strides[d]);
  return PKV_OK;
}

static pkv_status need_size(const pkv_tensor *t, int dim, int64_t expected, const char *op, const char *name,
                            const char *why, pkv_error *err) {
  if (t->sizes[dim] != expected)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s.size(%d) must be %lld (%s), got %lld", op, name, dim,
                    (long long)expected, why, (long long)t->sizes[dim]);
  return PKV_OK;
}

static pkv_status need_int32(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  if (t->dtype != PKV_DTYPE_I32)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be int32, got %s", op, name, pkv_dtype_name(t->dtype));
  return PKV_OK;
}

static pkv_status need_device(const pkv_tensor *t, int device, const char *op, const char *name,
                              const char *ref_name, pkv_error *err) {
  char a[32], b[32];
  if (t->device != device)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be on the same device as %s (%s), got %s", op, name,
                    ref_name, device_name(device, a, sizeof a), device_name(t->device, b, sizeof b));
  return PKV_OK;
}

static pkv_status need_unit_last_stride(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  int last = t->ndim - 1;
  if (t->sizes[last] > 1 && t->strides[last] != 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must have stride(-1) == 1, got %lld", op, name,
                    (long long)t->strides[last]);
  return PKV_OK;
}

/* A written tensor must not map two indices to one element through a zero stride. */
static pkv_status need_no_broadcast(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  for (int d = 0; d < t->ndim && d < PKV_MAX_DIMS; d++) /* copy_pages' pool may have more dims than recorded */
    if (t->sizes[d] > 1 && t->strides[d] == 0)
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must not be a broadcast view (stride 0 on dim %d)", op, name,
                      d);
  return PKV_OK;
}

static pkv_status need_float_input(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  if (!pkv_dtype_is_float_input(t->dtype))
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be float32, float16 or bfloat16, got %s", op, name,
                    pkv_dtype_name(t->dtype));
  return PKV_OK;
}

#define TRY(expr)                                                                                                 \
  do {                                                                                                            \
    pkv_status s_ = (expr);                                                                                       \
    if (s_ != PKV_OK) return s_;                                                                                  \
  } while (0)

/* A cache view: 4-D [N, P, Hk, D], a cache dtype, unit last stride. */
static pkv_status check_cache(const pkv_tensor *c, const char *op, const char *name, int written, pkv_error *err) {
  TRY(need_defined(c, op, name, err));
  TRY(need_dims(c, 4, op, name, "[N, P, Hk, D]", err));
  if (!pkv_dtype_is_cache(c->dtype))
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must be float32, float16, bfloat16, float8_e4m3fn or float8_e5m2, got %s", op, name,
                    pkv_dtype_name(c->dtype));
  if (c->sizes[1] < 1) return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s page size (size(1)) must be >= 1, got 0", op,
                                       name);
  if (c->sizes[2] < 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must have at least one KV head (size(2)), got 0", op, name);
  if (c->sizes[3] < 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s head size (size(3)) must be >= 1, got 0", op, name);
  TRY(need_unit_last_stride(c, op, name, err));
  if (written) TRY(need_no_broadcast(c, op, name, err));
  return PKV_OK;
}

/* With check_values (data host-readable): a per-tensor scale must be finite and > 0, the rule every
 * reader's float(q) * s and the store's x / s rely on. Per-token scales are data, not checked. */
static pkv_status check_scale_value(const pkv_tensor *s, const char *op, const char *name, pkv_error *err) {
  if (!pkv_scales_per_tensor(s)) return PKV_OK;
  float v = *(const float *)s->data;
  if (!(v > 0.0f) || v == 1.0f / 0.0f)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s (a per-tensor scale) must be finite and > 0, got %g", op, name,
                    (double)v);
  return PKV_OK;
}

/* Scales: required iff the cache is FP8, on the cache's device; f32 [N, P, Hk, ceil(D/G)] (per token,
 * head and group) or one element (per tensor: read, never written). */
static pkv_status check_scales(const pkv_tensor *s, const pkv_tensor *cache, int64_t group, const char *op,
                               const char *name, const char *cache_name, int written, pkv_error *err) {
  if (!pkv_dtype_is_fp8(cache->dtype)) {
    if (s->defined)
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be None because %s is %s (not FP8)", op, name,
                      cache_name, pkv_dtype_name(cache->dtype));
    return PKV_OK;
  }
  if (!s->defined)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s is required because %s is %s", op, name, cache_name,
                    pkv_dtype_name(cache->dtype));
  TRY(need_device(s, cache->device, op, name, cache_name, err));
  if (pkv_scales_per_tensor(s)) {
    if (s->dtype != PKV_DTYPE_F32)
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be float32, got %s", op, name, pkv_dtype_name(s->dtype));
    return PKV_OK;
  }
  if (s->ndim != 4)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must be 4-D [N, P, Hk, ceil(D/G)] (per-token scales) or hold one element (shape [] or "
                    "[1], a per-tensor scale), got %d-D with size(0) = %lld",
                    op, name, s->ndim, s->ndim > 0 ? (long long)s->sizes[0] : 0LL);
  TRY(need_dims(s, 4, op, name, "[N, P, Hk, ceil(D/G)]", err));
  if (s->dtype != PKV_DTYPE_F32)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be float32, got %s", op, name, pkv_dtype_name(s->dtype));
  TRY(need_size(s, 0, cache->sizes[0], op, name, "N of the cache", err));
  TRY(need_size(s, 1, cache->sizes[1], op, name, "P of the cache", err));
  TRY(need_size(s, 2, cache->sizes[2], op, name, "Hk of the cache", err));
  TRY(need_size(s, 3, pkv_num_groups(cache->sizes[3], group), op, name, "ceil(D / quant_group)", err));
  TRY(need_unit_last_stride(s, op, name, err));
  if (written) TRY(need_no_broadcast(s, op, name, err));
  return PKV_OK;
}

/* lookup_table int32 [B, max_pages], row lengths int32 [B], offsets int32 [B+1]. */
static pkv_status check_index_tensors(const pkv_tensor *offsets, const char *offsets_name,
                                      const pkv_tensor *lengths, const char *lengths_name,
                                      const pkv_tensor *table, int device, const char *device_ref, const char *op,
                                      pkv_error *err) {
  TRY(need_defined(table, op, "lookup_table", err));
  TRY(need_defined(lengths, op, lengths_name, err));
  TRY(need_defined(offsets, op, offsets_name, err));
  TRY(need_int32(table, op, "lookup_table", err));
  TRY(need_int32(lengths, op, lengths_name, err));
  TRY(need_int32(offsets, op, offsets_name, err));
  TRY(need_dims(table, 2, op, "lookup_table", "[B, max_pages]", err));
  TRY(need_dims(lengths, 1, op, lengths_name, "[B]", err));
  TRY(need_dims(offsets, 1, op, offsets_name, "[B+1]", err));
  int64_t batch = lengths->sizes[0];
  TRY(need_size(table, 0, batch, op, "lookup_table", "B, the length of the lengths tensor", err));
  /* Compared as size - 1 so a huge B (a zero-stride view can claim 2^63 - 1 rows) cannot overflow. */
  if (offsets->sizes[0] - 1 != batch)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s.size(0) must be B+1 (B = %lld rows of %s), got %lld", op,
                    offsets_name, (long long)batch, lengths_name, (long long)offsets->sizes[0]);
  TRY(need_device(table, device, op, "lookup_table", device_ref, err));
  TRY(need_device(lengths, device, op, lengths_name, device_ref, err));
  TRY(need_device(offsets, device, op, offsets_name, device_ref, err));
  return PKV_OK;
}

static pkv_status check_group(int64_t group, const char *op, pkv_error *err) {
  if (group < 1) return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: quant_group must be >= 1, got %lld", op, (long long)group);
  return PKV_OK;
}

/* ---- aliasing between arguments ----
 *
 * A written tensor must share no memory with another argument: a lookup table inside the cache being
 * written would change its page ids in the middle of a call, an out over q or a cache would feed the
 * op its own results. Views of one allocation that share no element stay legal (K and V of a layer
 * interleave in the collection layout [N, 2, L, P, Hk, D]), so the test is exact, not an extent test.
 *
 * Two views share a byte iff a_base + sum_d i_d sa_d + u == b_base + sum_d j_d sb_d + v for indices
 * i, j within the sizes and bytes u, v within one element (strides in bytes). Writing j_d as
 * (n_d - 1) - j'_d and v as (eb - 1) - v' makes every coefficient positive:
 *   sum_d sa_d i_d + sum_d sb_d j'_d + (u + v') = b_base - a_base + sum_d sb_d (n_d - 1) + eb - 1,
 * a bounded subset-sum that a depth-first search over the terms, largest coefficient first, decides;
 * terms of equal coefficient merge (x in [0, m] plus y in [0, n] is any value in [0, m + n]). For
 * strides that nest, as slicing, permuting and the contract's layouts produce, each term leaves at
 * most two candidates, so the search is a few dozen steps. */

typedef struct {
  uint64_t coef, bound; /* coef * x with x in [0, bound] */
} overlap_term;

#define OVERLAP_MAX_TERMS (2 * PKV_MAX_DIMS + 1)
#define OVERLAP_WORK 100000 /* search steps before giving up; past it the views count as sharing */

/* Whether sum_t terms[t].coef * x_t == target has a solution with terms t.. (reach[t] = their
 * largest sum). Running out of work answers 1: never a false "disjoint". */
static int overlap_search(const overlap_term *terms, const uint64_t *reach, int t, int n, uint64_t target,
                          int64_t *work) {
  if (t == n) return target == 0;
  if (target > reach[t]) return 0;
  if (--*work < 0) return 1;
  uint64_t c = terms[t].coef, rest = t + 1 < n ? reach[t + 1] : 0;
  uint64_t hi = target / c < terms[t].bound ? target / c : terms[t].bound;
  uint64_t lo = target > rest ? (target - rest + c - 1) / c : 0;
  for (uint64_t x = hi + 1; x-- > lo;)
    if (overlap_search(terms, reach, t + 1, n, target - c * x, work)) return 1;
  return 0;
}

/* Adds tensor t's dims as terms; the sum of coef * bound goes to *span. 0 on overflow. */
static int overlap_add_terms(const pkv_tensor *t, overlap_term *terms, int *n, uint64_t *span) {
  uint64_t elem = pkv_dtype_size(t->dtype);
  for (int d = 0; d < t->ndim && d < PKV_MAX_DIMS; d++) {
    if (t->sizes[d] < 2 || t->strides[d] == 0) continue; /* one index, or the same bytes for all */
    uint64_t coef, part;
    if (__builtin_mul_overflow((uint64_t)t->strides[d], elem, &coef) ||
        __builtin_mul_overflow(coef, (uint64_t)(t->sizes[d] - 1), &part) || __builtin_add_overflow(*span, part, span))
      return 0;
    terms[(*n)++] = (overlap_term){coef, (uint64_t)(t->sizes[d] - 1)};
  }
  return 1;
}

static int tensor_is_empty(const pkv_tensor *t) {
  for (int d = 0; d < t->ndim && d < PKV_MAX_DIMS; d++)
    if (t->sizes[d] == 0) return 1;
  return t->data == NULL;
}

/* 1 when a and b may share a byte (exact within OVERLAP_WORK steps; overflow also counts as
 * sharing). Sizes and strides are already validated (non-negative). */
static int tensors_share_memory(const pkv_tensor *a, const pkv_tensor *b) {
  if (!a->defined || !b->defined || a->device != b->device || tensor_is_empty(a) || tensor_is_empty(b)) return 0;
  overlap_term terms[OVERLAP_MAX_TERMS];
  int n = 0;
  uint64_t span_a = 0, span_b = 0, ea = pkv_dtype_size(a->dtype), eb = pkv_dtype_size(b->dtype);
  if (!overlap_add_terms(a, terms, &n, &span_a) || !overlap_add_terms(b, terms, &n, &span_b)) return 1;
  terms[n++] = (overlap_term){1, ea - 1 + eb - 1};
  /* target = b_base - a_base + span_b + eb - 1, which must lie in [0, span_a + span_b + ea + eb - 2] */
  uintptr_t pa = (uintptr_t)a->data, pb = (uintptr_t)b->data;
  uint64_t target;
  if (pb >= pa) {
    if (__builtin_add_overflow((uint64_t)(pb - pa), span_b + eb - 1, &target)) return 0; /* b starts past a's end */
  } else {
    uint64_t before = (uint64_t)(pa - pb);
    if (before > span_b + eb - 1) return 0; /* b ends before a starts */
    target = span_b + eb - 1 - before;
  }
  /* largest coefficient first; equal ones merged */
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && terms[j].coef > terms[j - 1].coef; j--) {
      overlap_term swap = terms[j];
      terms[j] = terms[j - 1];
      terms[j - 1] = swap;
    }
  int m = 0;
  for (int i = 0; i < n; i++) {
    if (m > 0 && terms[m - 1].coef == terms[i].coef) {
      if (__builtin_add_overflow(terms[m - 1].bound, terms[i].bound, &terms[m - 1].bound)) return 1;
    } else {
      terms[m++] = terms[i];
    }
  }
  uint64_t reach[OVERLAP_MAX_TERMS];
  uint64_t sum = 0;
  for (int i = m - 1; i >= 0; i--) {
    uint64_t part;
    if (__builtin_mul_overflow(terms[i].coef, terms[i].bound, &part) || __builtin_add_overflow(sum, part, &sum))
      return 1;
    reach[i] = sum;
  }
  int64_t work = OVERLAP_WORK;
  return overlap_search(terms, reach, 0, m, target, &work);
}

/* x must share no memory with y; `why` ends the message. */
static pkv_status need_disjoint(const pkv_tensor *x, const char *x_name, const pkv_tensor *y, const char *y_name,
                                const char *why, const char *op, pkv_error *err) {
  if (tensors_share_memory(x, y))
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s overlaps %s (they share memory); %s", op, x_name, y_name, why);
  return PKV_OK;
}

static const char *const READ_VS_WRITTEN = "a tensor the call reads must not alias one it writes";

/* Every written tensor against every read one (x named first) and written ones pairwise. */
typedef struct {
  const pkv_tensor *t;
  const char *name;
} named_tensor;

static pkv_status need_no_aliasing(const named_tensor *written, int num_written, const named_tensor *read,
                                   int num_read, const char *written_why, const char *op, pkv_error *err) {
  for (int w = 0; w < num_written; w++) {
    for (int r = 0; r < num_read; r++)
      TRY(need_disjoint(read[r].t, read[r].name, written[w].t, written[w].name, READ_VS_WRITTEN, op, err));
    for (int v = 0; v < w; v++)
      TRY(need_disjoint(written[w].t, written[w].name, written[v].t, written[v].name, written_why, op, err));
  }
  return PKV_OK;
}

/* ---- index value checks (host-readable index data) ---- */

static pkv_status check_offsets_values(const pkv_index_view *offsets, const char *name, int64_t rows_available,
                                       const char *rows_name, const char *op, pkv_error *err) {
  int64_t batch = offsets->rows - 1;
  if (pkv_index_at(offsets, 0) != 0)
    return pkv_fail(err, PKV_ERR_INDEX, "%s: %s[0] must be 0, got %d", op, name, pkv_index_at(offsets, 0));
  for (int64_t b = 0; b < batch; b++)
    if (pkv_index_at(offsets, b + 1) < pkv_index_at(offsets, b))
      return pkv_fail(err, PKV_ERR_INDEX, "%s: %s must be non-decreasing, got %s[%lld] = %d > %s[%lld] = %d", op,
                      name, name, (long long)b, pkv_index_at(offsets, b), name, (long long)(b + 1),
                      pkv_index_at(offsets, b + 1));
  int64_t last = pkv_index_at(offsets, batch);
  if (last > rows_available)
    return pkv_fail(err, PKV_ERR_INDEX, "%s: %s[B] = %lld exceeds the %lld rows of %s", op, name, (long long)last,
                    (long long)rows_available, rows_name);
  return PKV_OK;
}

/* Pages [first_page, last_page] of row b must hold ids in [0, N). */
static pkv_status check_pages(const pkv_index_view *table, int64_t b, int64_t first_page, int64_t end_page,
                              int64_t num_pages, const char *op, pkv_error *err) {
  for (int64_t j = first_page; j < end_page; j++) {
    int32_t page = pkv_index_at2(table, b, j);
    if (page < 0 || page >= num_pages)
      return pkv_fail(err, PKV_ERR_INDEX, "%s: lookup_table[%lld, %lld] = %d is not a page id in [0, %lld)", op,
                      (long long)b, (long long)j, page, (long long)num_pages);
  }
  return PKV_OK;
}

/* Row b's total tokens must fit in its table row. */
static pkv_status check_capacity(int64_t b, int64_t cached, int64_t added, const char *cached_name,
                                 int64_t max_pages, int64_t page_size, const char *op, pkv_error *err) {
  if (cached < 0)
    return pkv_fail(err, PKV_ERR_INDEX, "%s: %s[%lld] must be >= 0, got %lld", op, cached_name, (long long)b,
                    (long long)cached);
  /* a table row of max_pages * page_size tokens; broadcast views can make that product overflow,
   * and then it exceeds any int32 length */
  int64_t capacity = max_pages > 0 && page_size > INT64_MAX / max_pages ? INT64_MAX : max_pages * page_size;
  if (cached + added > capacity)
    return pkv_fail(err, PKV_ERR_INDEX,
                    "%s: row %lld needs %lld tokens (%s %lld + %lld new) but lookup_table holds %lld pages of %lld "
                    "tokens",
                    op, (long long)b, (long long)(cached + added), cached_name, (long long)cached, (long long)added,
                    (long long)max_pages, (long long)page_size);
  return PKV_OK;
}

static int compare_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return (x > y) - (x < y);
}

/* Two rows writing the same (page, slot) would race and lose a token. */
static pkv_status check_distinct_slots(const pkv_index_view *offsets, const pkv_index_view *lengths,
                                       const pkv_index_view *table, int64_t page_size, const char *op,
                                       pkv_error *err) {
  int64_t batch = lengths->rows, total = pkv_index_at(offsets, batch);
  if (total < 2) return PKV_OK;
  int64_t *slots = (int64_t *)malloc((size_t)total * sizeof *slots);
  if (!slots) return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: out of host memory checking lookup_table", op);
  int64_t n = 0;
  for (int64_t b = 0; b < batch; b++) {
    int64_t start = pkv_cache_length(lengths, b), added = pkv_new_tokens(offsets, b);
    for (int64_t i = 0; i < added; i++) {
      int64_t pos = start + i;
      slots[n++] = (int64_t)pkv_page_of(table, b, pos, page_size) * page_size + pkv_slot_of(pos, page_size);
    }
  }
  qsort(slots, (size_t)n, sizeof *slots, compare_i64);
  for (int64_t i = 1; i < n; i++)
    if (slots[i] == slots[i - 1]) {
      long long page = (long long)(slots[i] / page_size), slot = (long long)pkv_slot_of(slots[i], page_size);
      free(slots);
      return pkv_fail(err, PKV_ERR_INDEX,
                      "%s: lookup_table maps two new tokens to the same cache slot (page %lld, slot %lld); each "
                      "written slot must belong to one row",
                      op, page, slot);
    }
  free(slots);
  return PKV_OK;
}

/* ---- paged_store ---- */

pkv_status pkv_store_check(const pkv_store_args *a, int check_values, pkv_error *err) {
  const char *op = "paged_store";
  if (a->kv_format != PKV_KV_PLAIN)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: internal: a packed call must be unpacked before its check", op);
  TRY(check_group(a->quant_group, op, err));
  TRY(check_cache(&a->k_cache, op, "k_cache", 1, err));
  int device = a->k_cache.device;
  TRY(need_defined(&a->key, op, "key", err));
  TRY(need_dims(&a->key, 3, op, "key", "[T, Hk, D]", err));
  TRY(need_float_input(&a->key, op, "key", err));
  TRY(need_size(&a->key, 1, a->k_cache.sizes[2], op, "key", "Hk of k_cache", err));
  TRY(need_size(&a->key, 2, a->k_cache.sizes[3], op, "key", "D of k_cache", err));
  TRY(need_unit_last_stride(&a->key, op, "key", err));
  TRY(need_device(&a->key, device, op, "key", "k_cache", err));
  if (a->value.defined != a->v_cache.defined)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: value must be None if and only if v_cache is None (value is %s, v_cache is %s)",
                    op, a->value.defined ? "a tensor" : "None", a->v_cache.defined ? "a tensor" : "None");
  if (a->v_cache.defined) {
    TRY(check_cache(&a->v_cache, op, "v_cache", 1, err));
    TRY(need_device(&a->v_cache, device, op, "v_cache", "k_cache", err));
    TRY(need_size(&a->v_cache, 0, a->k_cache.sizes[0], op, "v_cache", "N of k_cache", err));
    TRY(need_size(&a->v_cache, 1, a->k_cache.sizes[1], op, "v_cache", "P of k_cache", err));
    TRY(need_size(&a->v_cache, 2, a->k_cache.sizes[2], op, "v_cache", "Hk of k_cache", err));
    TRY(need_dims(&a->value, 3, op, "value", "[T, Hk, Dv]", err));
    TRY(need_float_input(&a->value, op, "value", err));
    TRY(need_size(&a->value, 0, a->key.sizes[0], op, "value", "T of key", err));
    TRY(need_size(&a->value, 1, a->v_cache.sizes[2], op, "value", "Hk of v_cache", err));
    TRY(need_size(&a->value, 2, a->v_cache.sizes[3], op, "value", "Dv of v_cache", err));
    TRY(need_unit_last_stride(&a->value, op, "value", err));
    TRY(need_device(&a->value, device, op, "value", "k_cache", err));
  }
  TRY(check_scales(&a->k_scales, &a->k_cache, a->quant_group, op, "k_scales", "k_cache", 1, err));
  if (a->v_cache.defined) {
    TRY(check_scales(&a->v_scales, &a->v_cache, a->quant_group, op, "v_scales", "v_cache", 1, err));
  } else if (a->v_scales.defined) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: v_scales must be None because v_cache is None", op);
  }
  TRY(check_index_tensors(&a->input_row_offsets, "input_row_offsets", &a->cache_lengths, "cache_lengths",
                          &a->lookup_table, device, "k_cache", op, err));
  named_tensor written[4] = {{&a->k_cache, "k_cache"}, {&a->v_cache, "v_cache"}};
  named_tensor read[8] = {{&a->lookup_table, "lookup_table"}, {&a->cache_lengths, "cache_lengths"},
                          {&a->input_row_offsets, "input_row_offsets"}, {&a->key, "key"}, {&a->value, "value"}};
  int num_written = 2, num_read = 5;
  /* a per-tensor scale is only read (K and V may share one) */
  const named_tensor scales[2] = {{&a->k_scales, "k_scales"}, {&a->v_scales, "v_scales"}};
  for (int i = 0; i < 2; i++) {
    if (pkv_scales_per_tensor(scales[i].t)) read[num_read++] = scales[i];
    else written[num_written++] = scales[i];
  }
  TRY(need_no_aliasing(written, num_written, read, num_read, "pass separate K and V caches (and scales)", op, err));
  if (a->packed_cache.defined) {
    /* a part of a packed call: the other part writes the rest of each row (the latent and scales, or
     * the rope) and reads the rest of the key, so this part's reads and the whole key must stay off
     * the whole rows too (a key whose rope lay in the latent bytes was overwritten before it was read) */
    const named_tensor rows = {&a->packed_cache, "k_cache"};
    read[num_read++] = (named_tensor){&a->packed_key, "key"};
    TRY(need_no_aliasing(&rows, 1, read, num_read, "", op, err));
  }
  if (!check_values) return PKV_OK;

  TRY(check_scale_value(&a->k_scales, op, "k_scales", err));
  TRY(check_scale_value(&a->v_scales, op, "v_scales", err));
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->cache_lengths);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  int64_t page_size = a->k_cache.sizes[1], num_pages = a->k_cache.sizes[0];
  TRY(check_offsets_values(&offsets, "input_row_offsets", a->key.sizes[0], "key", op, err));
  for (int64_t b = 0; b < lengths.rows; b++) {
    int64_t cached = pkv_cache_length(&lengths, b), added = pkv_new_tokens(&offsets, b);
    TRY(check_capacity(b, cached, added, "cache_lengths", table.cols, page_size, op, err));
    if (added > 0)
      TRY(check_pages(&table, b, cached / page_size, pkv_pages_for(cached + added, page_size), num_pages, op, err));
  }
  return check_distinct_slots(&offsets, &lengths, &table, page_size, op, err);
}

/* ---- paged_load ---- */

pkv_status pkv_load_check(const pkv_load_args *a, int check_values, pkv_error *err) {
  const char *op = "paged_load";
  if (a->kv_format != PKV_KV_PLAIN)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: internal: a packed call must be unpacked before its check", op);
  TRY(check_group(a->quant_group, op, err));
  TRY(check_cache(&a->cache, op, "cache", 0, err));
  int device = a->cache.device;
  TRY(check_scales(&a->scales, &a->cache, a->quant_group, op, "scales", "cache", 0, err));
  TRY(need_defined(&a->out, op, "out", err));
  TRY(need_dims(&a->out, 3, op, "out", "[T_out, Hk, D]", err));
  TRY(need_float_input(&a->out, op, "out", err));
  TRY(need_size(&a->out, 1, a->cache.sizes[2], op, "out", "Hk of cache", err));
  TRY(need_size(&a->out, 2, a->cache.sizes[3], op, "out", "D of cache", err));
  TRY(need_unit_last_stride(&a->out, op, "out", err));
  TRY(need_no_broadcast(&a->out, op, "out", err));
  TRY(need_device(&a->out, device, op, "out", "cache", err));
  TRY(check_index_tensors(&a->output_row_offsets, "output_row_offsets", &a->seq_lens, "seq_lens", &a->lookup_table,
                          device, "cache", op, err));
  const named_tensor written[] = {{&a->out, "out"}};
  named_tensor read[6] = {{&a->lookup_table, "lookup_table"}, {&a->seq_lens, "seq_lens"},
                          {&a->output_row_offsets, "output_row_offsets"}, {&a->cache, "cache"},
                          {&a->scales, "scales"}};
  TRY(need_no_aliasing(written, 1, read, 5, "", op, err));
  if (a->packed_out.defined) {
    /* a part of a packed call writes some channels of out, the other part the rest, and reads the
     * rest of each row: the whole out must stay off this part's reads and the whole rows (out's rope
     * channels in a row's latent bytes were written into the cache) */
    const named_tensor whole_out = {&a->packed_out, "out"};
    read[5] = (named_tensor){&a->packed_cache, "cache"};
    TRY(need_no_aliasing(&whole_out, 1, read, 6, "", op, err));
  }
  if (!check_values) return PKV_OK;

  TRY(check_scale_value(&a->scales, op, "scales", err));
  pkv_index_view offsets = pkv_index_view_from(&a->output_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->seq_lens);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  int64_t page_size = a->cache.sizes[1];
  TRY(check_offsets_values(&offsets, "output_row_offsets", a->out.sizes[0], "out", op, err));
  for (int64_t b = 0; b < lengths.rows; b++) {
    int64_t len = pkv_index_at(&lengths, b);
    TRY(check_capacity(b, len, 0, "seq_lens", table.cols, page_size, op, err));
    if (len > pkv_new_tokens(&offsets, b))
      return pkv_fail(err, PKV_ERR_INDEX,
                      "%s: seq_lens[%lld] = %lld does not fit between output_row_offsets[%lld] and "
                      "output_row_offsets[%lld] (%lld rows)",
                      op, (long long)b, (long long)len, (long long)b, (long long)(b + 1),
                      (long long)pkv_new_tokens(&offsets, b));
    TRY(check_pages(&table, b, 0, pkv_pages_for(len, page_size), a->cache.sizes[0], op, err));
  }
  return PKV_OK;
}

static pkv_status need_f32(const pkv_tensor *t, const char *op, const char *name, pkv_error *err) {
  if (t->dtype != PKV_DTYPE_F32)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be float32, got %s", op, name, pkv_dtype_name(t->dtype));
  return PKV_OK;
}

/* A log-sum-exp tensor: f32 [T, H] on the reference's device. */
static pkv_status check_lse(const pkv_tensor *t, int64_t rows, int64_t heads, int device, const char *op,
                            const char *name, const char *ref_name, int written, pkv_error *err) {
  TRY(need_defined(t, op, name, err));
  TRY(need_dims(t, 2, op, name, "[T, H]", err));
  TRY(need_f32(t, op, name, err));
  TRY(need_size(t, 0, rows, op, name, "T", err));
  TRY(need_size(t, 1, heads, op, name, "H", err));
  TRY(need_device(t, device, op, name, ref_name, err));
  if (written) TRY(need_no_broadcast(t, op, name, err));
  return PKV_OK;
}

/* ---- flash_attn_paged ---- */

#define PKV_FLOAT_ARG_MAX 1e18 /* |scale|, softcap: 1e18 * log2(e) and 1e18 / 1e-18 fit float32 */
#define PKV_SOFTCAP_MIN 1e-18  /* a normal float32, far above the flush-to-zero range */

/* The operands every attention op shares: q [T, Hq, D], the K/V caches and scales, scale, softcap,
 * sinks [Hq] and out [T, Hq, Dv]. */
static pkv_status check_attention_operands(const char *op, const pkv_tensor *q, const pkv_tensor *k_cache,
                                           const pkv_tensor *v_cache, const pkv_tensor *k_scales,
                                           const pkv_tensor *v_scales, const pkv_tensor *sinks,
                                           const pkv_tensor *out, int64_t quant_group, double scale, double softcap,
                                           pkv_kv_format kv_format, int64_t tail_dim, pkv_error *err) {
  if (kv_format != PKV_KV_PLAIN || tail_dim < 0)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: internal: a packed call must be unpacked before its check", op);
  TRY(check_group(quant_group, op, err));
  TRY(check_cache(k_cache, op, "k_cache", 0, err));
  TRY(check_cache(v_cache, op, "v_cache", 0, err));
  int device = k_cache->device;
  TRY(need_device(v_cache, device, op, "v_cache", "k_cache", err));
  TRY(need_size(v_cache, 0, k_cache->sizes[0], op, "v_cache", "N of k_cache", err));
  TRY(need_size(v_cache, 1, k_cache->sizes[1], op, "v_cache", "P of k_cache", err));
  TRY(need_size(v_cache, 2, k_cache->sizes[2], op, "v_cache", "Hk of k_cache", err));
  TRY(check_scales(k_scales, k_cache, quant_group, op, "k_scales", "k_cache", 0, err));
  TRY(check_scales(v_scales, v_cache, quant_group, op, "v_scales", "v_cache", 0, err));
  TRY(need_defined(q, op, "q", err));
  TRY(need_dims(q, 3, op, "q", "[T, Hq, D]", err));
  TRY(need_float_input(q, op, "q", err));
  TRY(need_device(q, device, op, "q", "k_cache", err));
  TRY(need_size(q, 2, k_cache->sizes[3] + tail_dim, op, "q", tail_dim ? "D of the packed keys" : "D of k_cache", err));
  TRY(need_unit_last_stride(q, op, "q", err));
  int64_t hq = q->sizes[1], hk = k_cache->sizes[2];
  if (hq < 1 || hq % hk != 0)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: q.size(1) (Hq = %lld) must be a positive multiple of k_cache.size(2) (Hk = %lld)", op,
                    (long long)hq, (long long)hk);
  /* Kernels take scale and softcap as float32 and form scale * log2(e), softcap * log2(e) and
   * scale / softcap: within these bounds none overflows (an inf gives inf * 0 = NaN scores) and no
   * softcap flushes to 0 (which would silently disable it). */
  if (!(softcap == 0.0 || (softcap >= PKV_SOFTCAP_MIN && softcap <= PKV_FLOAT_ARG_MAX)))
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: softcap must be 0 (off) or in [%g, %g], got %g", op, PKV_SOFTCAP_MIN,
                    PKV_FLOAT_ARG_MAX, softcap);
  if (!(scale >= -PKV_FLOAT_ARG_MAX && scale <= PKV_FLOAT_ARG_MAX))
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: scale must be finite with |scale| <= %g, got %g", op,
                    PKV_FLOAT_ARG_MAX, scale);
  TRY(need_defined(out, op, "out", err));
  TRY(need_dims(out, 3, op, "out", "[T, Hq, Dv]", err));
  if (out->dtype != q->dtype)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: out must have q's dtype %s, got %s", op, pkv_dtype_name(q->dtype),
                    pkv_dtype_name(out->dtype));
  TRY(need_size(out, 0, q->sizes[0], op, "out", "T of q", err));
  TRY(need_size(out, 1, hq, op, "out", "Hq of q", err));
  TRY(need_size(out, 2, v_cache->sizes[3], op, "out", "Dv of v_cache", err));
  TRY(need_unit_last_stride(out, op, "out", err));
  TRY(need_no_broadcast(out, op, "out", err));
  TRY(need_device(out, device, op, "out", "k_cache", err));
  if (sinks->defined) {
    TRY(need_dims(sinks, 1, op, "sinks", "[Hq]", err));
    TRY(need_f32(sinks, op, "sinks", err));
    TRY(need_size(sinks, 0, hq, op, "sinks", "Hq of q", err));
    TRY(need_device(sinks, device, op, "sinks", "k_cache", err));
  }
  return PKV_OK;
}

/* The bytes of k_cache the keys are read from: with a K tail (packed MLA rows: the bf16 rope
 * tail_offset bytes into each row), each row widened to its tail's end, so that out and lse are kept
 * off the rope too and not only off the values before it. */
static pkv_tensor keys_with_tail(const pkv_tensor *k_cache, int64_t tail_dim, int64_t tail_offset) {
  pkv_tensor keys = *k_cache;
  int64_t elem = (int64_t)pkv_dtype_size(k_cache->dtype), end = tail_offset + 2 * tail_dim;
  if (tail_dim > 0 && end > keys.sizes[3] * elem) keys.sizes[3] = (end + elem - 1) / elem;
  return keys;
}

pkv_status pkv_attn_check(const pkv_attn_args *a, int check_values, pkv_error *err) {
  const char *op = "flash_attn_paged";
  TRY(check_attention_operands(op, &a->q, &a->k_cache, &a->v_cache, &a->k_scales, &a->v_scales, &a->sinks, &a->out,
                               a->quant_group, a->scale, a->softcap, a->kv_format, a->k_tail_dim, err));
  int device = a->k_cache.device;
  if (a->window_left < -1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: window_left must be -1 (no window) or >= 0, got %lld", op,
                    (long long)a->window_left);
  if (a->lse.defined) TRY(check_lse(&a->lse, a->q.sizes[0], a->q.sizes[1], device, op, "lse", "k_cache", 1, err));
  TRY(check_index_tensors(&a->input_row_offsets, "input_row_offsets", &a->cache_lengths, "cache_lengths",
                          &a->lookup_table, device, "k_cache", op, err));
  const pkv_tensor keys = keys_with_tail(&a->k_cache, a->k_tail_dim, a->k_tail_offset);
  const named_tensor written[] = {{&a->out, "out"}, {&a->lse, "lse"}};
  const named_tensor read[] = {{&a->lookup_table, "lookup_table"}, {&a->cache_lengths, "cache_lengths"},
                               {&a->input_row_offsets, "input_row_offsets"}, {&a->q, "q"},
                               {&keys, "k_cache"}, {&a->v_cache, "v_cache"}, {&a->k_scales, "k_scales"},
                               {&a->v_scales, "v_scales"}, {&a->sinks, "sinks"}};
  TRY(need_no_aliasing(written, 2, read, 9, "out and lse must be separate memory", op, err));
  if (!check_values) return PKV_OK;

  TRY(check_scale_value(&a->k_scales, op, "k_scales", err));
  TRY(check_scale_value(&a->v_scales, op, "v_scales", err));
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->cache_lengths);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  int64_t page_size = a->k_cache.sizes[1];
  TRY(check_offsets_values(&offsets, "input_row_offsets", a->q.sizes[0], "q", op, err));
  for (int64_t b = 0; b < lengths.rows; b++) {
    int64_t cached = pkv_cache_length(&lengths, b), added = pkv_new_tokens(&offsets, b);
    TRY(check_capacity(b, cached, added, "cache_lengths", table.cols, page_size, op, err));
    /* only rows with queries read keys */
    if (added > 0)
      TRY(check_pages(&table, b, 0, pkv_pages_for(cached + added, page_size), a->k_cache.sizes[0], op, err));
  }
  return PKV_OK;
}

/* ---- copy_pages ---- */

/* pool [N, ...]; src_pages, dst_pages int32 [C] on pool's device. */
pkv_status pkv_copy_pages_check(const pkv_copy_pages_args *a, int check_values, pkv_error *err) {
  const char *op = "copy_pages";
  if (a->pool.ndim < 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: pool must have a page dim 0 ([N, ...]), got a 0-D tensor", op);
  /* a copy writes pool: a broadcast pool would fail in the copy itself, with torch's message that names no
   * argument (dims past PKV_MAX_DIMS are not recorded; those are left to that message) */
  TRY(need_no_broadcast(&a->pool, op, "pool", err));
  const pkv_tensor *lists[2] = {&a->src_pages, &a->dst_pages};
  const char *names[2] = {"src_pages", "dst_pages"};
  for (int i = 0; i < 2; i++) {
    TRY(need_int32(lists[i], op, names[i], err));
    if (lists[i]->ndim != 1)
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be 1-D [num_copies], got %d-D", op, names[i],
                      lists[i]->ndim);
    TRY(need_device(lists[i], a->pool.device, op, names[i], "pool", err));
  }
  if (a->src_pages.sizes[0] != a->dst_pages.sizes[0])
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: src_pages and dst_pages must have the same length, got %lld and %lld",
                    op, (long long)a->src_pages.sizes[0], (long long)a->dst_pages.sizes[0]);
  if (!check_values || a->src_pages.sizes[0] == 0) return PKV_OK;
  for (int i = 0; i < 2; i++)
    if (lists[i]->sizes[0] > 1 && lists[i]->strides[0] != 1)
      return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be contiguous to check its values", op, names[i]);
  /* the value rule lives with the page manager that makes the copy lists (pkv_pm_copies.c) */
  return pkv_copy_pages_check_values(a->pool.sizes[0], (const int32_t *)a->src_pages.data,
                                     (const int32_t *)a->dst_pages.data, a->src_pages.sizes[0], err);
}

/* ---- merge_attn_states ---- */

static pkv_status check_state_out(const pkv_tensor *t, const pkv_tensor *ref, const char *op, const char *name,
                                  int written, pkv_error *err) {
  TRY(need_defined(t, op, name, err));
  TRY(need_dims(t, 3, op, name, "[T, H, Dv]", err));
  if (t->dtype != ref->dtype)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must have out_a's dtype %s, got %s", op, name,
                    pkv_dtype_name(ref->dtype), pkv_dtype_name(t->dtype));
  for (int d = 0; d < 3; d++) TRY(need_size(t, d, ref->sizes[d], op, name, "out_a's shape", err));
  TRY(need_unit_last_stride(t, op, name, err));
  TRY(need_device(t, ref->device, op, name, "out_a", err));
  if (written) TRY(need_no_broadcast(t, op, name, err));
  return PKV_OK;
}

pkv_status pkv_merge_check(const pkv_merge_args *a, pkv_error *err) {
  const char *op = "merge_attn_states";
  TRY(need_defined(&a->out_a, op, "out_a", err));
  TRY(need_dims(&a->out_a, 3, op, "out_a", "[T, H, Dv]", err));
  TRY(need_float_input(&a->out_a, op, "out_a", err));
  TRY(need_unit_last_stride(&a->out_a, op, "out_a", err));
  TRY(check_state_out(&a->out_b, &a->out_a, op, "out_b", 0, err));
  int64_t rows = a->out_a.sizes[0], heads = a->out_a.sizes[1];
  int device = a->out_a.device;
  TRY(check_lse(&a->lse_a, rows, heads, device, op, "lse_a", "out_a", 0, err));
  TRY(check_lse(&a->lse_b, rows, heads, device, op, "lse_b", "out_a", 0, err));
  TRY(check_state_out(&a->out, &a->out_a, op, "out", 1, err));
  TRY(check_lse(&a->lse, rows, heads, device, op, "lse", "out_a", 1, err));
  const named_tensor written[] = {{&a->out, "out"}, {&a->lse, "lse"}};
  const named_tensor read[] = {{&a->out_a, "out_a"}, {&a->lse_a, "lse_a"}, {&a->out_b, "out_b"},
                               {&a->lse_b, "lse_b"}};
  return need_no_aliasing(written, 2, read, 4, "out and lse must be separate memory", op, err);
}

/* ---- flash_attn_paged_sparse ---- */

pkv_status pkv_sparse_check(const pkv_sparse_args *a, int check_values, pkv_error *err) {
  const char *op = "flash_attn_paged_sparse";
  TRY(check_attention_operands(op, &a->q, &a->k_cache, &a->v_cache, &a->k_scales, &a->v_scales, &a->sinks, &a->out,
                               a->quant_group, a->scale, a->softcap, a->kv_format, a->k_tail_dim, err));
  const pkv_tensor *ix = &a->indices;
  TRY(need_defined(ix, op, "indices", err));
  TRY(need_dims(ix, 3, op, "indices", "[T, Hk or 1, K]", err));
  TRY(need_int32(ix, op, "indices", err));
  TRY(need_device(ix, a->k_cache.device, op, "indices", "k_cache", err));
  TRY(need_size(ix, 0, a->q.sizes[0], op, "indices", "T of q", err));
  int64_t hk = a->k_cache.sizes[2];
  if (ix->sizes[1] != hk && ix->sizes[1] != 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: indices.size(1) must be %lld (Hk: one list per KV head) or 1 (one "
                    "list shared by all heads), got %lld", op, (long long)hk, (long long)ix->sizes[1]);
  const pkv_tensor keys = keys_with_tail(&a->k_cache, a->k_tail_dim, a->k_tail_offset);
  const named_tensor written[] = {{&a->out, "out"}};
  const named_tensor read[] = {{ix, "indices"}, {&a->q, "q"}, {&keys, "k_cache"}, {&a->v_cache, "v_cache"},
                               {&a->k_scales, "k_scales"}, {&a->v_scales, "v_scales"}, {&a->sinks, "sinks"}};
  TRY(need_no_aliasing(written, 1, read, 7, "", op, err));
  if (!check_values) return PKV_OK;
  TRY(check_scale_value(&a->k_scales, op, "k_scales", err));
  TRY(check_scale_value(&a->v_scales, op, "v_scales", err));
  int64_t tokens; /* N * P; saturated, since an int32 entry is below any product too large for int64 */
  if (__builtin_mul_overflow(a->k_cache.sizes[0], a->k_cache.sizes[1], &tokens)) tokens = INT64_MAX;
  for (int64_t t = 0; t < ix->sizes[0]; t++)
    for (int64_t h = 0; h < ix->sizes[1]; h++)
      for (int64_t k = 0; k < ix->sizes[2]; k++) {
        int64_t v = pkv_sparse_index_at(ix, t, h, k);
        if (v < -1 || v >= tokens)
          return pkv_fail(err, PKV_ERR_INDEX, "%s: indices[%lld, %lld, %lld] must be -1 (no token) or an encoded "
                          "token page * P + slot in [0, %lld) (N * P), got %lld", op, (long long)t, (long long)h,
                          (long long)k, (long long)tokens, (long long)v);
      }
  return PKV_OK;
}
