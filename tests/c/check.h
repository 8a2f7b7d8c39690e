/* The CHECK harness of the C unit tests (tests/c/run.sh): counts checks and failures, prints each
 * failure with its location and message, and aborts after 20 failures. A test's main returns
 * g_failures != 0. */
#ifndef PKV_TEST_CHECK_H
#define PKV_TEST_CHECK_H

#include <stdio.h>
#include <stdlib.h>

static int g_checks, g_failures;

#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    g_checks++;                                                              \
    if (!(cond)) {                                                           \
      g_failures++;                                                          \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                          \
      fprintf(stderr, "\n");                                                 \
      if (g_failures > 20) abort();                                          \
    }                                                                        \
  } while (0)

/* The end of a test's main: prints the failures or the check count, returns the exit status. */
static inline int check_report(const char *what) {
  if (g_failures) {
    fprintf(stderr, "%d of %d checks failed (%s)\n", g_failures, g_checks, what);
    return 1;
  }
  printf("all %d checks passed (%s)\n", g_checks, what);
  return 0;
}

#endif
