/* Unit tests of csrc/core/pkv_page_manager (run by tests/c/run.sh under ASan + UBSan). */
#define _POSIX_C_SOURCE 200809L
#include "pkv_ops.h"
#include "pkv_page_manager.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
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

static struct timespec now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t;
}

static double seconds_since(const struct timespec *start) {
  const struct timespec t = now();
  return (double)(t.tv_sec - start->tv_sec) + 1e-9 * (double)(t.tv_nsec - start->tv_nsec);
}

static void check_invariants(pkv_page_manager *manager) { EXPECT_OK(pkv_page_manager_check_invariants(manager, MSG)); }

static pkv_page_manager_stats stats_of(pkv_page_manager *manager) {
  pkv_page_manager_stats stats;
  EXPECT_OK(pkv_page_manager_get_stats(manager, &stats, MSG));
  return stats;
}

static int64_t length_of(pkv_page_manager *manager, int64_t seq_id) {
  int64_t length = -1;
  EXPECT_OK(pkv_page_manager_length(manager, seq_id, &length, MSG));
  return length;
}

/* Page list of a sequence into `pages` (capacity 256); returns the count. */
static int64_t pages_of(pkv_page_manager *manager, int64_t seq_id, int32_t *pages) {
  int64_t count = -1;
  EXPECT_OK(pkv_page_manager_pages(manager, seq_id, pages, 256, &count, MSG));
  return count;
}

static int64_t reserve(pkv_page_manager *manager, int64_t seq_id, int64_t n, int32_t *src, int32_t *dst) {
  int64_t copies = -1;
  EXPECT_OK(pkv_page_manager_reserve(manager, seq_id, n, src, dst, 256, &copies, MSG));
  return copies;
}

static void add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt, int64_t n,
                         int64_t expected_cached) {
  int64_t cached = -1;
  EXPECT_OK(pkv_page_manager_add_sequence(manager, seq_id, prompt, n, &cached, MSG));
  CHECK(cached == expected_cached, "sequence %lld: %lld prompt tokens cached, expected %lld", (long long)seq_id,
        (long long)cached, (long long)expected_cached);
}

static pkv_page_manager *create(int64_t num_pages, int64_t page_size) {
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

static void snapshot_take(pkv_page_manager *manager, const int64_t *ids, int64_t count, snapshot *out) {
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

static void snapshot_expect_unchanged(pkv_page_manager *manager, const snapshot *before) {
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

/* ------------------------------------------------------------------------------------------ */
/* Focused tests                                                                              */
/* ------------------------------------------------------------------------------------------ */

static void test_create_arguments(void) {
  pkv_page_manager *manager = (pkv_page_manager *)1;
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(0, 16, &manager, MSG));
  EXPECT_MESSAGE_HAS("num_pages");
  CHECK(manager == NULL, "failed create must set *out_manager to NULL");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(8, 0, &manager, MSG));
  EXPECT_MESSAGE_HAS("page_size");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(-3, 16, &manager, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(1LL << 31, 16, &manager, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(8, 16, NULL, MSG));
  /* NULL manager and NULL message buffers are reported, not crashed on. */
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_check_invariants(NULL, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_create(0, 16, &manager, NULL));
  pkv_page_manager_destroy(NULL);

  manager = create(8, 4);
  const pkv_page_manager_stats stats = stats_of(manager);
  CHECK(stats.num_pages == 8 && stats.page_size == 4 && stats.free_pages == 8 && stats.used_pages == 0 &&
            stats.shared_pages == 0 && stats.num_sequences == 0,
        "fresh manager counters");
  check_invariants(manager);
  CHECK(strcmp(pkv_status_name(PKV_ERR_OUT_OF_PAGES), "PKV_ERR_OUT_OF_PAGES") == 0, "name");
  pkv_page_manager_destroy(manager);
}

static void test_reserve_commit(void) {
  pkv_page_manager *manager = create(8, 4);
  int32_t src[256], dst[256], pages[256];
  add_sequence(manager, 7, NULL, 0, 0);
  EXPECT_STATUS(PKV_ERR_SEQUENCE_EXISTS, pkv_page_manager_add_sequence(manager, 7, NULL, 0, &(int64_t){0}, MSG));
  EXPECT_MESSAGE_HAS("7");
  CHECK(pages_of(manager, 7, pages) == 0, "new sequence holds no page");

  /* Pages come only when needed, in order 0, 1, 2 on a fresh manager. */
  CHECK(reserve(manager, 7, 3, src, dst) == 0, "no copies");
  CHECK(pages_of(manager, 7, pages) == 1 && pages[0] == 0, "one page after reserving 3");
  CHECK(reserve(manager, 7, 4, src, dst) == 0, "no copies");
  CHECK(pages_of(manager, 7, pages) == 1, "capacity 4 covers 4 tokens: no new page");
  CHECK(reserve(manager, 7, 5, src, dst) == 0, "no copies");
  CHECK(pages_of(manager, 7, pages) == 2 && pages[1] == 1, "second page");
  CHECK(reserve(manager, 7, 0, src, dst) == 0, "reserve 0 is a no-op");
  CHECK(length_of(manager, 7) == 0, "reserve does not commit");

  EXPECT_OK(pkv_page_manager_commit(manager, 7, 6, NULL, MSG));
  CHECK(length_of(manager, 7) == 6, "length after commit");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_commit(manager, 7, 3, NULL, MSG));
  EXPECT_MESSAGE_HAS("capacity");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_commit(manager, 7, -1, NULL, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_reserve(manager, 7, -1, src, dst, 256, &(int64_t){0}, MSG));
  EXPECT_MESSAGE_HAS("num_new_tokens");
  EXPECT_STATUS(PKV_ERR_ARGUMENT,
                pkv_page_manager_reserve(manager, 7, (1LL << 31), src, dst, 256, &(int64_t){0}, MSG));
  /* near INT64_MAX: the message must not compute length + n (signed overflow; UBSan aborts here) */
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_reserve(manager, 7, INT64_MAX, src, dst, 256, &(int64_t){0}, MSG));
  EXPECT_MESSAGE_HAS("int32 limit");
  EXPECT_OK(pkv_page_manager_commit(manager, 7, 2, NULL, MSG));
  CHECK(length_of(manager, 7) == 8, "length 8 fills both pages");

  int64_t needed = -1, copies = -1;
  EXPECT_OK(pkv_page_manager_pages_needed(manager, 7, 9, &needed, &copies, MSG));
  CHECK(needed == 3 && copies == 0, "9 more tokens need 3 pages, got %lld", (long long)needed);

  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_reserve(manager, 99, 1, src, dst, 256, &(int64_t){0}, MSG));
  EXPECT_MESSAGE_HAS("99");
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_commit(manager, 99, 1, NULL, MSG));
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_release(manager, 99, MSG));
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_fork(manager, 99, 100, MSG));
  EXPECT_MESSAGE_HAS("src_seq");
  EXPECT_STATUS(PKV_ERR_SEQUENCE_EXISTS, pkv_page_manager_fork(manager, 7, 7, MSG));
  EXPECT_MESSAGE_HAS("dst_seq");
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_length(manager, 99, &needed, MSG));
  check_invariants(manager);

  /* Negative and huge ids are ordinary keys. */
  add_sequence(manager, -5, NULL, 0, 0);
  add_sequence(manager, INT64_MIN, NULL, 0, 0);
  add_sequence(manager, INT64_MAX, NULL, 0, 0);
  reserve(manager, INT64_MIN, 1, src, dst);
  check_invariants(manager);
  EXPECT_OK(pkv_page_manager_release(manager, INT64_MIN, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, -5, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, INT64_MAX, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, 7, MSG));
  const pkv_page_manager_stats stats = stats_of(manager);
  CHECK(stats.free_pages == 8 && stats.num_sequences == 0, "all pages back");
  check_invariants(manager);
  pkv_page_manager_destroy(manager);
}

