/* How fast can a decode read a paged bf16 KV pool whose pages lie in random places, and how much
 * does the order of its reads matter? Bare read loops (vector loads summed, no arithmetic), in one
 * process, the modes interleaved round by round, next to a sequential read of the same bytes.
 *
 *   cc -O2 -march=native -fopenmp benchmarks/probes/tile_read.c -o /tmp/tile_read && /tmp/tile_read
 *   /tmp/tile_read [pool_MiB=512] [threads=2] [reps=9]
 *
 * The pool is K and V halves of pages of 16 keys x 8 KV heads x 128 bf16 (32 KB: Hq/Hk 32/8, D 128,
 * page 16, token-major as pagedkv's caches), 2 MiB aligned and advised for transparent huge pages,
 * as pagedkv.host_alloc allocates caches. Each thread reads its half of a random permutation of the
 * pages (a random page table), OpenMP threads as torch's. Modes (GB/s, % of "sequential"):
 *   sequential           the K half, then the V half, each thread one contiguous part (the read ceiling)
 *   chunks, N at once    K pages in random order, N pages read side by side, a line of each in turn
 *                        (N = 1, 2, 4), no software prefetch: what the hardware prefetchers do alone
 *   tile <order>         decode-shaped: tiles of 32 keys (two K pages, two V pages), the next tile
 *                        prefetched to L2 (prefetcht1) key by key (its K row span, then V), 4 lines
 *                        per 256-byte row read, as pagedkv's CPU decode paces it. Orders of the reads:
 *                        memory (per key all heads' rows: each page start to end), heads (per head its
 *                        32 rows 2 KB apart, K then V: the order the decode kernel reads bf16), K blocks
 *                        (8 keys with the heads inside for K, heads for V: the kernel's FP8 K order).
 *   tile, no prefetch    memory order without the software prefetch: the hardware prefetchers alone
 *   tile, 4 pages        a tile's four pages (2 K, 2 V) read side by side, a line of each in turn, no
 *                        software prefetch: the order the hardware prefetchers serve best
 * Every figure reads the whole pool once per call; nothing is timed but the reads. The tile modes'
 * prefetch loop has a cost of its own: from the L3 (an 8 MiB pool) they read 54-61 GB/s on the 2-core
 * Zen 4 EPYC, where the modes without software prefetch read 136-148, so in minutes when DRAM reads
 * near 50 GB/s their figure is partly that loop's. */
#include "probe_pool.h"

#include <immintrin.h>
#include <stdio.h>

enum { KEYS_PER_PAGE = 16, HEADS = 8, ROW = 256, KEY_BYTES = HEADS * ROW, PAGE = KEYS_PER_PAGE * KEY_BYTES };
enum { SEQUENTIAL, CHUNKS_1, CHUNKS_2, CHUNKS_4, TILE_MEMORY, TILE_HEADS, TILE_K_BLOCKS, TILE_NO_PREFETCH,
       TILE_PAGES, MODES };
static const char *const names[MODES] = {"sequential",        "chunks, 1 at once",   "chunks, 2 at once",
                                         "chunks, 4 at once", "tile, memory order",  "tile, heads",
                                         "tile, K blocks",    "tile, no prefetch",   "tile, 4 pages"};

typedef struct {
  const char *k, *v;     /* the pool's halves */
  const int64_t *pages;  /* this thread's pages, in read order */
  int64_t count;         /* of them (a whole number of tiles) */
} job;

#ifdef __AVX512F__
typedef __m512 vec;
#define VZERO _mm512_setzero_ps
#define VADD(a, p) _mm512_add_ps(a, _mm512_load_ps((const float *)(p)))
#define VSUM(a) _mm512_reduce_add_ps(a)
#define VBYTES 64
#else
typedef __m256 vec;
#define VZERO _mm256_setzero_ps
#define VADD(a, p) _mm256_add_ps(a, _mm256_load_ps((const float *)(p)))
static float VSUM(__m256 a) {
  float x[8];
  _mm256_storeu_ps(x, a);
  return x[0] + x[1] + x[2] + x[3] + x[4] + x[5] + x[6] + x[7];
}
#define VBYTES 32
#endif

static vec read_row(const char *p, vec a) {
  for (int x = 0; x < ROW; x += VBYTES) a = VADD(a, p + x);
  return a;
}

static float read_contiguous(const char *p, int64_t bytes) {
  vec a = VZERO(), b = VZERO();
  for (int64_t x = 0; x < bytes; x += 2 * VBYTES) {
    a = VADD(a, p + x);
    b = VADD(b, p + x + VBYTES);
  }
  return VSUM(a) + VSUM(b);
}

static float read_chunks(const job *j, int n) {
  vec a = VZERO();
  for (int64_t i = 0; i + n <= j->count; i += n)
    for (int64_t x = 0; x < PAGE; x += VBYTES)
      for (int s = 0; s < n; s++) a = VADD(a, j->k + j->pages[i + s] * PAGE + x);
  return VSUM(a);
}

/* The next tile's lines in key order (per key: its K span of all heads, then its V span), issued
 * `per_row` at a time, one batch per row the current tile reads. */
typedef struct {
  const char *k[2], *v[2];
  int64_t line; /* next line, 0 .. 2 * 32 * KEY_BYTES / 64 */
} tile_prefetch;

