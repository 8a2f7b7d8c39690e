/* pagedkv CPU backend: flash_attn_paged on the CPU, the ISA-free driver.
 *
 * The plan lists work items (batch row, KV head, block of query rows, key
 * range). All query heads that share a KV head are one item, so every K/V
 * tile is read and converted once per item (decode reads the KV once). The
 * kernels themselves (tiles, QK^T, online softmax, PV) live in
 * pkv_cpu_kernels.inc, compiled per ISA and picked at run time (pkv_cpu.h);
 * the plan asks the table once per item which of its paths the item takes
 * (attn_path) and stores the answer in the item.
 *
 * Two scheduling rules keep both cores busy:
 *  - split-KV: a plan with few items (decode at small B x Hk) splits long
 *    rows' keys into several items whose (max, sum, acc) partials the last
 *    finisher merges with a log-sum-exp; the split count does not depend on
 *    the thread count, so results do not either;
 *  - balance: the torch op's threads claim items one at a time from an atomic
 *    counter (pkv_attn_cpu_claim), heaviest first (causal prefill blocks
 *    differ in cost by up to their row index), so the light ones fill the end
 *    and a thread slowed by other work takes fewer. pkv_attn_cpu runs a fixed
 *    range (the C tests and the fuzz harness).
 * A thread takes its next item one tile early (pkv_item_queue): the kernel
 * prefetches that item's first tile during the current item's last, which the
 * demand reads of every item's first tile left undone
 * (measured: benchmarks/README.md, "Measurements behind the CPU kernels"). */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_cpu.h"
#include "../core/pkv_numeric.h"
#include "../core/pkv_settings.h"

/* Query vectors (rows x query heads of one KV head) per item: each packed
 * 64-key tile is reused by 256 vectors (1.1x prefill over 128 on AMX), and
 * acc/scores (256 x 128 floats) stay in L2. */
#define PKV_CPU_QUERIES_PER_ITEM 256
/* Split-KV: plans with fewer items than this split rows of at least twice
 * PKV_CPU_SPLIT_MIN_KEYS keys; a split never has fewer keys than that, so the
 * merge (nq x Dv floats per split) stays negligible next to the KV read. */
#define PKV_CPU_SPLIT_TARGET_ITEMS 64
#define PKV_CPU_SPLIT_MIN_KEYS 512
/* Items of >= 16 query vectors per KV head (prefill blocks, a cascade's shared
 * prefix) split only into chunks of this many keys: each split repeats the
 * item's setup (q conversion, tile configuration) and its merge, which cost
 * a 32-query, 4096-key shared prefix (32/8 heads, AMX, 2 threads) 3.2 ms
 * unsplit, 3.6 ms in 2 splits, 4.5 ms in 8. */
#define PKV_CPU_SPLIT_MIN_KEYS_MANY_QUERIES 4096
/* Query vectors per KV head from which an item is prefill-like: the 16 rows
 * of an AMX tile (attn_path chooses the tile path from there). */
#define PKV_CPU_MANY_QUERIES 16

/* Fewest keys per split of an item (see above). */
static int64_t split_min_keys(const pkv_attn_item *it, int64_t heads) {
  return it->num_rows * heads >= PKV_CPU_MANY_QUERIES ? PKV_CPU_SPLIT_MIN_KEYS_MANY_QUERIES : PKV_CPU_SPLIT_MIN_KEYS;
}

static int64_t rows_per_item(int64_t heads) {
  int64_t r = PKV_CPU_QUERIES_PER_ITEM / heads;
  return r < 1 ? 1 : r;
}

/* Query vectors the attention scratch holds (pkv_cpu_attn_scratch.nq): an item's most, rounded up to the
 * AMX path's whole 32-row tile pairs. */
static int64_t scratch_queries(int64_t heads) { return (rows_per_item(heads) * heads + 31) / 32 * 32; }

/* What the table's attn_path reads besides an item's shape, read once per call. */
typedef struct {
  const pkv_cpu_kernels *kernels;
  int use_dot;             /* bf16 dot products allowed */
  pkv_cpu_decode decode;   /* the cpu_decode setting */
  int64_t scratch_queries; /* query vectors the scratch holds */
} path_inputs;

