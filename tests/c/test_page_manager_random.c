/* Unit tests of csrc/core/pkv_page_manager (run by tests/c/run.sh under ASan + UBSan): random
 * operation sequences checked against a model of the cache contents. */
#define _POSIX_C_SOURCE 200809L
#include "pm_harness.h"

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
  static const pm_test tests[] = {
    {"random_operations", test_random_operations},
  };
  return pm_run_tests(tests, sizeof tests / sizeof tests[0]);
}
