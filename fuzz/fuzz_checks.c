/* libFuzzer target: the op checkers (paged_store, paged_load, flash_attn_paged with its LSE and
 * sinks, flash_attn_paged_sparse, merge_attn_states), then the CPU kernels on exactly-sized buffers.
 *
 * The input bytes decode into a small geometry (N, P, Hk, D, ...), one descriptor per op argument
 * (dtype, rank, sizes, strides, device; usually consistent with the geometry, sometimes broken),
 * index values (offsets, lengths, page ids; usually valid, sometimes not) and the attention
 * options. Every host buffer is allocated with exactly the bytes its descriptor spans, so
 * AddressSanitizer proves that a kernel run after a passing check stays inside its tensors.
 *
 * Properties checked beyond memory safety and UB (any violation aborts):
 * - a failing check returns a message "<op>: ..." that names one of the op's arguments;
 * - the checker is deterministic and checking index values never turns a failure into a pass;
 * - paged_store changes no byte of the caches or scales outside the (page, slot, head) rows it
 *   addresses, and paged_load changes no byte of out outside the rows it addresses.
 *
 * Build: see fuzz/run.sh (clang -fsanitize=fuzzer,address,undefined). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_cpu_ops.h"

/* Decoded inputs stay tiny: the interesting structure is in strides and index values. */
#define MAX_SPAN_BYTES (1 << 20)
/* Kernels only run when their loop trip count is modest (huge broadcast sizes are check-only). */
#define MAX_KERNEL_WORK 200000

/* ---- byte reader: returns zeros past the end so every input decodes ---- */
typedef struct {
  const uint8_t *data;
  size_t size, pos;
} reader;

static uint8_t take(reader *r) { return r->pos < r->size ? r->data[r->pos++] : 0; }

static uint32_t take32(reader *r) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v = v << 8 | take(r);
  return v;
}

/* 0 .. n-1 */
static int64_t take_below(reader *r, int64_t n) { return n <= 1 ? 0 : (int64_t)(take(r) % (uint64_t)n); }

#define NUM_OPS 5
static long g_stats[NUM_OPS][3]; /* [op][checked, passed the check, ran the kernel] */

/* Saturating arithmetic for the harness's own cost estimates (sizes may be huge). */
static int64_t mul_sat(int64_t a, int64_t b) {
  __int128 p = (__int128)a * b;
  return p > INT64_MAX ? INT64_MAX : p < INT64_MIN ? INT64_MIN : (int64_t)p;
}
static int64_t add_sat(int64_t a, int64_t b) {
  __int128 p = (__int128)a + b;
  return p > INT64_MAX ? INT64_MAX : p < INT64_MIN ? INT64_MIN : (int64_t)p;
}

/* ---- tensors with owned buffers ---- */
#define MAX_TENSORS 16
typedef struct {
  void *buffers[MAX_TENSORS];
  int count;
  int oversize; /* some descriptor spans too much memory: run checks only */
} arena;

static const pkv_dtype FLOAT_DTYPES[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16};
static const pkv_dtype CACHE_DTYPES[] = {PKV_DTYPE_F32, PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3,
                                         PKV_DTYPE_FP8_E5M2};
static const pkv_dtype ANY_DTYPES[] = {PKV_DTYPE_F32,  PKV_DTYPE_F16, PKV_DTYPE_BF16, PKV_DTYPE_FP8_E4M3,
                                       PKV_DTYPE_FP8_E5M2, PKV_DTYPE_I32, PKV_DTYPE_I64, PKV_DTYPE_I16,
                                       PKV_DTYPE_I8,   PKV_DTYPE_U8,  PKV_DTYPE_F64, PKV_DTYPE_BOOL,
                                       PKV_DTYPE_OTHER};

/* Sizes far beyond the buffers: only reachable with stride 0 (broadcast) in a real framework. */
static const int64_t HUGE_SIZES[] = {(int64_t)1 << 31, ((int64_t)1 << 31) - 1, ((int64_t)1 << 32) + 3,
                                     (int64_t)1 << 40, (int64_t)1 << 62, INT64_MAX};

/* Data pointer of descriptors too large to back with memory. */
static uint8_t g_unbacked[1];

/* Element span of a descriptor: 1 + max offset (strides >= 0), 0 when empty. Saturates. */
static int64_t span_of(const pkv_tensor *t) {
  int64_t span = 1;
  for (int i = 0; i < t->ndim && i < PKV_MAX_DIMS; i++) {
    if (t->sizes[i] <= 0) return 0;
    if (t->sizes[i] == 1) continue; /* its stride never multiplies a nonzero index */
    if (t->strides[i] < 0) return -1;
    __int128 add = (__int128)(t->sizes[i] - 1) * t->strides[i];
    if (add > (__int128)MAX_SPAN_BYTES || span + add > (__int128)MAX_SPAN_BYTES) return INT64_MAX;
    span += (int64_t)add;
  }
  return span;
}

/* Decode a descriptor meant to be `ndim`-D with `sizes`, then maybe break it. `kind` picks the
 * dtype family: 0 float input, 1 cache, 2 int32 index, 3 float32 scales. */
static pkv_tensor decode_tensor_as(reader *r, arena *m, int kind, int ndim, const int64_t *sizes, int optional,
                                   int forced_dtype);

static pkv_tensor decode_tensor(reader *r, arena *m, int kind, int ndim, const int64_t *sizes, int optional) {
  return decode_tensor_as(r, m, kind, ndim, sizes, optional, -1);
}

