/* pagedkv core: how a KV cache holds its values (CONTRACT v1.2's kv_format), and the one
 * place that turns a packed cache into the plain views every kernel already reads.
 *
 * A quantized cache is described by four things: a values view (one dtype, [N, P, Hk, D]), its
 * scales (float32, one per `quant_group` channels of a token and head, or one per tensor), the
 * group, and, for packed MLA rows, a tail of bfloat16 channels stored at a fixed byte offset
 * inside each K row. The two packed formats are such descriptors over one uint8 row:
 *
 *   fp8_ds_mla  [N, P, 1, 656]: [0, 512) e4m3 latent, [512, 528) four float32 scales (one per 128
 *               latent channels), [528, 656) 64 bfloat16 rope values (DeepSeek-V3.2's row, as
 *               FlashMLA and vLLM store it);
 *   fp8_rope    [N, P, 1, 640]: [0, 512) e4m3 latent, [512, 640) 64 bfloat16 rope; the latent's
 *               scale is the per-tensor k_scales.
 *
 * Logical key (D = 576) = concat(latent * scale, rope); logical value (Dv = 512) = the latent.
 * The unpack functions below check the packed call (naming the caller's arguments) and return the
 * same call in plain form: paged_store and paged_load become two plain calls (latent with its
 * scales, rope without), attention one call whose K and V are the latent view and whose keys
 * carry the rope as a tail (pkv_attn_args.k_tail_dim / k_tail_offset). Kernels never see a
 * packed format, only views, scales, a group and a tail.
 *
 * Which scale groups each kernel family takes: every family takes any quant_group >= 1 (the one rule
 * the checks state); the group only picks the path inside it:
 *   CPU store, load, attention and sparse attention, every ISA: one scale per row (G >= D) is folded
 *     into the scores or probabilities, groups of a multiple of 32 channels keep the in-place bf16 dot
 *     products (pkv_cpu_fp8_dot_groups_ok), other groups the converting float32 paths;
 *   CUDA store and load: 16-channel chunks at a time where G >= D or G % 16 == 0 (store) / D % 8 == 0
 *     (load), element by element otherwise;
 *   CUDA attention: one scale per row staged a tile ahead where G >= D, per element in
 *     convert_fp8_tile otherwise; the portable kernel per element;
 *   CUDA sparse attention: the tiled kernel where G >= D or G % 8 == 0, else the portable kernel.
 */
#ifndef PKV_KV_FORMAT_H
#define PKV_KV_FORMAT_H

#include "pkv_common.h"
#include "pkv_numeric.h"
#include "pkv_view.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  PKV_KV_PLAIN = 0,      /* kv_format=None: a cache of one dtype */
  PKV_KV_FP8_DS_MLA = 1, /* kv_format="fp8_ds_mla" */
  PKV_KV_FP8_ROPE = 2,   /* kv_format="fp8_rope" */
} pkv_kv_format;

/* Channels of the packed MLA rows. */
#define PKV_MLA_LATENT_DIM 512
#define PKV_MLA_ROPE_DIM 64
#define PKV_MLA_KEY_DIM (PKV_MLA_LATENT_DIM + PKV_MLA_ROPE_DIM)
#define PKV_DS_MLA_GROUP 128

/* Byte layout of one packed row. */
typedef struct {
  int64_t row_bytes;     /* the uint8 cache's last dimension */
  int64_t scales_offset; /* float32 group scales inside the row; -1: the per-tensor k_scales */
  int64_t rope_offset;   /* the bfloat16 rope */
} pkv_kv_layout;

/* A cache as a kernel reads it (plain form): the values view, its float32 scales (one per `group`
 * channels of a token and head; per token, or a per-tensor scale's broadcast form), and the bfloat16
 * tail some keys carry after their values (packed MLA rows' rope). The helpers below are the one
 * rule for a scale's index, a channel's dequantized value and whether a scale folds. */