static void test_out_of_pages_changes_nothing(void) {
  pkv_page_manager *manager = create(6, 4);
  int32_t src[256], dst[256];
  const int64_t ids[] = {1, 2, 3};
  add_sequence(manager, 1, NULL, 0, 0);
  reserve(manager, 1, 10, src, dst); /* 3 pages */
  EXPECT_OK(pkv_page_manager_commit(manager, 1, 6, NULL, MSG));
  EXPECT_OK(pkv_page_manager_fork(manager, 1, 2, MSG)); /* shares 2 pages, one partly full */
  add_sequence(manager, 3, NULL, 0, 0);
  reserve(manager, 3, 8, src, dst); /* 2 pages: 1 left free */
  CHECK(stats_of(manager).free_pages == 1, "one free page");

  snapshot *before = malloc(sizeof *before);
  CHECK(before != NULL, "malloc");
  snapshot_take(manager, ids, 3, before);
  int64_t copies = -1;
  /* Sequence 2 needs a copy of its shared page 1 plus one new page: 2 > 1 free. */
  EXPECT_STATUS(PKV_ERR_OUT_OF_PAGES, pkv_page_manager_reserve(manager, 2, 6, src, dst, 256, &copies, MSG));
  EXPECT_MESSAGE_HAS("out of pages");
  EXPECT_MESSAGE_HAS("copy-on-write");
  snapshot_expect_unchanged(manager, before);
  EXPECT_STATUS(PKV_ERR_OUT_OF_PAGES, pkv_page_manager_reserve(manager, 3, 100, src, dst, 256, &copies, MSG));
  snapshot_expect_unchanged(manager, before);
  /* Too small a copy buffer is reported before anything changes. */
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_reserve(manager, 2, 1, src, dst, 0, &copies, MSG));
  EXPECT_MESSAGE_HAS("copy_capacity");
  snapshot_expect_unchanged(manager, before);
  /* Writing into a shared page without reserve is refused. */
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_commit(manager, 2, 1, NULL, MSG));
  EXPECT_MESSAGE_HAS("share");
  snapshot_expect_unchanged(manager, before);
  /* A reserve that fits exactly succeeds: one copy, no new page. */
  CHECK(reserve(manager, 2, 2, src, dst) == 1, "one copy-on-write");
  CHECK(stats_of(manager).free_pages == 0, "pool exhausted");
  check_invariants(manager);
  free(before);
  pkv_page_manager_destroy(manager);
}