/* forced_dtype >= 0 replaces the decoded dtype before the buffer is sized. */
static pkv_tensor decode_tensor_as(reader *r, arena *m, int kind, int ndim, const int64_t *sizes, int optional,
                                   int forced_dtype) {
  pkv_tensor t;
  memset(&t, 0, sizeof t);
  uint8_t flags = take(r);
  if (optional && (flags & 0x80)) return t; /* absent */
  t.defined = 1;
  t.device = PKV_DEVICE_CPU;
  switch (kind) {
  case 0: t.dtype = FLOAT_DTYPES[take_below(r, 3)]; break;
  case 1: t.dtype = CACHE_DTYPES[take_below(r, 5)]; break;
  case 2: t.dtype = PKV_DTYPE_I32; break;
  default: t.dtype = PKV_DTYPE_F32; break;
  }
  t.ndim = ndim;
  for (int i = 0; i < ndim; i++) t.sizes[i] = sizes[i];
  /* mutations of the descriptor (each rare) */
  uint8_t mut = take(r);
  switch (mut % 32) {
  case 1: t.dtype = ANY_DTYPES[take_below(r, 13)]; break;
  case 2: t.ndim = (int)take_below(r, 9); break; /* 0 .. 8: beyond PKV_MAX_DIMS too */
  case 3: t.sizes[take_below(r, ndim)] += 1 + take_below(r, 2); break;
  case 4: t.sizes[take_below(r, ndim)] = take_below(r, 2); break; /* 0 or 1 */
  case 5: t.device = (int)take_below(r, 3) - 1; break;
  case 6: t.sizes[take_below(r, ndim)] = HUGE_SIZES[take_below(r, 6)]; break;
  default: break;
  }
  if (forced_dtype >= 0) t.dtype = (pkv_dtype)forced_dtype;
  int dims = t.ndim < PKV_MAX_DIMS ? t.ndim : PKV_MAX_DIMS;
  for (int i = dims; i < PKV_MAX_DIMS; i++) t.sizes[i] = 0;
  /* strides: contiguous over a padded shape in a permuted dim order, or special */
  uint8_t layout = take(r);
  int64_t order[PKV_MAX_DIMS];
  for (int i = 0; i < dims; i++) order[i] = i;
  if (layout & 1 && dims > 2) { /* swap two leading dims' memory order (e.g. [N, Hk, P, D] storage) */
    int64_t a = take_below(r, dims - 1), b = take_below(r, dims - 1), tmp = order[a];
    order[a] = order[b];
    order[b] = tmp;
  }
  int64_t stride = 1;
  for (int k = dims - 1; k >= 0; k--) {
    int64_t d = order[k];
    int64_t pad = (layout & 2) ? take_below(r, 3) : 0;
    int64_t size = t.sizes[d] > 0 ? t.sizes[d] : 1;
    if (size > 64) size = 1; /* huge sizes get stride 0 below */
    t.strides[d] = stride;
    stride *= size + pad;
    if (stride > MAX_SPAN_BYTES) stride = MAX_SPAN_BYTES;
  }
  if (layout & 4 && dims > 0) t.strides[take_below(r, dims)] = 0; /* broadcast */
  if (layout & 8 && dims > 0) t.strides[dims - 1] = take_below(r, 3);  /* last stride 0, 1 or 2 */
  for (int i = 0; i < dims; i++) /* a huge dim can only be a broadcast */
    if (t.sizes[i] > 64) t.strides[i] = 0;
  if ((layout & 0x30) == 0x30 && dims > 0) t.strides[take_below(r, dims)] = -1 - take_below(r, 4);
  /* buffer of exactly the span */
  int64_t span = span_of(&t);
  if (getenv("FUZZ_DEBUG")) {
    fprintf(stderr, "tensor kind %d dtype %s ndim %d span %lld:", kind, pkv_dtype_name(t.dtype), t.ndim,
            (long long)span);
    for (int i = 0; i < dims; i++) fprintf(stderr, " %lld/%lld", (long long)t.sizes[i], (long long)t.strides[i]);
    fprintf(stderr, "\n");
  }
  if (span < 0 || span == INT64_MAX || t.ndim > PKV_MAX_DIMS) {
    m->oversize = 1;
    t.data = g_unbacked; /* never dereferenced: checks read index data only, kernels do not run */
    return t;
  }
  size_t es = pkv_dtype_size(t.dtype);
  if (es == 0) es = 1;
  if (span == 0) return t; /* empty: NULL data, like the torch shim */
  size_t bytes = (size_t)span * es;
  uint8_t *buf = malloc(bytes);
  for (size_t i = 0; i < bytes; i++) buf[i] = (uint8_t)(take(r) * 37u + i * 101u);
  m->buffers[m->count++] = buf;
  t.data = buf;
  return t;
}

/* A per-tensor scale that passed its check, in the readers' form, as the torch shims hand it to the
 * kernels: a broadcast per-token view over one copy per group (pkv_scales_broadcast). */
static void broadcast_per_tensor_scale(pkv_tensor *s, const pkv_tensor *cache, int64_t group, arena *m) {
  if (!pkv_scales_per_tensor(s) || m->count >= MAX_TENSORS) return;
  int64_t groups = pkv_num_groups(cache->sizes[3], group);
  float *copies = malloc((size_t)groups * sizeof *copies);
  for (int64_t i = 0; i < groups; i++) copies[i] = *(const float *)s->data;
  m->buffers[m->count++] = copies;
  pkv_scales_broadcast(s, cache, group, copies);
}