static path_inputs path_inputs_of(const pkv_attn_args *a, int64_t heads) {
  pkv_dtype kdt = a->k_cache.dtype;
  int64_t dk = a->k_cache.sizes[3];
  path_inputs p;
  p.kernels = pkv_cpu_kernels_get();
  /* bf16 dot products are exact only when q and the (raw) keys are bf16 values: FP8 keys under the dot
   * decode's rule for scale groups, the one dot_decode_ok applies (attn_path keeps grouped keys off the
   * other bf16 paths) */
  p.use_dot = pkv_cpu_has_dot_bf16() && a->q.dtype == PKV_DTYPE_BF16 &&
              (kdt == PKV_DTYPE_BF16 || (pkv_dtype_is_fp8(kdt) && pkv_cpu_fp8_dot_groups_ok(dk, a->quant_group)));
  p.decode = pkv_settings_get().cpu_decode;
  p.scratch_queries = scratch_queries(heads);
  return p;
}

/* The path (pkv_cpu_attn_path) of an item of nqh query vectors per KV head and nh KV heads: the table's
 * attn_path, where every path rule is. */
static pkv_cpu_attn_path item_path(const pkv_attn_args *a, const path_inputs *p, int64_t nqh, int64_t nh) {
  return p->kernels->attn_path(a, nqh, nh, p->use_dot, p->decode, p->scratch_queries);
}

/* Each item's path, chosen once here: the kernel runs the one function of that path. */
static void choose_paths(const pkv_attn_args *a, const path_inputs *p, pkv_attn_item *items, int64_t n,
                         int64_t heads) {
  for (int64_t i = 0; i < n; i++) items[i].path = item_path(a, p, items[i].num_rows * heads, items[i].num_kv_heads);
}

/* KV heads per item for a row with `rows` new tokens: rows short of a full
 * block (decode) take several heads, up to the same query-vector budget.
 * An item that attn_path sends to the AMX prefill tiles as one KV head keeps
 * one: the tile path takes one head per item, and grouping heads would send it
 * to the AVX-512 dot products instead (a 32-query, 4096-key shared prefix,
 * 32/8 heads, 2 threads: 11.8 -> 4.8 ms). */
static int64_t heads_per_item(const pkv_attn_args *a, const path_inputs *p, int64_t rows, int64_t rows_max,
                              int64_t heads, int64_t hk) {
  if (rows <= 0 || rows >= rows_max) return 1;
  if (item_path(a, p, rows * heads, 1) == PKV_CPU_PATH_AMX) return 1;
  int64_t nh = PKV_CPU_QUERIES_PER_ITEM / (rows * heads);
  return nh < 1 ? 1 : (nh > hk ? hk : nh);
}

typedef struct {
  atomic_int *done;   /* [groups] finished splits */
  int64_t *count;     /* [groups] splits in the group */
  int64_t *first;     /* [groups] first slot of the group */
  float *partials;    /* [slots, slot_floats]: m[nq], l[nq], acc[nq, dv] */
  int64_t slot_floats;
} split_state;

static void split_state_free(split_state *s) {
  if (!s) return;
  free(s->done);
  free(s->count);
  free(s->first);
  free(s->partials);
  free(s);
}

/* Keys [lo, hi) any row of the item can see. */
static void item_keys(const pkv_attn_args *a, const pkv_index_view *offsets, const pkv_index_view *lengths,
                      const pkv_attn_item *it, int64_t *lo_out, int64_t *hi_out) {
  int64_t b = it->batch, start = pkv_index_at(offsets, b), cached = pkv_cache_length(lengths, b);
  int64_t total = cached + pkv_new_tokens(offsets, b), kmin = total, kmax = 0;
  for (int64_t r = 0; r < it->num_rows; r++) {
    int64_t lo, hi;
    pkv_visible_keys(cached + (it->first_row + r - start), total, a->causal, a->window_left, &lo, &hi);
    if (lo < kmin) kmin = lo;
    if (hi > kmax) kmax = hi;
  }
  *lo_out = kmin;
  *hi_out = kmax > kmin ? kmax : kmin;
}

typedef struct {
  int64_t cost;
  int64_t index;
} item_cost;

static int by_cost_desc(const void *x, const void *y) {
  const item_cost *a = (const item_cost *)x, *b = (const item_cost *)y;
  if (a->cost != b->cost) return a->cost > b->cost ? -1 : 1;
  return a->index < b->index ? -1 : (a->index > b->index);
}

