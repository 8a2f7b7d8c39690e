/* The native read ceiling of the decode benchmark (bench_decode.py --issue26): vector loads
 * summed over a buffer, split into one contiguous part per thread, nothing else. A decode
 * kernel that reads the same number of bytes with the same threads cannot beat it, so decode
 * time is reported as a percentage of it, measured in the same process and interleaved with
 * the decode rounds (a ceiling from another run or of another traffic, e.g. a copy, is not
 * the limit of a read-only kernel).
 *
 * Built by the benchmark as a shared library (ctypes), with the widest vector ISA the compiler
 * and this CPU have (-march=native: a benchmark probe, never shipped):
 *   cc -O2 -march=native -shared -fPIC -fopenmp benchmarks/probes/read_ceiling.c -o .deps/read_ceiling.so
 * Four independent sums per thread, so the loop is bound by the loads, not by the add latency. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#if defined(__AVX512F__)
typedef __m512 vec;
#define VEC_BYTES 64
#define VEC_ZERO _mm512_setzero_ps
#define VEC_LOAD(p) _mm512_load_ps(p)
#define VEC_ADD _mm512_add_ps
#define VEC_FIRST(v) _mm512_cvtss_f32(v)
#define VEC_NAME "avx512"
#elif defined(__AVX__)
typedef __m256 vec;
#define VEC_BYTES 32
#define VEC_ZERO _mm256_setzero_ps
#define VEC_LOAD(p) _mm256_load_ps(p)
#define VEC_ADD _mm256_add_ps
#define VEC_FIRST(v) _mm256_cvtss_f32(v)
#define VEC_NAME "avx2"
#else
#error "read_ceiling.c needs AVX or AVX-512"
#endif

typedef struct {
  const char *begin, *end; /* 4 * VEC_BYTES aligned, end - begin a multiple of 4 * VEC_BYTES */
  float sum;
} read_part;

static void read_part_run(read_part *r) {
  vec a0 = VEC_ZERO(), a1 = VEC_ZERO(), a2 = VEC_ZERO(), a3 = VEC_ZERO();
  for (const char *p = r->begin; p < r->end; p += 4 * VEC_BYTES) {
    a0 = VEC_ADD(a0, VEC_LOAD((const float *)p));
    a1 = VEC_ADD(a1, VEC_LOAD((const float *)(p + VEC_BYTES)));
    a2 = VEC_ADD(a2, VEC_LOAD((const float *)(p + 2 * VEC_BYTES)));
    a3 = VEC_ADD(a3, VEC_LOAD((const float *)(p + 3 * VEC_BYTES)));
  }
  r->sum = VEC_FIRST(VEC_ADD(VEC_ADD(a0, a1), VEC_ADD(a2, a3)));
}

/* Name of the loads used ("avx512" or "avx2"). */
const char *pkv_read_ceiling_isa(void) { return VEC_NAME; }

/* Reads buf[0, bytes) once with `threads` OpenMP threads, one contiguous part each; returns the
 * sum of the first lanes, so the loads stay live. buf must be 64-byte aligned; bytes past the
 * last whole block of 4 vectors are not read. Returns NAN for bad arguments or when OpenMP gave
 * fewer threads than asked.
 * OpenMP, not threads of its own: loaded after torch, this library shares torch's libgomp (same
 * soname), so it reads on the very threads the decode ran on. Threads of its own competed with
 * that pool's workers, which spin for a while after each parallel call: on the 2-core Zen 4 EPYC,
 * interleaved with bf16 decodes, a pthread reader measured 23.4 GB/s against 30.8 on the pool
 * (268 MB) and 28.4 against 30.5 (1 GB), so decode looked up to 1.3x closer to the ceiling than
 * it was. */
float pkv_read_ceiling(const void *buf, int64_t bytes, int threads) {
  enum { MAX_THREADS = 256 };
  const int64_t block = 4 * VEC_BYTES;
  if (!buf || bytes < 0 || threads < 1 || threads > MAX_THREADS || ((uintptr_t)buf & 63)) return __builtin_nanf("");
  const int64_t blocks = bytes / block;
  const char *base = (const char *)buf;
  float sums[MAX_THREADS];
  int ran = 0;
#pragma omp parallel num_threads(threads)
  {
    int t = omp_get_thread_num(), n = omp_get_num_threads();
    read_part part = {base + blocks * t / n * block, base + blocks * (t + 1) / n * block, 0.0f};
    read_part_run(&part);
    sums[t] = part.sum;
    if (t == 0) ran = n;
  }
  if (ran != threads) return __builtin_nanf("");
  float sum = 0.0f;
  for (int t = 0; t < threads; t++) sum += sums[t];
  return sum;
}
