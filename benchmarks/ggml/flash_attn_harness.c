/* ggml's CPU flash attention (ggml_flash_attn_ext) on a batched decode step, the peer of
 * bench_decode.py --issue26. Built by benchmarks/ggml/build.sh against ggml's own headers;
 * this file only calls ggml's public API.
 *
 *   flash_attn_harness B L Hq Hk D threads reps
 *
 * One new token per sequence for B sequences of L cached tokens, each sequence its own stream
 * (ggml's 4th dimension = B, as llama.cpp lays out a cache per sequence), no mask (every key
 * visible), scale 1/sqrt(D). K/V values: standard normal from a fixed-seed generator (the
 * distribution of bench_decode.py's values, not the same numbers), stored as f16 and as q8_0
 * (llama.cpp's -ctk q8_0 -ctv q8_0). Each cache type is timed in two layouts over the same buffer:
 *   head-major  [D, L, Hk, B] contiguous (each head's keys contiguous: ggml's best case),
 *   token-major [D, Hk, L, B] viewed as [D, L, Hk, B] (llama.cpp's cache: a token's heads contiguous).
 * A persistent ggml threadpool of `threads` threads (as llama.cpp keeps one); 3 untimed calls per
 * configuration, then `reps` rounds, the four configurations interleaved round by round.
 * Prints one JSON line: median milliseconds per configuration, and per cache type the faster layout
 * ("f16", "q8_0"). */
#define _POSIX_C_SOURCE 199309L /* clock_gettime */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ggml-cpu.h"
#include "ggml.h"

enum { LAYOUTS = 2, TYPES = 2, CONFIGS = LAYOUTS * TYPES, WARMUP = 3 };
static const char *const layout_names[LAYOUTS] = {"head_major", "token_major"};
static const char *const type_names[TYPES] = {"f16", "q8_0"};

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* xorshift64* uniform in (0, 1) and Box-Muller: standard normal values without libc rand's state. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double uniform01(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return ((double)((rng_state * 0x2545f4914f6cdd1dull) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static void fill_normal(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i += 2) {
    double r = sqrt(-2.0 * log(uniform01())), a = 6.283185307179586 * uniform01();
    x[i] = (float)(r * cos(a));
    if (i + 1 < n) x[i + 1] = (float)(r * sin(a));
  }
}

/* A cache of `rows` rows of D values of `type`, filled chunk by chunk (no full-size f32 copy). */
static struct ggml_tensor *new_cache(struct ggml_context *ctx, enum ggml_type type, int64_t rows, int64_t d) {
  struct ggml_tensor *t = ggml_new_tensor_1d(ctx, type, rows * d);
  enum { CHUNK_ROWS = 4096 };
  float *tmp = (float *)malloc((size_t)(CHUNK_ROWS * d) * sizeof(float));
  if (!tmp) return NULL;
  size_t row_bytes = ggml_row_size(type, d);
  for (int64_t r = 0; r < rows; r += CHUNK_ROWS) {
    int64_t n = rows - r < CHUNK_ROWS ? rows - r : CHUNK_ROWS;
    fill_normal(tmp, n * d);
    char *dst = (char *)t->data + (size_t)r * row_bytes;
    if (type == GGML_TYPE_F16)
      ggml_fp32_to_fp16_row(tmp, (ggml_fp16_t *)dst, n * d);
    else
      ggml_quantize_chunk(type, tmp, dst, 0, n, d, NULL);
  }
  free(tmp);
  return t;
}