static void test_fork_copy_on_write(void) {
  pkv_page_manager *manager = create(16, 4);
  int32_t src[256], dst[256], pages_a[256], pages_b[256];
  add_sequence(manager, 10, NULL, 0, 0);
  reserve(manager, 10, 12, src, dst); /* 3 pages, commit 6: page 2 is reserved only */
  EXPECT_OK(pkv_page_manager_commit(manager, 10, 6, NULL, MSG));
  EXPECT_OK(pkv_page_manager_fork(manager, 10, 11, MSG));
  CHECK(length_of(manager, 11) == 6, "fork keeps the length");
  CHECK(pages_of(manager, 11, pages_b) == 2, "fork shares only pages holding tokens");
  CHECK(pages_of(manager, 10, pages_a) == 3, "src keeps its reserved page");
  CHECK(pages_a[0] == pages_b[0] && pages_a[1] == pages_b[1], "shared pages");
  pkv_page_manager_stats stats = stats_of(manager);
  CHECK(stats.shared_pages == 2 && stats.used_pages == 3, "2 shared of 3 used");
  check_invariants(manager);

  /* The full page 0 is never copied; the partly full page 1 is, once. */
  int64_t needed = -1, copies = -1;
  EXPECT_OK(pkv_page_manager_pages_needed(manager, 11, 1, &needed, &copies, MSG));
  CHECK(needed == 1 && copies == 1, "one copy needed");
  CHECK(reserve(manager, 11, 1, src, dst) == 1, "one copy");
  CHECK(src[0] == pages_a[1] && dst[0] != pages_a[1], "copy of the shared last page");
  pages_of(manager, 11, pages_b);
  CHECK(pages_b[0] == pages_a[0] && pages_b[1] == dst[0], "dst now holds the copy");
  stats = stats_of(manager);
  CHECK(stats.shared_pages == 1, "only page 0 still shared");
  /* src's page 1 is private again: no copy for src. */
  CHECK(reserve(manager, 10, 2, src, dst) == 0, "no copy after the other side copied");
  EXPECT_OK(pkv_page_manager_commit(manager, 10, 2, NULL, MSG));
  EXPECT_OK(pkv_page_manager_commit(manager, 11, 1, NULL, MSG));
  /* A further reserve on dst spanning into a new page copies nothing. */
  CHECK(reserve(manager, 11, 5, src, dst) == 0, "private pages are not copied");
  check_invariants(manager);

  /* Fork at a page boundary then reserve: no copy at all. */
  EXPECT_OK(pkv_page_manager_fork(manager, 10, 12, MSG));
  CHECK(length_of(manager, 12) == 8, "length 8");
  CHECK(reserve(manager, 12, 3, src, dst) == 0, "writes go to a new page");
  check_invariants(manager);

  EXPECT_OK(pkv_page_manager_release(manager, 10, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, 11, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, 12, MSG));
  stats = stats_of(manager);
  CHECK(stats.free_pages == 16 && stats.shared_pages == 0, "no page leaked");
  check_invariants(manager);
  pkv_page_manager_destroy(manager);
}

static void fill_tokens(int32_t *tokens, int64_t n, int32_t first) {
  for (int64_t i = 0; i < n; ++i) tokens[i] = first + (int32_t)i;
}

static void test_prefix_sharing(void) {
  pkv_page_manager *manager = create(32, 4);
  int32_t src[256], dst[256], pages_a[256], pages_b[256];
  int32_t prompt[64];
  fill_tokens(prompt, 64, 100);

  /* A computes a 10-token prompt: pages 0 and 1 become full and are registered. */
  add_sequence(manager, 1, prompt, 10, 0);
  reserve(manager, 1, 10, src, dst);
  EXPECT_OK(pkv_page_manager_commit(manager, 1, 10, prompt, MSG));
  CHECK(stats_of(manager).prefix_pages == 2, "two registered pages");
  pages_of(manager, 1, pages_a);

  /* Same prompt: 2 pages shared, 2 tokens left to compute. */
  add_sequence(manager, 2, prompt, 10, 8);
  CHECK(pages_of(manager, 2, pages_b) == 2 && pages_b[0] == pages_a[0] && pages_b[1] == pages_a[1],
        "shared the registered pages");
  CHECK(length_of(manager, 2) == 8, "length is the cached prefix");
  CHECK(stats_of(manager).shared_pages == 2, "two shared pages");
  /* A prompt of exactly 2 pages: only 1 page shared, so one token is computed. */
  add_sequence(manager, 3, prompt, 8, 4);
  /* A 9-token prompt: both pages. */
  add_sequence(manager, 4, prompt, 9, 8);
  /* Prompts differing in page 1 share page 0 only; in page 0 share nothing. */
  int32_t other[16];
  memcpy(other, prompt, sizeof other);
  other[6] = 7;
  add_sequence(manager, 5, other, 16, 4);
  other[0] = 7;
  add_sequence(manager, 6, other, 16, 0);
  add_sequence(manager, 8, prompt, 0, 0);
  add_sequence(manager, 9, prompt, 3, 0);
  check_invariants(manager);

  /* Sequence 2 computes its remaining prompt and 6 more tokens: pages 2 and 3 register. */
  CHECK(reserve(manager, 2, 8, src, dst) == 0, "full shared pages are never copied");
  EXPECT_OK(pkv_page_manager_commit(manager, 2, 8, prompt + 8, MSG));
  CHECK(stats_of(manager).prefix_pages == 4, "4 registered pages, got %lld", (long long)stats_of(manager).prefix_pages);
  add_sequence(manager, 20, prompt, 17, 16);

  /* Pages computed twice (sequence 1's pages 2 and 3 hold the same prefix as sequence 2's):
   * sequence 1 switches to the registered pages and frees its own; its page 4 registers. */
  const int64_t free_before = stats_of(manager).free_pages;
  reserve(manager, 1, 10, src, dst);
  CHECK(stats_of(manager).free_pages == free_before - 2, "two new pages");
  pages_of(manager, 1, pages_a);
  const int32_t own_page_3 = pages_a[3];
  EXPECT_OK(pkv_page_manager_commit(manager, 1, 10, prompt + 10, MSG));
  CHECK(stats_of(manager).free_pages == free_before, "own copies of pages 2 and 3 freed");
  CHECK(stats_of(manager).prefix_pages == 5, "sequence 1 adds only its page 4, got %lld",
        (long long)stats_of(manager).prefix_pages);
  CHECK(pages_of(manager, 1, pages_a) == 5 && pages_of(manager, 2, pages_b) == 4, "page counts");
  CHECK(pages_a[2] == pages_b[2] && pages_a[3] == pages_b[3] && pages_a[3] != own_page_3, "switched to registered");
  add_sequence(manager, 21, prompt, 21, 20);
  check_invariants(manager);

  /* The prefix stays cached while any holder lives, whoever registered it. */
  EXPECT_OK(pkv_page_manager_release(manager, 2, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, 20, MSG));
  EXPECT_OK(pkv_page_manager_release(manager, 21, MSG));
  add_sequence(manager, 22, prompt, 21, 20);
  check_invariants(manager);

  /* Releasing every holder removes pages from the table. */
  const int64_t all[] = {1, 3, 4, 5, 6, 8, 9, 22};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i) {
    EXPECT_OK(pkv_page_manager_release(manager, all[i], MSG));
    check_invariants(manager);
  }
  pkv_page_manager_stats stats = stats_of(manager);
  CHECK(stats.free_pages == 32 && stats.prefix_pages == 0, "table empty when pages are free");
  add_sequence(manager, 30, prompt, 10, 0);

  /* A commit without tokens ends registration for that sequence only. */
  reserve(manager, 30, 6, src, dst);
  EXPECT_OK(pkv_page_manager_commit(manager, 30, 2, NULL, MSG));
  EXPECT_OK(pkv_page_manager_commit(manager, 30, 4, prompt + 2, MSG));
  CHECK(stats_of(manager).prefix_pages == 0, "no registration after a gap");
  add_sequence(manager, 31, prompt, 10, 0);
  reserve(manager, 31, 10, src, dst);
  EXPECT_OK(pkv_page_manager_commit(manager, 31, 3, prompt, MSG));
  EXPECT_OK(pkv_page_manager_commit(manager, 31, 1, prompt + 3, MSG)); /* completes page 0 */
  CHECK(stats_of(manager).prefix_pages == 1, "chunked commits register pages");
  /* A fork continues the chain: its own page 1 registers. */
  EXPECT_OK(pkv_page_manager_fork(manager, 31, 32, MSG));
  reserve(manager, 32, 4, src, dst);
  EXPECT_OK(pkv_page_manager_commit(manager, 32, 4, prompt + 4, MSG));
  CHECK(stats_of(manager).prefix_pages == 2, "fork registered page 1");
  add_sequence(manager, 33, prompt, 9, 8);
  check_invariants(manager);

  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_add_sequence(manager, 40, NULL, 3, &(int64_t){0}, MSG));
  EXPECT_MESSAGE_HAS("prompt_tokens");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_add_sequence(manager, 40, prompt, -1, &(int64_t){0}, MSG));
  pkv_page_manager_destroy(manager); /* with live sequences: ASan checks for leaks */
}

