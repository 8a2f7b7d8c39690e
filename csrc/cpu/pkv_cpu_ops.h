/* pagedkv CPU backend: the op entry points the torch shim (csrc/torch/ops_cpu.cpp), the C
 * tests and the fuzzers call. Arguments are the core's op descriptors (csrc/core/pkv_ops.h),
 * already validated by the op's check; memory is host memory. */
#ifndef PKV_CPU_OPS_H
#define PKV_CPU_OPS_H

#include "../core/pkv_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CPU kernels: validated args, host memory, a work range [begin, end) ----
 * The shim splits [0, work) across its thread pool; ranges never write the
 * same bytes, so any split is race-free. */
int64_t pkv_store_cpu_work(const pkv_store_args *a); /* token rows */
void pkv_store_cpu(const pkv_store_args *a, int64_t begin, int64_t end);

int64_t pkv_load_cpu_work(const pkv_load_args *a); /* (row, page) pairs */
void pkv_load_cpu(const pkv_load_args *a, int64_t begin, int64_t end);

/* Sparse attention: items are (token row, KV head) pairs. The plan chooses their path once per
 * call (a pkv_cpu_sparse_path, pkv_cpu_sparse.h: the same for every item); pkv_sparse_cpu runs items
 * [begin, end) on it and fails only when scratch memory cannot be allocated (nothing written then). */
typedef struct {
  int path; /* how the kernel runs the items: a pkv_cpu_sparse_path, chosen by the plan */
} pkv_sparse_plan;

pkv_sparse_plan pkv_sparse_cpu_plan(const pkv_sparse_args *a);
int64_t pkv_sparse_cpu_work(const pkv_sparse_args *a);
pkv_status pkv_sparse_cpu(const pkv_sparse_args *a, const pkv_sparse_plan *plan, int64_t begin, int64_t end,
                          pkv_error *err);

/* vLLM's CPU cache writer's FP8 values (vllm_cpu_fp8.c) of elements [begin, end) of x (f32, bf16 or f16,
 * contiguous) with its per-tensor scale (finite, > 0), as bfloat16 into out (which holds each exactly). */
void pkv_vllm_cpu_fp8_values(const void *x, pkv_dtype x_dtype, float scale, pkv_dtype fp8_dtype, uint16_t *out,
                             int64_t begin, int64_t end);

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
  int path;                   /* how the kernel runs it: a pkv_cpu_attn_path (pkv_cpu.h), chosen by the plan */
} pkv_attn_item;

typedef struct {
  pkv_attn_item *items; /* heaviest first */
  int64_t num_items;
  void *splits; /* split-KV state (partials, counters), owned by the plan */
  void *claims; /* the next item no thread has claimed (an atomic counter, pkv_attn_cpu_claim), owned */
} pkv_attn_plan;

pkv_status pkv_attn_cpu_plan(const pkv_attn_args *a, pkv_attn_plan *plan, pkv_error *err);
/* Runs items [begin, end). Fails only when scratch memory cannot be allocated (nothing written then). */
pkv_status pkv_attn_cpu(const pkv_attn_args *a, const pkv_attn_plan *plan, int64_t begin, int64_t end,
                        pkv_error *err);
/* Runs the items no other caller has claimed yet, one at a time, until none is left: threads that
 * call it together share the items however fast each one runs (a core slowed by other work takes
 * fewer), where fixed ranges leave the faster threads waiting. Results do not depend on which
 * thread ran what. Fails as pkv_attn_cpu. */
pkv_status pkv_attn_cpu_claim(const pkv_attn_args *a, const pkv_attn_plan *plan, pkv_error *err);
void pkv_attn_plan_free(pkv_attn_plan *plan);

#ifdef __cplusplus
}
#endif
#endif /* PKV_CPU_OPS_H */