/* Write int32 values into an index tensor's elements (logical order). */
static void fill_index(pkv_tensor *t, const int32_t *values, int64_t count) {
  if (!t->defined || t->dtype != PKV_DTYPE_I32 || !t->data || t->data == g_unbacked || t->ndim < 1 || t->ndim > 2)
    return;
  int64_t rows = t->sizes[0], cols = t->ndim == 2 ? t->sizes[1] : 1;
  if (rows > 64 || cols > 64) return;
  int64_t sc = t->ndim == 2 ? t->strides[1] : 0;
  for (int64_t i = 0; i < rows; i++)
    for (int64_t j = 0; j < cols; j++)
      if (i * cols + j < count) ((int32_t *)t->data)[i * t->strides[0] + j * sc] = values[i * cols + j];
}

static void arena_free(arena *m) {
  for (int i = 0; i < m->count; i++) free(m->buffers[i]);
}

/* ---- geometry and index values ---- */
typedef struct {
  int64_t N, P, Hk, D, Dv, B, cols, T, Hq, G;
  int32_t offsets[9], lengths[8], table[8 * 8];
} geometry;

static int32_t special_index(reader *r, int64_t n) {
  static const int32_t specials[] = {-1, INT32_MIN, INT32_MAX, 0x40000000};
  uint8_t b = take(r);
  if (b < 240) return (int32_t)(b % (uint64_t)(n + 1));
  return specials[b % 4];
}

static void decode_geometry(reader *r, geometry *g) {
  g->N = take_below(r, 12);
  g->P = 1 + take_below(r, 8);
  g->Hk = 1 + take_below(r, 3);
  g->D = 1 + take_below(r, 16);
  g->Dv = take(r) & 1 ? 1 + take_below(r, 16) : g->D;
  g->B = take_below(r, 5);
  g->cols = take_below(r, 7);
  g->Hq = g->Hk * (1 + take_below(r, 3));
  g->G = 1 + take_below(r, 20);
  /* new tokens per row and cached lengths: small, consistent unless the bytes say otherwise */
  g->offsets[0] = 0;
  for (int64_t b = 0; b < g->B; b++) {
    uint8_t x = take(r);
    int32_t added = x < 240 ? (int32_t)(x % 6) : (x % 2 ? -1 : 1000);
    g->offsets[b + 1] = g->offsets[b] + added;
    uint8_t y = take(r);
    g->lengths[b] = y < 240 ? (int32_t)(y % (uint64_t)(g->cols * g->P + 2)) : special_index(r, 4);
  }
  g->T = (g->B ? g->offsets[g->B] : 0) + take_below(r, 3);
  if (g->T < 0) g->T = 0;
  for (int64_t i = 0; i < g->B * g->cols; i++) g->table[i] = special_index(r, g->N);
}

/* Every argument name of each op: a failing check must name one of them. */
static const char *STORE_NAMES[] = {"key", "value", "k_cache", "v_cache", "input_row_offsets", "cache_lengths",
                                    "lookup_table", "k_scales", "v_scales", "quant_group", NULL};
static const char *LOAD_NAMES[] = {"cache", "scales", "lookup_table", "seq_lens", "output_row_offsets", "out",
                                   "quant_group", NULL};
static const char *ATTN_NAMES[] = {"q", "input_row_offsets", "k_cache", "v_cache", "cache_lengths",
                                   "lookup_table", "scale", "k_scales", "v_scales", "quant_group", "out",
                                   "window_left", "softcap", "sinks", "lse", NULL};
static const char *SPARSE_NAMES[] = {"q", "k_cache", "v_cache", "indices", "scale", "k_scales", "v_scales",
                                     "quant_group", "softcap", "sinks", "out", NULL};
static const char *MERGE_NAMES[] = {"out_a", "lse_a", "out_b", "lse_b", "out", "lse", NULL};

static void require(int cond, const char *what, const char *detail) {
  if (!cond) {
    fprintf(stderr, "fuzz_checks: property violated: %s (%s)\n", what, detail);
    abort();
  }
}

static void check_message(pkv_status st, const pkv_error *err, const char *op, const char **names) {
  if (st == PKV_OK) return;
  size_t n = strlen(op);
  require(strncmp(err->message, op, n) == 0 && err->message[n] == ':', "message starts with '<op>:'", err->message);
  int named = 0;
  for (int i = 0; names[i]; i++) named |= strstr(err->message, names[i]) != NULL;
  require(named, "message names an argument", err->message);
}

/* Checks with and without index values: deterministic, and values only add failures. */
#define RUN_CHECK(fn, args, op, names, out_status)                                                  \
  do {                                                                                              \
    pkv_error e0, e1, e2;                                                                           \
    pkv_status s0 = fn(args, 0, &e0), s1 = fn(args, 1, &e1), s2 = fn(args, 1, &e2);                 \
    check_message(s0, &e0, op, names);                                                              \
    check_message(s1, &e1, op, names);                                                              \
    require(s1 == s2 && (s1 == PKV_OK || strcmp(e1.message, e2.message) == 0), "deterministic", op); \
    require(s0 == PKV_OK || s1 == s0, "value checks do not hide descriptor errors", e1.message);    \
    out_status = s1;                                                                                \
  } while (0)

static size_t bytes_of(const pkv_tensor *t) {
  int64_t span = span_of(t);
  return span > 0 ? (size_t)span * pkv_dtype_size(t->dtype) : 0;
}

/* mark[byte] = 1 for each byte of elements (page, slot, head, 0 .. last) of a cache view */
static void mark_row(uint8_t *mark, const pkv_tensor *c, int64_t page, int64_t slot, int64_t head) {
  size_t es = pkv_dtype_size(c->dtype);
  int64_t base = page * c->strides[0] + slot * c->strides[1] + head * c->strides[2];
  for (int64_t i = 0; i < c->sizes[3]; i++) memset(mark + (base + i * c->strides[3]) * (int64_t)es, 1, es);
}