static void test_export(void) {
  pkv_page_manager *manager = create(64, 2);
  int32_t src[256], dst[256];
  add_sequence(manager, 1, NULL, 0, 0);
  add_sequence(manager, 2, NULL, 0, 0);
  add_sequence(manager, 3, NULL, 0, 0);
  reserve(manager, 1, 3, src, dst); /* 2 pages */
  EXPECT_OK(pkv_page_manager_commit(manager, 1, 3, NULL, MSG));
  reserve(manager, 2, 34, src, dst); /* 17 pages */
  EXPECT_OK(pkv_page_manager_commit(manager, 2, 30, NULL, MSG));

  int64_t width = -1;
  const int64_t ids[] = {2, 1, 3, 1};
  EXPECT_OK(pkv_page_manager_export_width(manager, ids, 4, &width, MSG));
  CHECK(width == 32, "17 pages pad to 32, got %lld", (long long)width);
  EXPECT_OK(pkv_page_manager_export_width(manager, ids + 1, 2, &width, MSG));
  CHECK(width == 16, "2 pages pad to 16, got %lld", (long long)width);
  EXPECT_OK(pkv_page_manager_export_width(manager, ids + 2, 1, &width, MSG));
  CHECK(width == 16, "no pages still gives 16, got %lld", (long long)width);
  EXPECT_OK(pkv_page_manager_export_width(manager, NULL, 0, &width, MSG));
  CHECK(width == 16, "empty batch gives 16");

  int32_t table[4 * 32];
  int32_t lengths[4];
  for (int i = 0; i < 4 * 32; ++i) table[i] = -7;
  EXPECT_OK(pkv_page_manager_export(manager, ids, 4, table, 32, lengths, MSG));
  int32_t pages[256];
  const int64_t expected_lengths[] = {30, 3, 0, 3};
  for (int b = 0; b < 4; ++b) {
    const int64_t count = pages_of(manager, ids[b], pages);
    CHECK(lengths[b] == expected_lengths[b], "cache_lengths[%d] = %d", b, lengths[b]);
    for (int j = 0; j < 32; ++j) {
      const int32_t expected = j < count ? pages[j] : PKV_PM_PADDING_PAGE;
      CHECK(table[b * 32 + j] == expected, "lookup_table[%d, %d] = %d, expected %d", b, j, table[b * 32 + j], expected);
    }
  }
  /* Errors write nothing. */
  for (int i = 0; i < 4 * 32; ++i) table[i] = -7;
  const int64_t unknown[] = {1, 77};
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_export(manager, unknown, 2, table, 32, lengths, MSG));
  EXPECT_MESSAGE_HAS("seq_ids[1]");
  EXPECT_MESSAGE_HAS("77");
  EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_export_width(manager, unknown, 2, &width, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_page_manager_export(manager, ids, 4, table, 16, lengths, MSG));
  EXPECT_MESSAGE_HAS("width");
  for (int i = 0; i < 4 * 32; ++i) CHECK(table[i] == -7, "failed export wrote entry %d", i);
  pkv_page_manager_destroy(manager);
}

static void test_copy_pages_check(void) {
  const int32_t src[] = {0, 1, 2};
  const int32_t dst[] = {3, 4, 5};
  const int32_t dst_dup[] = {3, 4, 3};
  const int32_t dst_overlap[] = {3, 4, 0};
  const int32_t out_of_range[] = {3, 8, 5};
  EXPECT_OK(pkv_copy_pages_check_values(8, src, dst, 3, MSG));
  EXPECT_OK(pkv_copy_pages_check_values(8, NULL, NULL, 0, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, src, dst_dup, 3, MSG));
  EXPECT_MESSAGE_HAS("dst_pages must be distinct");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, src, dst_overlap, 3, MSG));
  EXPECT_MESSAGE_HAS("overlap");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, src, out_of_range, 3, MSG));
  EXPECT_MESSAGE_HAS("dst_pages[1] = 8");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, out_of_range, dst, 3, MSG));
  EXPECT_MESSAGE_HAS("src_pages[1]");
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, src, src, 1, MSG));
  EXPECT_STATUS(PKV_ERR_ARGUMENT, pkv_copy_pages_check_values(8, src, dst, -1, MSG));
}

