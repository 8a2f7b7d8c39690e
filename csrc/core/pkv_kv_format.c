/* pagedkv core: packed MLA rows (kv_format) checked and rewritten as plain calls
 * (pkv_kv_format.h). */
#include <string.h>

#include "pkv_ops.h"

#define TRY(x)                         \
  do {                                 \
    pkv_status s_ = (x);               \
    if (s_ != PKV_OK) return s_;       \
  } while (0)

static const pkv_kv_layout DS_MLA = {656, 512, 528};
static const pkv_kv_layout ROPE = {640, -1, 512};

int pkv_kv_format_parse(const char *name, pkv_kv_format *format) {
  if (!name) *format = PKV_KV_PLAIN;
  else if (strcmp(name, "fp8_ds_mla") == 0) *format = PKV_KV_FP8_DS_MLA;
  else if (strcmp(name, "fp8_rope") == 0) *format = PKV_KV_FP8_ROPE;
  else return 0;
  return 1;
}

const char *pkv_kv_format_name(pkv_kv_format format) {
  switch (format) {
  case PKV_KV_FP8_DS_MLA: return "fp8_ds_mla";
  case PKV_KV_FP8_ROPE: return "fp8_rope";
  default: return "None";
  }
}

const pkv_kv_layout *pkv_kv_format_layout(pkv_kv_format format) {
  switch (format) {
  case PKV_KV_FP8_DS_MLA: return &DS_MLA;
  case PKV_KV_FP8_ROPE: return &ROPE;
  default: return NULL;
  }
}

/* A view of `channels` elements of `dtype` starting `offset` bytes into each row of the uint8 cache
 * (strides divisible by the element size: checked by check_packed_cache). */
static pkv_tensor row_part(const pkv_tensor *cache, int64_t offset, pkv_dtype dtype, int64_t channels) {
  pkv_tensor v = *cache;
  int64_t elem = (int64_t)pkv_dtype_size(dtype);
  v.dtype = dtype;
  v.data = cache->data ? (void *)((char *)cache->data + offset) : NULL;
  for (int d = 0; d < 3; d++) v.strides[d] = cache->strides[d] / elem;
  v.sizes[3] = channels;
  v.strides[3] = 1;
  return v;
}

void pkv_kv_packed_views(pkv_kv_format format, const pkv_tensor *cache, const pkv_tensor *per_tensor,
                         pkv_tensor *latent, pkv_tensor *scales, int64_t *group, pkv_tensor *rope) {
  const pkv_kv_layout *l = pkv_kv_format_layout(format);
  *latent = row_part(cache, 0, PKV_DTYPE_FP8_E4M3, PKV_MLA_LATENT_DIM);
  *rope = row_part(cache, l->rope_offset, PKV_DTYPE_BF16, PKV_MLA_ROPE_DIM);
  if (l->scales_offset >= 0) {
    *scales = row_part(cache, l->scales_offset, PKV_DTYPE_F32, PKV_MLA_LATENT_DIM / PKV_DS_MLA_GROUP);
    *group = PKV_DS_MLA_GROUP;
  } else {
    *scales = *per_tensor;
    *group = PKV_MLA_LATENT_DIM;
  }
}

pkv_kv_cache pkv_kv_cache_from(const pkv_tensor *values, const pkv_tensor *scales, int64_t group, int64_t tail_dim,
                               int64_t tail_offset) {
  pkv_kv_cache c;
  memset(&c, 0, sizeof c);
  c.values = pkv_cache_view_from(values);
  if (scales->defined) c.scales = pkv_cache_view_from(scales);
  c.group = group;
  c.tail_dim = tail_dim;
  c.tail_offset = tail_offset;
  c.elem_bytes = (int64_t)pkv_dtype_size(values->dtype);
  return c;
}

/* ---- the packed call's own rules, named after the caller's arguments ---- */

/* uint8 [N, P, 1, row_bytes], unit last stride, and a base and strides that keep the float32
 * scales and bfloat16 rope of every row aligned (so their views have whole-element strides). */
