/* pagedkv core: the ops as argument structs (descriptors) and one
 * checker per op, shared by every backend (pkv_check.c). The backends' kernels
 * are declared in csrc/cpu/pkv_cpu_ops.h and csrc/cuda/pkv_cuda.h.
 *
 * Backends fill an args struct with descriptors, call the op's check
 * (which validates shapes, dtypes, strides, devices and, when asked, the
 * index values), and only then run a kernel. A failed check has written
 * nothing. */
#ifndef PKV_OPS_H
#define PKV_OPS_H

#include "pkv_common.h"
#include "pkv_view.h"
#include "pkv_kv_format.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  pkv_tensor key;               /* [T, Hk, D]  f32/f16/bf16 */
  pkv_tensor value;             /* [T, Hk, Dv] or undefined (K-only) */
  pkv_tensor k_cache;           /* [N, P, Hk, D] */
  pkv_tensor v_cache;           /* [N, P, Hk, Dv] or undefined */
  pkv_tensor input_row_offsets; /* int32 [B+1] */
  pkv_tensor cache_lengths;     /* int32 [B] */
  pkv_tensor lookup_table;      /* int32 [B, max_pages] */
  pkv_tensor k_scales;          /* iff k_cache is FP8: f32 [N, P, Hk, ceil(D/G)], written, or per tensor
                                 * (one element, [] or [1]: read, pkv_scales_per_tensor) */
  pkv_tensor v_scales;          /* the same for v_cache (Dv) */
  int64_t quant_group;
  pkv_kv_format kv_format;      /* packed formats: pkv_store_unpack gives the plain calls */
  /* Parts of a packed call only (undefined otherwise): the caller's whole key and packed k_cache.
   * A part reads some channels of the key and writes some bytes of each row, the other part the
   * rest, so each part's check also keeps its reads and the whole key off the whole rows. */
  pkv_tensor packed_key, packed_cache;
} pkv_store_args;

typedef struct {
  pkv_tensor cache;              /* [N, P, Hk, D] */
  pkv_tensor scales;             /* f32 [N, P, Hk, ceil(D/G)] iff cache is FP8; the checks also take a
                                  * per-tensor one, kernels its pkv_scales_broadcast form */
  pkv_tensor lookup_table;       /* int32 [B, max_pages] */
  pkv_tensor seq_lens;           /* int32 [B] */
  pkv_tensor output_row_offsets; /* int32 [B+1] */
  pkv_tensor out;                /* [T_out, Hk, D] f32/f16/bf16 */
  int64_t quant_group;
  pkv_kv_format kv_format;       /* packed formats: pkv_load_unpack gives the plain calls */
  /* Parts of a packed call only (undefined otherwise): the caller's whole out and packed cache, as
   * pkv_store_args' packed_key and packed_cache (each part writes some channels of out). */
  pkv_tensor packed_out, packed_cache;
} pkv_load_args;

typedef struct {
  pkv_tensor q;                 /* [T, Hq, D] f32/f16/bf16 */
  pkv_tensor input_row_offsets; /* int32 [B+1] */
  pkv_tensor k_cache;           /* [N, P, Hk, D] */
  pkv_tensor v_cache;           /* [N, P, Hk, Dv] */
  pkv_tensor cache_lengths;     /* int32 [B] */
  pkv_tensor lookup_table;      /* int32 [B, max_pages] */
  pkv_tensor k_scales, v_scales; /* as pkv_load_args' scales, for k_cache and v_cache */
  pkv_tensor out;               /* [T, Hq, Dv], q's dtype */
  double scale;                 /* already resolved: 1/sqrt(D) when the caller gave none */
  int causal;
  int64_t quant_group;
  int64_t window_left; /* -1: no window */
  double softcap;      /* 0: off */
  pkv_tensor sinks;    /* f32 [Hq] or undefined: exp(sinks[h]) joins head h's softmax denominator */
  pkv_tensor lse;      /* f32 [T, Hq] or undefined: log of each row's softmax denominator, written */
  pkv_kv_format kv_format; /* packed formats: pkv_attn_unpack gives the plain call below */
  /* Plain form only: keys have k_tail_dim more channels than k_cache's D (q's D = D + k_tail_dim),
   * bfloat16, stored k_tail_offset bytes after the start of each K row (packed MLA rows' rope;
   * scores include them, values do not). 0: no tail. */
  int64_t k_tail_dim, k_tail_offset;
} pkv_attn_args;

