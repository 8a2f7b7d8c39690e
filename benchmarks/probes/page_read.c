/* How fast can this machine read a paged KV pool at all? A bare read loop
 * (vector loads summed, no other work) over the pages of a decode step, next
 * to a memcpy ceiling, in one process: the upper bound a decode kernel's
 * bandwidth can reach, as a fraction of the copy ceiling the targets use.
 *
 *   cc -O2 -mavx2 -pthread benchmarks/probes/page_read.c -o /tmp/page_read && /tmp/page_read
 *   /tmp/page_read [page_KiB=32] [pool_MiB=128] [threads=2] [reps=15]
 *
 * Rows (median GB/s over reps, the modes interleaved round by round):
 *   copy          memcpy of a 512 MiB buffer, bytes read + written (the benchmarks' ceiling)
 *   read random   every page of the pool once, pages in a random order (a random page table)
 *   read in order the same pages in address order
 *   read random + prefetch   random order, the next page prefetched to L2 (T1) a line per
 *                 line read, as pagedkv's CPU decode prefetches the tile ahead
 *   read random, 4 at once   four random pages read side by side (more streams in flight)
 * Before every timed call a buffer of 1 GiB is read (untimed), so the pool
 * starts in DRAM and the caches hold no dirty lines ("--cold" of common.py).
 * Threads split the page list in halves, as the decode plan splits its items. */
#define _GNU_SOURCE
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
  const char *pool;
  const int64_t *order;
  int64_t first, count, page_bytes;
  int streams;  /* pages read side by side, a line of each in turn */
  int prefetch; /* 1: the next page's lines prefetched to L2 (T1) while reading this one */
  float sum;
} read_job;

/* Mode 0 is the memcpy ceiling; the others read the pool. */
static const struct {
  const char *name;
  int random_order, streams, prefetch; /* see read_job */
} modes[] = {
    {"copy (read + write)", 0, 0, 0},    {"read random pages", 1, 1, 0}, {"read pages in order", 0, 1, 0},
    {"read random + prefetch", 1, 1, 1}, {"read random, 4 at once", 1, 4, 0},
};
#define MODES (int)(sizeof modes / sizeof modes[0])

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *read_pages(void *arg) {
  read_job *j = (read_job *)arg;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t end = j->first + j->count, w = j->streams;
  for (int64_t i = j->first; i < end; i += w) {
    const float *p[8];
    int64_t n = end - i < w ? end - i : w;
    for (int64_t s = 0; s < n; s++) p[s] = (const float *)(j->pool + j->order[i + s] * j->page_bytes);
    const char *next = j->pool + j->order[i + n < end ? i + n : i] * j->page_bytes;
    for (int64_t x = 0; x < j->page_bytes / 4; x += 16) { /* two independent sums: loads, not adds, bound */
      if (j->prefetch) _mm_prefetch(next + 4 * x, _MM_HINT_T1);
      for (int64_t s = 0; s < n; s++) {
        a0 = _mm256_add_ps(a0, _mm256_load_ps(p[s] + x));
        a1 = _mm256_add_ps(a1, _mm256_load_ps(p[s] + x + 8));
      }
    }
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, _mm256_add_ps(a0, a1));
  j->sum = lanes[0];
  return NULL;
}

typedef struct {
  char *dst;
  const char *src;
  size_t bytes;
} copy_job;

static void *copy_part(void *arg) {
  copy_job *c = (copy_job *)arg;
  memcpy(c->dst, c->src, c->bytes);
  return NULL;
}

