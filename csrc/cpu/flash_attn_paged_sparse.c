/* pagedkv core: flash_attn_paged_sparse on the CPU.
 *
 * One work item = (query token row t, KV head): its list of K encoded tokens
 * (page * P + slot, -1 for none) is gathered once, K rows then V rows, into
 * float32 scratch through the ISA table's load_vec (which also dequantizes
 * FP8 with the row's group scales), and every query head of the GQA group is
 * scored against the gathered rows. The list is at most a few thousand
 * tokens, so a two-pass softmax (max, then exp) over all of them is cheaper
 * than an online one. Entries outside [0, N * P) are skipped: the check has
 * already refused them, this only keeps the kernel in bounds by itself. */
#include <math.h>
#include <stdlib.h>

#include "pkv_cpu.h"
#include "../core/pkv_numeric.h"

int64_t pkv_sparse_cpu_work(const pkv_sparse_args *a) { return a->q.sizes[0] * a->k_cache.sizes[2]; }

/* Gather the listed tokens' rows of one head into dst [count, n] as float32; returns count. The rows
 * are scattered over the pool, so the next rows are prefetched while one is converted. */
#define PKV_SPARSE_PREFETCH_AHEAD 8
static int64_t gather_rows(const pkv_cpu_kernels *k, const pkv_sparse_args *a, const pkv_tensor *cache_t,
                           const pkv_tensor *scales_t, int64_t t, int64_t list, int64_t head, float *dst) {
  pkv_cache_view cache = pkv_cache_view_from(cache_t), scales = {0};
  if (scales_t->defined) scales = pkv_cache_view_from(scales_t);
  int64_t tokens = cache.num_pages * cache.page_size, n = cache.head_dim, count = 0, listed = a->indices.sizes[2];
  size_t es = pkv_dtype_size(cache.dtype);
  for (int64_t j = 0; j < listed; j++) {
    if (j + PKV_SPARSE_PREFETCH_AHEAD < listed) {
      int64_t ahead = pkv_sparse_index_at(&a->indices, t, list, j + PKV_SPARSE_PREFETCH_AHEAD);
      if (ahead >= 0 && ahead < tokens) {
        const char *row = (const char *)cache.data + pkv_cache_token_offset(&cache, ahead, head) * (int64_t)es;
        for (int64_t b = 0; b < n * (int64_t)es; b += 64) __builtin_prefetch(row + b);
      }
    }
    int64_t token = pkv_sparse_index_at(&a->indices, t, list, j);
    if (token < 0 || token >= tokens) continue;
    const char *src = (const char *)cache.data + pkv_cache_token_offset(&cache, token, head) * (int64_t)es;
    const float *sc = scales_t->defined ? (const float *)scales.data + pkv_cache_token_offset(&scales, token, head)
                                        : NULL;
    k->load_vec(src, cache.dtype, sc, a->quant_group, n, dst + count * n, PKV_DTYPE_F32);
    count++;
  }
  return count;
}

/* q . k over n floats with 8 independent partial sums (vectorizable without reassociation flags). */
static float dot_f32(const float *x, const float *y, int64_t n) {
  float part[8] = {0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int u = 0; u < 8; u++) part[u] += x[i + u] * y[i + u];
  float sum = 0.0f;
  for (; i < n; i++) sum += x[i] * y[i];
  for (int u = 0; u < 8; u++) sum += part[u];
  return sum;
}

pkv_status pkv_sparse_cpu(const pkv_sparse_args *a, int64_t begin, int64_t end, pkv_error *err) {
  if (begin >= end) return PKV_OK;
  const pkv_cpu_kernels *k = pkv_cpu_kernels_get();
  pkv_rows_view q = pkv_rows_view_from(&a->q), out = pkv_rows_view_from(&a->out);
  int64_t hk = a->k_cache.sizes[2], group = q.num_heads / hk, d = q.head_dim, dv = a->v_cache.sizes[3];
  int64_t listed = a->indices.sizes[2];
  float *mem = (float *)malloc((size_t)(listed * (d + dv) + listed + d + dv + 1) * sizeof(float));
  if (!mem) return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged_sparse: out of host memory for scratch");
  float *keys = mem, *values = keys + listed * d, *probs = values + listed * dv, *qrow = probs + listed,
        *acc = qrow + d;
  const float scale_l2 = (float)a->scale * PKV_LOG2E, softcap = (float)a->softcap;
  for (int64_t item = begin; item < end; item++) {
    int64_t t = item / hk, kvh = item % hk, list = a->indices.sizes[1] == 1 ? 0 : kvh;
    int64_t count = gather_rows(k, a, &a->k_cache, &a->k_scales, t, list, kvh, keys);
    if (count > 0) gather_rows(k, a, &a->v_cache, &a->v_scales, t, list, kvh, values);
    for (int64_t g = 0; g < group; g++) {
      int64_t head = kvh * group + g;
      size_t qes = pkv_dtype_size(q.dtype);
      k->load_vec((const char *)q.data + (t * q.stride_row + head * q.stride_head) * (int64_t)qes, q.dtype, NULL, 1,
                  d, qrow, PKV_DTYPE_F32);
      /* scores in log2 units (softcap applied in natural units first) */
      float m = -INFINITY;
      for (int64_t j = 0; j < count; j++) {
        float dot = dot_f32(qrow, keys + j * d, d);
        float s = softcap > 0.0f ? softcap * tanhf(dot * (float)a->scale / softcap) * PKV_LOG2E : dot * scale_l2;
        probs[j] = s;
        if (s > m || s != s) m = s;
      }
      float l = 0.0f;
      for (int64_t i = 0; i < dv; i++) acc[i] = 0.0f;
      if (count > 0 && m != -INFINITY) {
        for (int64_t j = 0; j < count; j++) {
          float p = exp2f(probs[j] - m);
          l += p;
          const float *vr = values + j * dv;
          for (int64_t i = 0; i < dv; i++) acc[i] += p * vr[i];
        }
      }
      float sink = a->sinks.defined ? ((const float *)a->sinks.data)[head * a->sinks.strides[0]] : -INFINITY;
      float inv, lse;
      pkv_softmax_finish(m == -INFINITY ? 0.0f : m, l, sink, &inv, &lse);
      int64_t dst = t * out.stride_row + head * out.stride_head;
      for (int64_t i = 0; i < dv; i++) pkv_store_f32(out.data, dst + i, out.dtype, acc[i] * inv);
    }
  }
  free(mem);
  return PKV_OK;
}
