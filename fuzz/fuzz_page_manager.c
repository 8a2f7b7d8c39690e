/* libFuzzer target: the page manager (csrc/core/pkv_page_manager.h) against a model.
 *
 * The input bytes are a program of manager calls on a small pool (add_sequence with prompts from
 * a 3-token alphabet so prefixes repeat, reserve, write + commit, fork, release, export, pages,
 * pages_needed, copy_pages_check, and calls whose host allocations are made to fail). The harness
 * keeps what the pool's pages would contain: every committed token is written into the slot its
 * page list names, reserve's copy-on-write pairs are applied, so a sequence whose pages are
 * shared wrongly or switched to a page holding other tokens reads back a different history.
 *
 * After every call (any violation aborts):
 * - check_invariants passes and get_stats agrees with the model (sequence count, free + used);
 * - each live sequence's length equals the model's and its pages hold exactly its history;
 * - a failed call changed nothing observable (stats, every sequence's length and page list);
 * - export writes nothing on failure, and on success rows equal the page lists plus padding;
 * - pages_needed predicts the free pages the following reserve takes.
 *
 * Build: see fuzz/run.sh (needs -DPKV_PM_ALLOC_FAILURE_INJECTION for the allocation hook). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_ops.h"
#include "pkv_page_manager.h"

extern long pkv_pm_fail_allocation_after; /* PKV_PM_ALLOC_FAILURE_INJECTION hook */

#define MAX_PAGES 48
#define MAX_PAGE_SIZE 6
#define MAX_SEQS 6
#define MAX_TOKENS (MAX_PAGES * MAX_PAGE_SIZE)
#define MAX_OPS 64

typedef struct {
  const uint8_t *data;
  size_t size, pos;
} reader;

static uint8_t take(reader *r) { return r->pos < r->size ? r->data[r->pos++] : 0; }
static int64_t take_below(reader *r, int64_t n) { return n <= 1 ? 0 : (int64_t)(take(r) % (uint64_t)n); }

static void fail(const char *what, const char *detail) {
  fprintf(stderr, "fuzz_page_manager: property violated: %s (%s)\n", what, detail);
  abort();
}

#define REQUIRE(cond, what) \
  do {                      \
    if (!(cond)) fail(what, g_message); \
  } while (0)

static pkv_error g_error;
#define g_message g_error.message
#define MSG (&g_error)

/* ---- the model ---- */
typedef struct {
  int live;
  int64_t length;
  int64_t history[MAX_TOKENS]; /* token value at each committed position */
} model_seq;

typedef struct {
  pkv_page_manager *pm;
  int64_t N, P;
  int64_t content[MAX_PAGES][MAX_PAGE_SIZE]; /* what each slot of the pool holds */
  model_seq seq[MAX_SEQS];
  int64_t next_synthetic; /* token values for commits without token ids: never in the alphabet */
} world;

/* Observable state: stats and every sequence id's length and page list. */
typedef struct {
  pkv_page_manager_stats stats;
  pkv_status status[MAX_SEQS];
  int64_t length[MAX_SEQS], num_pages[MAX_SEQS];
  int32_t pages[MAX_SEQS][MAX_PAGES + 1];
} observation;

static void observe(world *w, observation *o) {
  memset(o, 0, sizeof *o);
  REQUIRE(pkv_page_manager_get_stats(w->pm, &o->stats, MSG) == PKV_OK, "get_stats succeeds");
  for (int s = 0; s < MAX_SEQS; s++) {
    o->status[s] = pkv_page_manager_length(w->pm, s, &o->length[s], MSG);
    if (o->status[s] != PKV_OK) continue;
    pkv_status st = pkv_page_manager_pages(w->pm, s, o->pages[s], MAX_PAGES + 1, &o->num_pages[s], MSG);
    REQUIRE(st == PKV_OK, "pages of a live sequence");
  }
}

static int same_observation(const observation *a, const observation *b) {
  if (memcmp(&a->stats, &b->stats, sizeof a->stats) != 0) return 0;
  for (int s = 0; s < MAX_SEQS; s++) {
    if (a->status[s] != b->status[s]) return 0;
    if (a->status[s] != PKV_OK) continue;
    if (a->length[s] != b->length[s] || a->num_pages[s] != b->num_pages[s]) return 0;
    if (memcmp(a->pages[s], b->pages[s], (size_t)a->num_pages[s] * sizeof(int32_t)) != 0) return 0;
  }
  return 1;
}

