/* Unit tests of csrc/core/pkv_page_manager (run by tests/c/run.sh under ASan + UBSan) under faults:
 * every allocation point of every call fails once and nothing changes; concurrent misuse from two
 * threads is refused as BUSY and never corrupts the state. */
#define _POSIX_C_SOURCE 200809L
#include "pm_harness.h"

#include <pthread.h>
#include <stdatomic.h>

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

int main(void) {
  static const pm_test tests[] = {
    {"allocation_failures_change_nothing", test_allocation_failures_change_nothing},
    {"concurrent_misuse_detected", test_concurrent_misuse_detected},
  };
  return pm_run_tests(tests, sizeof tests / sizeof tests[0]);
}
