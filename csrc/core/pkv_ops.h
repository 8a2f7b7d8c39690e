/* pagedkv core: the three contract ops as argument structs, one checker
 * per op (shared by every backend) and the CPU kernels.
 *
 * Backends fill an args struct with descriptors, call the op's check
 * (which validates shapes, dtypes, strides, devices and, when asked, the
 * index values), and only then run a kernel. A failed check has written
 * nothing. */
#ifndef PKV_OPS_H
#define PKV_OPS_H

#include "pkv_common.h"
#include "pkv_view.h"

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
  pkv_tensor k_scales;          /* f32 [N, P, Hk, ceil(D/G)] iff k_cache is FP8 */
  pkv_tensor v_scales;          /* f32 [N, P, Hk, ceil(Dv/G)] iff v_cache is FP8 */
  int64_t quant_group;
} pkv_store_args;

typedef struct {
  pkv_tensor cache;              /* [N, P, Hk, D] */
  pkv_tensor scales;             /* f32 [N, P, Hk, ceil(D/G)] iff cache is FP8 */
  pkv_tensor lookup_table;       /* int32 [B, max_pages] */
  pkv_tensor seq_lens;           /* int32 [B] */
  pkv_tensor output_row_offsets; /* int32 [B+1] */
  pkv_tensor out;                /* [T_out, Hk, D] f32/f16/bf16 */
  int64_t quant_group;
} pkv_load_args;

typedef struct {
  pkv_tensor q;                 /* [T, Hq, D] f32/f16/bf16 */
  pkv_tensor input_row_offsets; /* int32 [B+1] */
  pkv_tensor k_cache;           /* [N, P, Hk, D] */
  pkv_tensor v_cache;           /* [N, P, Hk, Dv] */
  pkv_tensor cache_lengths;     /* int32 [B] */
  pkv_tensor lookup_table;      /* int32 [B, max_pages] */
  pkv_tensor k_scales, v_scales;
  pkv_tensor out;               /* [T, Hq, Dv], q's dtype */
  double scale;                 /* already resolved: 1/sqrt(D) when the caller gave none */
  int causal;
  int64_t quant_group;
  int64_t window_left; /* -1: no window */
  double softcap;      /* 0: off */
  pkv_tensor sinks;    /* f32 [Hq] or undefined: exp(sinks[h]) joins head h's softmax denominator */
  pkv_tensor lse;      /* f32 [T, Hq] or undefined: log of each row's softmax denominator, written */
} pkv_attn_args;

/* flash_attn_paged_sparse: each query row attends over the tokens it lists. */
typedef struct {
  pkv_tensor q;                 /* [T, Hq, D] f32/f16/bf16 */
  pkv_tensor k_cache, v_cache;  /* [N, P, Hk, D], [N, P, Hk, Dv] */
  pkv_tensor indices;           /* int32 [T, Hk or 1, K]: encoded tokens page * P + slot, or -1 (none) */
  pkv_tensor k_scales, v_scales;
  pkv_tensor sinks;             /* f32 [Hq] or undefined */
  pkv_tensor out;               /* [T, Hq, Dv], q's dtype, written */
  double scale;                 /* resolved */
  int64_t quant_group;
  double softcap;
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

/* check_values: also validate index values (page ids, lengths, offsets);
 * the index tensors' data must then be readable from the host. */
pkv_status pkv_store_check(const pkv_store_args *a, int check_values, pkv_error *err);
pkv_status pkv_load_check(const pkv_load_args *a, int check_values, pkv_error *err);
pkv_status pkv_attn_check(const pkv_attn_args *a, int check_values, pkv_error *err);
pkv_status pkv_merge_check(const pkv_merge_args *a, pkv_error *err);
pkv_status pkv_sparse_check(const pkv_sparse_args *a, int check_values, pkv_error *err);

/* ---- CPU kernels: validated args, host memory, a work range [begin, end) ----
 * The shim splits [0, work) across its thread pool; ranges never write the
 * same bytes, so any split is race-free. */
int64_t pkv_store_cpu_work(const pkv_store_args *a); /* token rows */
void pkv_store_cpu(const pkv_store_args *a, int64_t begin, int64_t end);

int64_t pkv_load_cpu_work(const pkv_load_args *a); /* (row, page) pairs */
void pkv_load_cpu(const pkv_load_args *a, int64_t begin, int64_t end);

/* Sparse attention: items are (token row, KV head) pairs. Fails only when scratch memory cannot
 * be allocated (nothing written then). */
int64_t pkv_sparse_cpu_work(const pkv_sparse_args *a);
pkv_status pkv_sparse_cpu(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err);

int64_t pkv_merge_cpu_work(const pkv_merge_args *a); /* token rows */
void pkv_merge_cpu(const pkv_merge_args *a, int64_t begin, int64_t end);

/* Attention is planned first: the plan lists work items (a batch row, a
 * KV head and a block of query rows), and zeroes padding rows of out. */
typedef struct {
  int64_t batch;      /* row b */
  int64_t first_row;  /* first query row of the block (ragged index) */
  int64_t num_rows;   /* query rows in the block */
  int64_t kv_head;            /* first KV head */
  int64_t num_kv_heads;       /* KV heads [kv_head, kv_head + num_kv_heads): decode items take several so a
                                 token's heads (contiguous in the usual layouts) are streamed together */
  int64_t key_begin, key_end; /* keys [key_begin, key_end) of the row this item attends to */
  int64_t split_group;        /* -1, or the split-KV group whose partial results it merges into */
  int64_t split_slot;         /* its partial-result slot in that case */
} pkv_attn_item;

typedef struct {
  pkv_attn_item *items;
  int64_t num_items;
  void *splits; /* split-KV state (partials, counters), owned by the plan */
} pkv_attn_plan;

pkv_status pkv_attn_cpu_plan(const pkv_attn_args *a, pkv_attn_plan *plan, pkv_error *err);
/* Fails only when scratch memory cannot be allocated (nothing written then). */
pkv_status pkv_attn_cpu(const pkv_attn_args *a, const pkv_attn_plan *plan, int64_t begin, int64_t end,
                        pkv_error *err);
void pkv_attn_plan_free(pkv_attn_plan *plan);

#ifdef __cplusplus
}
#endif
#endif /* PKV_OPS_H */