/* Everything the model knows must match the manager. */
static void verify(world *w) {
  REQUIRE(pkv_page_manager_check_invariants(w->pm, MSG) == PKV_OK, "check_invariants");
  observation o;
  observe(w, &o);
  int live = 0;
  for (int s = 0; s < MAX_SEQS; s++) {
    model_seq *m = &w->seq[s];
    live += m->live;
    if (!m->live) {
      REQUIRE(o.status[s] == PKV_ERR_NO_SUCH_SEQUENCE, "released or never added sequence is unknown");
      continue;
    }
    REQUIRE(o.status[s] == PKV_OK, "live sequence is known");
    REQUIRE(o.length[s] == m->length, "length matches the model");
    REQUIRE(o.num_pages[s] * w->P >= m->length, "capacity covers the length");
    for (int64_t pos = 0; pos < m->length; pos++) {
      int32_t page = o.pages[s][pos / w->P];
      REQUIRE(page >= 0 && page < w->N, "page ids in range");
      if (w->content[page][pos % w->P] != m->history[pos]) {
        snprintf(g_message, sizeof g_message, "seq %d pos %lld page %d holds %lld, history %lld", s, (long long)pos,
                 page, (long long)w->content[page][pos % w->P], (long long)m->history[pos]);
        fail("pages hold the sequence's history", g_message);
      }
    }
  }
  REQUIRE(o.stats.num_sequences == live, "sequence count");
  REQUIRE(o.stats.free_pages + o.stats.used_pages == w->N, "free + used == N");
}

/* A failed call must leave the observation unchanged. */
static void expect_unchanged(world *w, const observation *before, pkv_status st, const char *op) {
  if (st == PKV_OK) return;
  observation after;
  observe(w, &after);
  if (!same_observation(before, &after)) {
    snprintf(g_message, sizeof g_message, "%s failed with %s", op, pkv_status_name(st));
    fail("a failed call changes nothing", g_message);
  }
}

static int32_t alphabet_token(reader *r) { return 1 + (int32_t)take_below(r, 3); }

/* reserve(n), then apply the copy-on-write pairs to the pool contents. */
static pkv_status do_reserve(world *w, int s, int64_t n, int64_t copy_capacity) {
  int32_t src[MAX_PAGES + 1], dst[MAX_PAGES + 1];
  int64_t copies = -1;
  observation before;
  observe(w, &before);
  pkv_status st = pkv_page_manager_reserve(w->pm, s, n, src, dst, copy_capacity, &copies, MSG);
  expect_unchanged(w, &before, st, "reserve");
  if (st != PKV_OK) return st;
  REQUIRE(copies >= 0 && copies <= copy_capacity, "copy count within the given capacity");
  REQUIRE(pkv_copy_pages_check_values(w->N, src, dst, copies, MSG) == PKV_OK, "reserve's copies pass copy_pages_check");
  for (int64_t i = 0; i < copies; i++) memcpy(w->content[dst[i]], w->content[src[i]], sizeof w->content[0]);
  return st;
}

/* Write n tokens at the sequence's length (as paged_store would), then commit them. */
static pkv_status do_commit(world *w, int s, int64_t n, const int32_t *tokens) {
  int32_t pages[MAX_PAGES + 1];
  int64_t num_pages = 0, length = 0;
  if (pkv_page_manager_length(w->pm, s, &length, MSG) != PKV_OK) length = 0;
  if (pkv_page_manager_pages(w->pm, s, pages, MAX_PAGES + 1, &num_pages, MSG) != PKV_OK) num_pages = 0;
  /* writes go to a scratch pool: kept only if the manager accepts the commit */
  static int64_t scratch[MAX_PAGES][MAX_PAGE_SIZE];
  memcpy(scratch, w->content, sizeof scratch);
  int64_t values[MAX_TOKENS];
  for (int64_t i = 0; i < n && i < MAX_TOKENS; i++) {
    values[i] = tokens ? tokens[i] : w->next_synthetic + i;
    int64_t pos = length + i;
    if (pos / w->P < num_pages) scratch[pages[pos / w->P]][pos % w->P] = values[i];
  }
  observation before;
  observe(w, &before);
  pkv_status st = pkv_page_manager_commit(w->pm, s, n, tokens, MSG);
  expect_unchanged(w, &before, st, "commit");
  if (st != PKV_OK) return st;
  REQUIRE(n >= 0 && length + n <= num_pages * w->P, "commit within capacity");
  memcpy(w->content, scratch, sizeof scratch);
  if (!tokens) w->next_synthetic += n;
  model_seq *m = &w->seq[s];
  for (int64_t i = 0; i < n; i++) m->history[m->length + i] = values[i];
  m->length += n;
  return st;
}