static void require_only_marked(const uint8_t *before, const uint8_t *after, const uint8_t *mark, size_t n,
                                const char *what) {
  for (size_t i = 0; i < n; i++)
    if (before[i] != after[i] && !mark[i]) require(0, "no write outside the addressed rows", what);
}

/* ---- aliasing: a read tensor (or a second written one) placed inside a written tensor's buffer ---- */

/* Moves t's data into host's buffer at an element-aligned offset where t's span fits; 0 if it cannot. */
static int alias_into(reader *r, pkv_tensor *t, const pkv_tensor *host) {
  if (!t->defined || !host->defined || !t->data || !host->data || t->data == g_unbacked || host->data == g_unbacked)
    return 0;
  size_t need = bytes_of(t), have = bytes_of(host), es = pkv_dtype_size(t->dtype);
  if (need == 0 || need > have || es == 0) return 0;
  t->data = (uint8_t *)host->data + (size_t)take_below(r, (int64_t)((have - need) / es) + 1) * es;
  return 1;
}

/* mark[byte - host start] for every byte of t's elements (t inside host's buffer, small). */
static void mark_elements(uint8_t *mark, const pkv_tensor *t, const pkv_tensor *host) {
  int64_t idx[PKV_MAX_DIMS] = {0}, dims = t->ndim, es = (int64_t)pkv_dtype_size(t->dtype);
  for (int d = 0; d < dims; d++)
    if (t->sizes[d] == 0) return;
  for (;;) {
    int64_t e = 0;
    for (int d = 0; d < dims; d++) e += idx[d] * t->strides[d];
    memset(mark + ((uint8_t *)t->data - (uint8_t *)host->data) + e * es, 1, (size_t)es);
    int d = dims - 1;
    while (d >= 0 && ++idx[d] == t->sizes[d]) idx[d--] = 0;
    if (d < 0) return;
  }
}

/* Property: a check that passed with `t` placed inside `host` means no element of t shares a byte
 * with one of host (counted element by element; skipped for tensors too large to enumerate). */
static void require_disjoint(const pkv_tensor *t, const pkv_tensor *host, const char *what) {
  size_t have = bytes_of(host);
  int64_t elements = 1;
  for (int d = 0; d < t->ndim && d < PKV_MAX_DIMS; d++) elements = mul_sat(elements, t->sizes[d]);
  for (int d = 0; d < host->ndim && d < PKV_MAX_DIMS; d++) elements = mul_sat(elements, host->sizes[d]);
  if (!have || t->ndim > PKV_MAX_DIMS || host->ndim > PKV_MAX_DIMS || elements > ((int64_t)1 << 24)) return;
  uint8_t *a = calloc(have, 1), *b = calloc(have, 1);
  mark_elements(a, host, host);
  mark_elements(b, t, host);
  for (size_t i = 0; i < have; i++) require(!(a[i] && b[i]), "a check refuses aliasing of written memory", what);
  free(a);
  free(b);
}

static void fuzz_store(reader *r) {
  geometry g;
  arena m = {0};
  decode_geometry(r, &g);
  pkv_store_args a;
  memset(&a, 0, sizeof a);
  a.quant_group = take(r) == 255 ? -(int64_t)take(r) : g.G;
  int k_only = take(r) % 4 == 0;
  a.k_cache = decode_tensor(r, &m, 1, 4, (int64_t[]){g.N, g.P, g.Hk, g.D}, 0);
  a.key = decode_tensor(r, &m, 0, 3, (int64_t[]){g.T, g.Hk, g.D}, 0);
  if (!k_only) {
    a.v_cache = decode_tensor(r, &m, 1, 4, (int64_t[]){g.N, g.P, g.Hk, g.Dv}, 0);
    a.value = decode_tensor(r, &m, 0, 3, (int64_t[]){g.T, g.Hk, g.Dv}, 0);
  }
  if (pkv_dtype_is_fp8(a.k_cache.dtype) || take(r) == 7)
    a.k_scales = decode_tensor(r, &m, 3, 4, (int64_t[]){g.N, g.P, g.Hk, pkv_num_groups(g.D, g.G)}, 1);
  if ((a.v_cache.defined && pkv_dtype_is_fp8(a.v_cache.dtype)) || take(r) == 7)
    a.v_scales = decode_tensor(r, &m, 3, 4, (int64_t[]){g.N, g.P, g.Hk, pkv_num_groups(g.Dv, g.G)}, 1);
  a.input_row_offsets = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B + 1}, 0);
  a.cache_lengths = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B}, 0);
  a.lookup_table = decode_tensor(r, &m, 2, 2, (int64_t[]){g.B, g.cols}, 0);
  /* sometimes an index tensor inside a written cache or scales (filled below, like a table that is a
   * view of the cache), or v_cache inside k_cache's buffer */
  pkv_tensor *alias = NULL, *host = NULL;
  uint8_t pick = take(r);
  if (pick % 4 == 1) {
    pkv_tensor *reads[4] = {&a.lookup_table, &a.cache_lengths, &a.input_row_offsets, &a.v_cache};
    pkv_tensor *writes[3] = {&a.k_cache, &a.v_cache, &a.k_scales};
    alias = reads[(pick >> 2) % 4];
    host = alias == &a.v_cache ? &a.k_cache : writes[(pick >> 4) % 3];
    if (alias == host || !alias_into(r, alias, host)) alias = host = NULL;
  }
  fill_index(&a.input_row_offsets, g.offsets, g.B + 1);
  fill_index(&a.cache_lengths, g.lengths, g.B);
  fill_index(&a.lookup_table, g.table, g.B * g.cols);
  pkv_status st;
  RUN_CHECK(pkv_store_check, &a, "paged_store", STORE_NAMES, st);
  if (alias && st == PKV_OK) require_disjoint(alias, host, "paged_store");
  g_stats[0][0]++;
  if (st != PKV_OK || m.oversize) goto done;
  g_stats[0][1]++;
  int64_t work = pkv_store_cpu_work(&a);
  if (mul_sat(mul_sat(work, a.k_cache.sizes[2]), add_sat(a.k_cache.sizes[3], a.v_cache.sizes[3])) > MAX_KERNEL_WORK)
    goto done;
  /* snapshot every written buffer and mark the rows the call addresses */
  pkv_tensor *written[4] = {&a.k_cache, &a.v_cache, &a.k_scales, &a.v_scales};
  uint8_t *before[4] = {0}, *mark[4] = {0};
  for (int i = 0; i < 4; i++) {
    size_t n = written[i]->defined ? bytes_of(written[i]) : 0;
    if (!n) continue;
    before[i] = malloc(n);
    mark[i] = calloc(n, 1);
    memcpy(before[i], written[i]->data, n);
  }
  pkv_index_view offsets = pkv_index_view_from(&a.input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a.cache_lengths);
  pkv_index_view table = pkv_index_view_from(&a.lookup_table);
  for (int64_t b = 0; b < lengths.rows; b++)
    for (int64_t i = 0; i < pkv_new_tokens(&offsets, b); i++) {
      int64_t pos = pkv_cache_length(&lengths, b) + i;
      int64_t page = pkv_page_of(&table, b, pos, a.k_cache.sizes[1]), slot = pos % a.k_cache.sizes[1];
      for (int64_t h = 0; h < a.k_cache.sizes[2]; h++)
        for (int k = 0; k < 4; k++)
          if (mark[k]) mark_row(mark[k], written[k], page, slot, h);
    }
  /* two ranges, like a thread pool would split the work */
  int64_t mid = work ? take_below(r, work + 1) : 0;
  pkv_store_cpu(&a, mid, work);
  pkv_store_cpu(&a, 0, mid);
  g_stats[0][2]++;
  for (int i = 0; i < 4; i++) {
    if (!before[i]) continue;
    /* v_cache inside k_cache's buffer: each snapshot spans the other's rows, so only ASan judges */
    if (alias != &a.v_cache)
      require_only_marked(before[i], written[i]->data, mark[i], bytes_of(written[i]), "paged_store");
    free(before[i]);
    free(mark[i]);
  }