static pkv_status check_packed_cache(pkv_kv_format f, const pkv_tensor *c, const char *op, const char *name,
                                     pkv_error *err) {
  const pkv_kv_layout *l = pkv_kv_format_layout(f);
  const char *fmt = pkv_kv_format_name(f);
  if (!c->defined) return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s is required", op, name);
  if (c->dtype != PKV_DTYPE_U8)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be uint8 (packed rows) for kv_format='%s', got %s", op, name,
                    fmt, pkv_dtype_name(c->dtype));
  if (c->ndim != 4)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must be [N, P, 1, %lld] (one %lld-byte row per token) for kv_format='%s', got %d-D",
                    op, name, (long long)l->row_bytes, (long long)l->row_bytes, fmt, c->ndim);
  if (c->sizes[2] != 1 || c->sizes[3] != l->row_bytes)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must be [N, P, 1, %lld] (one latent head, one %lld-byte row per token) for "
                    "kv_format='%s', got [%lld, %lld, %lld, %lld]",
                    op, name, (long long)l->row_bytes, (long long)l->row_bytes, fmt, (long long)c->sizes[0],
                    (long long)c->sizes[1], (long long)c->sizes[2], (long long)c->sizes[3]);
  if (c->sizes[1] < 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s page size (size(1)) must be >= 1, got 0", op, name);
  if (c->strides[3] != 1)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must have stride 1 in its last dimension, got %lld", op, name,
                    (long long)c->strides[3]);
  int64_t align = l->scales_offset >= 0 ? 4 : 2; /* float32 scales, bfloat16 rope */
  int misaligned = c->data && (uintptr_t)c->data % (uintptr_t)align != 0;
  for (int d = 0; d < 3; d++) misaligned |= c->sizes[d] > 1 && c->strides[d] % align != 0;
  if (misaligned)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must start at a %lld-byte aligned address with page, token and head strides that are "
                    "multiples of %lld bytes for kv_format='%s' (its rows hold %s)",
                    op, name, (long long)align, (long long)align, fmt,
                    align == 4 ? "float32 scales" : "bfloat16 values");
  return PKV_OK;
}

static pkv_status need_none(const pkv_tensor *t, pkv_kv_format f, const char *op, const char *name, const char *why,
                            pkv_error *err) {
  if (t->defined)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s must be None for kv_format='%s' (%s)", op, name,
                    pkv_kv_format_name(f), why);
  return PKV_OK;
}

/* The scales a format takes through k_scales: none for fp8_ds_mla (they are in the rows), one
 * float32 element for fp8_rope (the latent's per-tensor scale; its value is checked with the
 * plain call's values). */
static pkv_status check_packed_scales(pkv_kv_format f, const pkv_tensor *k_scales, const pkv_tensor *v_scales,
                                      const char *op, const char *k_name, pkv_error *err) {
  TRY(need_none(v_scales, f, op, "v_scales", "values are the K rows' latent, scaled by its scales", err));
  if (f == PKV_KV_FP8_DS_MLA) return need_none(k_scales, f, op, k_name, "each row holds its four scales", err);
  if (!pkv_scales_per_tensor(k_scales) || k_scales->dtype != PKV_DTYPE_F32)
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "%s: %s must be one float32 element (shape [] or [1]: the latent's per-tensor scale) for "
                    "kv_format='fp8_rope', got %s",
                    op, k_name, k_scales->defined ? "another shape or dtype" : "None");
  return PKV_OK;
}

/* t's last dimension must be `width` (t is 3-D: rank errors are left to the plain check). */
static pkv_status need_width(const pkv_tensor *t, int64_t width, pkv_kv_format f, const char *op, const char *name,
                             const char *what, pkv_error *err) {
  if (t->defined && t->ndim == 3 && t->sizes[2] != width)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: %s.size(2) must be %lld (%s) for kv_format='%s', got %lld", op, name,
                    (long long)width, what, pkv_kv_format_name(f), (long long)t->sizes[2]);
  return PKV_OK;
}

/* Channels [first, first + n) of a [T, H, D] rows tensor. */
static pkv_tensor channels(const pkv_tensor *t, int64_t first, int64_t n) {
  pkv_tensor v = *t;
  if (v.data) v.data = (char *)v.data + first * (int64_t)pkv_dtype_size(t->dtype);
  v.sizes[2] = n;
  return v;
}

pkv_status pkv_store_unpack(const pkv_store_args *a, pkv_store_args parts[2], int *num_parts, pkv_error *err) {
  const char *op = "paged_store";
  *num_parts = 1;
  parts[0] = *a;
  if (a->kv_format == PKV_KV_PLAIN) return PKV_OK;
  pkv_kv_format f = a->kv_format;
  TRY(check_packed_cache(f, &a->k_cache, op, "k_cache", err));
  TRY(need_none(&a->v_cache, f, op, "v_cache", "the rows hold keys and values", err));
  TRY(need_none(&a->value, f, op, "value", "the value is the key's latent", err));
  TRY(check_packed_scales(f, &a->k_scales, &a->v_scales, op, "k_scales", err));
  if (!a->key.defined || a->key.ndim != 3)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: key must be [T, 1, %d] for kv_format='%s'", op, PKV_MLA_KEY_DIM,
                    pkv_kv_format_name(f));
  TRY(need_width(&a->key, PKV_MLA_KEY_DIM, f, op, "key", "latent and rope", err));
  pkv_tensor latent, scales, rope;
  int64_t group;
  pkv_kv_packed_views(f, &a->k_cache, &a->k_scales, &latent, &scales, &group, &rope);
  parts[0].key = channels(&a->key, 0, PKV_MLA_LATENT_DIM);
  parts[0].k_cache = latent;
  parts[0].k_scales = scales;
  parts[0].quant_group = group;
  parts[0].kv_format = PKV_KV_PLAIN;
  parts[0].packed_key = a->key;
  parts[0].packed_cache = a->k_cache;
  parts[1] = parts[0];
  parts[1].key = channels(&a->key, PKV_MLA_LATENT_DIM, PKV_MLA_ROPE_DIM);
  parts[1].k_cache = rope;
  parts[1].k_scales = (pkv_tensor){0};
  *num_parts = 2;
  return PKV_OK;
}