static void op_add(world *w, reader *r) {
  int s = (int)take_below(r, MAX_SEQS);
  int64_t len = take_below(r, 4 * w->P + 1);
  int32_t prompt[MAX_TOKENS];
  for (int64_t i = 0; i < len; i++) prompt[i] = alphabet_token(r);
  int64_t cached = -1;
  observation before;
  observe(w, &before);
  pkv_status st = pkv_page_manager_add_sequence(w->pm, s, len ? prompt : NULL, len, &cached, MSG);
  expect_unchanged(w, &before, st, "add_sequence");
  if (st != PKV_OK) {
    REQUIRE(w->seq[s].live || st != PKV_ERR_SEQUENCE_EXISTS, "SEQUENCE_EXISTS only for a live id");
    return;
  }
  REQUIRE(!w->seq[s].live, "add_sequence of a live id must fail");
  REQUIRE(cached >= 0 && cached % w->P == 0 && (len == 0 ? cached == 0 : cached < len), "cached prefix bounds");
  model_seq *m = &w->seq[s];
  m->live = 1;
  m->length = cached;
  for (int64_t i = 0; i < cached; i++) m->history[i] = prompt[i];
  verify(w); /* shared prefix pages must hold the prompt's tokens */
  if (len > cached && do_reserve(w, s, len - cached, MAX_PAGES + 1) == PKV_OK)
    do_commit(w, s, len - cached, prompt + cached);
}

static void op_reserve(world *w, reader *r) {
  int s = (int)take_below(r, MAX_SEQS);
  /* INT64_MAX would hit a reported bug (reserve's error message computes length + n in int64,
   * pkv_page_manager.c pm_plan_reserve); build with -DPKV_FUZZ_KNOWN_BUGS to include it. */
#ifdef PKV_FUZZ_KNOWN_BUGS
  static const int64_t specials[] = {-1, INT64_MAX, INT64_MIN, (int64_t)1 << 40};
#else
  static const int64_t specials[] = {-1, INT64_MAX / 2, INT64_MIN, (int64_t)1 << 40};
#endif
  uint8_t b = take(r);
  int64_t n = b < 250 ? (int64_t)(b % (uint64_t)(3 * w->P + 1)) : specials[b % 4];
  uint8_t c = take(r);
  int64_t capacity = c < 200 ? MAX_PAGES + 1 : (int64_t)(c % 3);
  do_reserve(w, s, n, capacity);
}

static void op_commit(world *w, reader *r) {
  int s = (int)take_below(r, MAX_SEQS);
  int64_t n = take_below(r, 2 * w->P + 2) - (take(r) == 255 ? 3 : 0);
  int32_t tokens[MAX_TOKENS];
  int with_tokens = take(r) % 4 != 0;
  for (int64_t i = 0; i < n && i < MAX_TOKENS; i++) tokens[i] = alphabet_token(r);
  if (take(r) % 2) do_reserve(w, s, n > 0 ? n : 0, MAX_PAGES + 1); /* usually reserve first */
  do_commit(w, s, n, with_tokens ? tokens : NULL);
}

static void op_fork(world *w, reader *r) {
  int src = (int)take_below(r, MAX_SEQS), dst = (int)take_below(r, MAX_SEQS);
  observation before;
  observe(w, &before);
  pkv_status st = pkv_page_manager_fork(w->pm, src, dst, MSG);
  expect_unchanged(w, &before, st, "fork");
  if (st != PKV_OK) return;
  REQUIRE(w->seq[src].live && !w->seq[dst].live, "fork needs a live source and a free target");
  w->seq[dst] = w->seq[src];
}

static void op_release(world *w, reader *r) {
  int s = (int)take_below(r, MAX_SEQS);
  observation before;
  observe(w, &before);
  pkv_status st = pkv_page_manager_release(w->pm, s, MSG);
  expect_unchanged(w, &before, st, "release");
  REQUIRE((st == PKV_OK) == (w->seq[s].live != 0), "release succeeds exactly for live ids");
  w->seq[s].live = 0;
}