static float evict(const float *buf, size_t n) { /* read, never write: leaves no dirty lines */
  __m256 a = _mm256_setzero_ps();
  for (size_t i = 0; i < n; i += 8) a = _mm256_add_ps(a, _mm256_load_ps(buf + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, a);
  return lanes[0];
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  int64_t page_bytes = (argc > 1 ? atoll(argv[1]) : 32) << 10;
  int64_t pool_bytes = (argc > 2 ? atoll(argv[2]) : 128) << 20;
  int threads = argc > 3 ? atoi(argv[3]) : 2, reps = argc > 4 ? atoi(argv[4]) : 15;
  if (page_bytes < 64 || pool_bytes < page_bytes || threads < 1 || threads > 64 || reps < 1) {
    fprintf(stderr, "usage: %s [page_KiB>=1] [pool_MiB] [threads 1..64] [reps>=1]\n", argv[0]);
    return 2;
  }
  int64_t pages = pool_bytes / page_bytes;
  size_t copy_bytes = (size_t)512 << 20, evict_bytes = (size_t)1 << 30;
  char *pool = aligned_alloc(4096, (size_t)(pages * page_bytes));
  char *src = aligned_alloc(4096, copy_bytes), *dst = aligned_alloc(4096, copy_bytes);
  float *ev = aligned_alloc(4096, evict_bytes);
  int64_t *random_order = malloc((size_t)pages * sizeof *random_order);
  int64_t *in_order = malloc((size_t)pages * sizeof *in_order);
  double *t = malloc((size_t)MODES * (size_t)reps * sizeof *t); /* t[mode * reps + round] */
  if (!pool || !src || !dst || !ev || !random_order || !in_order || !t) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  memset(pool, 0, (size_t)(pages * page_bytes));
  memset(src, 1, copy_bytes);
  memset(dst, 0, copy_bytes);
  memset(ev, 0, evict_bytes);
  srand(1);
  for (int64_t i = 0; i < pages; i++) random_order[i] = in_order[i] = i;
  for (int64_t i = pages - 1; i > 0; i--) {
    int64_t k = rand() % (i + 1), x = random_order[i];
    random_order[i] = random_order[k];
    random_order[k] = x;
  }

  volatile float sink = 0;
  pthread_t th[64];
  for (int r = 0; r < reps; r++) {
    for (int m = 0; m < MODES; m++) {
      int mode = (m + r) % MODES; /* rotate who goes first */
      sink += evict(ev, evict_bytes / sizeof(float));
      double t0 = now();
      if (mode == 0) {
        copy_job c[64];
        for (int x = 0; x < threads; x++) {
          size_t lo = copy_bytes / threads * x, hi = x + 1 == threads ? copy_bytes : copy_bytes / threads * (x + 1);
          c[x] = (copy_job){dst + lo, src + lo, hi - lo};
          pthread_create(&th[x], NULL, copy_part, &c[x]);
        }
        for (int x = 0; x < threads; x++) pthread_join(th[x], NULL);
      } else {
        read_job j[64];
        for (int x = 0; x < threads; x++) {
          int64_t lo = pages * x / threads, hi = pages * (x + 1) / threads;
          const int64_t *order = modes[mode].random_order ? random_order : in_order;
          j[x] = (read_job){pool, order, lo, hi - lo, page_bytes, modes[mode].streams, modes[mode].prefetch, 0};
          pthread_create(&th[x], NULL, read_pages, &j[x]);
        }
        for (int x = 0; x < threads; x++) {
          pthread_join(th[x], NULL);
          sink += j[x].sum;
        }
      }
      t[mode * reps + r] = now() - t0;
    }
  }
  double copy_gbps = 0;
  printf("page %lld KiB, pool %lld MiB, %d threads, %d reps, 1 GiB read before every call\n",
         (long long)(page_bytes >> 10), (long long)(pool_bytes >> 20), threads, reps);
  for (int m = 0; m < MODES; m++) {
    double *tm = t + m * reps, bytes = m ? (double)(pages * page_bytes) : 2.0 * (double)copy_bytes;
    qsort(tm, (size_t)reps, sizeof *tm, cmp_double);
    double gbps = bytes / tm[reps / 2] / 1e9;
    printf("%-22s median %6.2f GB/s  (best %6.2f, worst %6.2f)", modes[m].name, gbps, bytes / tm[0] / 1e9,
           bytes / tm[reps - 1] / 1e9);
    if (m)
      printf("  %5.1f%% of copy", 100.0 * gbps / copy_gbps);
    else
      copy_gbps = gbps;
    printf("\n");
  }
  return sink == 12345.0f; /* keeps the sums alive */
}
