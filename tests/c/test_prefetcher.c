/* Unit test of the CPU decode's software prefetcher (csrc/cpu/kernels/tile_rows.inc; run by
 * tests/c/run.sh under ASan + UBSan). The prefetch instruction is replaced by a recorder and the
 * prefetcher is driven the way attn_item drives it: the row pointers of the tile ahead filled
 * before each tile, pf_pace per head, a random number of pf_step calls per head, the rest of the
 * next tile flushed at each tile's end, the next item's first tile announced during the last one.
 *
 * On token-major pages (heads next to each other: key order) and head-major pages (one run per
 * head: head order when merged), K and V in tensors of their own or side by side in one (vLLM's
 * caches), bf16 and FP8 rows with scale rows (1-3 scale groups per row), merged spans or not (pf_init's `merge`), page sizes that
 * do and do not divide the tiles, split items and partial tiles: every cache line of the rows of the
 * tiles ahead (K and V rows of the item's heads, their scale rows) must be prefetched, and no line
 * outside those rows' hulls (a key's bytes from its first head's row to the end of its last head's,
 * what a span over all heads covers): prefetches never leave the rows the item reads. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_view.h"
#include "pkv_cpu.h"
#include "check.h"
#include "test_util.h"

#define PKV_AI static inline
#define KEYS PKV_CPU_KEYS_PER_TILE

/* ---- the prefetch instruction, recorded ---- */
static uintptr_t *g_lines;
static int64_t g_count, g_cap;

static void v_prefetch(const void *p) {
  if (g_count == g_cap) {
    g_cap = g_cap ? 2 * g_cap : 4096;
    g_lines = realloc(g_lines, (size_t)g_cap * sizeof *g_lines);
    if (!g_lines) abort();
  }
  g_lines[g_count++] = (uintptr_t)p;
}

#include "tile_rows.inc"

static int cmp_line(const void *a, const void *b) {
  uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
  return x < y ? -1 : x > y;
}

static int has_line(const uintptr_t *set, int64_t n, uintptr_t line) {
  return n > 0 && bsearch(&line, set, (size_t)n, sizeof *set, cmp_line) != NULL;
}

/* The lines of `bytes` bytes from p, appended to set[*n]. */
static void add_lines(uintptr_t *set, int64_t *n, const char *p, int64_t bytes) {
  for (uintptr_t line = (uintptr_t)p & ~(uintptr_t)63; line < (uintptr_t)p + (uintptr_t)bytes; line += 64)
    set[(*n)++] = line;
}

/* A cache view over `data`: [pages, P, H, D] rows of `row` elements (D, or 2 D for K and V side by side
 * in one tensor, as vLLM's caches), token-major ([pages][P][H][row]) or head-major ([pages][H][P][row]). */
static pkv_cache_view cache_view(void *data, pkv_dtype dt, int64_t pages, int64_t P, int64_t H, int64_t D, int64_t row,
                                 int head_major) {
  pkv_cache_view c;
  memset(&c, 0, sizeof c);
  c.data = data, c.dtype = dt, c.num_pages = pages, c.page_size = P, c.num_heads = H, c.head_dim = D;
  c.stride_page = P * H * row;
  c.stride_token = head_major ? row : H * row;
  c.stride_head = head_major ? P * row : row;
  return c;
}

/* The lines of the rows of keys [k0, k0 + n) of row b (K, V and the scale rows of heads [h, h + nh))
 * into rows[*nr], and of each key's hull of them (a part's bytes from head h's row to the end of head
 * h + nh - 1's: what one span of all heads covers) into hull[*nh_]. */
static void part_lines(const pkv_cache_view *c, int64_t elem, int64_t page, int64_t slot, int64_t h, int64_t nh,
                       uintptr_t *rows, int64_t *nr, uintptr_t *hull, int64_t *nhull) {
  const char *base = (const char *)c->data;
  for (int64_t x = h; x < h + nh; x++)
    add_lines(rows, nr, base + pkv_cache_offset(c, page, slot, x) * elem, c->head_dim * elem);
  add_lines(hull, nhull, base + pkv_cache_offset(c, page, slot, h) * elem,
            ((nh - 1) * c->stride_head + c->head_dim) * elem);
}

static void item_lines(const tile_source *t, int64_t b, int64_t k0, int64_t n, uintptr_t *rows, int64_t *nr,
                       uintptr_t *hull, int64_t *nhull) {
  for (int64_t key = k0; key < k0 + n; key++) {
    int64_t page = pkv_index_at2(&t->table, b, key / t->kc.page_size), slot = key % t->kc.page_size;
    part_lines(&t->kc, (int64_t)t->k_elem, page, slot, t->h, t->nh, rows, nr, hull, nhull);
    part_lines(&t->vc, (int64_t)t->v_elem, page, slot, t->h, t->nh, rows, nr, hull, nhull);
    if (t->ks.data) part_lines(&t->ks, 4, page, slot, t->h, t->nh, rows, nr, hull, nhull);
    if (t->vs.data) part_lines(&t->vs, 4, page, slot, t->h, t->nh, rows, nr, hull, nhull);
  }
}