static void op_export(world *w, reader *r) {
  int64_t ids[8];
  int64_t count = take_below(r, 6);
  for (int64_t i = 0; i < count; i++) ids[i] = take_below(r, MAX_SEQS + 1) - (take(r) == 255 ? 9 : 0);
  int64_t width = -1;
  pkv_status wst = pkv_page_manager_export_width(w->pm, ids, count, &width, MSG);
  int64_t given = wst == PKV_OK && take(r) % 4 ? width : take_below(r, MAX_PAGES + 2);
  enum { SENTINEL = 0x5a5a5a5a };
  static int32_t table[8 * (MAX_PAGES + 64)], lengths[8];
  if (given > MAX_PAGES + 48) given = MAX_PAGES + 48;
  for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) table[i] = SENTINEL;
  for (int i = 0; i < 8; i++) lengths[i] = SENTINEL;
  pkv_status st = pkv_page_manager_export(w->pm, ids, count, table, given, lengths, MSG);
  if (st != PKV_OK) {
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) REQUIRE(table[i] == SENTINEL, "export writes nothing on error");
    for (int i = 0; i < 8; i++) REQUIRE(lengths[i] == SENTINEL, "export writes no length on error");
    return;
  }
  REQUIRE(wst == PKV_OK && width % PKV_PM_EXPORT_WIDTH_MULTIPLE == 0 && width >= PKV_PM_EXPORT_WIDTH_MULTIPLE,
          "export width is a positive multiple");
  for (int64_t i = 0; i < count; i++) {
    int64_t s = ids[i];
    REQUIRE(s >= 0 && s < MAX_SEQS && w->seq[s].live, "export succeeds only for live ids");
    int32_t pages[MAX_PAGES + 1];
    int64_t num_pages = 0;
    REQUIRE(pkv_page_manager_pages(w->pm, s, pages, MAX_PAGES + 1, &num_pages, MSG) == PKV_OK, "pages");
    REQUIRE(lengths[i] == w->seq[s].length, "exported length");
    REQUIRE(num_pages <= given, "width holds every page");
    for (int64_t j = 0; j < given; j++)
      REQUIRE(table[i * given + j] == (j < num_pages ? pages[j] : PKV_PM_PADDING_PAGE), "exported row");
  }
  REQUIRE(table[count * given] == SENTINEL, "export writes only [num_seqs, width]");
}

static void op_pages_needed(world *w, reader *r) {
  int s = (int)take_below(r, MAX_SEQS);
  int64_t n = take_below(r, 3 * w->P + 1), needed = -1, copies = -1;
  pkv_status st = pkv_page_manager_pages_needed(w->pm, s, n, &needed, &copies, MSG);
  if (st != PKV_OK) return;
  REQUIRE(needed >= copies && copies >= 0, "pages_needed counts copies among the pages");
  pkv_page_manager_stats a, b;
  REQUIRE(pkv_page_manager_get_stats(w->pm, &a, MSG) == PKV_OK, "stats");
  pkv_status rs = do_reserve(w, s, n, MAX_PAGES + 1);
  REQUIRE(pkv_page_manager_get_stats(w->pm, &b, MSG) == PKV_OK, "stats");
  if (rs == PKV_OK) REQUIRE(a.free_pages - b.free_pages == needed, "reserve takes pages_needed free pages");
  else REQUIRE(rs != PKV_ERR_OUT_OF_PAGES || needed > a.free_pages, "out of pages only when short");
}

static void op_copy_check(world *w, reader *r) {
  int32_t src[6], dst[6];
  int64_t n = take_below(r, 6);
  for (int64_t i = 0; i < n; i++) {
    src[i] = (int32_t)take_below(r, w->N + 2) - 1;
    dst[i] = (int32_t)take_below(r, w->N + 2) - 1;
  }
  int ok = 1;
  for (int64_t i = 0; i < n; i++) {
    ok &= src[i] >= 0 && src[i] < w->N && dst[i] >= 0 && dst[i] < w->N;
    for (int64_t j = 0; j < n; j++) ok &= (j == i || dst[i] != dst[j]) && dst[i] != src[j];
  }
  pkv_status st = pkv_copy_pages_check_values(w->N, src, dst, n, MSG);
  REQUIRE((st == PKV_OK) == ok, "copy_pages_check follows its rule");
}