static void prefetch_some(tile_prefetch *t, int n) {
  const int64_t lines_per_key = 2 * KEY_BYTES / 64, end = 2 * KEYS_PER_PAGE * lines_per_key;
  for (; n > 0 && t->k[0] && t->line < end; n--, t->line++) {
    int64_t key = t->line / lines_per_key, at = t->line % lines_per_key * 64;
    const char *base = at < KEY_BYTES ? t->k[key / KEYS_PER_PAGE] : t->v[key / KEYS_PER_PAGE] - KEY_BYTES;
    _mm_prefetch(base + key % KEYS_PER_PAGE * KEY_BYTES + at, _MM_HINT_T1);
  }
}

#define ROW_AT(pages, key, head) ((pages)[(key) / KEYS_PER_PAGE] + (key) % KEYS_PER_PAGE * KEY_BYTES + (head) * ROW)

static float read_tiles(const job *j, int mode) {
  vec a = VZERO();
  for (int64_t t = 0; t + 2 <= j->count; t += 2) {
    const char *k[2] = {j->k + j->pages[t] * PAGE, j->k + j->pages[t + 1] * PAGE};
    const char *v[2] = {j->v + j->pages[t] * PAGE, j->v + j->pages[t + 1] * PAGE};
    tile_prefetch pf = {{0, 0}, {0, 0}, 0};
    if (t + 4 <= j->count)
      for (int x = 0; x < 2; x++) pf.k[x] = j->k + j->pages[t + 2 + x] * PAGE, pf.v[x] = j->v + j->pages[t + 2 + x] * PAGE;
    const int per_row = 4; /* 2048 lines of the next tile over this tile's 512 row reads */
    if (mode == TILE_NO_PREFETCH) pf.k[0] = NULL; /* prefetch_some does nothing */
    if (mode == TILE_MEMORY || mode == TILE_NO_PREFETCH) {
      for (int key = 0; key < 2 * KEYS_PER_PAGE; key++) {
        for (int h = 0; h < HEADS; h++) prefetch_some(&pf, per_row), a = read_row(ROW_AT(k, key, h), a);
        for (int h = 0; h < HEADS; h++) prefetch_some(&pf, per_row), a = read_row(ROW_AT(v, key, h), a);
      }
    } else if (mode == TILE_PAGES) {
      for (int64_t x = 0; x < PAGE; x += VBYTES)
        for (int p = 0; p < 2; p++) a = VADD(a, k[p] + x), a = VADD(a, v[p] + x);
    } else {
      if (mode == TILE_K_BLOCKS)
        for (int k0 = 0; k0 < 2 * KEYS_PER_PAGE; k0 += 8)
          for (int h = 0; h < HEADS; h++)
            for (int key = k0; key < k0 + 8; key++) prefetch_some(&pf, per_row), a = read_row(ROW_AT(k, key, h), a);
      for (int h = 0; h < HEADS; h++) {
        for (int key = 0; mode == TILE_HEADS && key < 2 * KEYS_PER_PAGE; key++)
          prefetch_some(&pf, per_row), a = read_row(ROW_AT(k, key, h), a);
        for (int key = 0; key < 2 * KEYS_PER_PAGE; key++) prefetch_some(&pf, per_row), a = read_row(ROW_AT(v, key, h), a);
      }
    }
  }
  return VSUM(a);
}

static float walk(const probe_pool *pool, int mode, int64_t lo, int64_t hi, int thread) {
  (void)thread;
  job j = {pool->k, pool->v, pool->order + lo, hi - lo};
  return mode == SEQUENTIAL ? read_contiguous(pool->k + lo * PAGE, (hi - lo) * PAGE) + read_contiguous(pool->v + lo * PAGE, (hi - lo) * PAGE)
         : mode <= CHUNKS_4 ? read_chunks(&j, mode == CHUNKS_1 ? 1 : mode == CHUNKS_2 ? 2 : 4)
                            : read_tiles(&j, mode);
}

int main(int argc, char **argv) {
  int64_t pool = (argc > 1 ? atoll(argv[1]) : 512) << 20;
  int threads = argc > 2 ? atoi(argv[2]) : 2, reps = argc > 3 ? atoi(argv[3]) : 9;
  probe_pool pp = {0};
  int failed = threads < 1 || threads > 256 || reps < 1 ? 0 : probe_pool_init(&pp, pool, PAGE, 4 * threads);
  if (threads < 1 || threads > 256 || reps < 1 || pp.pages < 8 * threads) {
    fprintf(stderr, "usage: %s [pool_MiB >= 64] [threads 1..256] [reps >= 1]\n", argv[0]);
    return 2;
  }
  double *t = malloc((size_t)MODES * (size_t)reps * sizeof *t);
  if (failed || !t) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  probe_time_modes(&pp, MODES, reps, threads, walk, t);
  const int64_t half = pp.half, pages = pp.pages;
  printf("pool %lld MiB (K + V, %lld pages of 32 KB each), %d threads, %d reps, huge pages %s\n",
         (long long)(2 * half >> 20), (long long)pages, threads, reps, pp.advised ? "advised" : "refused");
  double base = 0;
  for (int m = 0; m < MODES; m++) {
    double *tm = t + m * reps, bytes = (double)(m == SEQUENTIAL || m >= TILE_MEMORY ? 2 * pages * PAGE : pages * PAGE);
    qsort(tm, (size_t)reps, sizeof *tm, probe_cmp_double);
    double gbps = bytes / tm[reps / 2] / 1e9;
    if (m == SEQUENTIAL) base = gbps;
    printf("%-20s median %6.2f GB/s (best %6.2f, worst %6.2f)  %5.1f%% of sequential\n", names[m], gbps,
           bytes / tm[0] / 1e9, bytes / tm[reps - 1] / 1e9, 100.0 * gbps / base);
  }
  return 0;
}
