/* The harness of the page-manager unit tests (tests/c/run.sh): a CHECK that aborts on the first
 * failure and prints the manager's last message, status expectations, small wrappers over the
 * manager's calls and a snapshot of sequences that must not change. Header-only, `static inline`,
 * so each test binary takes what it uses. */
#ifndef PKV_TEST_PM_HARNESS_H
#define PKV_TEST_PM_HARNESS_H

#include "pkv_ops.h"
#include "pkv_page_manager.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------------------------ */
/* Harness                                                                                    */
/* ------------------------------------------------------------------------------------------ */

static pkv_error g_error;
#define g_message g_error.message
#define MSG (&g_error)

static int g_checks;

#define CHECK(condition, ...)                                                       \
  do {                                                                              \
    g_checks += 1;                                                                  \
    if (!(condition)) {                                                             \
      fprintf(stderr, "%s:%d: CHECK(%s) failed: ", __FILE__, __LINE__, #condition); \
      fprintf(stderr, __VA_ARGS__);                                                 \
      fprintf(stderr, "\n  last message: %s\n", g_message);                         \
      abort();                                                                      \
    }                                                                               \
  } while (0)

/* Runs a manager call and requires `expected`; the call must use MSG as its message buffer. */
#define EXPECT_STATUS(expected, call)                                                               \
  do {                                                                                              \
    const pkv_status status_ = (call);                                                           \
    CHECK(status_ == (expected), "%s returned %s, expected %s", #call, pkv_status_name(status_), \
          pkv_status_name(expected));                                                            \
  } while (0)

#define EXPECT_OK(call) EXPECT_STATUS(PKV_OK, call)

#define EXPECT_MESSAGE_HAS(text) CHECK(strstr(g_message, (text)) != NULL, "message does not mention \"%s\"", (text))

static inline struct timespec now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t;
}

static inline double seconds_since(const struct timespec *start) {
  const struct timespec t = now();
  return (double)(t.tv_sec - start->tv_sec) + 1e-9 * (double)(t.tv_nsec - start->tv_nsec);
}

static inline void check_invariants(pkv_page_manager *manager) { EXPECT_OK(pkv_page_manager_check_invariants(manager, MSG)); }

static inline pkv_page_manager_stats stats_of(pkv_page_manager *manager) {
  pkv_page_manager_stats stats;
  EXPECT_OK(pkv_page_manager_get_stats(manager, &stats, MSG));
  return stats;
}

static inline int64_t length_of(pkv_page_manager *manager, int64_t seq_id) {
  int64_t length = -1;
  EXPECT_OK(pkv_page_manager_length(manager, seq_id, &length, MSG));
  return length;
}

/* Page list of a sequence into `pages` (capacity 256); returns the count. */
static inline int64_t pages_of(pkv_page_manager *manager, int64_t seq_id, int32_t *pages) {
  int64_t count = -1;
  EXPECT_OK(pkv_page_manager_pages(manager, seq_id, pages, 256, &count, MSG));
  return count;
}

static inline int64_t reserve(pkv_page_manager *manager, int64_t seq_id, int64_t n, int32_t *src, int32_t *dst) {
  int64_t copies = -1;
  EXPECT_OK(pkv_page_manager_reserve(manager, seq_id, n, src, dst, 256, &copies, MSG));
  return copies;
}

static inline void add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt, int64_t n,
                         int64_t expected_cached) {
  int64_t cached = -1;
  EXPECT_OK(pkv_page_manager_add_sequence(manager, seq_id, prompt, n, &cached, MSG));
  CHECK(cached == expected_cached, "sequence %lld: %lld prompt tokens cached, expected %lld", (long long)seq_id,
        (long long)cached, (long long)expected_cached);
}

static inline pkv_page_manager *create(int64_t num_pages, int64_t page_size) {
  pkv_page_manager *manager = NULL;
  EXPECT_OK(pkv_page_manager_create(num_pages, page_size, &manager, MSG));
  CHECK(manager != NULL, "create returned NULL");
  return manager;
}

/* ------------------------------------------------------------------------------------------ */
/* Snapshots: everything observable through the API, for "failed call changed nothing"        */
/* ------------------------------------------------------------------------------------------ */

#define MAX_SNAPSHOT_SEQUENCES 64

typedef struct snapshot {
  pkv_page_manager_stats stats;
  int64_t count;
  int64_t ids[MAX_SNAPSHOT_SEQUENCES];
  int64_t lengths[MAX_SNAPSHOT_SEQUENCES];
  int64_t num_pages[MAX_SNAPSHOT_SEQUENCES];
  int32_t pages[MAX_SNAPSHOT_SEQUENCES][256];
} snapshot;

static inline void snapshot_take(pkv_page_manager *manager, const int64_t *ids, int64_t count, snapshot *out) {
  memset(out, 0, sizeof *out);
  CHECK(count <= MAX_SNAPSHOT_SEQUENCES, "too many sequences for a snapshot");
  out->stats = stats_of(manager);
  out->count = count;
  for (int64_t i = 0; i < count; ++i) {
    out->ids[i] = ids[i];
    out->lengths[i] = length_of(manager, ids[i]);
    out->num_pages[i] = pages_of(manager, ids[i], out->pages[i]);
  }
}

static inline void snapshot_expect_unchanged(pkv_page_manager *manager, const snapshot *before) {
  snapshot *after = malloc(sizeof *after);
  CHECK(after != NULL, "malloc");
  snapshot_take(manager, before->ids, before->count, after);
  CHECK(memcmp(&before->stats, &after->stats, sizeof before->stats) == 0,
        "counters changed: free %lld -> %lld, shared %lld -> %lld, prefix %lld -> %lld",
        (long long)before->stats.free_pages, (long long)after->stats.free_pages, (long long)before->stats.shared_pages,
        (long long)after->stats.shared_pages, (long long)before->stats.prefix_pages,
        (long long)after->stats.prefix_pages);
  for (int64_t i = 0; i < before->count; ++i) {
    CHECK(before->lengths[i] == after->lengths[i], "sequence %lld length changed", (long long)before->ids[i]);
    CHECK(before->num_pages[i] == after->num_pages[i] &&
              memcmp(before->pages[i], after->pages[i], (size_t)before->num_pages[i] * sizeof(int32_t)) == 0,
          "sequence %lld pages changed", (long long)before->ids[i]);
  }
  free(after);
  check_invariants(manager);
}

static inline void fill_tokens(int32_t *tokens, int64_t n, int32_t first) {
  for (int64_t i = 0; i < n; ++i) tokens[i] = first + (int32_t)i;
}

/* A test binary's main: runs each named test in order (a failing CHECK aborts) and prints the count. */
typedef struct pm_test {
  const char *name;
  void (*run)(void);
} pm_test;

static inline int pm_run_tests(const pm_test *tests, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    printf("test %s\n", tests[i].name);
    fflush(stdout);
    tests[i].run();
  }
  printf("%zu tests passed (%d checks)\n", count, g_checks);
  return 0;
}

#endif
