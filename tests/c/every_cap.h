/* Runs a C test's checks once per PAGEDKV_CPU_ISA cap (scalar, avx2, avx512, amx) for the tests of the CPU
 * plans' path choices. The kernel table is chosen once per process, so each cap runs in a child process of
 * its own (a cap above the CPU gets the best table it has). Include after check.h; the includer defines
 * _POSIX_C_SOURCE (setenv, fork, waitpid under -std=c11). */
#ifndef PKV_TEST_EVERY_CAP_H
#define PKV_TEST_EVERY_CAP_H

#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "pkv_cpu.h"

/* body() in a child per cap, its checks reported there under the cap's name; the end of the test's main,
 * reporting `what`. */
static inline int check_on_every_cap(void (*body)(void), const char *what) {
  static const char *caps[] = {"scalar", "avx2", "avx512", "amx"};
  int failed = 0;
  for (int x = 0; x < 4; x++) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
      setenv("PAGEDKV_CPU_ISA", caps[x], 1);
      printf("  PAGEDKV_CPU_ISA=%s: table %s\n", caps[x], pkv_cpu_kernels_get()->name);
      body();
      exit(check_report(caps[x]));
    }
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork for %s", caps[x]);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) failed++;
  }
  CHECK(failed == 0, "%d of the 4 caps failed", failed);
  return check_report(what);
}

#endif
