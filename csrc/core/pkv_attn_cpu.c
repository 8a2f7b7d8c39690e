/* pagedkv core: flash_attn_paged on the CPU.
 *
 * One work item = (batch row, KV head, block of query rows). All query heads
 * that share the KV head are processed together, so every K/V tile is read
 * and converted to float once per item (decode reads the KV once). Scores
 * use an online softmax (running max m, sum l, accumulator acc) in float32. */
#include <math.h>
#include <stdlib.h>

#include "pkv_numeric.h"
#include "pkv_ops.h"

/* Query rows per work item: enough to reuse each converted K/V tile across
 * many queries in prefill, small enough to give every core several items. */
#define PKV_CPU_ROWS_PER_ITEM 32
/* Keys converted per tile: K and V tiles of 64 x D floats stay in L1/L2. */
#define PKV_CPU_KEYS_PER_TILE 64

pkv_status pkv_attn_cpu_plan(const pkv_attn_args *a, pkv_attn_plan *plan, pkv_error *err) {
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  int64_t batch = offsets.rows - 1, hk = a->k_cache.sizes[2];
  int64_t count = 0;
  for (int64_t b = 0; b < batch; b++)
    count += (pkv_new_tokens(&offsets, b) + PKV_CPU_ROWS_PER_ITEM - 1) / PKV_CPU_ROWS_PER_ITEM * hk;
  plan->items = NULL;
  plan->num_items = 0;
  if (count > 0) {
    plan->items = (pkv_attn_item *)malloc((size_t)count * sizeof *plan->items);
    if (!plan->items) return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for the work plan");
  }
  for (int64_t b = 0; b < batch; b++) {
    int64_t start = pkv_index_at(&offsets, b), rows = pkv_new_tokens(&offsets, b);
    for (int64_t r = 0; r < rows; r += PKV_CPU_ROWS_PER_ITEM)
      for (int64_t h = 0; h < hk; h++) {
        pkv_attn_item *it = &plan->items[plan->num_items++];
        it->batch = b;
        it->first_row = start + r;
        it->num_rows = rows - r < PKV_CPU_ROWS_PER_ITEM ? rows - r : PKV_CPU_ROWS_PER_ITEM;
        it->kv_head = h;
      }
  }
  /* padding rows (at or after offsets[B]) output zeros */
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  size_t row_bytes = (size_t)out.head_dim * pkv_dtype_size(out.dtype);
  for (int64_t row = pkv_index_at(&offsets, batch); row < out.num_rows; row++)
    for (int64_t h = 0; h < out.num_heads; h++)
      memset((char *)out.data + (row * out.stride_row + h * out.stride_head) * (int64_t)pkv_dtype_size(out.dtype), 0,
             row_bytes);
  return PKV_OK;
}

void pkv_attn_plan_free(pkv_attn_plan *plan) {
  free(plan->items);
  plan->items = NULL;
  plan->num_items = 0;
}

/* Convert keys [k0, k1) of row b, head h into dst[(k - k0) * d + i] (dequantized). */
static void load_tile(const pkv_cache_view *c, const pkv_cache_view *s, int64_t group, const pkv_index_view *table,
                      int64_t b, int64_t h, int64_t k0, int64_t k1, float *dst) {
  int64_t d = c->head_dim;
  for (int64_t k = k0; k < k1; k++) {
    int64_t page = pkv_page_of(table, b, k, c->page_size), slot = k % c->page_size;
    int64_t src = pkv_cache_offset(c, page, slot, h);
    float *out = dst + (k - k0) * d;
    switch (c->dtype) {
    case PKV_DTYPE_F32: memcpy(out, (const float *)c->data + src, (size_t)d * sizeof(float)); break;
    case PKV_DTYPE_BF16: {
      const uint16_t *p = (const uint16_t *)c->data + src;
      for (int64_t i = 0; i < d; i++) out[i] = pkv_bf16_to_f32(p[i]);
      break;
    }
    case PKV_DTYPE_F16: {
      const uint16_t *p = (const uint16_t *)c->data + src;
      for (int64_t i = 0; i < d; i++) out[i] = pkv_f16_to_f32(p[i]);
      break;
    }
    default: {
      const uint8_t *p = (const uint8_t *)c->data + src;
      const float *sc = (const float *)s->data + pkv_cache_offset(s, page, slot, h);
      int e4m3 = c->dtype == PKV_DTYPE_FP8_E4M3;
      for (int64_t i = 0; i < d; i++) out[i] = (e4m3 ? pkv_e4m3_to_f32(p[i]) : pkv_e5m2_to_f32(p[i])) * sc[i / group];
      break;
    }
    }
  }
}

static float dot(const float *x, const float *y, int64_t n) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; i++) acc += x[i] * y[i];
  return acc;
}

typedef struct {
  float *q;   /* [rows * G, D], pre-scaled */
  float *acc; /* [rows * G, Dv] */
  float *m;   /* [rows * G] running max */
  float *l;   /* [rows * G] running sum */
  float *k;   /* [KEYS_PER_TILE, D] */
  float *v;   /* [KEYS_PER_TILE, Dv] */
  float *p;   /* [KEYS_PER_TILE] */
} attn_scratch;