done:
  arena_free(&m);
}

static void fuzz_load(reader *r) {
  geometry g;
  arena m = {0};
  decode_geometry(r, &g);
  pkv_load_args a;
  memset(&a, 0, sizeof a);
  a.quant_group = take(r) == 255 ? -(int64_t)take(r) : g.G;
  /* seq_lens = lengths + new tokens; output rows follow the offsets */
  /* values wrap to int32 on purpose (special lengths are near INT32_MAX) */
  int32_t seq[8];
  for (int64_t b = 0; b < g.B; b++)
    seq[b] = (int32_t)(uint32_t)((int64_t)g.lengths[b] + (g.offsets[b + 1] - g.offsets[b]) * (take(r) & 1));
  int32_t out_offsets[9] = {0};
  for (int64_t b = 0; b < g.B; b++)
    out_offsets[b + 1] = (int32_t)(uint32_t)((int64_t)out_offsets[b] + (seq[b] > 0 ? seq[b] : 0) + take_below(r, 2));
  if (take(r) == 9 && g.B) {
    int64_t i = take_below(r, g.B + 1);
    out_offsets[i] = (int32_t)(uint32_t)((int64_t)out_offsets[i] + take_below(r, 5) - 2);
  }
  int64_t T_out = g.B ? (int64_t)out_offsets[g.B] + take_below(r, 3) - (take(r) == 3) : take_below(r, 2);
  if (T_out < 0) T_out = 0;
  if (T_out > 4096) T_out = 4096;
  a.cache = decode_tensor(r, &m, 1, 4, (int64_t[]){g.N, g.P, g.Hk, g.D}, 0);
  if (pkv_dtype_is_fp8(a.cache.dtype) || take(r) == 7)
    a.scales = decode_tensor(r, &m, 3, 4, (int64_t[]){g.N, g.P, g.Hk, pkv_num_groups(g.D, g.G)}, 1);
  a.out = decode_tensor(r, &m, 0, 3, (int64_t[]){T_out, g.Hk, g.D}, 0);
  a.lookup_table = decode_tensor(r, &m, 2, 2, (int64_t[]){g.B, g.cols}, 0);
  a.seq_lens = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B}, 0);
  a.output_row_offsets = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B + 1}, 0);
  pkv_tensor *alias = NULL;
  uint8_t pick = take(r);
  if (pick % 4 == 1) { /* an index tensor inside out */
    pkv_tensor *reads[3] = {&a.lookup_table, &a.seq_lens, &a.output_row_offsets};
    alias = reads[(pick >> 2) % 3];
    if (!alias_into(r, alias, &a.out)) alias = NULL;
  }
  fill_index(&a.lookup_table, g.table, g.B * g.cols);
  fill_index(&a.seq_lens, seq, g.B);
  fill_index(&a.output_row_offsets, out_offsets, g.B + 1);
  pkv_status st;
  RUN_CHECK(pkv_load_check, &a, "paged_load", LOAD_NAMES, st);
  if (alias && st == PKV_OK) require_disjoint(alias, &a.out, "paged_load");
  g_stats[1][0]++;
  if (st != PKV_OK || m.oversize) goto done;
  g_stats[1][1]++;
  /* pkv_load_cpu_work is B * max_pages: a broadcast table of absurd width would overflow it and
   * loop for hours (reported against the kernel); such calls are check-only here */
  if (mul_sat(a.lookup_table.sizes[0], a.lookup_table.sizes[1]) > MAX_KERNEL_WORK) goto done;
  broadcast_per_tensor_scale(&a.scales, &a.cache, a.quant_group, &m);
  if (pkv_scales_per_tensor(&a.scales)) goto done; /* no room left for its copies */
  int64_t work = pkv_load_cpu_work(&a);
  int64_t per_item = mul_sat(mul_sat(a.cache.sizes[1], a.cache.sizes[2]), a.cache.sizes[3]);
  if (work > MAX_KERNEL_WORK || mul_sat(work, per_item) > 50 * MAX_KERNEL_WORK) goto done;
  size_t n = bytes_of(&a.out);
  uint8_t *before = n ? malloc(n) : NULL, *mark = n ? calloc(n, 1) : NULL;
  if (n) memcpy(before, a.out.data, n);
  pkv_index_view offsets = pkv_index_view_from(&a.output_row_offsets);
  pkv_index_view lens = pkv_index_view_from(&a.seq_lens);
  size_t es = pkv_dtype_size(a.out.dtype);
  for (int64_t b = 0; b < lens.rows; b++)
    for (int64_t t = 0; t < pkv_index_at(&lens, b); t++)
      for (int64_t h = 0; h < a.out.sizes[1]; h++)
        for (int64_t i = 0; i < a.out.sizes[2]; i++) {
          int64_t e = (pkv_index_at(&offsets, b) + t) * a.out.strides[0] + h * a.out.strides[1] + i * a.out.strides[2];
          memset(mark + e * (int64_t)es, 1, es);
        }
  int64_t mid = work ? take_below(r, work + 1) : 0;
  pkv_load_cpu(&a, 0, mid);
  pkv_load_cpu(&a, mid, work);
  g_stats[1][2]++;
  if (n) require_only_marked(before, a.out.data, mark, n, "paged_load");
  free(before);
  free(mark);