/* Run one mutating call with the k-th host allocation failing: OUT_OF_MEMORY changes nothing. */
static void op_alloc_failure(world *w, reader *r) {
  long k = 1 + (long)take_below(r, 6);
  uint8_t which = take(r) % 4;
  observation before;
  observe(w, &before);
  int s = (int)take_below(r, MAX_SEQS);
  pkv_status st = PKV_OK;
  int32_t prompt[16];
  int64_t cached = 0, len = take_below(r, 16);
  for (int64_t i = 0; i < len; i++) prompt[i] = alphabet_token(r);
  int dst = (int)take_below(r, MAX_SEQS);
  int64_t n = take_below(r, 2 * w->P + 1);
  pkv_pm_fail_allocation_after = k;
  switch (which) {
  case 0:
    st = pkv_page_manager_add_sequence(w->pm, s, len ? prompt : NULL, len, &cached, MSG);
    break;
  case 1: {
    int32_t src_p[MAX_PAGES + 1], dst_p[MAX_PAGES + 1];
    int64_t copies = 0;
    st = pkv_page_manager_reserve(w->pm, s, n, src_p, dst_p, MAX_PAGES + 1, &copies, MSG);
    if (st == PKV_OK) /* the caller copies the pages, as after any reserve */
      for (int64_t i = 0; i < copies; i++) memcpy(w->content[dst_p[i]], w->content[src_p[i]], sizeof w->content[0]);
    break;
  }
  case 2: st = pkv_page_manager_fork(w->pm, s, dst, MSG); break;
  default: {
    int64_t ids[2] = {s, dst}, width = 0;
    st = pkv_page_manager_export_width(w->pm, ids, 2, &width, MSG);
    break;
  }
  }
  long left = pkv_pm_fail_allocation_after;
  pkv_pm_fail_allocation_after = 0;
  if (st == PKV_ERR_OUT_OF_MEMORY) {
    REQUIRE(left == 0, "OUT_OF_MEMORY only when an allocation failed");
    expect_unchanged(w, &before, st, "call with a failed allocation");
    return;
  }
  /* the call did not hit the failing allocation: bring the model up to date */
  expect_unchanged(w, &before, st, "call");
  if (st != PKV_OK) return;
  if (which == 0) {
    w->seq[s].live = 1;
    w->seq[s].length = cached;
    for (int64_t i = 0; i < cached; i++) w->seq[s].history[i] = prompt[i];
  } else if (which == 2) {
    w->seq[dst] = w->seq[s];
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  reader r = {data, size, 0};
  static world w;
  memset(&w, 0, sizeof w);
  w.N = 1 + take_below(&r, MAX_PAGES);
  w.P = 1 + take_below(&r, MAX_PAGE_SIZE);
  w.next_synthetic = 1000;
  for (int64_t p = 0; p < MAX_PAGES; p++)
    for (int64_t t = 0; t < MAX_PAGE_SIZE; t++) w.content[p][t] = -1;
  REQUIRE(pkv_page_manager_create(w.N, w.P, &w.pm, MSG) == PKV_OK, "create");
  for (int op = 0; op < MAX_OPS && r.pos < r.size; op++) {
    switch (take(&r) % 10) {
    case 0: case 1: op_add(&w, &r); break;
    case 2: op_reserve(&w, &r); break;
    case 3: case 4: op_commit(&w, &r); break;
    case 5: op_fork(&w, &r); break;
    case 6: op_release(&w, &r); break;
    case 7: op_export(&w, &r); break;
    case 8: op_pages_needed(&w, &r); break;
    default: if (take(&r) % 2) op_copy_check(&w, &r); else op_alloc_failure(&w, &r); break;
    }
    verify(&w);
  }
  pkv_page_manager_destroy(w.pm);
  /* bad create arguments fail cleanly */
  pkv_page_manager *bad = NULL;
  REQUIRE(pkv_page_manager_create(0, 4, &bad, MSG) != PKV_OK && bad == NULL, "create rejects 0 pages");
  REQUIRE(pkv_page_manager_create(4, 0, &bad, MSG) != PKV_OK && bad == NULL, "create rejects page size 0");
  return 0;
}
