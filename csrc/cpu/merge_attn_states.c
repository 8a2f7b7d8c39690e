/* pagedkv core: merge_attn_states on the CPU. Per (token, head) the two
 * log-sum-exps give the weights (pkv_merge_weights, shared with CUDA), then
 * the Dv values are blended in float32. Memory-bound and element-wise: one
 * portable blend loop serves every ISA (the compiler vectorizes it); 16-bit
 * rows are widened and rounded by the ISA table's load_vec/store_vec (an
 * element-by-element conversion took 0.24 ms of the 5.6 ms cascade benchmark). */
#include "pkv_cpu.h"
#include "../core/pkv_numeric.h"

int64_t pkv_merge_cpu_work(const pkv_merge_args *a) { return a->out_a.sizes[0]; }

static float lse_at(const pkv_tensor *t, int64_t row, int64_t head) {
  return ((const float *)t->data)[row * t->strides[0] + head * t->strides[1]];
}

#define MERGE_CHUNK 256 /* float32 values per blend step (stack buffers) */

/* out[0, n) = the blend of a and b, float32 rows. A part with weight 0 (it saw no key: its out is
 * meaningless, maybe never written, maybe NaN) is left out. The weight tests are made once per
 * row, so each loop is a plain one the compiler vectorizes (tested per element, they kept the
 * loop scalar: 28% of a 32-token merge's samples). */
static void blend_row(float wa, const float *a, float wb, const float *b, float *out, int64_t n) {
  if (wa != 0.0f && wb != 0.0f)
    for (int64_t i = 0; i < n; i++) out[i] = wa * a[i] + wb * b[i];
  else if (wa != 0.0f)
    for (int64_t i = 0; i < n; i++) out[i] = wa * a[i];
  else if (wb != 0.0f)
    for (int64_t i = 0; i < n; i++) out[i] = wb * b[i];
  else
    for (int64_t i = 0; i < n; i++) out[i] = 0.0f;
}

static void *row_at(const pkv_rows_view *v, int64_t elem) {
  return (char *)v->data + elem * (int64_t)pkv_dtype_size(v->dtype);
}

void pkv_merge_cpu(const pkv_merge_args *a, int64_t begin, int64_t end) {
  pkv_rows_view oa = pkv_rows_view_from(&a->out_a), ob = pkv_rows_view_from(&a->out_b);
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  int64_t dv = oa.head_dim;
  const pkv_cpu_kernels *k = pkv_cpu_kernels_get();
  float ta[MERGE_CHUNK], tb[MERGE_CHUNK];
  for (int64_t row = begin; row < end; row++)
    for (int64_t h = 0; h < oa.num_heads; h++) {
      float wa, wb, lse;
      pkv_merge_weights(lse_at(&a->lse_a, row, h), lse_at(&a->lse_b, row, h), &wa, &wb, &lse);
      ((float *)a->lse.data)[row * a->lse.strides[0] + h * a->lse.strides[1]] = lse;
      if (dv == 0) continue; /* no values: the outs are empty and their data may be NULL (no arithmetic on it) */
      int64_t ia = row * oa.stride_row + h * oa.stride_head, ib = row * ob.stride_row + h * ob.stride_head;
      int64_t io = row * out.stride_row + h * out.stride_head;
      if (oa.dtype == PKV_DTYPE_F32 && ob.dtype == PKV_DTYPE_F32 && out.dtype == PKV_DTYPE_F32) {
        blend_row(wa, (const float *)oa.data + ia, wb, (const float *)ob.data + ib, (float *)out.data + io, dv);
        continue;
      }
      for (int64_t c0 = 0; c0 < dv; c0 += MERGE_CHUNK) {
        int64_t n = dv - c0 < MERGE_CHUNK ? dv - c0 : MERGE_CHUNK;
        k->load_vec(row_at(&oa, ia + c0), oa.dtype, NULL, 0, n, ta, PKV_DTYPE_F32);
        k->load_vec(row_at(&ob, ib + c0), ob.dtype, NULL, 0, n, tb, PKV_DTYPE_F32);
        blend_row(wa, ta, wb, tb, ta, n);
        k->store_vec(ta, PKV_DTYPE_F32, n, row_at(&out, io + c0), out.dtype, NULL, 0);
      }
    }
}