/* The cache viewed as ggml's K/V operand [D, L, Hk, B]. */
static struct ggml_tensor *cache_view(struct ggml_context *ctx, struct ggml_tensor *c, int layout, int64_t d,
                                      int64_t len, int64_t hk, int64_t b) {
  size_t row = ggml_row_size(c->type, d), seq = row * (size_t)(len * hk);
  if (layout == 0) return ggml_view_4d(ctx, c, d, len, hk, b, row, row * (size_t)len, seq, 0);
  return ggml_view_4d(ctx, c, d, len, hk, b, row * (size_t)hk, row, seq, 0);
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  if (argc != 8) {
    fprintf(stderr, "usage: %s B L Hq Hk D threads reps\n", argv[0]);
    return 2;
  }
  int64_t b = atoll(argv[1]), len = atoll(argv[2]), hq = atoll(argv[3]), hk = atoll(argv[4]), d = atoll(argv[5]);
  int threads = atoi(argv[6]), reps = atoi(argv[7]);
  if (b < 1 || len < 1 || hk < 1 || hq < hk || hq % hk || d < 32 || d % 32 || threads < 1 || reps < 1) {
    fprintf(stderr, "bad arguments: need B, L >= 1, Hq a multiple of Hk, D a multiple of 32, threads, reps >= 1\n");
    return 2;
  }
  int64_t rows = b * len * hk;
  size_t bytes = 0;
  for (int t = 0; t < TYPES; t++) bytes += 2 * ggml_row_size(t ? GGML_TYPE_Q8_0 : GGML_TYPE_F16, d) * (size_t)rows;
  bytes += (size_t)(2 * b * hq * d) * sizeof(float) + 64 * ggml_tensor_overhead() + 8 * ggml_graph_overhead() +
           ((size_t)1 << 20);
  struct ggml_init_params params = {bytes, NULL, false};
  struct ggml_context *ctx = ggml_init(params);
  if (!ctx) {
    fprintf(stderr, "ggml_init failed for %zu bytes\n", bytes);
    return 1;
  }
  ggml_cpu_init();
  struct ggml_tensor *q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d, 1, hq, b);
  fill_normal((float *)q->data, d * hq * b);
  struct ggml_cgraph *graphs[CONFIGS];
  for (int t = 0; t < TYPES; t++) {
    enum ggml_type type = t ? GGML_TYPE_Q8_0 : GGML_TYPE_F16;
    struct ggml_tensor *kc = new_cache(ctx, type, rows, d), *vc = new_cache(ctx, type, rows, d);
    if (!kc || !vc) {
      fprintf(stderr, "out of memory\n");
      return 1;
    }
    for (int l = 0; l < LAYOUTS; l++) {
      struct ggml_tensor *k = cache_view(ctx, kc, l, d, len, hk, b), *v = cache_view(ctx, vc, l, d, len, hk, b);
      struct ggml_tensor *out = ggml_flash_attn_ext(ctx, q, k, v, NULL, 1.0f / sqrtf((float)d), 0.0f, 0.0f);
      graphs[t * LAYOUTS + l] = ggml_new_graph(ctx);
      ggml_build_forward_expand(graphs[t * LAYOUTS + l], out);
    }
  }
  struct ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
  struct ggml_threadpool *pool = ggml_threadpool_new(&tpp);
  struct ggml_cplan plans[CONFIGS];
  for (int c = 0; c < CONFIGS; c++) {
    plans[c] = ggml_graph_plan(graphs[c], threads, pool);
    plans[c].work_data = plans[c].work_size ? (uint8_t *)malloc(plans[c].work_size) : NULL;
    if (plans[c].work_size && !plans[c].work_data) {
      fprintf(stderr, "out of memory\n");
      return 1;
    }
    for (int w = 0; w < WARMUP; w++)
      if (ggml_graph_compute(graphs[c], &plans[c]) != GGML_STATUS_SUCCESS) {
        fprintf(stderr, "ggml_graph_compute failed\n");
        return 1;
      }
  }
  double *ms = (double *)malloc((size_t)(CONFIGS * reps) * sizeof(double)); /* ms[config * reps + round] */
  for (int r = 0; r < reps; r++)
    for (int i = 0; i < CONFIGS; i++) {
      int c = (i + r) % CONFIGS; /* rotate who goes first */
      double t0 = now();
      ggml_graph_compute(graphs[c], &plans[c]);
      ms[c * reps + r] = 1e3 * (now() - t0);
    }
  double median[CONFIGS];
  printf("{");
  for (int c = 0; c < CONFIGS; c++) {
    qsort(ms + c * reps, (size_t)reps, sizeof(double), cmp_double);
    median[c] = ms[c * reps + reps / 2];
    printf("\"%s_%s\": %.4f, ", type_names[c / LAYOUTS], layout_names[c % LAYOUTS], median[c]);
  }
  for (int t = 0; t < TYPES; t++) {
    double best = median[t * LAYOUTS] < median[t * LAYOUTS + 1] ? median[t * LAYOUTS] : median[t * LAYOUTS + 1];
    printf("\"%s\": %.4f%s", type_names[t], best, t + 1 < TYPES ? ", " : "");
  }
  printf(", \"threads\": %d, \"reps\": %d}\n", threads, reps);
  ggml_threadpool_free(pool);
  ggml_free(ctx);
  return 0;
}