pkv_status pkv_load_unpack(const pkv_load_args *a, pkv_load_args parts[2], int *num_parts, pkv_error *err) {
  const char *op = "paged_load";
  *num_parts = 1;
  parts[0] = *a;
  if (a->kv_format == PKV_KV_PLAIN) return PKV_OK;
  pkv_kv_format f = a->kv_format;
  TRY(check_packed_cache(f, &a->cache, op, "cache", err));
  pkv_tensor no_v_scales = {0};
  TRY(check_packed_scales(f, &a->scales, &no_v_scales, op, "scales", err));
  if (!a->out.defined || a->out.ndim != 3)
    return pkv_fail(err, PKV_ERR_ARGUMENT, "%s: out must be [T_out, 1, %d] for kv_format='%s'", op,
                    PKV_MLA_KEY_DIM, pkv_kv_format_name(f));
  TRY(need_width(&a->out, PKV_MLA_KEY_DIM, f, op, "out", "the logical key: latent and rope", err));
  pkv_tensor latent, scales, rope;
  int64_t group;
  pkv_kv_packed_views(f, &a->cache, &a->scales, &latent, &scales, &group, &rope);
  parts[0].cache = latent;
  parts[0].scales = scales;
  parts[0].quant_group = group;
  parts[0].out = channels(&a->out, 0, PKV_MLA_LATENT_DIM);
  parts[0].kv_format = PKV_KV_PLAIN;
  parts[0].packed_out = a->out;
  parts[0].packed_cache = a->cache;
  parts[1] = parts[0];
  parts[1].cache = rope;
  parts[1].scales = (pkv_tensor){0};
  parts[1].out = channels(&a->out, PKV_MLA_LATENT_DIM, PKV_MLA_ROPE_DIM);
  *num_parts = 2;
  return PKV_OK;
}

/* What attention and sparse attention share: K and V become the latent view with its scales,
 * the rope a K tail. */
static pkv_status unpack_attention(const char *op, pkv_kv_format f, pkv_tensor *q, pkv_tensor *k_cache,
                                   pkv_tensor *v_cache, pkv_tensor *k_scales, pkv_tensor *v_scales,
                                   const pkv_tensor *out, int64_t *quant_group, int64_t *tail_dim,
                                   int64_t *tail_offset, pkv_error *err) {
  TRY(check_packed_cache(f, k_cache, op, "k_cache", err));
  TRY(need_none(v_cache, f, op, "v_cache", "values are the K rows' latent", err));
  TRY(check_packed_scales(f, k_scales, v_scales, op, "k_scales", err));
  TRY(need_width(q, PKV_MLA_KEY_DIM, f, op, "q", "latent and rope", err));
  TRY(need_width(out, PKV_MLA_LATENT_DIM, f, op, "out", "the latent", err));
  pkv_tensor latent, scales, rope;
  pkv_kv_packed_views(f, k_cache, k_scales, &latent, &scales, quant_group, &rope);
  *k_cache = latent;
  *v_cache = latent;
  *k_scales = scales;
  *v_scales = scales;
  *tail_dim = PKV_MLA_ROPE_DIM;
  *tail_offset = pkv_kv_format_layout(f)->rope_offset;
  return PKV_OK;
}

pkv_status pkv_attn_unpack(const pkv_attn_args *a, pkv_attn_args *plain, pkv_error *err) {
  *plain = *a;
  if (a->kv_format == PKV_KV_PLAIN) {
    plain->k_tail_dim = plain->k_tail_offset = 0;
    return PKV_OK;
  }
  TRY(unpack_attention("flash_attn_paged", a->kv_format, &plain->q, &plain->k_cache, &plain->v_cache,
                       &plain->k_scales, &plain->v_scales, &plain->out, &plain->quant_group, &plain->k_tail_dim,
                       &plain->k_tail_offset, err));
  plain->kv_format = PKV_KV_PLAIN;
  return PKV_OK;
}

pkv_status pkv_sparse_unpack(const pkv_sparse_args *a, pkv_sparse_args *plain, pkv_error *err) {
  *plain = *a;
  if (a->kv_format == PKV_KV_PLAIN) {
    plain->k_tail_dim = plain->k_tail_offset = 0;
    return PKV_OK;
  }
  TRY(unpack_attention("flash_attn_paged_sparse", a->kv_format, &plain->q, &plain->k_cache, &plain->v_cache,
                       &plain->k_scales, &plain->v_scales, &plain->out, &plain->quant_group, &plain->k_tail_dim,
                       &plain->k_tail_offset, err));
  plain->kv_format = PKV_KV_PLAIN;
  return PKV_OK;
}
