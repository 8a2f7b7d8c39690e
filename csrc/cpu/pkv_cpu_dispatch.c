/* pagedkv CPU backend: pick the CPU kernel table once per process.
 *
 * cpuid and XGETBV (the OS must save the wider registers) decide what the CPU
 * can run; PAGEDKV_CPU_ISA=scalar|avx2|avx512|amx lowers the choice (tests force
 * each path this way). Any other value, or none, means the best available (the Python package
 * refuses other values at import: pagedkv.build_report.check_cpu_isa_variable). */
#define _GNU_SOURCE 1 /* syscall() */
#include <stdlib.h>
#include <string.h>

#include "pkv_cpu.h"
#include "pkv_cpu_sparse.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#define PKV_CPU_X86 1
#endif

enum { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AMX = 3 };

#if defined(PKV_CPU_X86) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PKV_ARCH_REQ_XCOMP_PERM 0x1023
#define PKV_XFEATURE_XTILEDATA 18
/* Linux hands out the AMX tile state only on request (once per process). */
static int amx_permitted(void) { return syscall(SYS_arch_prctl, PKV_ARCH_REQ_XCOMP_PERM, PKV_XFEATURE_XTILEDATA) == 0; }
#else
static int amx_permitted(void) { return 0; }
#endif

typedef struct {
  int isa;
  int dot_bf16;
  int vbmi; /* AVX512_VBMI byte permutes (the AVX-512 build's FP8 decode lookups) */
} cpu_choice;

#ifdef PKV_CPU_X86
static unsigned long long xcr0(void) {
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return ((unsigned long long)hi << 32) | lo;
}
#endif

static cpu_choice detect(void) {
  cpu_choice c = {ISA_SCALAR, 0, 0};
#ifdef PKV_CPU_X86
  unsigned a, b, cx, d;
  if (!__get_cpuid(1, &a, &b, &cx, &d)) return c;
  int fma = (cx >> 12) & 1, osxsave = (cx >> 27) & 1, avx = (cx >> 28) & 1, f16c = (cx >> 29) & 1;
  if (!osxsave || !avx) return c;
  unsigned long long x = xcr0();
  if ((x & 0x6) != 0x6) return c; /* SSE + AVX state */
  if (!__get_cpuid_count(7, 0, &a, &b, &cx, &d)) return c;
  int avx2 = (b >> 5) & 1, avx512f = (b >> 16) & 1, avx512bw = (b >> 30) & 1, avx512vl = (b >> 31) & 1;
  if (avx2 && fma && f16c) c.isa = ISA_AVX2;
  if (c.isa == ISA_AVX2 && avx512f && avx512bw && avx512vl && (x & 0xe6) == 0xe6) {
    c.isa = ISA_AVX512;
    unsigned a1 = 0, b1, c1, d1;
    if (__get_cpuid_count(7, 1, &a1, &b1, &c1, &d1)) c.dot_bf16 = (a1 >> 5) & 1;
    /* AMX-BF16 (edx bit 22) and AMX-TILE (bit 24), tile state enabled in XCR0 (bits 17, 18);
     * the AMX build also uses AVX512_VBMI byte permutes (ecx bit 1; every AMX CPU has it) */
    int amx_bf16 = (d >> 22) & 1, amx_tile = (d >> 24) & 1;
    c.vbmi = (cx >> 1) & 1;
    if (c.dot_bf16 && c.vbmi && amx_bf16 && amx_tile && (x & 0x60000) == 0x60000) c.isa = ISA_AMX;
  }
  const char *want = getenv("PAGEDKV_CPU_ISA");
  if (want) {
    int cap = strcmp(want, "scalar") == 0 ? ISA_SCALAR
              : strcmp(want, "avx2") == 0 ? ISA_AVX2
              : strcmp(want, "avx512") == 0 ? ISA_AVX512
                                            : ISA_AMX;
    if (cap < c.isa) c.isa = cap;
  }
  /* the syscall only when AMX would be used; AVX-512 when the OS refuses */
  if (c.isa == ISA_AMX && !amx_permitted()) c.isa = ISA_AVX512;
  if (c.isa < ISA_AVX512) c.dot_bf16 = c.vbmi = 0;
#endif
  return c;
}

/* 0: not chosen yet; otherwise 1 + isa + 4 * dot_bf16 + 8 * vbmi. Racing threads compute
 * the same value, so a relaxed store is enough. */
static int chosen;

static cpu_choice choice(void) {
  int v = __atomic_load_n(&chosen, __ATOMIC_RELAXED);
  if (!v) {
    cpu_choice c = detect();
    v = 1 + c.isa + 4 * c.dot_bf16 + 8 * c.vbmi;
    __atomic_store_n(&chosen, v, __ATOMIC_RELAXED);
  }
  cpu_choice c = {(v - 1) & 3, ((v - 1) >> 2) & 1, (v - 1) >> 3};
  return c;
}

const pkv_cpu_kernels *pkv_cpu_kernels_get(void) {
#ifdef PKV_CPU_X86
  switch (choice().isa) {
  case ISA_AMX: return &pkv_cpu_kernels_amx;
  case ISA_AVX512: return &pkv_cpu_kernels_avx512;
  case ISA_AVX2: return &pkv_cpu_kernels_avx2;
  default: break;
  }
#endif
  return &pkv_cpu_kernels_scalar;
}

/* flash_attn_paged_sparse's table for the same ISA as the attention table. */
const pkv_cpu_sparse_kernels *pkv_cpu_sparse_get(void) {
#ifdef PKV_CPU_X86
  switch (choice().isa) {
  case ISA_AMX: return &pkv_cpu_sparse_amx;
  case ISA_AVX512: return &pkv_cpu_sparse_avx512;
  case ISA_AVX2: return &pkv_cpu_sparse_avx2;
  default: break;
  }
#endif
  return &pkv_cpu_sparse_scalar;
}

int pkv_cpu_has_dot_bf16(void) { return choice().dot_bf16; }

int pkv_cpu_has_vbmi(void) { return choice().vbmi; }