typedef struct {
  pkv_cache_view values;
  pkv_cache_view scales;         /* data NULL: no scales (16-bit or float32 values) */
  int64_t group;                 /* channels per scale */
  int64_t tail_dim, tail_offset; /* bf16 channels after the values' head_dim, bytes from each row's start */
  int64_t elem_bytes;            /* of the values' dtype */
} pkv_kv_cache;

/* keys: values and tail (q's D); values: head_dim */
PKV_HD int64_t pkv_kv_dim(const pkv_kv_cache *c) { return c->values.head_dim + c->tail_dim; }

/* 1 when one scale covers each row's values (group >= head_dim) and there is no tail: a reader may
 * then fold it into scores or probabilities instead of dequantizing each value. */
PKV_HD int pkv_kv_scale_per_row(const pkv_kv_cache *c) {
  return c->scales.data != NULL && c->group >= c->values.head_dim && c->tail_dim == 0;
}

/* The scale of value channel ch of (page, slot, head); 1 without scales. */
PKV_HD float pkv_kv_scale(const pkv_kv_cache *c, int64_t page, int64_t slot, int64_t head, int64_t ch) {
  if (c->scales.data == NULL) return 1.0f;
  return ((const float *)c->scales.data)[pkv_cache_offset(&c->scales, page, slot, head) + ch / c->group];
}

/* Value channel ch (< head_dim) of (page, slot, head) as float32: the value times its scale. */
PKV_HD float pkv_kv_value(const pkv_kv_cache *c, int64_t page, int64_t slot, int64_t head, int64_t ch) {
  return pkv_load_f32(c->values.data, pkv_cache_offset(&c->values, page, slot, head) + ch, c->values.dtype) *
         pkv_kv_scale(c, page, slot, head, ch);
}

/* Tail channel i (< tail_dim) of (page, slot, head): key channel head_dim + i. */
PKV_HD float pkv_kv_tail(const pkv_kv_cache *c, int64_t page, int64_t slot, int64_t head, int64_t i) {
  const char *row = (const char *)c->values.data + pkv_cache_offset(&c->values, page, slot, head) * c->elem_bytes;
  return pkv_load_f32(row + c->tail_offset, i, PKV_DTYPE_BF16);
}

/* Key channel ch (< pkv_kv_dim) as float32: a value or the tail. */
PKV_HD float pkv_kv_load(const pkv_kv_cache *c, int64_t page, int64_t slot, int64_t head, int64_t ch) {
  return ch < c->values.head_dim ? pkv_kv_value(c, page, slot, head, ch)
                                 : pkv_kv_tail(c, page, slot, head, ch - c->values.head_dim);
}

/* The descriptor of a plain call's cache (descriptors validated; scales undefined: none). */
pkv_kv_cache pkv_kv_cache_from(const pkv_tensor *values, const pkv_tensor *scales, int64_t group, int64_t tail_dim,
                               int64_t tail_offset);

/* 1 and the format for "fp8_ds_mla" / "fp8_rope" / NULL (plain); 0 for any other name. */
int pkv_kv_format_parse(const char *name, pkv_kv_format *format);
const char *pkv_kv_format_name(pkv_kv_format format);
/* The row layout of a packed format; NULL for PKV_KV_PLAIN. */
const pkv_kv_layout *pkv_kv_format_layout(pkv_kv_format format);

/* The plain views of a packed uint8 cache [N, P, 1, row_bytes] (already checked): the e4m3 latent
 * [N, P, 1, 512], its scales (float32 [N, P, 1, 4] inside the rows, or *per_tensor for fp8_rope)
 * with *group channels per scale, and the bfloat16 rope [N, P, 1, 64]. */
void pkv_kv_packed_views(pkv_kv_format format, const pkv_tensor *cache, const pkv_tensor *per_tensor,
                         pkv_tensor *latent, pkv_tensor *scales, int64_t *group, pkv_tensor *rope);

#ifdef __cplusplus
}
#endif
#endif /* PKV_KV_FORMAT_H */