pkv_status pkv_attn_cpu_plan(const pkv_attn_args *a, pkv_attn_plan *plan, pkv_error *err) {
  pkv_index_view offsets = pkv_index_view_from(&a->input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a->cache_lengths);
  int64_t batch = offsets.rows - 1, hk = a->k_cache.sizes[2], heads = a->q.sizes[1] / hk;
  int64_t rows_max = rows_per_item(heads), count = 0;
  const path_inputs paths = path_inputs_of(a, heads); /* once per call */
  plan->items = NULL;
  plan->num_items = 0;
  plan->splits = NULL;
  plan->claims = NULL;
  for (int64_t b = 0; b < batch; b++) {
    int64_t rows = pkv_new_tokens(&offsets, b), nh = heads_per_item(a, &paths, rows, rows_max, heads, hk);
    count += (rows + rows_max - 1) / rows_max * ((hk + nh - 1) / nh);
  }

  pkv_attn_item *items = NULL;
  if (count > 0) {
    items = (pkv_attn_item *)malloc((size_t)count * sizeof *items);
    if (!items) return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for the work plan");
  }
  int64_t n = 0, splits_wanted = 1;
  for (int64_t b = 0; b < batch; b++) {
    int64_t start = pkv_index_at(&offsets, b), rows = pkv_new_tokens(&offsets, b);
    int64_t nh = heads_per_item(a, &paths, rows, rows_max, heads, hk);
    for (int64_t r = 0; r < rows; r += rows_max)
      for (int64_t h = 0; h < hk; h += nh) {
        pkv_attn_item *it = &items[n++];
        it->batch = b;
        it->first_row = start + r;
        it->num_rows = rows - r < rows_max ? rows - r : rows_max;
        it->kv_head = h;
        it->num_kv_heads = hk - h < nh ? hk - h : nh;
        item_keys(a, &offsets, &lengths, it, &it->key_begin, &it->key_end);
        it->split_group = -1;
        it->split_slot = -1;
      }
  }
  choose_paths(a, &paths, items, n, heads); /* before the splits: they copy their item's path */
  if (n > 0 && n < PKV_CPU_SPLIT_TARGET_ITEMS) splits_wanted = (PKV_CPU_SPLIT_TARGET_ITEMS + n - 1) / n;

  /* ---- split-KV ---- */
  if (splits_wanted > 1) {
    int64_t groups = 0, slots = 0, nq_max = rows_max * heads, dv = a->v_cache.sizes[3];
    for (int64_t i = 0; i < n; i++) {
      int64_t s = (items[i].key_end - items[i].key_begin) / split_min_keys(&items[i], heads);
      s = s < splits_wanted ? s : splits_wanted;
      if (s > 1) {
        groups++;
        slots += s;
      }
    }
    if (groups > 0) {
      split_state *st = (split_state *)calloc(1, sizeof *st);
      pkv_attn_item *all = (pkv_attn_item *)malloc((size_t)(n - groups + slots) * sizeof *all);
      if (st) {
        st->slot_floats = pkv_cpu_pad(nq_max * (dv + 2));
        st->done = (atomic_int *)malloc((size_t)groups * sizeof *st->done);
        st->count = (int64_t *)malloc((size_t)groups * sizeof *st->count);
        st->first = (int64_t *)malloc((size_t)groups * sizeof *st->first);
        st->partials = (float *)malloc((size_t)(slots * st->slot_floats) * sizeof(float));
      }
      if (!st || !all || !st->done || !st->count || !st->first || !st->partials) {
        split_state_free(st);
        free(all);
        free(items);
        return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for the split-KV plan");
      }
      int64_t m = 0, g = 0, slot = 0;
      for (int64_t i = 0; i < n; i++) {
        int64_t span = items[i].key_end - items[i].key_begin;
        int64_t s = span / split_min_keys(&items[i], heads);
        s = s < splits_wanted ? s : splits_wanted;
        if (s <= 1) {
          all[m++] = items[i];
          continue;
        }
        /* equal chunks, rounded to whole 64-key tiles */
        int64_t chunk = (span + s - 1) / s;
        chunk = (chunk + PKV_CPU_KEYS_PER_TILE - 1) / PKV_CPU_KEYS_PER_TILE * PKV_CPU_KEYS_PER_TILE;
        int64_t made = 0;
        for (int64_t k = items[i].key_begin; k < items[i].key_end; k += chunk) {
          pkv_attn_item it = items[i];
          it.key_begin = k;
          it.key_end = k + chunk < items[i].key_end ? k + chunk : items[i].key_end;
          it.split_group = g;
          it.split_slot = slot + made++;
          all[m++] = it;
        }
        atomic_init(&st->done[g], 0);
        st->count[g] = made;
        st->first[g] = slot;
        slot += made;
        g++;
      }
      free(items);
      items = all;
      n = m;
      plan->splits = st;
    }
  }

  /* ---- heaviest first: the threads claim items in this order (pkv_attn_cpu_claim), so the light
   * ones fill the gaps at the end ---- */
  if (n > 1) {
    item_cost *cost = (item_cost *)malloc((size_t)n * sizeof *cost);
    pkv_attn_item *ordered = (pkv_attn_item *)malloc((size_t)n * sizeof *ordered);
    if (cost && ordered) {
      for (int64_t i = 0; i < n; i++) {
        cost[i].cost =
            items[i].num_rows * items[i].num_kv_heads * (items[i].key_end - items[i].key_begin + PKV_CPU_KEYS_PER_TILE);
        cost[i].index = i;
      }
      qsort(cost, (size_t)n, sizeof *cost, by_cost_desc);
      for (int64_t i = 0; i < n; i++) ordered[i] = items[cost[i].index];
      free(items);
      items = ordered;
    } else {
      free(ordered); /* keep the natural order */
    }
    free(cost);
  }
  plan->items = items;
  plan->num_items = n;
  plan->claims = malloc(sizeof(atomic_llong));
  if (!plan->claims) {
    pkv_attn_plan_free(plan);
    return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for the work plan");
  }
  atomic_init((atomic_llong *)plan->claims, 0);

  /* padding rows (at or after offsets[B]) output zeros, and lse -inf */
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  if (a->lse.defined)
    for (int64_t row = pkv_index_at(&offsets, batch); row < out.num_rows; row++)
      for (int64_t h = 0; h < out.num_heads; h++)
        ((float *)a->lse.data)[row * a->lse.strides[0] + h * a->lse.strides[1]] = -INFINITY;
  size_t row_bytes = (size_t)out.head_dim * pkv_dtype_size(out.dtype);
  for (int64_t row = pkv_index_at(&offsets, batch); row < out.num_rows; row++)
    for (int64_t h = 0; h < out.num_heads; h++)
      memset((char *)out.data + (row * out.stride_row + h * out.stride_head) * (int64_t)pkv_dtype_size(out.dtype), 0,
             row_bytes);
  return PKV_OK;
}

