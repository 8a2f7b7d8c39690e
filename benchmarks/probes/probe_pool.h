/* What the paged-pool probes (tile_read.c, overlap_read.c) share: a K and a V pool of 32 KB pages on
 * 2 MiB-aligned, huge-page-advised memory (as pagedkv.host_alloc allocates caches), mapped before
 * timing, a random page order (a seeded shuffle: a random page table), and the timed rounds of their
 * modes on OpenMP threads (compile with -fopenmp). */
#ifndef PROBE_POOL_H
#define PROBE_POOL_H

#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

typedef struct {
  char *k, *v;     /* the pools' halves, `half` bytes each */
  int64_t half;    /* bytes per half: a whole number of 2 MiB pages */
  int64_t pages;   /* per half, of page_bytes each: a multiple of `multiple` */
  int64_t *order;  /* pages 0 .. pages - 1 in a random order */
  int advised;     /* 1 if both halves took MADV_HUGEPAGE */
} probe_pool;

/* 0 on success, 1 when out of memory; pool->pages is 0 (nothing allocated) when pool_bytes holds fewer
 * than `multiple` pages per half. */
static int probe_pool_init(probe_pool *pool, int64_t pool_bytes, int64_t page_bytes, int64_t multiple) {
  const int64_t huge = 2 << 20;
  memset(pool, 0, sizeof *pool);
  pool->half = pool_bytes / 2 / huge * huge;
  pool->pages = pool->half / page_bytes / multiple * multiple;
  if (pool->pages < multiple) return pool->pages = 0, 0;
  pool->k = aligned_alloc((size_t)huge, (size_t)pool->half);
  pool->v = aligned_alloc((size_t)huge, (size_t)pool->half);
  pool->order = malloc((size_t)pool->pages * sizeof *pool->order);
  if (!pool->k || !pool->v || !pool->order) return 1;
  pool->advised = madvise(pool->k, (size_t)pool->half, MADV_HUGEPAGE) == 0 &&
                  madvise(pool->v, (size_t)pool->half, MADV_HUGEPAGE) == 0;
  memset(pool->k, 1, (size_t)pool->half); /* every page mapped before timing */
  memset(pool->v, 1, (size_t)pool->half);
  srand(1);
  for (int64_t i = 0; i < pool->pages; i++) pool->order[i] = i;
  for (int64_t i = pool->pages - 1; i > 0; i--) {
    int64_t r = rand() % (i + 1), x = pool->order[i];
    pool->order[i] = pool->order[r], pool->order[r] = x;
  }
  return 0;
}

/* One mode's walk by one thread over its share of the pages, [lo, hi) of the order; returns a sum that
 * keeps the reads alive. */
typedef float (*probe_walk)(const probe_pool *pool, int mode, int64_t lo, int64_t hi, int thread);

static double probe_now(void);

/* seconds[mode * reps + r]: `reps` rounds of every mode, who goes first rotating, each call on `threads`
 * OpenMP threads, each thread a contiguous share of the page order (a multiple of 4 pages). */
static void probe_time_modes(const probe_pool *pool, int modes, int reps, int threads, probe_walk walk, double *seconds) {
  volatile float sink = 0;
  for (int r = 0; r < reps; r++)
    for (int m = 0; m < modes; m++) {
      int mode = (m + r) % modes;
      double t0 = probe_now();
#pragma omp parallel num_threads(threads)
      {
        int id = omp_get_thread_num(), n = omp_get_num_threads();
        int64_t lo = pool->pages * id / n / 4 * 4, hi = id + 1 == n ? pool->pages : pool->pages * (id + 1) / n / 4 * 4;
        float s = walk(pool, mode, lo, hi, id);
#pragma omp atomic
        sink += s;
      }
      seconds[mode * reps + r] = probe_now() - t0;
    }
  (void)sink;
}

static double probe_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int probe_cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#endif