/* ------------------------------------------------------------------------------------------ */
/* Allocation failures: every allocation point of every call fails once; nothing may change    */
/* ------------------------------------------------------------------------------------------ */

extern long pkv_pm_fail_allocation_after; /* PKV_PM_ALLOC_FAILURE_INJECTION hook */

typedef enum { OP_ADD, OP_RESERVE, OP_COMMIT, OP_FORK, OP_RELEASE, OP_EXPORT, OP_COPY_CHECK } op_kind;

static pkv_status run_op(pkv_page_manager *manager, op_kind kind, int64_t seq_id, int64_t n, const int32_t *tokens) {
  int32_t src[256], dst[256], table[16 * 8], lengths[8];
  int64_t out = 0;
  const int64_t ids[] = {seq_id};
  switch (kind) {
  case OP_ADD: return pkv_page_manager_add_sequence(manager, seq_id, tokens, n, &out, MSG);
  case OP_RESERVE: return pkv_page_manager_reserve(manager, seq_id, n, src, dst, 256, &out, MSG);
  case OP_COMMIT: return pkv_page_manager_commit(manager, seq_id, n, tokens, MSG);
  case OP_FORK: return pkv_page_manager_fork(manager, seq_id, n, MSG);
  case OP_RELEASE: return pkv_page_manager_release(manager, seq_id, MSG);
  case OP_EXPORT: return pkv_page_manager_export(manager, ids, 1, table, 16, lengths, MSG);
  case OP_COPY_CHECK: return pkv_copy_pages_check_values(8, tokens, tokens + 4, 4, MSG);
  }
  return PKV_ERR_ARGUMENT;
}

/* Runs an operation with its 1st, 2nd, ... allocation failing until it succeeds; each failure
 * must be OUT_OF_MEMORY and leave everything observable unchanged. Returns the failures seen. */
static int64_t run_op_with_failures(pkv_page_manager *manager, const int64_t *ids, int64_t count, op_kind kind,
                                    int64_t seq_id, int64_t n, const int32_t *tokens) {
  snapshot *before = malloc(sizeof *before);
  CHECK(before != NULL, "malloc");
  int64_t failures = 0;
  for (long fail_at = 1;; ++fail_at) {
    snapshot_take(manager, ids, count, before);
    pkv_pm_fail_allocation_after = fail_at;
    const pkv_status status = run_op(manager, kind, seq_id, n, tokens);
    const bool injected = pkv_pm_fail_allocation_after == 0;
    pkv_pm_fail_allocation_after = 0;
    if (status == PKV_OK) {
      CHECK(!injected, "op %d succeeded although allocation %ld failed", (int)kind, fail_at);
      break;
    }
    CHECK(status == PKV_ERR_OUT_OF_MEMORY && injected, "op %d: %s after failing allocation %ld", (int)kind,
          pkv_status_name(status), fail_at);
    snapshot_expect_unchanged(manager, before);
    failures += 1;
  }
  free(before);
  check_invariants(manager);
  return failures;
}

