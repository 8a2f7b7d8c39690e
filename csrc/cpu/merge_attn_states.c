/* pagedkv core: merge_attn_states on the CPU. Per (token, head) the two
 * log-sum-exps give the weights (pkv_merge_weights, shared with CUDA), then
 * the Dv values are blended in float32. Memory-bound and element-wise, so one
 * portable loop serves every ISA (the compiler vectorizes the float32 case). */
#include "pkv_cpu.h"
#include "../core/pkv_numeric.h"

int64_t pkv_merge_cpu_work(const pkv_merge_args *a) { return a->out_a.sizes[0]; }

static float lse_at(const pkv_tensor *t, int64_t row, int64_t head) {
  return ((const float *)t->data)[row * t->strides[0] + head * t->strides[1]];
}

/* A part with weight 0 (it saw no key: its out is meaningless, maybe never written) is left out. */
static inline float blend(float wa, float a, float wb, float b) {
  return (wa != 0.0f ? wa * a : 0.0f) + (wb != 0.0f ? wb * b : 0.0f);
}

void pkv_merge_cpu(const pkv_merge_args *a, int64_t begin, int64_t end) {
  pkv_rows_view oa = pkv_rows_view_from(&a->out_a), ob = pkv_rows_view_from(&a->out_b);
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  int64_t dv = oa.head_dim;
  for (int64_t row = begin; row < end; row++)
    for (int64_t h = 0; h < oa.num_heads; h++) {
      float wa, wb, lse;
      pkv_merge_weights(lse_at(&a->lse_a, row, h), lse_at(&a->lse_b, row, h), &wa, &wb, &lse);
      ((float *)a->lse.data)[row * a->lse.strides[0] + h * a->lse.strides[1]] = lse;
      int64_t ia = row * oa.stride_row + h * oa.stride_head, ib = row * ob.stride_row + h * ob.stride_head;
      int64_t io = row * out.stride_row + h * out.stride_head;
      if (oa.dtype == PKV_DTYPE_F32) {
        const float *pa = (const float *)oa.data + ia, *pb = (const float *)ob.data + ib;
        float *po = (float *)out.data + io;
        for (int64_t i = 0; i < dv; i++) po[i] = blend(wa, pa[i], wb, pb[i]);
        continue;
      }
      for (int64_t i = 0; i < dv; i++)
        pkv_store_f32(out.data, io + i, out.dtype,
                      blend(wa, pkv_load_f32(oa.data, ia + i, oa.dtype), wb, pkv_load_f32(ob.data, ib + i, ob.dtype)));
    }
}