done:
  arena_free(&m);
}

/* Attention options, normal and hostile (picked by bytes). */
static const double FUZZ_SCALES[] = {0.25, 1.0, 0.0, -0.5, 1e18, 1e300, NAN, INFINITY};
static const double FUZZ_SOFTCAPS[] = {0.0, 1e-300, 5.0, 1e-18, -1.0, NAN, 1e300, 30.0};

/* The operands flash_attn_paged and its sparse form share: the caches, their FP8 scales, q and out
 * (usually of q's dtype, as the ops require). */
typedef struct {
  pkv_tensor k_cache, v_cache, k_scales, v_scales, q, out;
} attention_operands;

static attention_operands decode_attention_operands(reader *r, arena *m, const geometry *g) {
  attention_operands o;
  memset(&o, 0, sizeof o);
  o.k_cache = decode_tensor(r, m, 1, 4, (int64_t[]){g->N, g->P, g->Hk, g->D}, 0);
  o.v_cache = decode_tensor(r, m, 1, 4, (int64_t[]){g->N, g->P, g->Hk, g->Dv}, 0);
  if (pkv_dtype_is_fp8(o.k_cache.dtype) || take(r) == 7)
    o.k_scales = decode_tensor(r, m, 3, 4, (int64_t[]){g->N, g->P, g->Hk, pkv_num_groups(g->D, g->G)}, 1);
  if (pkv_dtype_is_fp8(o.v_cache.dtype) || take(r) == 7)
    o.v_scales = decode_tensor(r, m, 3, 4, (int64_t[]){g->N, g->P, g->Hk, pkv_num_groups(g->Dv, g->G)}, 1);
  o.q = decode_tensor(r, m, 0, 3, (int64_t[]){g->T, g->Hq, g->D}, 0);
  o.out = decode_tensor_as(r, m, 0, 3, (int64_t[]){g->T, g->Hq, g->Dv}, 0, take(r) % 8 ? (int)o.q.dtype : -1);
  return o;
}

