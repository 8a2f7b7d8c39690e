/* The native read ceiling of the decode benchmark (bench_decode.py --issue26): vector loads
 * summed over a buffer, split into one contiguous part per thread, nothing else. A decode
 * kernel that reads the same number of bytes with the same threads cannot beat it, so decode
 * time is reported as a percentage of it, measured in the same process and interleaved with
 * the decode rounds (a ceiling from another run or of another traffic, e.g. a copy, is not
 * the limit of a read-only kernel).
 *
 * Built by the benchmark as a shared library (ctypes), with the widest vector ISA the compiler
 * and this CPU have (-march=native: a benchmark probe, never shipped):
 *   cc -O2 -march=native -shared -fPIC -pthread benchmarks/probes/read_ceiling.c -o .deps/read_ceiling.so
 * Four independent sums per thread, so the loop is bound by the loads, not by the add latency. */
#include <immintrin.h>
#include <pthread.h>
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

static void *read_part_run(void *arg) {
  read_part *r = (read_part *)arg;
  vec a0 = VEC_ZERO(), a1 = VEC_ZERO(), a2 = VEC_ZERO(), a3 = VEC_ZERO();
  for (const char *p = r->begin; p < r->end; p += 4 * VEC_BYTES) {
    a0 = VEC_ADD(a0, VEC_LOAD((const float *)p));
    a1 = VEC_ADD(a1, VEC_LOAD((const float *)(p + VEC_BYTES)));
    a2 = VEC_ADD(a2, VEC_LOAD((const float *)(p + 2 * VEC_BYTES)));
    a3 = VEC_ADD(a3, VEC_LOAD((const float *)(p + 3 * VEC_BYTES)));
  }
  r->sum = VEC_FIRST(VEC_ADD(VEC_ADD(a0, a1), VEC_ADD(a2, a3)));
  return 0;
}

/* Name of the loads used ("avx512" or "avx2"). */
const char *pkv_read_ceiling_isa(void) { return VEC_NAME; }

/* Reads buf[0, bytes) once with `threads` threads (thread 0 is the caller); returns the sum of
 * the first lanes, so the loads stay live. buf must be 64-byte aligned; bytes past the last
 * whole block of 4 vectors are not read. Returns NAN for bad arguments or a failed thread start. */
float pkv_read_ceiling(const void *buf, int64_t bytes, int threads) {
  enum { MAX_THREADS = 256 };
  const int64_t block = 4 * VEC_BYTES;
  if (!buf || bytes < 0 || threads < 1 || threads > MAX_THREADS || ((uintptr_t)buf & 63)) return __builtin_nanf("");
  int64_t blocks = bytes / block;
  read_part parts[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  const char *base = (const char *)buf;
  for (int t = 0; t < threads; t++) {
    parts[t].begin = base + blocks * t / threads * block;
    parts[t].end = base + blocks * (t + 1) / threads * block;
    parts[t].sum = 0.0f;
  }
  int started = 1, failed = 0;
  for (; started < threads; started++)
    if (pthread_create(&ids[started], 0, read_part_run, &parts[started])) {
      failed = 1;
      break;
    }
  read_part_run(&parts[0]);
  float sum = parts[0].sum;
  for (int t = 1; t < started; t++) {
    pthread_join(ids[t], 0);
    sum += parts[t].sum;
  }
  return failed ? __builtin_nanf("") : sum;
}
