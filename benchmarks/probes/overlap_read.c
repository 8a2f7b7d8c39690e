/* Can a decode's arithmetic overlap its reading of random KV pages better than pagedkv's CPU decode does,
 * and with which order of reads? Each mode reads a bf16 paged pool once (pages of 16 keys x 8 KV heads x
 * 256 B rows, 32 KB, token-major as pagedkv's caches; K and V pools; a random page table; 2 OpenMP
 * threads, each its half of the pages in tiles of 32 keys = two K pages and two V pages) and does
 * decode-like arithmetic on every row it reads: WORK vdpbf16ps per 256-byte row into 16 independent
 * accumulators (WORK 32 by default: about 21 ns per key and KV head per core on the 2-core Zen 4 EPYC,
 * where pagedkv's bf16 decode takes ~24 warm). The modes are interleaved round by round in one process.
 *
 *   cc -O2 -march=native -fopenmp benchmarks/probes/overlap_read.c -o /tmp/overlap_read && /tmp/overlap_read
 *   /tmp/overlap_read [pool_MiB=512] [reps=9]          (-DWORK=n: vdpbf16ps per row)
 *
 * Modes (the figure: GB/s of K/V, % of the sequential read, and ns per key and KV head per core):
 *   sequential            the pools read start to end, no arithmetic (the read ceiling)
 *   arithmetic only       the arithmetic on one tile's rows over and over (in L1/L2): its own speed
 *   T1 one tile ahead     pagedkv's scheme: rows in head order (per head its 32 K rows 2 KB apart, then
 *                         its V rows), the next tile's lines prefetched to L2 (prefetcht1) key by key
 *                         (its K span, then V), 4 lines per row of arithmetic
 *   T1 two tiles ahead    the same, prefetching the tile after next
 *   rows, 4 pages         no software prefetch; the rows in memory order (key by key, all heads), a row
 *                         of each of the tile's four pages in turn: the hardware prefetchers' best case
 *   rows, K(t+1)|V(t)     no software prefetch; the next tile's K rows and this tile's V rows in memory
 *                         order, alternating, each over its two pages (a decode that runs QK one tile
 *                         ahead of PV with every head of a key together)
 *   heads, no prefetch    head order as pagedkv, no software prefetch
 *   rows, heads in 4 keys K(t+1)|V(t) in blocks of 4 keys with the heads inside (a head's rows of the
 *                         block, then the next head's), no software prefetch
 *   K rows | V T1         the next tile's K rows in memory order (hardware prefetch) interleaved row by
 *                         row with this tile's V rows in head order, the next tile's V prefetched (T1)
 *   touch loads           head order, the next tile's lines loaded (one int per line) instead of
 *                         prefetched, so the hardware prefetchers see demand misses
 *   staged copy           the next tile's rows copied in memory order (four pages in turn) into a
 *                         per-thread buffer, this tile's arithmetic in head order from the buffer
 *   rows + PV in memory   rows, K(t+1)|V(t), where 16 of each V row's products go to its head's 16
 *                         accumulators in memory, loaded and stored (the same number of products: what
 *                         PV costs when all heads of a key are done together, since 4 query vectors x
 *                         128 columns of float32 per head, 8 heads, do not fit the registers)
 * Nothing but the walk is timed. */
#include "probe_pool.h"

#include <immintrin.h>
#include <stdio.h>

#ifndef WORK
#define WORK 32
#endif

enum { KEYS_PER_PAGE = 16, HEADS = 8, ROW = 256, KEY_BYTES = HEADS * ROW, PAGE = KEYS_PER_PAGE * KEY_BYTES,
       TILE = 2 * KEYS_PER_PAGE, THREADS = 2 };
enum { SEQUENTIAL, ARITHMETIC, T1_ONE, T1_TWO, ROWS_4_PAGES, ROWS_PIPELINED, HEADS_NO_PREFETCH, ROWS_BLOCKS_4,
       K_ROWS_V_T1, TOUCH, STAGED, ROWS_PV_MEMORY, MODES };
static const char *const names[MODES] = {
    "sequential", "arithmetic only", "T1 one tile ahead", "T1 two tiles ahead", "rows, 4 pages", "rows, K(t+1)|V(t)",
    "heads, no prefetch", "rows, heads in 4 keys", "K rows | V T1", "touch loads", "staged copy", "rows + PV in memory"};

typedef struct {
  __m512 a[16];
} acc16;

/* WORK products on one 256-byte row. */
static inline void work(const char *row, acc16 *a) {
  __m512i x[4];
  for (int i = 0; i < 4; i++) x[i] = _mm512_loadu_si512(row + 64 * i);
  const __m512bh q = (__m512bh)_mm512_set1_epi32(0x3f803f80);
#pragma GCC unroll 64
  for (int w = 0; w < WORK; w++) a->a[w & 15] = _mm512_dpbf16_ps(a->a[w & 15], q, (__m512bh)x[w & 3]);
}