static void fuzz_attn(reader *r) {
  geometry g;
  arena m = {0};
  decode_geometry(r, &g);
  pkv_attn_args a;
  memset(&a, 0, sizeof a);
  a.quant_group = take(r) == 255 ? -(int64_t)take(r) : g.G;
  static const int64_t windows[] = {-1, -1, 0, 1, 3, (int64_t)1 << 40, -2, INT64_MIN};
  uint8_t opt = take(r);
  a.scale = FUZZ_SCALES[opt % 8];
  a.softcap = FUZZ_SOFTCAPS[(opt >> 3) % 8];
  a.causal = (opt >> 6) & 1;
  a.window_left = windows[take(r) % 8];
  attention_operands o = decode_attention_operands(r, &m, &g);
  a.k_cache = o.k_cache, a.v_cache = o.v_cache, a.k_scales = o.k_scales, a.v_scales = o.v_scales;
  a.q = o.q, a.out = o.out;
  a.input_row_offsets = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B + 1}, 0);
  a.cache_lengths = decode_tensor(r, &m, 2, 1, (int64_t[]){g.B}, 0);
  a.lookup_table = decode_tensor(r, &m, 2, 2, (int64_t[]){g.B, g.cols}, 0);
  /* flash_attn_paged_lse's log-sum-exps and the attention sinks, each sometimes */
  a.sinks = decode_tensor(r, &m, 3, 1, (int64_t[]){g.Hq}, 1);
  a.lse = decode_tensor(r, &m, 3, 2, (int64_t[]){g.T, g.Hq}, 1);
  /* sometimes an index tensor inside out or lse, or out inside q or a cache */
  pkv_tensor *alias = NULL, *host = NULL;
  uint8_t pick = take(r);
  if (pick % 4 == 1) {
    pkv_tensor *reads[3] = {&a.lookup_table, &a.cache_lengths, &a.input_row_offsets};
    alias = reads[(pick >> 2) % 3], host = (pick >> 4) & 1 ? &a.lse : &a.out;
  } else if (pick % 4 == 2) {
    pkv_tensor *inputs[3] = {&a.q, &a.k_cache, &a.v_cache};
    alias = &a.out, host = inputs[(pick >> 2) % 3];
  }
  if (alias && !alias_into(r, alias, host)) alias = host = NULL;
  fill_index(&a.input_row_offsets, g.offsets, g.B + 1);
  fill_index(&a.cache_lengths, g.lengths, g.B);
  fill_index(&a.lookup_table, g.table, g.B * g.cols);
  pkv_status st;
  RUN_CHECK(pkv_attn_check, &a, "flash_attn_paged", ATTN_NAMES, st);
  if (alias && st == PKV_OK) require_disjoint(alias, host, "flash_attn_paged");
  g_stats[2][0]++;
  if (st != PKV_OK || m.oversize) goto done;
  g_stats[2][1]++;
  /* trip count: query rows x visible keys x heads x channels */
  pkv_index_view offsets = pkv_index_view_from(&a.input_row_offsets);
  pkv_index_view lengths = pkv_index_view_from(&a.cache_lengths);
  int64_t cost = mul_sat(mul_sat(a.out.sizes[0], a.out.sizes[1]), a.out.sizes[2]);
  for (int64_t b = 0; b < lengths.rows; b++) {
    int64_t added = pkv_new_tokens(&offsets, b), keys = add_sat(pkv_cache_length(&lengths, b), added);
    int64_t row = mul_sat(mul_sat(added, keys), a.q.sizes[1]);
    cost = add_sat(cost, mul_sat(row, add_sat(a.k_cache.sizes[3], a.v_cache.sizes[3])));
  }
  if (cost > 10 * MAX_KERNEL_WORK) goto done;
  broadcast_per_tensor_scale(&a.k_scales, &a.k_cache, a.quant_group, &m);
  broadcast_per_tensor_scale(&a.v_scales, &a.v_cache, a.quant_group, &m);
  if (pkv_scales_per_tensor(&a.k_scales) || pkv_scales_per_tensor(&a.v_scales)) goto done;
  pkv_attn_plan plan;
  pkv_error err;
  if (pkv_attn_cpu_plan(&a, &plan, &err) != PKV_OK) goto done;
  if (take(r) & 1) { /* claimed one at a time (the torch op's way); a second caller finds none left */
    require(pkv_attn_cpu_claim(&a, &plan, &err) == PKV_OK, "attention kernel runs", err.message);
    require(pkv_attn_cpu_claim(&a, &plan, &err) == PKV_OK, "attention kernel runs", err.message);
  } else { /* two ranges, the second first */
    int64_t mid = plan.num_items ? take_below(r, plan.num_items + 1) : 0;
    require(pkv_attn_cpu(&a, &plan, mid, plan.num_items, &err) == PKV_OK, "attention kernel runs", err.message);
    require(pkv_attn_cpu(&a, &plan, 0, mid, &err) == PKV_OK, "attention kernel runs", err.message);
  }
  pkv_attn_plan_free(&plan);
  g_stats[2][2]++;
done:
  arena_free(&m);
}

/* Sparse index entries: encoded tokens page * P + slot, mostly valid, sometimes -1 (none) or out of
 * range either way. */
static int32_t sparse_entry(reader *r, int64_t tokens) {
  static const int32_t specials[] = {-1, -2, INT32_MIN, INT32_MAX};
  uint8_t b = take(r);
  if (b < 200) return tokens > 0 ? (int32_t)(take32(r) % (uint64_t)tokens) : -1;
  if (b < 240) return -1;
  return b % 2 ? specials[b % 4] : (int32_t)(tokens < INT32_MAX ? tokens : INT32_MAX); /* one past the end */
}

static void fuzz_sparse(reader *r) {
  geometry g;
  arena m = {0};
  decode_geometry(r, &g);
  pkv_sparse_args a;
  memset(&a, 0, sizeof a);
  a.quant_group = take(r) == 255 ? -(int64_t)take(r) : g.G;
  uint8_t opt = take(r);
  a.scale = FUZZ_SCALES[opt % 8];
  a.softcap = FUZZ_SOFTCAPS[(opt >> 3) % 8];
  int64_t lists = opt & 0x40 ? 1 : g.Hk, K = take_below(r, 9);
  attention_operands o = decode_attention_operands(r, &m, &g);
  a.k_cache = o.k_cache, a.v_cache = o.v_cache, a.k_scales = o.k_scales, a.v_scales = o.v_scales;
  a.q = o.q, a.out = o.out;
  a.sinks = decode_tensor(r, &m, 3, 1, (int64_t[]){g.Hq}, 1);
  a.indices = decode_tensor(r, &m, 2, 3, (int64_t[]){g.T, lists, K}, 0);
  pkv_tensor *ix = &a.indices;
  if (ix->defined && ix->dtype == PKV_DTYPE_I32 && ix->ndim == 3 && ix->data && ix->data != g_unbacked &&
      ix->sizes[0] <= 64 && ix->sizes[1] <= 64 && ix->sizes[2] <= 64 && ix->strides[0] >= 0 && ix->strides[1] >= 0 &&
      ix->strides[2] >= 0) {
    int64_t tokens = mul_sat(g.N, g.P);
    for (int64_t t = 0; t < ix->sizes[0]; t++)
      for (int64_t h = 0; h < ix->sizes[1]; h++)
        for (int64_t k = 0; k < ix->sizes[2]; k++)
          ((int32_t *)ix->data)[t * ix->strides[0] + h * ix->strides[1] + k * ix->strides[2]] = sparse_entry(r, tokens);
  }
  pkv_status st;
  RUN_CHECK(pkv_sparse_check, &a, "flash_attn_paged_sparse", SPARSE_NAMES, st);
  g_stats[3][0]++;
  if (st != PKV_OK || m.oversize) goto done;
  g_stats[3][1]++;
  /* trip count: query rows x heads x listed keys x channels */
  int64_t cost = mul_sat(mul_sat(mul_sat(a.q.sizes[0], a.q.sizes[1]), add_sat(a.indices.sizes[2], 1)),
                         add_sat(a.k_cache.sizes[3], a.v_cache.sizes[3]));
  if (cost > 10 * MAX_KERNEL_WORK) goto done;
  broadcast_per_tensor_scale(&a.k_scales, &a.k_cache, a.quant_group, &m);
  broadcast_per_tensor_scale(&a.v_scales, &a.v_cache, a.quant_group, &m);
  if (pkv_scales_per_tensor(&a.k_scales) || pkv_scales_per_tensor(&a.v_scales)) goto done;
  int64_t work = pkv_sparse_cpu_work(&a), mid = work ? take_below(r, work + 1) : 0;
  const pkv_sparse_plan plan = pkv_sparse_cpu_plan(&a);
  pkv_error err;
  require(pkv_sparse_cpu(&a, &plan, mid, work, &err) == PKV_OK, "sparse kernel runs", err.message);
  require(pkv_sparse_cpu(&a, &plan, 0, mid, &err) == PKV_OK, "sparse kernel runs", err.message);
  g_stats[3][2]++;
done:
  arena_free(&m);
}

