/* Unit tests of csrc/core/pkv_page_manager (run by tests/c/run.sh under ASan + UBSan): arguments,
 * reserve/commit, out of pages, fork and copy-on-write, prefix sharing, export and the copy_pages check. */
#define _POSIX_C_SOURCE 200809L
#include "pm_harness.h"

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

int main(void) {
  static const pm_test tests[] = {
    {"create_arguments", test_create_arguments},
    {"reserve_commit", test_reserve_commit},
    {"out_of_pages_changes_nothing", test_out_of_pages_changes_nothing},
    {"fork_copy_on_write", test_fork_copy_on_write},
    {"prefix_sharing", test_prefix_sharing},
    {"export", test_export},
    {"copy_pages_check", test_copy_pages_check},
  };
  return pm_run_tests(tests, sizeof tests / sizeof tests[0]);
}