/* WORK - 16 products on one row (the rest of a row's work where 16 go to accumulators in memory). */
static inline void work_half(const char *row, acc16 *a) {
  __m512i x[4];
  for (int i = 0; i < 4; i++) x[i] = _mm512_loadu_si512(row + 64 * i);
  const __m512bh q = (__m512bh)_mm512_set1_epi32(0x3f803f80);
#pragma GCC unroll 64
  for (int w = 0; w < WORK - 16; w++) a->a[w & 15] = _mm512_dpbf16_ps(a->a[w & 15], q, (__m512bh)x[w & 3]);
}

typedef struct {
  const char *k[2], *v[2]; /* a tile's pages */
} tile;

static tile tile_at(const char *k, const char *v, const int64_t *pages) {
  tile t = {{k + pages[0] * PAGE, k + pages[1] * PAGE}, {v + pages[0] * PAGE, v + pages[1] * PAGE}};
  return t;
}

static const char *row_at(const char *const pages[2], int key, int head) {
  return pages[key / KEYS_PER_PAGE] + key % KEYS_PER_PAGE * KEY_BYTES + head * ROW;
}

/* A tile's lines in key order (per key its K span, then its V span), `n` at a time. */
typedef struct {
  tile t;
  int on, key, line; /* line 0..63: 32 of K, then 32 of V */
} cursor;

static inline const char *cursor_next(cursor *c) {
  if (!c->on || c->key == TILE) return NULL;
  const char *const *pages = c->line < 32 ? c->t.k : c->t.v;
  const char *p = row_at(pages, c->key, 0) + (c->line % 32) * 64;
  if (++c->line == 64) c->line = 0, c->key++;
  return p;
}

static inline void prefetch_some(cursor *c, int n) {
  for (const char *p; n > 0 && (p = cursor_next(c)); n--) _mm_prefetch(p, _MM_HINT_T1);
}

static inline int touch_some(cursor *c, int n, int x) {
  for (const char *p; n > 0 && (p = cursor_next(c)); n--) x += *(const volatile int *)p;
  return x;
}

static _Alignas(64) char staging[THREADS][2][2][HEADS][TILE][ROW]; /* [thread][slot][K, V][head][key] */
static _Alignas(64) __m512 pv_acc[THREADS][HEADS][16];

static inline void copy_row(char *dst, const char *src) {
  for (int i = 0; i < 4; i++) _mm512_store_si512(dst + 64 * i, _mm512_loadu_si512(src + 64 * i));
}

/* One tile's rows in memory order, the next tile's K and this tile's V alternating over both pages. */
static void rows_pipelined(const tile *now, const tile *next, acc16 *a, int pv_memory, int thread) {
  for (int key = 0; key < KEYS_PER_PAGE; key++)
    for (int h = 0; h < HEADS; h++)
      for (int p = 0; p < 2; p++) {
        int x = key + p * KEYS_PER_PAGE;
        work(row_at(next->k, x, h), a);
        if (!pv_memory) {
          work(row_at(now->v, x, h), a);
          continue;
        }
        /* the same number of products, 16 of them on this head's accumulators in memory */
        work_half(row_at(now->v, x, h), a);
        for (int i = 0; i < 16; i++)
          pv_acc[thread][h][i] = _mm512_dpbf16_ps(pv_acc[thread][h][i], (__m512bh)_mm512_loadu_si512(row_at(now->v, x, h) + 64 * (i % 4)),
                                                  (__m512bh)_mm512_set1_epi32(0x3f803f80));
      }
}