/* merge_attn_states has no index values: both RUN_CHECK passes check the same thing */
static pkv_status merge_check(const pkv_merge_args *a, int check_values, pkv_error *err) {
  (void)check_values;
  return pkv_merge_check(a, err);
}

static void fuzz_merge(reader *r) {
  arena m = {0};
  int64_t T = take_below(r, 6), H = 1 + take_below(r, 4), Dv = 1 + take_below(r, 20);
  pkv_merge_args a;
  memset(&a, 0, sizeof a);
  a.out_a = decode_tensor(r, &m, 0, 3, (int64_t[]){T, H, Dv}, 0);
  int same = take(r) % 8 ? (int)a.out_a.dtype : -1; /* usually out_a's dtype, as the op requires */
  a.out_b = decode_tensor_as(r, &m, 0, 3, (int64_t[]){T, H, Dv}, 0, same);
  a.out = decode_tensor_as(r, &m, 0, 3, (int64_t[]){T, H, Dv}, 0, same);
  a.lse_a = decode_tensor(r, &m, 3, 2, (int64_t[]){T, H}, 0);
  a.lse_b = decode_tensor(r, &m, 3, 2, (int64_t[]){T, H}, 0);
  a.lse = decode_tensor(r, &m, 3, 2, (int64_t[]){T, H}, 0);
  /* log-sum-exps with the special values a partial attention produces */
  static const float special_lse[] = {-INFINITY, INFINITY, NAN, 0.0f, 80.0f, -80.0f, 1e30f, -1e30f};
  pkv_tensor *lses[2] = {&a.lse_a, &a.lse_b};
  for (int i = 0; i < 2; i++) {
    pkv_tensor *l = lses[i];
    if (!l->defined || l->dtype != PKV_DTYPE_F32 || l->ndim != 2 || !l->data || l->data == g_unbacked ||
        l->sizes[0] > 64 || l->sizes[1] > 64 || l->strides[0] < 0 || l->strides[1] < 0)
      continue;
    for (int64_t t = 0; t < l->sizes[0]; t++)
      for (int64_t h = 0; h < l->sizes[1]; h++) {
        uint8_t b = take(r);
        ((float *)l->data)[t * l->strides[0] + h * l->strides[1]] =
            b < 128 ? (float)b / 16.0f - 4.0f : special_lse[b % 8];
      }
  }
  pkv_status st;
  RUN_CHECK(merge_check, &a, "merge_attn_states", MERGE_NAMES, st);
  g_stats[4][0]++;
  if (st != PKV_OK || m.oversize) goto done;
  g_stats[4][1]++;
  int64_t work = pkv_merge_cpu_work(&a);
  if (mul_sat(mul_sat(work, a.out_a.sizes[1]), a.out_a.sizes[2]) > MAX_KERNEL_WORK) goto done;
  int64_t mid = work ? take_below(r, work + 1) : 0;
  pkv_merge_cpu(&a, mid, work);
  pkv_merge_cpu(&a, 0, mid);
  g_stats[4][2]++;
done:
  arena_free(&m);
}

/* FUZZ_STATS=1: print how often each op passed its check and ran its kernel. */
static void print_stats(void) {
  const char *ops[NUM_OPS] = {"paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged_sparse",
                              "merge_attn_states"};
  for (int i = 0; i < NUM_OPS; i++)
    fprintf(stderr, "%s: %ld inputs, %ld passed the check, %ld ran the kernel\n", ops[i], g_stats[i][0],
            g_stats[i][1], g_stats[i][2]);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int registered;
  if (!registered && getenv("FUZZ_STATS")) {
    registered = 1;
    atexit(print_stats);
  }
  reader r = {data, size, 0};
  switch (take(&r) % NUM_OPS) {
  case 0: fuzz_store(&r); break;
  case 1: fuzz_load(&r); break;
  case 2: fuzz_attn(&r); break;
  case 3: fuzz_sparse(&r); break;
  default: fuzz_merge(&r); break;
  }
  return 0;
}