static void test_allocation_failures_change_nothing(void) {
  pkv_page_manager *manager = NULL;
  pkv_pm_fail_allocation_after = 2;
  EXPECT_STATUS(PKV_ERR_OUT_OF_MEMORY, pkv_page_manager_create(8, 2, &manager, MSG));
  CHECK(manager == NULL, "failed create returns NULL");
  pkv_pm_fail_allocation_after = 0;

  manager = create(32, 2);
  int32_t prompt[16];
  fill_tokens(prompt, 16, 40);
  int64_t failures = 0;
  /* Sequence 1 computes a prompt with token ids (prefix table, pending buffer, map growth). */
  int64_t ids[MAX_SNAPSHOT_SEQUENCES] = {1};
  int64_t count = 1;
  failures += run_op_with_failures(manager, ids, 0, OP_ADD, 1, 9, prompt);
  failures += run_op_with_failures(manager, ids, count, OP_RESERVE, 1, 9, NULL);
  failures += run_op_with_failures(manager, ids, count, OP_COMMIT, 1, 9, prompt);
  /* Sequences 2.. share its prefix, fork, grow, commit (with duplicates switching pages). */
  for (int64_t seq = 2; seq < 24; ++seq) {
    failures += run_op_with_failures(manager, ids, count, OP_ADD, seq, 9, prompt);
    ids[count++] = seq;
    /* Completes page 4 (registered by sequence 2, switched to by later ones), page 5 partial. */
    failures += run_op_with_failures(manager, ids, count, OP_RESERVE, seq, 3, NULL);
    failures += run_op_with_failures(manager, ids, count, OP_COMMIT, seq, 3, prompt + 8);
    if (seq % 3 == 0) {
      failures += run_op_with_failures(manager, ids, count, OP_FORK, seq, 100 + seq, NULL);
      ids[count++] = 100 + seq;
      failures += run_op_with_failures(manager, ids, count, OP_RESERVE, 100 + seq, 1, NULL); /* copies page 5 */
    }
    if (seq % 4 == 0) {
      failures += run_op_with_failures(manager, ids, count, OP_RELEASE, ids[0], 0, NULL);
      ids[0] = ids[--count];
    }
    failures += run_op_with_failures(manager, ids, count, OP_EXPORT, seq, 0, NULL);
    if (stats_of(manager).free_pages < 4) break;
  }
  const int32_t copies[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  failures += run_op_with_failures(manager, ids, count, OP_COPY_CHECK, 0, 0, copies);
  EXPECT_STATUS(PKV_OK, pkv_page_manager_check_invariants(manager, MSG));
  pkv_pm_fail_allocation_after = 1;
  EXPECT_STATUS(PKV_ERR_OUT_OF_MEMORY, pkv_page_manager_check_invariants(manager, MSG));
  pkv_pm_fail_allocation_after = 0;
  const pkv_page_manager_stats stats = stats_of(manager);
  CHECK(stats.prefix_pages == 5 && stats.shared_pages >= 5, "prefix pages %lld, shared %lld",
        (long long)stats.prefix_pages, (long long)stats.shared_pages);
  printf("  %lld injected allocation failures, none changed the manager\n", (long long)failures);
  CHECK(failures > 20, "allocation points exercised: %lld", (long long)failures);
  pkv_page_manager_destroy(manager);
}

/* ------------------------------------------------------------------------------------------ */
/* Concurrent misuse: calls either complete or return BUSY; state never corrupts              */
/* ------------------------------------------------------------------------------------------ */

typedef struct worker {
  pkv_page_manager *manager;
  int64_t seq_id;
  int64_t committed; /* tokens whose commit returned OK */
  int64_t busy;      /* calls that returned BUSY */
  int64_t other;     /* unexpected statuses */
  atomic_int *stop;  /* set by the mutating worker when it is done */
} worker;

/* Reserve + commit one token at a time; retries a commit refused as busy. */
static void *mutating_worker_run(void *argument) {
  worker *w = argument;
  pkv_error error; /* per thread: the workers run concurrently */
  int32_t src[64], dst[64];
  const struct timespec start = now();
  /* Until some calls collided and some went through (or time is up, reported below). */
  while ((w->busy < 20 || w->committed < 20) && seconds_since(&start) < 5.0) {
    int64_t copies;
    pkv_status status =
        pkv_page_manager_reserve(w->manager, w->seq_id, 1, src, dst, 64, &copies, &error);
    if (status == PKV_ERR_BUSY) {
      w->busy += 1;
      continue;
    }
    if (status != PKV_OK) {
      w->other += 1;
      break;
    }
    while ((status = pkv_page_manager_commit(w->manager, w->seq_id, 1, NULL, &error)) == PKV_ERR_BUSY) {
      w->busy += 1;
    }
    if (status != PKV_OK) {
      w->other += 1;
      break;
    }
    w->committed += 1;
  }
  atomic_store(w->stop, 1);
  return NULL;
}

/* Long read-only calls (check_invariants over a large pool) keep the flag taken most of the time. */
static void *checking_worker_run(void *argument) {
  worker *w = argument;
  pkv_error error; /* per thread: the workers run concurrently */
  while (!atomic_load(w->stop)) {
    const pkv_status status = pkv_page_manager_check_invariants(w->manager, &error);
    if (status == PKV_ERR_BUSY)
      w->busy += 1;
    else if (status != PKV_OK)
      w->other += 1;
    nanosleep(&(struct timespec){0, 200000}, NULL); /* leave gaps for the other thread */
  }
  return NULL;
}

static void test_concurrent_misuse_detected(void) {
  pkv_page_manager *manager = create(1 << 20, 1);
  atomic_int stop = 0;
  worker mutating = {manager, 1, 0, 0, 0, &stop};
  worker checking = {manager, 0, 0, 0, 0, &stop};
  add_sequence(manager, 1, NULL, 0, 0);
  pthread_t threads[2];
  CHECK(pthread_create(&threads[0], NULL, checking_worker_run, &checking) == 0, "pthread_create");
  CHECK(pthread_create(&threads[1], NULL, mutating_worker_run, &mutating) == 0, "pthread_create");
  for (int i = 0; i < 2; ++i) pthread_join(threads[i], NULL);
  CHECK(mutating.other == 0 && checking.other == 0, "unexpected statuses: %lld, %lld", (long long)mutating.other,
        (long long)checking.other);
  CHECK(length_of(manager, 1) == mutating.committed, "length %lld, committed %lld", (long long)length_of(manager, 1),
        (long long)mutating.committed);
  check_invariants(manager);
  printf("  concurrent misuse: %lld + %lld calls refused as busy, %lld tokens committed\n", (long long)mutating.busy,
         (long long)checking.busy, (long long)mutating.committed);
  CHECK(mutating.busy > 0, "no concurrent call was refused in 5 s");
  CHECK(mutating.committed > 0, "no call went through in 5 s");
  pkv_page_manager_destroy(manager);
}

/* ------------------------------------------------------------------------------------------ */
/* Random operation sequences against a model of the cache contents                          */
/* ------------------------------------------------------------------------------------------ */

/* The test plays the cache: content[page * P + slot] is the token stored there. Reserve's
 * copy-on-write pairs are applied to it, commits write their tokens. After every step each
 * sequence must read back exactly its token history through its page list, which checks page
 * ownership, copy-on-write and prefix sharing together. */

#define MAX_TRACKED 48
#define MAX_HISTORY 96

typedef struct tracked {
  int64_t id;
  int64_t length;
  int32_t history[MAX_HISTORY];
} tracked;

typedef struct random_state {
  uint64_t s;
} random_state;

static uint64_t random_next(random_state *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static int64_t random_below(random_state *r, int64_t n) { return (int64_t)(random_next(r) % (uint64_t)n); }

typedef struct world {
  pkv_page_manager *manager;
  int64_t num_pages, page_size;
  int32_t *content;
  tracked sequences[MAX_TRACKED];
  int64_t count;
  int64_t next_id;
  int64_t cached_tokens; /* tokens served from the prefix table */
  int64_t copies;        /* copy-on-write pairs */
  int64_t out_of_pages;  /* refused reserves */
  int64_t deduplicated;  /* pages freed by commits that switched to a registered page */
} world;

static void world_verify(world *w) {
  check_invariants(w->manager);
  int32_t pages[256];
  int64_t held = 0;
  for (int64_t i = 0; i < w->count; ++i) {
    const tracked *t = &w->sequences[i];
    const int64_t count = pages_of(w->manager, t->id, pages);
    held += count;
    CHECK(length_of(w->manager, t->id) == t->length, "length of %lld", (long long)t->id);
    for (int64_t pos = 0; pos < t->length; ++pos) {
      const int32_t page = pages[pos / w->page_size];
      const int32_t stored = w->content[page * w->page_size + pos % w->page_size];
      CHECK(stored == t->history[pos],
            "sequence %lld token %lld reads %d from page %d, "
            "expected %d",
            (long long)t->id, (long long)pos, stored, page, t->history[pos]);
    }
  }
  const pkv_page_manager_stats stats = stats_of(w->manager);
  CHECK(stats.num_sequences == w->count, "sequence count");
  CHECK(stats.used_pages <= held, "used pages %lld > held slots %lld", (long long)stats.used_pages, (long long)held);
}

static void world_snapshot(world *w, snapshot *out) {
  int64_t ids[MAX_TRACKED];
  for (int64_t i = 0; i < w->count; ++i) ids[i] = w->sequences[i].id;
  snapshot_take(w->manager, ids, w->count, out);
}

/* Reserves n tokens for t, applying copies to the content. false if out of pages (checked to
 * change nothing). */
static bool world_reserve(world *w, tracked *t, int64_t n, snapshot *scratch) {
  int32_t src[256], dst[256], before_pages[256], after_pages[256];
  int64_t needed = -1, copies_needed = -1;
  EXPECT_OK(pkv_page_manager_pages_needed(w->manager, t->id, n, &needed, &copies_needed, MSG));
  const pkv_page_manager_stats before = stats_of(w->manager);
  const int64_t count_before = pages_of(w->manager, t->id, before_pages);
  if (needed > before.free_pages) {
    world_snapshot(w, scratch);
    int64_t copies = -1;
    EXPECT_STATUS(PKV_ERR_OUT_OF_PAGES, pkv_page_manager_reserve(w->manager, t->id, n, src, dst, 256, &copies, MSG));
    snapshot_expect_unchanged(w->manager, scratch);
    w->out_of_pages += 1;
    return false;
  }
  const int64_t copies = reserve(w->manager, t->id, n, src, dst);
  CHECK(copies == copies_needed, "copies %lld, predicted %lld", (long long)copies, (long long)copies_needed);
  const int64_t count_after = pages_of(w->manager, t->id, after_pages);
  const int64_t wanted = (t->length + n + w->page_size - 1) / w->page_size;
  CHECK(count_after == (wanted > count_before ? wanted : count_before),
        "pages only when needed: %lld -> %lld for %lld tokens", (long long)count_before, (long long)count_after,
        (long long)(t->length + n));
  CHECK(stats_of(w->manager).free_pages == before.free_pages - needed, "free pages accounting");
  for (int64_t i = 0; i < copies; ++i) {
    memcpy(w->content + dst[i] * w->page_size, w->content + src[i] * w->page_size,
           (size_t)w->page_size * sizeof(int32_t));
  }
  w->copies += copies;
  return true;
}

/* Commits tokens (already in t->history past t->length) and writes them to the content. */
/* Writes the tokens (already in t->history past t->length) like a kernel would, then commits. */
static void world_commit(world *w, tracked *t, int64_t n, bool with_tokens) {
  int32_t pages[256];
  pages_of(w->manager, t->id, pages);
  for (int64_t pos = t->length; pos < t->length + n; ++pos) {
    w->content[pages[pos / w->page_size] * w->page_size + pos % w->page_size] = t->history[pos];
  }
  const int64_t free_before = stats_of(w->manager).free_pages;
  EXPECT_OK(pkv_page_manager_commit(w->manager, t->id, n, with_tokens ? t->history + t->length : NULL, MSG));
  w->deduplicated += stats_of(w->manager).free_pages - free_before;
  t->length += n;
}

static void world_remove(world *w, int64_t index) {
  EXPECT_OK(pkv_page_manager_release(w->manager, w->sequences[index].id, MSG));
  w->sequences[index] = w->sequences[w->count - 1];
  w->count -= 1;
}

/* Prompts come from a few shared stems over a tiny alphabet, so prefixes repeat often. */
static int64_t make_prompt(random_state *r, int32_t *prompt, int64_t max_length) {
  static const int32_t stems[3][24] = {
      {1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3},
      {1, 2, 3, 1, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0, 1, 0, 1},
      {3, 3, 2, 2, 1, 1, 0, 0, 3, 3, 2, 2, 1, 1, 0, 0, 3, 3, 2, 2, 1, 1, 0, 0},
  };
  const int64_t length = random_below(r, max_length + 1);
  const int32_t *stem = stems[random_below(r, 3)];
  const int64_t from_stem = random_below(r, 25);
  for (int64_t i = 0; i < length; ++i) {
    prompt[i] = i < from_stem && i < 24 ? stem[i] : (int32_t)random_below(r, 4);
  }
  return length;
}

static void random_run(uint64_t seed, int64_t num_pages, int64_t page_size, int steps) {
  random_state r = {seed};
  world *w = calloc(1, sizeof *w);
  snapshot *scratch = malloc(sizeof *scratch);
  CHECK(w != NULL && scratch != NULL, "malloc");
  w->manager = create(num_pages, page_size);
  w->num_pages = num_pages;
  w->page_size = page_size;
  w->content = calloc((size_t)(num_pages * page_size), sizeof(int32_t));
  w->next_id = 1000;
  const int64_t max_length = MAX_HISTORY < 256 ? MAX_HISTORY : 256;

  for (int step = 0; step < steps; ++step) {
    int64_t op = random_below(&r, 100);
    /* Under pressure, release more often so that runs alternate between full and roomy. */
    if (stats_of(w->manager).free_pages * 4 < num_pages && random_below(&r, 3) == 0) op = 80;
    if ((op < 25 || w->count == 0) && w->count < MAX_TRACKED) {
      /* add a sequence with a prompt, then compute the uncached rest of the prompt */
      tracked *t = &w->sequences[w->count];
      memset(t, 0, sizeof *t);
      t->id = w->next_id++;
      const int64_t prompt_length = make_prompt(&r, t->history, 40);
      int64_t cached = -1;
      EXPECT_OK(pkv_page_manager_add_sequence(w->manager, t->id, t->history, prompt_length, &cached, MSG));
      CHECK(cached % page_size == 0 && (prompt_length == 0 || cached < prompt_length), "cached %lld of %lld",
            (long long)cached, (long long)prompt_length);
      t->length = cached; /* shared pages must already hold history[0, cached) */
      w->count += 1;
      w->cached_tokens += cached;
      world_verify(w);
      if (!world_reserve(w, t, prompt_length - cached, scratch)) {
        world_remove(w, w->count - 1);
      } else {
        world_commit(w, t, prompt_length - cached, true);
      }
    } else if (op < 65) {
      /* decode or extend: reserve n (sometimes more than committed), commit */
      tracked *t = &w->sequences[random_below(&r, w->count)];
      const int64_t room = max_length - t->length;
      if (room <= 0) {
        world_remove(w, t - w->sequences);
      } else {
        const int64_t n = 1 + random_below(&r, room < 2 * page_size ? room : 2 * page_size);
        const int64_t extra = random_below(&r, 3) == 0 ? random_below(&r, page_size + 1) : 0;
        const int64_t reserve_n = n + extra <= room ? n + extra : n;
        if (world_reserve(w, t, reserve_n, scratch)) {
          for (int64_t i = 0; i < n; ++i) {
            t->history[t->length + i] = (int32_t)random_below(&r, 4);
          }
          world_commit(w, t, n, random_below(&r, 10) != 0);
        }
      }
    } else if (op < 78 && w->count < MAX_TRACKED) {
      /* fork */
      tracked *source = &w->sequences[random_below(&r, w->count)];
      tracked *copy = &w->sequences[w->count];
      *copy = *source;
      copy->id = w->next_id++;
      EXPECT_OK(pkv_page_manager_fork(w->manager, source->id, copy->id, MSG));
      w->count += 1;
    } else if (op < 93) {
      world_remove(w, random_below(&r, w->count));
    } else {
      /* misuse that must change nothing */
      tracked *t = &w->sequences[random_below(&r, w->count)];
      world_snapshot(w, scratch);
      int32_t pages[256];
      const int64_t capacity = pages_of(w->manager, t->id, pages) * page_size;
      EXPECT_STATUS(PKV_ERR_ARGUMENT,
                    pkv_page_manager_commit(w->manager, t->id, capacity - t->length + 1, NULL, MSG));
      EXPECT_STATUS(PKV_ERR_SEQUENCE_EXISTS, pkv_page_manager_fork(w->manager, t->id, t->id, MSG));
      EXPECT_STATUS(PKV_ERR_NO_SUCH_SEQUENCE, pkv_page_manager_release(w->manager, w->next_id + 5, MSG));
      snapshot_expect_unchanged(w->manager, scratch);
    }
    world_verify(w);
  }
  while (w->count > 0) {
    world_remove(w, w->count - 1);
    check_invariants(w->manager);
  }
  const pkv_page_manager_stats stats = stats_of(w->manager);
  CHECK(stats.free_pages == num_pages && stats.used_pages == 0 && stats.shared_pages == 0 && stats.prefix_pages == 0 &&
            stats.num_sequences == 0,
        "pages leaked: %lld free of %lld", (long long)stats.free_pages, (long long)num_pages);
  printf(
      "  random N=%lld P=%lld seed=%llu: %d steps, %lld cached prompt tokens, %lld copies, "
      "%lld deduplicated pages, %lld out-of-pages\n",
      (long long)num_pages, (long long)page_size, (unsigned long long)seed, steps, (long long)w->cached_tokens,
      (long long)w->copies, (long long)w->deduplicated, (long long)w->out_of_pages);
  /* With one-token pages every committed page is full, so nothing is ever copied. */
  CHECK(w->out_of_pages > 0, "the run must exercise exhaustion");
  CHECK(page_size == 1 || w->copies > 0, "the run must exercise copy-on-write");
  CHECK(page_size > 8 || w->cached_tokens > 0, "the run must exercise prefix sharing");
  pkv_page_manager_destroy(w->manager);
  free(w->content);
  free(scratch);
  free(w);
}

static void test_random_operations(void) {
  static const int64_t configs[][2] = {{12, 1}, {24, 2}, {40, 3}, {48, 4}, {20, 8}, {9, 16}};
  for (size_t i = 0; i < sizeof configs / sizeof configs[0]; ++i) {
    random_run(0x5eed0000u + i, configs[i][0], configs[i][1], 20000);
  }
}

/* ------------------------------------------------------------------------------------------ */

int main(void) {
  struct {
    const char *name;
    void (*run)(void);
  } tests[] = {
      {"create_arguments", test_create_arguments},
      {"reserve_commit", test_reserve_commit},
      {"out_of_pages_changes_nothing", test_out_of_pages_changes_nothing},
      {"fork_copy_on_write", test_fork_copy_on_write},
      {"prefix_sharing", test_prefix_sharing},
      {"export", test_export},
      {"copy_pages_check", test_copy_pages_check},
      {"allocation_failures_change_nothing", test_allocation_failures_change_nothing},
      {"concurrent_misuse_detected", test_concurrent_misuse_detected},
      {"random_operations", test_random_operations},
  };
  const size_t count = sizeof tests / sizeof tests[0];
  for (size_t i = 0; i < count; ++i) {
    printf("test %s\n", tests[i].name);
    fflush(stdout);
    tests[i].run();
  }
  printf("%zu tests passed (%d checks)\n", count, g_checks);
  return 0;
}