void pkv_attn_plan_free(pkv_attn_plan *plan) {
  free(plan->items);
  split_state_free((split_state *)plan->splits);
  free(plan->claims);
  plan->items = NULL;
  plan->splits = NULL;
  plan->claims = NULL;
  plan->num_items = 0;
}

/* One allocation per work range, carved into the scratch arrays (64-byte aligned); nq: scratch_queries. */
static void *scratch_alloc(pkv_cpu_attn_scratch *w, int64_t nq, int64_t d, int64_t dv) {
  int64_t keys = PKV_CPU_KEYS_PER_TILE, dp = pkv_cpu_pad(d), d2p = pkv_cpu_pad((d + 1) / 2), dvp = pkv_cpu_pad(dv);
  int64_t nqp = pkv_cpu_pad(nq);
  int64_t floats = nq * dp + nq * d2p + nq * pkv_cpu_pair_q_words(d) + dp * keys + keys * dp + keys * dvp + nq * keys + nq * dvp + 2 * nqp +
                   2 * nq * keys + dp + (nq * keys / 2 + keys / 2 * dvp) * PKV_CPU_PV_TILES + nq * d2p + d2p * (nq + 16) + nq * keys + PKV_CPU_MAX_LANES * nq;
  size_t ptr_bytes = (size_t)(4 * PKV_CPU_TILE_SLOTS * keys) * sizeof(void *);
  size_t bytes = ((size_t)floats * sizeof(float) + ptr_bytes + 63) / 64 * 64;
  char *mem = (char *)aligned_alloc(64, bytes);
  if (!mem) return NULL;
  float *f = (float *)mem;
  w->nq = nq;
  w->d = d;
  w->dv = dv;
  w->q = f, f += nq * dp;
  w->qw = (uint32_t *)f, f += nq * d2p;
  w->qp = (uint32_t *)f, f += nq * pkv_cpu_pair_q_words(d);
  w->kt = (uint32_t *)f, f += dp * keys;
  w->krow = (uint32_t *)f, f += keys * dp;
  w->vt = f, f += keys * dvp;
  w->s = f, f += nq * keys;
  w->acc = f, f += nq * dvp;
  w->m = f, f += nqp;
  w->l = f, f += nqp;
  w->kscale = f, f += nq * keys; /* direct decode: [KV heads of the item][KEYS] */
  w->vscale = f, f += nq * keys;
  w->zero = (uint32_t *)f, f += dp;
  w->pb = (uint16_t *)f, f += nq * keys / 2 * PKV_CPU_PV_TILES;
  w->vb = (uint32_t *)f, f += keys / 2 * dvp * PKV_CPU_PV_TILES;
  w->qt = (uint32_t *)f, f += nq * d2p;
  w->qa = (uint32_t *)f, f += d2p * (nq + 16);
  w->sk = f, f += nq * keys;
  w->lv = f, f += PKV_CPU_MAX_LANES * nq;
  memset(w->zero, 0, (size_t)dp * sizeof(uint32_t));
  memset(w->s, 0, (size_t)(nq * keys) * sizeof(float)); /* lanes the dot decode's QK leaves: never garbage */
  const void **p = (const void **)f;
  w->kptr = p, p += PKV_CPU_TILE_SLOTS * keys;
  w->vptr = p, p += PKV_CPU_TILE_SLOTS * keys;
  w->ksptr = (const float **)p, p += PKV_CPU_TILE_SLOTS * keys;
  w->vsptr = (const float **)p;
  return mem;
}