/* Sorted, without repeats; returns the count. */
static int64_t sort_unique(uintptr_t *set, int64_t n) {
  if (n == 0) return 0;
  qsort(set, (size_t)n, sizeof *set, cmp_line);
  int64_t unique = 0;
  for (int64_t i = 0; i < n; i++)
    if (unique == 0 || set[i] != set[unique - 1]) set[unique++] = set[i];
  return unique;
}

static void test_prefetch_lines(void) {
  for (int iter = 0; iter < 800; iter++) {
    const int head_major = iter % 2, fp8 = iter / 2 % 2, with_next = iter / 4 % 2, merge = iter / 8 % 2;
    const int kv_side = iter / 16 % 2; /* K and V rows side by side in one tensor */
    const int64_t P = 1 + (int64_t)(rnd() % 40), H = 1 + (int64_t)(rnd() % 8), D = 16 * (1 + (int64_t)(rnd() % 9));
    const int64_t h0 = (int64_t)(rnd() % (uint64_t)H), nh = 1 + (int64_t)(rnd() % (uint64_t)(H - h0));
    const int64_t tile_len = rnd() % 2 ? PKV_CPU_DECODE_KEYS : KEYS;
    const int64_t len = 1 + (int64_t)(rnd() % 300), max_pages = (len + P - 1) / P, pages = 2 * max_pages + 3;
    const size_t elem = fp8 ? 1 : 2;
    /* two rows of the table: the item (row 0) and the next item (row 1), pages in random order */
    int32_t *table = malloc((size_t)(2 * max_pages) * sizeof *table);
    int64_t *perm = malloc((size_t)pages * sizeof *perm);
    for (int64_t i = 0; i < pages; i++) perm[i] = i;
    for (int64_t i = pages - 1; i > 0; i--) {
      int64_t j = (int64_t)(rnd() % (uint64_t)(i + 1)), x = perm[i];
      perm[i] = perm[j], perm[j] = x;
    }
    for (int64_t i = 0; i < 2 * max_pages; i++) table[i] = (int32_t)perm[i];
    char *k = malloc((size_t)(pages * P * H * D * (kv_side ? 2 : 1)) * elem);
    char *v = kv_side ? k + D * (int64_t)elem : malloc((size_t)(pages * P * H * D) * elem);
    const int64_t groups = 1 + (int64_t)(rnd() % 3); /* FP8 scales per row: one, or per group of channels */
    float *ks = fp8 ? malloc((size_t)(pages * P * H * groups) * sizeof(float)) : NULL;
    float *vs = fp8 ? malloc((size_t)(pages * P * H * groups) * sizeof(float)) : NULL;
    pkv_dtype dt = fp8 ? PKV_DTYPE_FP8_E4M3 : PKV_DTYPE_BF16;

    tile_source src;
    memset(&src, 0, sizeof src);
    src.kc = cache_view(k, dt, pages, P, H, D, kv_side ? 2 * D : D, head_major);
    src.vc = cache_view(v, dt, pages, P, H, D, kv_side ? 2 * D : D, head_major);
    if (fp8) {
      src.ks = cache_view(ks, PKV_DTYPE_F32, pages, P, H, groups, groups, head_major);
      src.vs = cache_view(vs, PKV_DTYPE_F32, pages, P, H, groups, groups, head_major);
    }
    src.table.data = table, src.table.rows = 2, src.table.cols = max_pages;
    src.table.stride_row = max_pages, src.table.stride_col = 1;
    src.b = 0, src.h = h0, src.nh = nh, src.group = D, src.k_elem = elem, src.v_elem = elem;

    /* the item: keys [kmin, kmax) of row 0 (a split's part); the next item: row 1 from key 0 */
    const int64_t kmin = (int64_t)(rnd() % (uint64_t)len), kmax = kmin + 1 + (int64_t)(rnd() % (uint64_t)(len - kmin));
    const int64_t keys = kmax - kmin, tiles = (keys + tile_len - 1) / tile_len;
    const int64_t next_n = with_next ? (len < tile_len ? len : tile_len) : 0;
    const void *kp[TILE_SLOTS * KEYS], *vp[TILE_SLOTS * KEYS];
    const float *ksp[TILE_SLOTS * KEYS], *vsp[TILE_SLOTS * KEYS];
    for (int64_t x = 0; x < PF_AHEAD && x < tiles; x++) {
      int64_t at = x % TILE_SLOTS * KEYS;
      tile_rows(&src, kmin + x * tile_len, tile_keys(keys, x, tile_len), kp + at, vp + at, ksp + at, vsp + at);
    }
    prefetcher pf;
    pf_init(&pf, &src, kp, vp, ksp, vsp, keys, tile_len, merge);
    g_count = 0;
    for (int64_t tile = 0; tile < tiles; tile++) {
      int64_t nk = tile_keys(keys, tile, tile_len), ahead = tile + PF_AHEAD, limit = ahead < tiles ? ahead : tiles - 1;
      if (ahead < tiles) {
        int64_t an = ahead % TILE_SLOTS * KEYS;
        tile_rows(&src, kmin + ahead * tile_len, tile_keys(keys, ahead, tile_len), kp + an, vp + an, ksp + an,
                  vsp + an);
      } else if (ahead == tiles && next_n > 0) {
        tile_source next = src;
        next.b = 1;
        int64_t an = ahead % TILE_SLOTS * KEYS;
        tile_rows(&next, 0, next_n, kp + an, vp + an, ksp + an, vsp + an);
        pf_next_item(&pf, next_n), limit = ahead;
      }
      const int64_t calls = 2 * nk; /* per head, as the dot decode's budget */
      for (int64_t hh = 0; hh < nh; hh++) {
        pf_pace(&pf, limit, (nh - hh) * calls);
        int64_t steps = (int64_t)(rnd() % (uint64_t)(2 * calls + 1)); /* fewer or more calls than paced */
        for (int64_t s = 0; s < steps; s++) {
          if (rnd() % 3 == 0)
            pf_steps(&pf, 1 + (int64_t)(rnd() % 4));
          else
            pf_step(&pf);
        }
      }
      pf_lines(&pf, INT64_MAX, tile + 1);
    }

    /* expected: the rows of tiles 1 .. tiles - 1 and of the next item's first tile; allowed: their hulls
     * (a span over all heads where pf_part takes one: heads at most twice a row apart, or 4 lines) */
    int64_t hull_lines = (nh * H * 2 * D * (int64_t)elem * P) / 64 + 4;
    int64_t per_key = 2 * (nh * ((D * (int64_t)elem + 63) / 64 + 1)) + (fp8 ? 4 * nh : 0);
    uintptr_t *rows = malloc((size_t)((keys + next_n) * per_key + 1) * sizeof *rows);
    uintptr_t *hull = malloc((size_t)((keys + next_n) * 4 * hull_lines + 1) * sizeof *hull);
    int64_t n_rows = 0, n_hull = 0;
    if (tiles > 1) item_lines(&src, 0, kmin + tile_len, keys - tile_len, rows, &n_rows, hull, &n_hull);
    if (next_n > 0) {
      tile_source next = src;
      next.b = 1;
      item_lines(&next, 1, 0, next_n, rows, &n_rows, hull, &n_hull);
    }
    n_rows = sort_unique(rows, n_rows);
    n_hull = sort_unique(hull, n_hull);
    if (g_count > 0) qsort(g_lines, (size_t)g_count, sizeof *g_lines, cmp_line);

    int64_t outside = 0, missing = 0;
    for (int64_t i = 0; i < g_count; i++) outside += !has_line(hull, n_hull, g_lines[i]);
    for (int64_t i = 0; i < n_rows; i++) missing += !has_line(g_lines, g_count, rows[i]);
    CHECK(outside == 0 && missing == 0,
          "iter %d (%s%s, %s, merge %d, P %lld, H %lld heads %lld..%lld, D %lld, tile %lld, keys %lld..%lld, "
          "next %lld): %lld of %lld prefetched lines outside the rows' hulls, %lld of %lld row lines not prefetched",
          iter, head_major ? "head-major" : "token-major", kv_side ? " K|V" : "", fp8 ? "fp8 + scales" : "bf16", merge,
          (long long)P, (long long)H,
          (long long)h0, (long long)(h0 + nh - 1), (long long)D, (long long)tile_len, (long long)kmin, (long long)kmax,
          (long long)next_n, (long long)outside, (long long)g_count, (long long)missing, (long long)n_rows);
    /* merged spans: each line about once, twice at most where two spans share one (scale rows, a row's
     * last line); without, spans over all heads of a part repeat lines the next key's span covers too */
    if (merge)
      CHECK(g_count <= 2 * n_hull, "iter %d: %lld prefetches for %lld lines", iter, (long long)g_count,
            (long long)n_hull);
    free(rows), free(hull);
    free(k), free(kv_side ? NULL : v), free(ks), free(vs), free(table), free(perm);
  }
}

int main(void) {
  test_prefetch_lines();
  free(g_lines);
  return check_report("prefetcher");
}