/* copy_pages: pool[dst_pages[i]] = pool[src_pages[i]] along dim 0 (the page manager's
 * copy-on-write copies). */
typedef struct {
  pkv_tensor pool;      /* [N, ...] any dtype, any strides */
  pkv_tensor src_pages; /* int32 [C] on pool's device, values in [0, N) */
  pkv_tensor dst_pages; /* int32 [C], distinct and disjoint from src_pages */
} pkv_copy_pages_args;

/* flash_attn_paged_sparse: each query row attends over the tokens it lists. */
typedef struct {
  pkv_tensor q;                 /* [T, Hq, D] f32/f16/bf16 */
  pkv_tensor k_cache, v_cache;  /* [N, P, Hk, D], [N, P, Hk, Dv] */
  pkv_tensor indices;           /* int32 [T, Hk or 1, K]: encoded tokens page * P + slot, or -1 (none) */
  pkv_tensor k_scales, v_scales; /* as pkv_load_args' scales */
  pkv_tensor sinks;             /* f32 [Hq] or undefined */
  pkv_tensor out;               /* [T, Hq, Dv], q's dtype, written */
  double scale;                 /* resolved */
  int64_t quant_group;
  double softcap;
  pkv_kv_format kv_format;          /* as pkv_attn_args' */
  int64_t k_tail_dim, k_tail_offset; /* as pkv_attn_args' */
} pkv_sparse_args;

/* Entry [t, h, k] of an int32 indices tensor (any non-negative strides). */
PKV_HD int64_t pkv_sparse_index_at(const pkv_tensor *ix, int64_t t, int64_t h, int64_t k) {
  return ((const int32_t *)ix->data)[t * ix->strides[0] + h * ix->strides[1] + k * ix->strides[2]];
}

/* merge_attn_states: two partial attentions over disjoint key sets -> their union. */
typedef struct {
  pkv_tensor out_a, out_b; /* [T, H, Dv] f32/f16/bf16, same dtype */
  pkv_tensor lse_a, lse_b; /* f32 [T, H] */
  pkv_tensor out;          /* [T, H, Dv], out_a's dtype, written */
  pkv_tensor lse;          /* f32 [T, H], written */
} pkv_merge_args;

/* check_values: also validate index values (page ids, lengths, offsets) and per-tensor scales'
 * values (finite, > 0); the index tensors' and per-tensor scales' data must then be readable from
 * the host (for copy_pages: host-readable and contiguous). */
pkv_status pkv_store_check(const pkv_store_args *a, int check_values, pkv_error *err);
pkv_status pkv_load_check(const pkv_load_args *a, int check_values, pkv_error *err);
pkv_status pkv_attn_check(const pkv_attn_args *a, int check_values, pkv_error *err);
pkv_status pkv_copy_pages_check(const pkv_copy_pages_args *a, int check_values, pkv_error *err);

/* The value rule of copy_pages on plain arrays (num_copies entries each; may be NULL when 0):
 * every entry in [0, num_pages), dst entries distinct and none also in src (so the copies can
 * run in any order, or all at once). */
pkv_status pkv_copy_pages_check_values(int64_t num_pages, const int32_t *src_pages, const int32_t *dst_pages,
                                       int64_t num_copies, pkv_error *err);
pkv_status pkv_merge_check(const pkv_merge_args *a, pkv_error *err);
pkv_status pkv_sparse_check(const pkv_sparse_args *a, int check_values, pkv_error *err);

/* Packed formats (pkv_kv_format.h): check what the format fixes (cache dtype and row width, the
 * arguments it has none of, key and output widths), naming the caller's arguments, and write the
 * call in plain form. Store and load give 1 call (plain format: *a itself) or 2 (latent with its
 * scales, then rope), each still to pass the op's check; the backends check every part before
 * running any, so a failed check writes nothing. Attention gives one plain call with a K tail. */
pkv_status pkv_store_unpack(const pkv_store_args *a, pkv_store_args parts[2], int *num_parts, pkv_error *err);
pkv_status pkv_load_unpack(const pkv_load_args *a, pkv_load_args parts[2], int *num_parts, pkv_error *err);
pkv_status pkv_attn_unpack(const pkv_attn_args *a, pkv_attn_args *plain, pkv_error *err);
pkv_status pkv_sparse_unpack(const pkv_sparse_args *a, pkv_sparse_args *plain, pkv_error *err);

#ifdef __cplusplus
}
#endif
#endif /* PKV_OPS_H */