float pkv_attn_cpu_finish_row(const pkv_attn_args *a, int64_t row, int64_t head, float m, float l) {
  float sink = a->sinks.defined ? ((const float *)a->sinks.data)[head * a->sinks.strides[0]] : -INFINITY;
  float inv, lse;
  pkv_softmax_finish(m, l, sink, &inv, &lse);
  if (a->lse.defined) ((float *)a->lse.data)[row * a->lse.strides[0] + head * a->lse.strides[1]] = lse;
  return inv;
}

/* Log-sum-exp merge of a split group's partials into out; row: dv floats of scratch. Per output row the
 * partial rows are summed in split order into `row` (contiguous loops the compiler vectorizes) and
 * converted by the kernels' store_vec (not per element with a strided inner loop over the splits and
 * a scalar store, which cost about twice as much (measured: benchmarks/README.md, "Measurements behind the CPU kernels")). */
static void merge_splits(const pkv_attn_args *a, const pkv_attn_item *it, const split_state *st,
                         const pkv_cpu_kernels *k, float *row) {
  pkv_rows_view out = pkv_rows_view_from(&a->out);
  int64_t hk = a->k_cache.sizes[2], heads = a->q.sizes[1] / hk, dv = a->v_cache.sizes[3];
  int64_t per_head = it->num_rows * heads, nq = per_head * it->num_kv_heads, count = st->count[it->split_group];
  const float *base = st->partials + st->first[it->split_group] * st->slot_floats;
  for (int64_t qi = 0; qi < nq; qi++) {
    /* query vector order: (KV head of the item, row, query head of the group) */
    int64_t hh = qi / per_head, r = qi % per_head / heads;
    int64_t head = (it->kv_head + hh) * heads + qi % heads;
    int64_t dst = (it->first_row + r) * out.stride_row + head * out.stride_head;
    float mx = -INFINITY, sum = 0.0f;
    for (int64_t s = 0; s < count; s++) {
      float m = base[s * st->slot_floats + qi];
      if (m > mx || m != m) mx = m;
    }
    float weight[PKV_CPU_SPLIT_TARGET_ITEMS];
    for (int64_t s = 0; s < count; s++) {
      const float *p = base + s * st->slot_floats;
      weight[s] = mx == -INFINITY || p[qi] == -INFINITY ? 0.0f : exp2f(p[qi] - mx); /* m in log2 units */
      sum += weight[s] * p[nq + qi];
    }
    /* a NaN sum (a split saw a NaN/+inf score) stays NaN */
    float inv = pkv_attn_cpu_finish_row(a, it->first_row + r, head, mx, sum);
    for (int64_t i = 0; i < dv; i++) row[i] = 0.0f;
    for (int64_t s = 0; s < count; s++) {
      const float *part = base + s * st->slot_floats + 2 * nq + qi * dv, ws = weight[s];
      for (int64_t i = 0; i < dv; i++) row[i] += ws * part[i];
    }
    for (int64_t i = 0; i < dv; i++) row[i] *= inv;
    k->store_vec(row, PKV_DTYPE_F32, dv, (char *)out.data + dst * (int64_t)pkv_dtype_size(out.dtype), out.dtype, NULL, 0);
  }
}