static void run_item(const pkv_attn_args *a, const pkv_attn_item *it, attn_scratch *w) {
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->cache_lengths);
  pkv_index_view table = pkv_index_view_from(&a->lookup_table);
  pkv_cache_view kc = pkv_cache_view_from(&a->k_cache), vc = pkv_cache_view_from(&a->v_cache);
  pkv_cache_view ks = {0}, vs = {0};
  if (a->k_scales.defined) ks = pkv_cache_view_from(&a->k_scales);
  if (a->v_scales.defined) vs = pkv_cache_view_from(&a->v_scales);
  pkv_rows_view q = pkv_rows_view_from(&a->q), out = pkv_rows_view_from(&a->out);
  int64_t d = kc.head_dim, dv = vc.head_dim, group_heads = q.num_heads / kc.num_heads;
  int64_t b = it->batch, start = pkv_index_at(&offsets, b), cached = pkv_cache_length(&lengths, b);
  int64_t total = cached + pkv_new_tokens(&offsets, b);
  float scale = (float)a->scale, softcap = (float)a->softcap;

  /* keys any query of this block can see */
  int64_t kmin = total, kmax = 0;
  for (int64_t r = 0; r < it->num_rows; r++) {
    int64_t lo, hi;
    pkv_visible_keys(cached + (it->first_row + r - start), total, a->causal, a->window_left, &lo, &hi);
    if (lo < kmin) kmin = lo;
    if (hi > kmax) kmax = hi;
  }
  for (int64_t r = 0; r < it->num_rows; r++)
    for (int64_t g = 0; g < group_heads; g++) {
      int64_t qi = r * group_heads + g, head = it->kv_head * group_heads + g;
      int64_t src = (it->first_row + r) * q.stride_row + head * q.stride_head;
      for (int64_t i = 0; i < d; i++) w->q[qi * d + i] = pkv_load_f32(q.data, src + i, q.dtype) * scale;
      w->m[qi] = -INFINITY;
      w->l[qi] = 0.0f;
      memset(w->acc + qi * dv, 0, (size_t)dv * sizeof(float));
    }

  for (int64_t k0 = kmin; k0 < kmax; k0 += PKV_CPU_KEYS_PER_TILE) {
    int64_t k1 = k0 + PKV_CPU_KEYS_PER_TILE < kmax ? k0 + PKV_CPU_KEYS_PER_TILE : kmax;
    load_tile(&kc, &ks, a->quant_group, &table, b, it->kv_head, k0, k1, w->k);
    load_tile(&vc, &vs, a->quant_group, &table, b, it->kv_head, k0, k1, w->v);
    for (int64_t r = 0; r < it->num_rows; r++) {
      int64_t lo, hi;
      pkv_visible_keys(cached + (it->first_row + r - start), total, a->causal, a->window_left, &lo, &hi);
      lo = lo > k0 ? lo : k0;
      hi = hi < k1 ? hi : k1;
      if (lo >= hi) continue;
      for (int64_t g = 0; g < group_heads; g++) {
        int64_t qi = r * group_heads + g;
        const float *qv = w->q + qi * d;
        float tile_max = -INFINITY;
        for (int64_t k = lo; k < hi; k++) {
          float s = dot(qv, w->k + (k - k0) * d, d);
          if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
          w->p[k - k0] = s;
          if (!(s <= tile_max)) tile_max = s;
        }
        float m_new = w->m[qi] > tile_max ? w->m[qi] : tile_max;
        if (m_new == -INFINITY) continue; /* every visible score is -inf */
        float correction = expf(w->m[qi] - m_new), sum = 0.0f;
        float *acc = w->acc + qi * dv;
        for (int64_t i = 0; i < dv; i++) acc[i] *= correction;
        for (int64_t k = lo; k < hi; k++) {
          float pk = expf(w->p[k - k0] - m_new);
          const float *vr = w->v + (k - k0) * dv;
          sum += pk;
          for (int64_t i = 0; i < dv; i++) acc[i] += pk * vr[i];
        }
        w->l[qi] = w->l[qi] * correction + sum;
        w->m[qi] = m_new;
      }
    }
  }

  for (int64_t r = 0; r < it->num_rows; r++)
    for (int64_t g = 0; g < group_heads; g++) {
      int64_t qi = r * group_heads + g, head = it->kv_head * group_heads + g;
      int64_t dst = (it->first_row + r) * out.stride_row + head * out.stride_head;
      float inv = w->l[qi] > 0.0f ? 1.0f / w->l[qi] : 0.0f;
      for (int64_t i = 0; i < dv; i++) pkv_store_f32(out.data, dst + i, out.dtype, w->acc[qi * dv + i] * inv);
    }
}

pkv_status pkv_attn_cpu(const pkv_attn_args *a, const pkv_attn_plan *plan, int64_t begin, int64_t end,
                        pkv_error *err) {
  int64_t d = a->k_cache.sizes[3], dv = a->v_cache.sizes[3];
  int64_t nq = PKV_CPU_ROWS_PER_ITEM * (a->q.sizes[1] / a->k_cache.sizes[2]);
  size_t floats = (size_t)(nq * d + nq * dv + 2 * nq + PKV_CPU_KEYS_PER_TILE * (d + dv + 1));
  float *mem = (float *)malloc(floats * sizeof(float));
  if (!mem) return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for %zu scratch floats", floats);
  attn_scratch w;
  w.q = mem;
  w.acc = w.q + nq * d;
  w.m = w.acc + nq * dv;
  w.l = w.m + nq;
  w.k = w.l + nq;
  w.v = w.k + PKV_CPU_KEYS_PER_TILE * d;
  w.p = w.v + PKV_CPU_KEYS_PER_TILE * dv;
  for (int64_t i = begin; i < end; i++) run_item(a, &plan->items[i], &w);
  free(mem);
  return PKV_OK;
}