static float walk(const char *k, const char *v, const int64_t *pages, int64_t count, int mode, int thread) {
  acc16 a;
  for (int i = 0; i < 16; i++) a.a[i] = _mm512_setzero_ps();
  int touched = 0;
  for (int64_t t = 0; t + 2 <= count; t += 2) {
    tile now = tile_at(k, v, pages + t), ahead = now;
    int64_t skip = mode == T1_TWO ? 4 : 2;
    cursor c = {now, 0, 0, 0};
    if (t + skip + 2 <= count) c.t = tile_at(k, v, pages + t + skip), c.on = 1;
    if (t + 4 <= count) ahead = tile_at(k, v, pages + t + 2);
    if (mode == ARITHMETIC) now = tile_at(k, v, pages), c.on = 0;
    switch (mode) {
    case ROWS_4_PAGES:
      for (int key = 0; key < KEYS_PER_PAGE; key++)
        for (int h = 0; h < HEADS; h++)
          for (int p = 0; p < 2; p++) {
            int x = key + p * KEYS_PER_PAGE;
            work(row_at(now.k, x, h), &a), work(row_at(now.v, x, h), &a);
          }
      break;
    case ROWS_PIPELINED:
    case ROWS_PV_MEMORY:
      rows_pipelined(&now, &ahead, &a, mode == ROWS_PV_MEMORY, thread);
      break;
    case ROWS_BLOCKS_4:
      for (int k0 = 0; k0 < TILE; k0 += 4)
        for (int h = 0; h < HEADS; h++) {
          for (int x = k0; x < k0 + 4; x++) work(row_at(ahead.k, x, h), &a);
          for (int x = k0; x < k0 + 4; x++) work(row_at(now.v, x, h), &a);
        }
      break;
    case K_ROWS_V_T1: {
      cursor vc = {ahead, t + 4 <= count, 0, 32}; /* V lines only: start at line 32 of each key */
      int r = 0;
      for (int h = 0; h < HEADS; h++)
        for (int x = 0; x < TILE; x++, r++) {
          for (int n = 0; n < 2; n++) {
            const char *p = cursor_next(&vc);
            if (p) _mm_prefetch(p, _MM_HINT_T1);
            if (vc.line == 0) vc.line = 32; /* skip the K span */
          }
          work(row_at(ahead.k, r / HEADS, r % HEADS), &a);
          work(row_at(now.v, x, h), &a);
        }
      break;
    }
    case STAGED: {
      char(*slot)[2][HEADS][TILE][ROW] = staging[thread];
      int s = (int)(t / 2) & 1, copied = 0;
      for (int h = 0; h < HEADS; h++)
        for (int part = 0; part < 2; part++)
          for (int x = 0; x < TILE; x++) {
            if (t + 4 <= count && copied < 2 * TILE * HEADS) { /* row `copied` of the next tile, memory order */
              int w = copied % 4, r = copied / 4, key = r / HEADS + (w >= 2 ? KEYS_PER_PAGE : 0), hh = r % HEADS;
              copy_row(slot[s ^ 1][w & 1][hh][key], row_at(w & 1 ? ahead.v : ahead.k, key, hh));
              copied++;
            }
            work(t == 0 ? row_at(part ? now.v : now.k, x, h) : slot[s][part][h][x], &a);
          }
      break;
    }
    default: /* head order: SEQUENTIAL never comes here */
      for (int h = 0; h < HEADS; h++)
        for (int part = 0; part < 2; part++)
          for (int x = 0; x < TILE; x++) {
            if (mode == TOUCH) touched = touch_some(&c, 4, touched);
            else if (mode != HEADS_NO_PREFETCH) prefetch_some(&c, 4);
            work(row_at(part ? now.v : now.k, x, h), &a);
          }
    }
  }
  __m512 s = _mm512_set1_ps((float)touched);
  for (int i = 0; i < 16; i++) s = _mm512_add_ps(s, a.a[i]);
  return _mm512_reduce_add_ps(s);
}

static float read_contiguous(const char *p, int64_t bytes) {
  __m512 a = _mm512_setzero_ps(), b = a;
  for (int64_t x = 0; x < bytes; x += 128)
    a = _mm512_add_ps(a, _mm512_load_ps((const float *)(p + x))), b = _mm512_add_ps(b, _mm512_load_ps((const float *)(p + x + 64)));
  return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}

static float walk_mode(const probe_pool *pool, int mode, int64_t lo, int64_t hi, int thread) {
  return mode == SEQUENTIAL ? read_contiguous(pool->k + lo * PAGE, (hi - lo) * PAGE) + read_contiguous(pool->v + lo * PAGE, (hi - lo) * PAGE)
                            : walk(pool->k, pool->v, pool->order + lo, hi - lo, mode, thread);
}

int main(int argc, char **argv) {
  int64_t pool = (argc > 1 ? atoll(argv[1]) : 512) << 20;
  int reps = argc > 2 ? atoi(argv[2]) : 9;
  probe_pool pp = {0};
  int failed = reps < 1 ? 0 : probe_pool_init(&pp, pool, PAGE, 4 * THREADS);
  if (reps < 1 || pp.pages < 8 * THREADS) {
    fprintf(stderr, "usage: %s [pool_MiB >= 64] [reps >= 1]\n", argv[0]);
    return 2;
  }
  double *t = malloc((size_t)MODES * (size_t)reps * sizeof *t);
  if (failed || !t) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  probe_time_modes(&pp, MODES, reps, THREADS, walk_mode, t);
  const int64_t half = pp.half, pages = pp.pages;
  printf("pool %lld MiB (K + V, %lld pages of 32 KB), %d threads, %d reps, %d vdpbf16ps per row, huge pages %s\n",
         (long long)(2 * half >> 20), (long long)pages, THREADS, reps, WORK, pp.advised ? "advised" : "refused");
  double base = 0, bytes = 2.0 * (double)pages * PAGE, key_heads = (double)pages * KEYS_PER_PAGE * HEADS / THREADS;
  for (int m = 0; m < MODES; m++) {
    double *tm = t + m * reps;
    qsort(tm, (size_t)reps, sizeof *tm, probe_cmp_double);
    double gbps = bytes / tm[reps / 2] / 1e9;
    if (m == SEQUENTIAL) base = gbps;
    printf("%-22s median %6.2f GB/s  %5.1f%% of sequential  %5.1f ns per key and KV head per core\n", names[m], gbps,
           100.0 * gbps / base, tm[reps / 2] / key_heads * 1e9);
  }
  return 0;
}