static int64_t queue_take(pkv_item_queue *q) {
  return q->claims ? (int64_t)atomic_fetch_add((atomic_llong *)q->claims, 1) : q->next++;
}

const pkv_attn_item *pkv_item_queue_take_ahead(pkv_item_queue *q) {
  if (q->ahead < 0) q->ahead = queue_take(q);
  return q->ahead < q->end ? &q->items[q->ahead] : NULL;
}

/* The item to run now: the one taken ahead, else the next of the range or counter (>= end: none). */
static int64_t queue_next(pkv_item_queue *q) {
  int64_t i = q->ahead >= 0 ? q->ahead : queue_take(q);
  q->ahead = -1;
  return i;
}

/* Runs items [begin, end), or with `claims` the items claimed from that counter until none is left. */
static pkv_status run_items(const pkv_attn_args *a, const pkv_attn_plan *plan, int64_t begin, int64_t end,
                            atomic_llong *claims, pkv_error *err) {
  if (begin >= end) return PKV_OK;
  int64_t dk = a->k_cache.sizes[3], d = dk + a->k_tail_dim, dv = a->v_cache.sizes[3];
  int64_t heads = a->q.sizes[1] / a->k_cache.sizes[2], dvp = pkv_cpu_pad(dv);
  pkv_cpu_attn_scratch w;
  void *mem = scratch_alloc(&w, scratch_queries(heads), d, dv);
  if (!mem) return pkv_fail(err, PKV_ERR_ARGUMENT, "flash_attn_paged: out of host memory for attention scratch");
  const pkv_cpu_kernels *k = pkv_cpu_kernels_get();
  split_state *st = (split_state *)plan->splits;
  pkv_item_queue queue = {plan->items, claims, begin, end, -1};
  for (int64_t i = queue_next(&queue); i < end; i = queue_next(&queue)) {
    const pkv_attn_item *it = &plan->items[i];
    if (it->split_group < 0) {
      k->attn_item(a, it, &queue, 1, &w);
      continue;
    }
    k->attn_item(a, it, &queue, 0, &w);
    int64_t rows = it->num_rows * heads * it->num_kv_heads;
    float *slot = st->partials + it->split_slot * st->slot_floats;
    memcpy(slot, w.m, (size_t)rows * sizeof(float));
    memcpy(slot + rows, w.l, (size_t)rows * sizeof(float));
    for (int64_t qi = 0; qi < rows; qi++) memcpy(slot + 2 * rows + qi * dv, w.acc + qi * dvp, (size_t)dv * sizeof(float));
    /* the last split of the group to finish merges (acq_rel: it sees every partial) */
    if (atomic_fetch_add_explicit(&st->done[it->split_group], 1, memory_order_acq_rel) + 1 ==
        st->count[it->split_group]) {
      merge_splits(a, it, st, k, w.acc); /* this item's acc is in its slot: w.acc is free */
    }
  }
  free(mem);
  return PKV_OK;
}

pkv_status pkv_attn_cpu(const pkv_attn_args *a, const pkv_attn_plan *plan, int64_t begin, int64_t end,
                        pkv_error *err) {
  return run_items(a, plan, begin, end, NULL, err);
}

pkv_status pkv_attn_cpu_claim(const pkv_attn_args *a, const pkv_attn_plan *plan, pkv_error *err) {
  atomic_llong *claims = (atomic_llong *)plan->claims;
  if (!claims || atomic_load(claims) >= plan->num_items) return PKV_OK; /* no scratch for nothing */
  return run_items(a, plan, 0, plan->num_items, claims, err);
}
