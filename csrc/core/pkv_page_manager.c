/* pkv_page_manager: see pkv_page_manager.h for the contract. C11, no torch, no CUDA. */
#include "pkv_page_manager.h"

#include <limits.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* Messages                                                                                   */
/* ------------------------------------------------------------------------------------------ */

#if defined(__GNUC__) || defined(__clang__)
#define PKV_PM_PRINTF(fmt_index, first_arg) __attribute__((format(printf, fmt_index, first_arg)))
#else
#define PKV_PM_PRINTF(fmt_index, first_arg)
#endif

static pkv_pm_status pm_fail(pkv_pm_status status, char *message, size_t message_size, const char *format, ...)
    PKV_PM_PRINTF(4, 5);

static pkv_pm_status pm_fail(pkv_pm_status status, char *message, size_t message_size, const char *format, ...) {
  if (message != NULL && message_size > 0) {
    va_list args;
    va_start(args, format);
    vsnprintf(message, message_size, format, args);
    va_end(args);
  }
  return status;
}

const char *pkv_pm_status_name(pkv_pm_status status) {
  switch (status) {
  case PKV_PM_OK: return "PKV_PM_OK";
  case PKV_PM_OUT_OF_PAGES: return "PKV_PM_OUT_OF_PAGES";
  case PKV_PM_BAD_ARGUMENT: return "PKV_PM_BAD_ARGUMENT";
  case PKV_PM_NO_SUCH_SEQUENCE: return "PKV_PM_NO_SUCH_SEQUENCE";
  case PKV_PM_SEQUENCE_EXISTS: return "PKV_PM_SEQUENCE_EXISTS";
  case PKV_PM_OUT_OF_MEMORY: return "PKV_PM_OUT_OF_MEMORY";
  case PKV_PM_BUSY: return "PKV_PM_BUSY";
  case PKV_PM_INVARIANT_VIOLATED: return "PKV_PM_INVARIANT_VIOLATED";
  }
  return "PKV_PM_UNKNOWN_STATUS";
}

/* ------------------------------------------------------------------------------------------ */
/* Allocation                                                                                 */
/* ------------------------------------------------------------------------------------------ */

#ifdef PKV_PM_ALLOC_FAILURE_INJECTION
/* Test hook (tests/c builds only): when > 0, the allocation that brings it to 0 fails. */
long pkv_pm_fail_allocation_after = 0;
static bool pm_allocation_fails(void) {
  return pkv_pm_fail_allocation_after > 0 && --pkv_pm_fail_allocation_after == 0;
}
#else
static bool pm_allocation_fails(void) { return false; }
#endif

static void *pm_malloc(size_t size) { return pm_allocation_fails() ? NULL : malloc(size); }
static void *pm_calloc(size_t count, size_t size) { return pm_allocation_fails() ? NULL : calloc(count, size); }
static void *pm_realloc(void *pointer, size_t size) { return pm_allocation_fails() ? NULL : realloc(pointer, size); }

/* ------------------------------------------------------------------------------------------ */
/* Hashing                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* splitmix64 finaliser: spreads any 64-bit key over all bits (map slots, chain hashes). */
static uint64_t pm_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

/* Chain hash of the empty prefix. */
#define PKV_PM_CHAIN_ROOT 0x706b765f726f6f74ULL

/* hash(previous page's chain hash, this page's tokens). Only locates candidates: matches are
 * always confirmed by comparing tokens and predecessors. */
static uint64_t pm_chain_hash(uint64_t previous, const int32_t *tokens, int64_t page_size) {
  uint64_t h = pm_mix64(previous + 0x9e3779b97f4a7c15ULL);
  for (int64_t i = 0; i < page_size; ++i) {
    h = (h ^ (uint32_t)tokens[i]) * 0x100000001b3ULL; /* FNV-1a step over 32-bit words */
  }
  return pm_mix64(h ^ (uint64_t)page_size);
}

/* ------------------------------------------------------------------------------------------ */
/* Open-addressing map uint64 -> int32 (linear probing, backward-shift deletion)              */
/* ------------------------------------------------------------------------------------------ */

typedef struct pm_map {
  uint64_t *keys;
  int32_t *values;  /* -1 marks an empty slot */
  int64_t capacity; /* 0 or a power of two; load kept <= 1/2 */
  int64_t count;
} pm_map;

static int64_t pm_map_home(const pm_map *map, uint64_t key) {
  return (int64_t)(pm_mix64(key) & (uint64_t)(map->capacity - 1));
}

/* Slot holding `key`, or -1. */
static int64_t pm_map_slot(const pm_map *map, uint64_t key) {
  if (map->capacity == 0) return -1;
  const int64_t mask = map->capacity - 1;
  for (int64_t i = pm_map_home(map, key);; i = (i + 1) & mask) {
    if (map->values[i] < 0) return -1;
    if (map->keys[i] == key) return i;
  }
}

static int32_t pm_map_find(const pm_map *map, uint64_t key) {
  const int64_t slot = pm_map_slot(map, key);
  return slot < 0 ? -1 : map->values[slot];
}

/* Inserts a key that is not present; capacity must have been reserved. */
static void pm_map_insert(pm_map *map, uint64_t key, int32_t value) {
  const int64_t mask = map->capacity - 1;
  int64_t i = pm_map_home(map, key);
  while (map->values[i] >= 0) i = (i + 1) & mask;
  map->keys[i] = key;
  map->values[i] = value;
  map->count += 1;
}

static void pm_map_remove(pm_map *map, uint64_t key) {
  int64_t hole = pm_map_slot(map, key);
  if (hole < 0) return;
  const int64_t mask = map->capacity - 1;
  /* Shift later members of the probe run back into the hole when their home slot allows. */
  for (int64_t j = (hole + 1) & mask; map->values[j] >= 0; j = (j + 1) & mask) {
    const int64_t home = pm_map_home(map, map->keys[j]);
    const bool stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
    if (stays) continue;
    map->keys[hole] = map->keys[j];
    map->values[hole] = map->values[j];
    hole = j;
  }
  map->values[hole] = -1;
  map->count -= 1;
}

/* Makes room for `count` entries at load <= 1/2. On failure the map is unchanged. */
static bool pm_map_reserve(pm_map *map, int64_t count) {
  if (count * 2 <= map->capacity) return true;
  int64_t capacity = map->capacity > 0 ? map->capacity : 16;
  while (capacity < count * 2) capacity *= 2;
  uint64_t *keys = pm_malloc((size_t)capacity * sizeof(uint64_t));
  int32_t *values = pm_malloc((size_t)capacity * sizeof(int32_t));
  if (keys == NULL || values == NULL) {
    free(keys);
    free(values);
    return false;
  }
  for (int64_t i = 0; i < capacity; ++i) values[i] = -1;
  pm_map grown = {keys, values, capacity, 0};
  for (int64_t i = 0; i < map->capacity; ++i) {
    if (map->values[i] >= 0) pm_map_insert(&grown, map->keys[i], map->values[i]);
  }
  free(map->keys);
  free(map->values);
  *map = grown;
  return true;
}

static void pm_map_free(pm_map *map) {
  free(map->keys);
  free(map->values);
  map->keys = NULL;
  map->values = NULL;
  map->capacity = 0;
  map->count = 0;
}

/* ------------------------------------------------------------------------------------------ */
/* Manager state                                                                              */
/* ------------------------------------------------------------------------------------------ */

typedef struct pm_sequence {
  int64_t id;
  int32_t *pages;         /* [num_pages] physical page of logical page j */
  int64_t num_pages;      /* capacity = num_pages * page_size */
  int64_t pages_capacity; /* allocated entries of `pages` */
  int64_t length;         /* committed tokens */
  /* Prefix chain. While chain_known, every committed token is known: pages [0, length / P)
   * are hashed, and the tokens of the partly filled page are in pending_tokens. */
  bool chain_known;
  uint64_t chain_hash;              /* chain hash of page length / P - 1 (root when none) */
  int32_t chain_parent;             /* registered page equal to that page, or our own; -1 at root */
  uint32_t chain_parent_generation; /* generation of chain_parent when it was recorded */
  int32_t *pending_tokens;          /* [page_size] or NULL until first needed */
} pm_sequence;

struct pkv_page_manager {
  int64_t num_pages;
  int64_t page_size;
  atomic_flag busy;

  int32_t *refcount;    /* [N] holders of each page */
  uint32_t *generation; /* [N] bumped each time a page returns to the free list */
  int32_t *free_stack;  /* [N] free pages; the top is free_stack[free_count - 1] */
  int64_t free_count;
  int64_t shared_count; /* pages with refcount >= 2 */

  pm_sequence *sequences; /* dense array, order not meaningful */
  int64_t num_sequences;
  int64_t sequences_capacity;
  pm_map sequence_index; /* seq id -> index into sequences */

  /* Prefix table, allocated by the first commit that carries tokens. */
  bool prefix_ready;
  pm_map prefix_index;              /* chain hash -> registered page */
  bool *page_registered;            /* [N] */
  uint64_t *page_hash;              /* [N] chain hash of a registered page */
  int32_t *page_parent;             /* [N] registered predecessor (-1 at root) */
  uint32_t *page_parent_generation; /* [N] the predecessor's generation at registration */
  int32_t *page_tokens;             /* [N, P] tokens of a registered page */
};

static pkv_pm_status pm_enter(pkv_page_manager *manager, char *message, size_t message_size) {
  if (message != NULL && message_size > 0) message[0] = '\0';
  if (manager == NULL) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "manager must not be NULL");
  }
  if (atomic_flag_test_and_set_explicit(&manager->busy, memory_order_acquire)) {
    return pm_fail(PKV_PM_BUSY, message, message_size,
                   "page manager is busy: another call is in progress (a manager is not "
                   "thread-safe; serialise calls)");
  }
  return PKV_PM_OK;
}

static void pm_leave(pkv_page_manager *manager) { atomic_flag_clear_explicit(&manager->busy, memory_order_release); }

static pm_sequence *pm_find_sequence(pkv_page_manager *manager, int64_t seq_id) {
  const int32_t index = pm_map_find(&manager->sequence_index, (uint64_t)seq_id);
  return index < 0 ? NULL : &manager->sequences[index];
}

static pkv_pm_status pm_no_such_sequence(int64_t seq_id, const char *argument, char *message, size_t message_size) {
  return pm_fail(PKV_PM_NO_SUCH_SEQUENCE, message, message_size, "%s: sequence %lld is not in the page manager",
                 argument, (long long)seq_id);
}

static int64_t pm_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Grows a sequence's page array to hold `count` entries; the sequence is unchanged on failure. */
static bool pm_sequence_reserve_pages(pm_sequence *sequence, int64_t count) {
  if (count <= sequence->pages_capacity) return true;
  int64_t capacity = sequence->pages_capacity > 0 ? sequence->pages_capacity * 2 : 4;
  if (capacity < count) capacity = count;
  int32_t *pages = pm_realloc(sequence->pages, (size_t)capacity * sizeof(int32_t));
  if (pages == NULL) return false;
  sequence->pages = pages;
  sequence->pages_capacity = capacity;
  return true;
}

/* Makes room for one more sequence (dense array and index). Logical state is unchanged. */
static bool pm_reserve_sequence_slot(pkv_page_manager *manager) {
  if (manager->num_sequences >= INT32_MAX - 1) return false;
  if (manager->num_sequences == manager->sequences_capacity) {
    const int64_t capacity = manager->sequences_capacity > 0 ? manager->sequences_capacity * 2 : 8;
    pm_sequence *sequences = pm_realloc(manager->sequences, (size_t)capacity * sizeof(pm_sequence));
    if (sequences == NULL) return false;
    manager->sequences = sequences;
    manager->sequences_capacity = capacity;
  }
  return pm_map_reserve(&manager->sequence_index, manager->num_sequences + 1);
}

/* Appends a sequence; a slot must have been reserved. */
static pm_sequence *pm_append_sequence(pkv_page_manager *manager, const pm_sequence *sequence) {
  const int64_t index = manager->num_sequences;
  manager->sequences[index] = *sequence;
  manager->num_sequences += 1;
  pm_map_insert(&manager->sequence_index, (uint64_t)sequence->id, (int32_t)index);
  return &manager->sequences[index];
}

/* Allocates the prefix table's per-page arrays. Logical state is unchanged. */
static bool pm_prefix_init(pkv_page_manager *manager) {
  if (manager->prefix_ready) return true;
  const size_t n = (size_t)manager->num_pages;
  const size_t p = (size_t)manager->page_size;
  if (p != 0 && n > SIZE_MAX / sizeof(int32_t) / p) return false;
  bool *registered = pm_calloc(n, sizeof(bool));
  uint64_t *hashes = pm_malloc(n * sizeof(uint64_t));
  int32_t *parents = pm_malloc(n * sizeof(int32_t));
  uint32_t *parent_generations = pm_malloc(n * sizeof(uint32_t));
  int32_t *tokens = pm_malloc(n * p * sizeof(int32_t));
  if (registered == NULL || hashes == NULL || parents == NULL || parent_generations == NULL || tokens == NULL) {
    free(registered);
    free(hashes);
    free(parents);
    free(parent_generations);
    free(tokens);
    return false;
  }
  manager->page_registered = registered;
  manager->page_hash = hashes;
  manager->page_parent = parents;
  manager->page_parent_generation = parent_generations;
  manager->page_tokens = tokens;
  manager->prefix_ready = true;
  return true;
}

static void pm_page_ref(pkv_page_manager *manager, int32_t page) {
  manager->refcount[page] += 1;
  if (manager->refcount[page] == 2) manager->shared_count += 1;
}

static int32_t pm_page_allocate(pkv_page_manager *manager) {
  manager->free_count -= 1;
  const int32_t page = manager->free_stack[manager->free_count];
  manager->refcount[page] = 1;
  return page;
}

/* Drops one reference; a page that reaches zero leaves the prefix table and becomes free. */
static void pm_page_unref(pkv_page_manager *manager, int32_t page) {
  manager->refcount[page] -= 1;
  if (manager->refcount[page] == 1) manager->shared_count -= 1;
  if (manager->refcount[page] > 0) return;
  if (manager->prefix_ready && manager->page_registered[page]) {
    pm_map_remove(&manager->prefix_index, manager->page_hash[page]);
    manager->page_registered[page] = false;
  }
  /* Registered pages naming this page as predecessor no longer match through it. */
  manager->generation[page] += 1;
  manager->free_stack[manager->free_count] = page;
  manager->free_count += 1;
}

/* Is registered page `page` the continuation of (parent, parent_generation) with `tokens`? */
static bool pm_prefix_page_matches(const pkv_page_manager *manager, int32_t page, int32_t parent,
                                   uint32_t parent_generation, const int32_t *tokens) {
  if (!manager->page_registered[page]) return false;
  if (manager->page_parent[page] != parent) return false;
  if (parent >= 0 && manager->page_parent_generation[page] != parent_generation) return false;
  return memcmp(manager->page_tokens + (size_t)page * (size_t)manager->page_size, tokens,
                (size_t)manager->page_size * sizeof(int32_t)) == 0;
}

/* Walks the prompt's leading full pages through the prefix table, at most `max_pages` of them.
 * Writes matched pages to out_pages (when not NULL) and the chain state after the last match. */
static int64_t pm_prefix_match(const pkv_page_manager *manager, const int32_t *tokens, int64_t max_pages,
                               int32_t *out_pages, uint64_t *out_hash, int32_t *out_parent,
                               uint32_t *out_parent_generation) {
  uint64_t hash = PKV_PM_CHAIN_ROOT;
  int32_t parent = -1;
  uint32_t parent_generation = 0;
  int64_t matched = 0;
  if (manager->prefix_ready) {
    for (; matched < max_pages; ++matched) {
      const int32_t *page_tokens = tokens + matched * manager->page_size;
      const uint64_t next_hash = pm_chain_hash(hash, page_tokens, manager->page_size);
      const int32_t page = pm_map_find(&manager->prefix_index, next_hash);
      if (page < 0 || !pm_prefix_page_matches(manager, page, parent, parent_generation, page_tokens)) {
        break;
      }
      if (out_pages != NULL) out_pages[matched] = page;
      hash = next_hash;
      parent = page;
      parent_generation = manager->generation[page];
    }
  }
  *out_hash = hash;
  *out_parent = parent;
  *out_parent_generation = parent_generation;
  return matched;
}

/* The sequence's pending page (its logical page `page_index`, private: commit checked) just
 * became full. If the same prefix already has a registered page, the sequence switches to that
 * page and its own copy returns to the free list: both hold the KV of the same tokens after the
 * same prefix, so one page per prefix is kept, and a registered page's predecessor is held by
 * every holder of the page. Otherwise the page is registered. */
static void pm_prefix_complete_page(pkv_page_manager *manager, pm_sequence *sequence, int64_t page_index) {
  const int32_t page = sequence->pages[page_index];
  const int32_t *tokens = sequence->pending_tokens;
  const uint64_t hash = pm_chain_hash(sequence->chain_hash, tokens, manager->page_size);
  int32_t canonical = page;
  const int32_t existing = pm_map_find(&manager->prefix_index, hash);
  if (existing >= 0) {
    if (existing != page &&
        pm_prefix_page_matches(manager, existing, sequence->chain_parent, sequence->chain_parent_generation, tokens)) {
      pm_page_ref(manager, existing);
      sequence->pages[page_index] = existing;
      pm_page_unref(manager, page);
      canonical = existing;
    }
    /* Otherwise a hash collision with a different chain: this page stays unregistered (only
     * sharing is lost; later pages of this sequence chain to it and are never matched). */
  } else if (!manager->page_registered[page]) {
    manager->page_registered[page] = true;
    manager->page_hash[page] = hash;
    manager->page_parent[page] = sequence->chain_parent;
    manager->page_parent_generation[page] = sequence->chain_parent_generation;
    memcpy(manager->page_tokens + (size_t)page * (size_t)manager->page_size, tokens,
           (size_t)manager->page_size * sizeof(int32_t));
    pm_map_insert(&manager->prefix_index, hash, page);
  }
  sequence->chain_hash = hash;
  sequence->chain_parent = canonical;
  sequence->chain_parent_generation = manager->generation[canonical];
}

/* ------------------------------------------------------------------------------------------ */
/* Lifetime and counters                                                                      */
/* ------------------------------------------------------------------------------------------ */

pkv_pm_status pkv_page_manager_create(int64_t num_pages, int64_t page_size, pkv_page_manager **out_manager,
                                      char *message, size_t message_size) {
  if (message != NULL && message_size > 0) message[0] = '\0';
  if (out_manager == NULL) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_manager must not be NULL");
  }
  *out_manager = NULL;
  /* Page ids are int32 and -1 is reserved as "no page". */
  if (num_pages < 1 || num_pages > INT32_MAX - 1) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "num_pages must be in [1, %d], got %lld", INT32_MAX - 1,
                   (long long)num_pages);
  }
  /* Lengths are exported as int32 cache_lengths. */
  if (page_size < 1 || page_size > INT32_MAX) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "page_size must be in [1, %d], got %lld", INT32_MAX,
                   (long long)page_size);
  }
  pkv_page_manager *manager = pm_calloc(1, sizeof(pkv_page_manager));
  if (manager != NULL) {
    manager->refcount = pm_calloc((size_t)num_pages, sizeof(int32_t));
    manager->generation = pm_calloc((size_t)num_pages, sizeof(uint32_t));
    manager->free_stack = pm_malloc((size_t)num_pages * sizeof(int32_t));
  }
  if (manager == NULL || manager->refcount == NULL || manager->generation == NULL || manager->free_stack == NULL) {
    pkv_page_manager_destroy(manager);
    return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate a page manager for %lld pages",
                   (long long)num_pages);
  }
  manager->num_pages = num_pages;
  manager->page_size = page_size;
  atomic_flag_clear(&manager->busy);
  /* Stack top is page 0, so a fresh manager hands out pages 0, 1, 2, ... */
  for (int64_t i = 0; i < num_pages; ++i) manager->free_stack[i] = (int32_t)(num_pages - 1 - i);
  manager->free_count = num_pages;
  *out_manager = manager;
  return PKV_PM_OK;
}

void pkv_page_manager_destroy(pkv_page_manager *manager) {
  if (manager == NULL) return;
  for (int64_t i = 0; i < manager->num_sequences; ++i) {
    free(manager->sequences[i].pages);
    free(manager->sequences[i].pending_tokens);
  }
  free(manager->sequences);
  pm_map_free(&manager->sequence_index);
  pm_map_free(&manager->prefix_index);
  free(manager->page_registered);
  free(manager->page_hash);
  free(manager->page_parent);
  free(manager->page_parent_generation);
  free(manager->page_tokens);
  free(manager->refcount);
  free(manager->generation);
  free(manager->free_stack);
  free(manager);
}

pkv_pm_status pkv_page_manager_get_stats(pkv_page_manager *manager, pkv_page_manager_stats *out_stats, char *message,
                                         size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  if (out_stats == NULL) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_stats must not be NULL");
  } else {
    out_stats->num_pages = manager->num_pages;
    out_stats->page_size = manager->page_size;
    out_stats->free_pages = manager->free_count;
    out_stats->used_pages = manager->num_pages - manager->free_count;
    out_stats->shared_pages = manager->shared_count;
    out_stats->num_sequences = manager->num_sequences;
    out_stats->prefix_pages = manager->prefix_index.count;
  }
  pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Sequences                                                                                  */
/* ------------------------------------------------------------------------------------------ */

static pkv_pm_status pm_add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt_tokens,
                                     int64_t num_prompt_tokens, int64_t *out_cached_tokens, char *message,
                                     size_t message_size) {
  if (out_cached_tokens == NULL) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_cached_tokens must not be NULL");
  }
  if (num_prompt_tokens < 0 || num_prompt_tokens > INT32_MAX) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "num_prompt_tokens must be in [0, %d], got %lld",
                   INT32_MAX, (long long)num_prompt_tokens);
  }
  if (num_prompt_tokens > 0 && prompt_tokens == NULL) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "prompt_tokens must not be NULL when num_prompt_tokens (%lld) > 0", (long long)num_prompt_tokens);
  }
  if (pm_find_sequence(manager, seq_id) != NULL) {
    return pm_fail(PKV_PM_SEQUENCE_EXISTS, message, message_size,
                   "seq_id: sequence %lld is already in the page manager", (long long)seq_id);
  }
  /* Keep at least one prompt token to compute (its logits start generation). */
  const int64_t max_shared_pages = num_prompt_tokens > 0 ? (num_prompt_tokens - 1) / manager->page_size : 0;
  uint64_t hash;
  int32_t parent;
  uint32_t parent_generation;
  const int64_t matched =
      pm_prefix_match(manager, prompt_tokens, max_shared_pages, NULL, &hash, &parent, &parent_generation);

  pm_sequence sequence = {0};
  if (!pm_reserve_sequence_slot(manager) || !pm_sequence_reserve_pages(&sequence, matched)) {
    free(sequence.pages);
    return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate sequence %lld", (long long)seq_id);
  }
  /* Same walk again, now recording the pages (the table has not changed in between). */
  pm_prefix_match(manager, prompt_tokens, matched, sequence.pages, &hash, &parent, &parent_generation);
  for (int64_t j = 0; j < matched; ++j) pm_page_ref(manager, sequence.pages[j]);
  sequence.id = seq_id;
  sequence.num_pages = matched;
  sequence.length = matched * manager->page_size;
  sequence.chain_known = true;
  sequence.chain_hash = hash;
  sequence.chain_parent = parent;
  sequence.chain_parent_generation = parent_generation;
  pm_append_sequence(manager, &sequence);
  *out_cached_tokens = sequence.length;
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt_tokens,
                                            int64_t num_prompt_tokens, int64_t *out_cached_tokens, char *message,
                                            size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  status = pm_add_sequence(manager, seq_id, prompt_tokens, num_prompt_tokens, out_cached_tokens, message, message_size);
  pm_leave(manager);
  return status;
}

/* What reserve(sequence, n) needs: new pages appended and shared pages copied. */
typedef struct pm_reserve_plan {
  int64_t new_pages;
  int64_t copy_pages;
  int64_t first_write_page; /* logical pages [first_write_page, end_write_page) are written */
  int64_t end_write_page;
} pm_reserve_plan;

static pkv_pm_status pm_plan_reserve(const pkv_page_manager *manager, const pm_sequence *sequence,
                                     int64_t num_new_tokens, pm_reserve_plan *plan, char *message,
                                     size_t message_size) {
  if (num_new_tokens < 0) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "num_new_tokens must be >= 0, got %lld",
                   (long long)num_new_tokens);
  }
  if (num_new_tokens > INT32_MAX - sequence->length) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "num_new_tokens: sequence %lld (%lld tokens) cannot take %lld more: more than the "
                   "int32 limit %d of cache_lengths",
                   (long long)sequence->id, (long long)sequence->length, (long long)num_new_tokens, INT32_MAX);
  }
  const int64_t page_size = manager->page_size;
  const int64_t needed_pages = pm_ceil_div(sequence->length + num_new_tokens, page_size);
  plan->new_pages = needed_pages > sequence->num_pages ? needed_pages - sequence->num_pages : 0;
  plan->copy_pages = 0;
  plan->first_write_page = sequence->length / page_size;
  plan->end_write_page = num_new_tokens > 0 ? needed_pages : plan->first_write_page;
  const int64_t end_existing = plan->end_write_page < sequence->num_pages ? plan->end_write_page : sequence->num_pages;
  for (int64_t j = plan->first_write_page; j < end_existing; ++j) {
    if (manager->refcount[sequence->pages[j]] > 1) plan->copy_pages += 1;
  }
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_pages_needed(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                            int64_t *out_pages_needed, int64_t *out_copy_pages, char *message,
                                            size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  const pm_sequence *sequence = pm_find_sequence(manager, seq_id);
  pm_reserve_plan plan;
  if (out_pages_needed == NULL) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_pages_needed must not be NULL");
  } else if (sequence == NULL) {
    status = pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  } else {
    status = pm_plan_reserve(manager, sequence, num_new_tokens, &plan, message, message_size);
    if (status == PKV_PM_OK) {
      *out_pages_needed = plan.new_pages + plan.copy_pages;
      if (out_copy_pages != NULL) *out_copy_pages = plan.copy_pages;
    }
  }
  pm_leave(manager);
  return status;
}

static pkv_pm_status pm_reserve(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens, int32_t *copy_src,
                                int32_t *copy_dst, int64_t copy_capacity, int64_t *out_num_copies, char *message,
                                size_t message_size) {
  pm_sequence *sequence = pm_find_sequence(manager, seq_id);
  if (sequence == NULL) return pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  if (out_num_copies == NULL) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_num_copies must not be NULL");
  }
  pm_reserve_plan plan;
  const pkv_pm_status status = pm_plan_reserve(manager, sequence, num_new_tokens, &plan, message, message_size);
  if (status != PKV_PM_OK) return status;
  const int64_t needed = plan.new_pages + plan.copy_pages;
  if (needed > manager->free_count) {
    return pm_fail(PKV_PM_OUT_OF_PAGES, message, message_size,
                   "out of pages: sequence %lld needs %lld free pages for %lld new tokens "
                   "(%lld new, %lld copy-on-write) but only %lld of %lld are free",
                   (long long)seq_id, (long long)needed, (long long)num_new_tokens, (long long)plan.new_pages,
                   (long long)plan.copy_pages, (long long)manager->free_count, (long long)manager->num_pages);
  }
  if (plan.copy_pages > copy_capacity || (plan.copy_pages > 0 && (copy_src == NULL || copy_dst == NULL))) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "copy_capacity: %lld copy-on-write pairs needed, buffers hold %lld", (long long)plan.copy_pages,
                   (long long)copy_capacity);
  }
  if (!pm_sequence_reserve_pages(sequence, sequence->num_pages + plan.new_pages)) {
    return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot grow the page list of sequence %lld",
                   (long long)seq_id);
  }
  /* Everything is checked and allocated: apply. */
  int64_t copies = 0;
  const int64_t end_existing = plan.end_write_page < sequence->num_pages ? plan.end_write_page : sequence->num_pages;
  for (int64_t j = plan.first_write_page; j < end_existing; ++j) {
    const int32_t shared = sequence->pages[j];
    if (manager->refcount[shared] <= 1) continue;
    const int32_t copy = pm_page_allocate(manager);
    pm_page_unref(manager, shared); /* stays >= 1: another holder keeps it */
    sequence->pages[j] = copy;
    copy_src[copies] = shared;
    copy_dst[copies] = copy;
    copies += 1;
  }
  for (int64_t i = 0; i < plan.new_pages; ++i) {
    sequence->pages[sequence->num_pages] = pm_page_allocate(manager);
    sequence->num_pages += 1;
  }
  *out_num_copies = copies;
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_reserve(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                       int32_t *copy_src, int32_t *copy_dst, int64_t copy_capacity,
                                       int64_t *out_num_copies, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  status = pm_reserve(manager, seq_id, num_new_tokens, copy_src, copy_dst, copy_capacity, out_num_copies, message,
                      message_size);
  pm_leave(manager);
  return status;
}

static pkv_pm_status pm_commit(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens, const int32_t *tokens,
                               char *message, size_t message_size) {
  pm_sequence *sequence = pm_find_sequence(manager, seq_id);
  if (sequence == NULL) return pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  const int64_t page_size = manager->page_size;
  const int64_t capacity = sequence->num_pages * page_size;
  if (num_new_tokens < 0) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "num_new_tokens must be >= 0, got %lld",
                   (long long)num_new_tokens);
  }
  if (num_new_tokens > capacity - sequence->length) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "num_new_tokens: committing %lld tokens to sequence %lld (length %lld) "
                   "exceeds its reserved capacity %lld; reserve() first",
                   (long long)num_new_tokens, (long long)seq_id, (long long)sequence->length, (long long)capacity);
  }
  if (num_new_tokens == 0) return PKV_PM_OK;
  const int64_t first_page = sequence->length / page_size;
  const int64_t end_page = pm_ceil_div(sequence->length + num_new_tokens, page_size);
  for (int64_t j = first_page; j < end_page; ++j) {
    const int32_t page = sequence->pages[j];
    if (manager->refcount[page] > 1) {
      return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                     "num_new_tokens: sequence %lld would write into page %d (its page %lld) "
                     "that %d sequences share; reserve() first so it is copied",
                     (long long)seq_id, page, (long long)j, manager->refcount[page]);
    }
  }
  const bool register_pages = tokens != NULL && sequence->chain_known;
  if (register_pages) {
    /* Pages that become full in this commit, each possibly a new prefix-table entry. */
    const int64_t completed = (sequence->length + num_new_tokens) / page_size - sequence->length / page_size;
    bool ok =
        pm_prefix_init(manager) && pm_map_reserve(&manager->prefix_index, manager->prefix_index.count + completed);
    if (ok && sequence->pending_tokens == NULL) {
      sequence->pending_tokens = pm_malloc((size_t)page_size * sizeof(int32_t));
      ok = sequence->pending_tokens != NULL;
    }
    if (!ok) {
      return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate the prefix table");
    }
  }
  /* Everything is checked and allocated: apply. */
  if (register_pages) {
    int64_t position = sequence->length;
    int64_t consumed = 0;
    while (consumed < num_new_tokens) {
      const int64_t offset = position % page_size;
      int64_t take = page_size - offset;
      if (take > num_new_tokens - consumed) take = num_new_tokens - consumed;
      memcpy(sequence->pending_tokens + offset, tokens + consumed, (size_t)take * sizeof(int32_t));
      position += take;
      consumed += take;
      if (position % page_size == 0) {
        pm_prefix_complete_page(manager, sequence, position / page_size - 1);
      }
    }
  } else if (tokens == NULL) {
    /* Token history now has a gap: no later page of this sequence can be registered. */
    sequence->chain_known = false;
  }
  sequence->length += num_new_tokens;
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_commit(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                      const int32_t *tokens, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  status = pm_commit(manager, seq_id, num_new_tokens, tokens, message, message_size);
  pm_leave(manager);
  return status;
}

static pkv_pm_status pm_fork(pkv_page_manager *manager, int64_t src_seq_id, int64_t dst_seq_id, char *message,
                             size_t message_size) {
  if (pm_find_sequence(manager, src_seq_id) == NULL) {
    return pm_no_such_sequence(src_seq_id, "src_seq", message, message_size);
  }
  if (pm_find_sequence(manager, dst_seq_id) != NULL) {
    return pm_fail(PKV_PM_SEQUENCE_EXISTS, message, message_size,
                   "dst_seq: sequence %lld is already in the page manager", (long long)dst_seq_id);
  }
  pm_sequence copy = {0};
  bool ok = pm_reserve_sequence_slot(manager);
  /* The dense array may have moved: look src up after reserving. */
  const pm_sequence *source = pm_find_sequence(manager, src_seq_id);
  const int64_t shared_pages = pm_ceil_div(source->length, manager->page_size);
  ok = ok && pm_sequence_reserve_pages(&copy, shared_pages);
  if (ok && source->chain_known && source->pending_tokens != NULL) {
    copy.pending_tokens = pm_malloc((size_t)manager->page_size * sizeof(int32_t));
    ok = copy.pending_tokens != NULL;
  }
  if (!ok) {
    free(copy.pages);
    free(copy.pending_tokens);
    return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate sequence %lld", (long long)dst_seq_id);
  }
  /* Everything is checked and allocated: apply. */
  copy.id = dst_seq_id;
  copy.num_pages = shared_pages;
  copy.length = source->length;
  copy.chain_known = source->chain_known;
  copy.chain_hash = source->chain_hash;
  copy.chain_parent = source->chain_parent;
  copy.chain_parent_generation = source->chain_parent_generation;
  if (copy.pending_tokens != NULL) {
    memcpy(copy.pending_tokens, source->pending_tokens, (size_t)manager->page_size * sizeof(int32_t));
  }
  for (int64_t j = 0; j < shared_pages; ++j) {
    copy.pages[j] = source->pages[j];
    pm_page_ref(manager, source->pages[j]);
  }
  pm_append_sequence(manager, &copy);
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_fork(pkv_page_manager *manager, int64_t src_seq_id, int64_t dst_seq_id, char *message,
                                    size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  status = pm_fork(manager, src_seq_id, dst_seq_id, message, message_size);
  pm_leave(manager);
  return status;
}

static pkv_pm_status pm_release(pkv_page_manager *manager, int64_t seq_id, char *message, size_t message_size) {
  const int32_t index = pm_map_find(&manager->sequence_index, (uint64_t)seq_id);
  if (index < 0) return pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  pm_sequence *sequence = &manager->sequences[index];
  /* Reverse order: the sequence's first page ends on top of the free stack. */
  for (int64_t j = sequence->num_pages - 1; j >= 0; --j) pm_page_unref(manager, sequence->pages[j]);
  free(sequence->pages);
  free(sequence->pending_tokens);
  pm_map_remove(&manager->sequence_index, (uint64_t)seq_id);
  const int64_t last = manager->num_sequences - 1;
  if (index != last) {
    manager->sequences[index] = manager->sequences[last];
    const int64_t slot = pm_map_slot(&manager->sequence_index, (uint64_t)manager->sequences[index].id);
    manager->sequence_index.values[slot] = index;
  }
  manager->num_sequences -= 1;
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_release(pkv_page_manager *manager, int64_t seq_id, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  status = pm_release(manager, seq_id, message, message_size);
  pm_leave(manager);
  return status;
}

pkv_pm_status pkv_page_manager_length(pkv_page_manager *manager, int64_t seq_id, int64_t *out_length, char *message,
                                      size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  const pm_sequence *sequence = pm_find_sequence(manager, seq_id);
  if (out_length == NULL) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_length must not be NULL");
  } else if (sequence == NULL) {
    status = pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  } else {
    *out_length = sequence->length;
  }
  pm_leave(manager);
  return status;
}

pkv_pm_status pkv_page_manager_pages(pkv_page_manager *manager, int64_t seq_id, int32_t *out_pages,
                                     int64_t out_capacity, int64_t *out_num_pages, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  const pm_sequence *sequence = pm_find_sequence(manager, seq_id);
  if (out_num_pages == NULL) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_num_pages must not be NULL");
  } else if (sequence == NULL) {
    status = pm_no_such_sequence(seq_id, "seq_id", message, message_size);
  } else {
    *out_num_pages = sequence->num_pages;
    if (sequence->num_pages > out_capacity || (sequence->num_pages > 0 && out_pages == NULL)) {
      status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                       "out_capacity: sequence %lld holds %lld pages, buffer holds %lld", (long long)seq_id,
                       (long long)sequence->num_pages, (long long)out_capacity);
    } else if (sequence->num_pages > 0) {
      memcpy(out_pages, sequence->pages, (size_t)sequence->num_pages * sizeof(int32_t));
    }
  }
  pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Export                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Largest page count among the sequences, or an error naming the first unknown id. */
static pkv_pm_status pm_max_pages(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                  int64_t *out_max_pages, char *message, size_t message_size) {
  if (num_seqs < 0 || (num_seqs > 0 && seq_ids == NULL)) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "seq_ids: need num_seqs >= 0 ids, got num_seqs %lld and %s", (long long)num_seqs,
                   seq_ids == NULL ? "NULL" : "an array");
  }
  int64_t max_pages = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const pm_sequence *sequence = pm_find_sequence(manager, seq_ids[b]);
    if (sequence == NULL) {
      return pm_fail(PKV_PM_NO_SUCH_SEQUENCE, message, message_size,
                     "seq_ids[%lld]: sequence %lld is not in the page manager", (long long)b, (long long)seq_ids[b]);
    }
    if (sequence->num_pages > max_pages) max_pages = sequence->num_pages;
  }
  *out_max_pages = max_pages;
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_export_width(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                            int64_t *out_width, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  int64_t max_pages = 0;
  if (out_width == NULL) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "out_width must not be NULL");
  } else {
    status = pm_max_pages(manager, seq_ids, num_seqs, &max_pages, message, message_size);
  }
  if (status == PKV_PM_OK) {
    const int64_t multiple = PKV_PM_EXPORT_WIDTH_MULTIPLE;
    const int64_t groups = max_pages > 0 ? pm_ceil_div(max_pages, multiple) : 1;
    *out_width = groups * multiple;
  }
  pm_leave(manager);
  return status;
}

pkv_pm_status pkv_page_manager_export(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                      int32_t *lookup_table, int64_t width, int32_t *cache_lengths, char *message,
                                      size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  int64_t max_pages = 0;
  status = pm_max_pages(manager, seq_ids, num_seqs, &max_pages, message, message_size);
  if (status == PKV_PM_OK && width < max_pages) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                     "width: lookup_table rows hold %lld entries, a sequence holds %lld pages", (long long)width,
                     (long long)max_pages);
  }
  if (status == PKV_PM_OK && num_seqs > 0 && ((width > 0 && lookup_table == NULL) || cache_lengths == NULL)) {
    status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size, "lookup_table and cache_lengths must not be NULL");
  }
  if (status == PKV_PM_OK) {
    for (int64_t b = 0; b < num_seqs; ++b) {
      const pm_sequence *sequence = pm_find_sequence(manager, seq_ids[b]);
      int32_t *row = lookup_table + b * width;
      if (sequence->num_pages > 0) {
        memcpy(row, sequence->pages, (size_t)sequence->num_pages * sizeof(int32_t));
      }
      for (int64_t j = sequence->num_pages; j < width; ++j) row[j] = PKV_PM_PADDING_PAGE;
      cache_lengths[b] = (int32_t)sequence->length;
    }
  }
  pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Invariants                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static pkv_pm_status pm_check_invariants(pkv_page_manager *manager, int32_t *holders, char *message,
                                         size_t message_size) {
  const pkv_pm_status bad = PKV_PM_INVARIANT_VIOLATED;
  const int64_t n = manager->num_pages;
  const int64_t page_size = manager->page_size;
  if (manager->free_count < 0 || manager->free_count > n) {
    return pm_fail(bad, message, message_size, "free count %lld outside [0, %lld]", (long long)manager->free_count,
                   (long long)n);
  }
  /* holders[p]: -1 once seen on the free list, else the number of sequence slots holding p. */
  for (int64_t i = 0; i < manager->free_count; ++i) {
    const int32_t page = manager->free_stack[i];
    if (page < 0 || page >= n) {
      return pm_fail(bad, message, message_size, "free list entry %lld is page %d, not in [0, %lld)", (long long)i,
                     page, (long long)n);
    }
    if (holders[page] != 0) return pm_fail(bad, message, message_size, "page %d is on the free list twice", page);
    holders[page] = -1;
  }
  if (manager->sequence_index.count != manager->num_sequences) {
    return pm_fail(bad, message, message_size, "sequence index holds %lld ids for %lld sequences",
                   (long long)manager->sequence_index.count, (long long)manager->num_sequences);
  }
  for (int64_t s = 0; s < manager->num_sequences; ++s) {
    const pm_sequence *sequence = &manager->sequences[s];
    const long long id = (long long)sequence->id;
    if (pm_map_find(&manager->sequence_index, (uint64_t)sequence->id) != s) {
      return pm_fail(bad, message, message_size, "sequence %lld is not indexed at slot %lld", id, (long long)s);
    }
    if (sequence->num_pages < 0 || sequence->num_pages > sequence->pages_capacity) {
      return pm_fail(bad, message, message_size, "sequence %lld holds %lld pages in an array of %lld", id,
                     (long long)sequence->num_pages, (long long)sequence->pages_capacity);
    }
    if (sequence->length < 0 || sequence->length > sequence->num_pages * page_size) {
      return pm_fail(bad, message, message_size, "sequence %lld has length %lld outside its capacity %lld", id,
                     (long long)sequence->length, (long long)(sequence->num_pages * page_size));
    }
    for (int64_t j = 0; j < sequence->num_pages; ++j) {
      const int32_t page = sequence->pages[j];
      if (page < 0 || page >= n) {
        return pm_fail(bad, message, message_size, "sequence %lld page %lld is %d, not in [0, %lld)", id, (long long)j,
                       page, (long long)n);
      }
      if (holders[page] < 0) {
        return pm_fail(bad, message, message_size, "page %d is both free and held by sequence %lld", page, id);
      }
      holders[page] += 1;
      /* One page per cached prefix: whoever holds a registered page holds its predecessor just before it. */
      const int32_t previous = j > 0 ? sequence->pages[j - 1] : -1;
      if (manager->prefix_ready && manager->page_registered[page] && manager->page_parent[page] != previous) {
        return pm_fail(bad, message, message_size,
                       "sequence %lld holds registered page %d at %lld after page %d, but its predecessor is %d", id,
                       page, (long long)j, previous, manager->page_parent[page]);
      }
    }
  }
  int64_t used = 0;
  int64_t shared = 0;
  int64_t registered = 0;
  for (int64_t p = 0; p < n; ++p) {
    const int32_t expected = holders[p] < 0 ? 0 : holders[p];
    if (manager->refcount[p] != expected) {
      return pm_fail(bad, message, message_size, "page %lld has reference count %d but %d holders%s", (long long)p,
                     manager->refcount[p], expected, holders[p] < 0 ? " (it is free)" : "");
    }
    if (holders[p] == 0) {
      return pm_fail(bad, message, message_size, "page %lld is neither free nor held (leaked)", (long long)p);
    }
    used += holders[p] > 0;
    shared += holders[p] > 1;
    if (manager->prefix_ready && manager->page_registered[p]) {
      registered += 1;
      if (holders[p] <= 0) {
        return pm_fail(bad, message, message_size, "free page %lld is in the prefix table", (long long)p);
      }
      if (pm_map_find(&manager->prefix_index, manager->page_hash[p]) != p) {
        return pm_fail(bad, message, message_size, "registered page %lld is not indexed under its hash", (long long)p);
      }
      const int32_t parent = manager->page_parent[p];
      if (parent >= 0 && manager->page_parent_generation[p] != manager->generation[parent]) {
        return pm_fail(bad, message, message_size, "registered page %lld outlived its predecessor %d", (long long)p,
                       parent);
      }
    }
  }
  if (manager->free_count + used != n) {
    return pm_fail(bad, message, message_size, "free %lld + used %lld != %lld pages", (long long)manager->free_count,
                   (long long)used, (long long)n);
  }
  if (shared != manager->shared_count) {
    return pm_fail(bad, message, message_size, "shared counter %lld, but %lld pages are shared",
                   (long long)manager->shared_count, (long long)shared);
  }
  if (registered != manager->prefix_index.count) {
    return pm_fail(bad, message, message_size, "prefix table holds %lld entries for %lld registered pages",
                   (long long)manager->prefix_index.count, (long long)registered);
  }
  return PKV_PM_OK;
}

pkv_pm_status pkv_page_manager_check_invariants(pkv_page_manager *manager, char *message, size_t message_size) {
  pkv_pm_status status = pm_enter(manager, message, message_size);
  if (status != PKV_PM_OK) return status;
  int32_t *holders = pm_calloc((size_t)manager->num_pages, sizeof(int32_t));
  if (holders == NULL) {
    status = pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate %lld counters to check invariants",
                     (long long)manager->num_pages);
  } else {
    status = pm_check_invariants(manager, holders, message, message_size);
    free(holders);
  }
  pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Page copies                                                                                */
/* ------------------------------------------------------------------------------------------ */

static int pm_compare_int32(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a;
  const int32_t y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

pkv_pm_status pkv_copy_pages_check(int64_t num_pages, const int32_t *src_pages, const int32_t *dst_pages,
                                   int64_t num_copies, char *message, size_t message_size) {
  if (message != NULL && message_size > 0) message[0] = '\0';
  if (num_copies < 0 || (num_copies > 0 && (src_pages == NULL || dst_pages == NULL))) {
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "src_pages/dst_pages: need num_copies >= 0 entries, got %lld", (long long)num_copies);
  }
  for (int64_t i = 0; i < num_copies; ++i) {
    if (src_pages[i] < 0 || src_pages[i] >= num_pages) {
      return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                     "src_pages[%lld] = %d is not a page of the pool, expected [0, %lld)", (long long)i, src_pages[i],
                     (long long)num_pages);
    }
    if (dst_pages[i] < 0 || dst_pages[i] >= num_pages) {
      return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                     "dst_pages[%lld] = %d is not a page of the pool, expected [0, %lld)", (long long)i, dst_pages[i],
                     (long long)num_pages);
    }
  }
  if (num_copies == 0) return PKV_PM_OK;
  if (num_copies == 1) {
    if (src_pages[0] != dst_pages[0]) return PKV_PM_OK;
    return pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                   "dst_pages must not overlap src_pages, page %d is in both", dst_pages[0]);
  }
  int32_t *sorted = pm_malloc((size_t)num_copies * 2 * sizeof(int32_t));
  if (sorted == NULL) {
    return pm_fail(PKV_PM_OUT_OF_MEMORY, message, message_size, "cannot allocate %lld entries to check page copies",
                   (long long)num_copies);
  }
  int32_t *sorted_src = sorted;
  int32_t *sorted_dst = sorted + num_copies;
  memcpy(sorted_src, src_pages, (size_t)num_copies * sizeof(int32_t));
  memcpy(sorted_dst, dst_pages, (size_t)num_copies * sizeof(int32_t));
  qsort(sorted_src, (size_t)num_copies, sizeof(int32_t), pm_compare_int32);
  qsort(sorted_dst, (size_t)num_copies, sizeof(int32_t), pm_compare_int32);
  pkv_pm_status status = PKV_PM_OK;
  for (int64_t i = 1; i < num_copies && status == PKV_PM_OK; ++i) {
    if (sorted_dst[i] == sorted_dst[i - 1]) {
      status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                       "dst_pages must be distinct, page %d appears more than once", sorted_dst[i]);
    }
  }
  for (int64_t i = 0, j = 0; i < num_copies && j < num_copies && status == PKV_PM_OK;) {
    if (sorted_src[i] < sorted_dst[j]) {
      ++i;
    } else if (sorted_dst[j] < sorted_src[i]) {
      ++j;
    } else {
      status = pm_fail(PKV_PM_BAD_ARGUMENT, message, message_size,
                       "dst_pages must not overlap src_pages, page %d is in both", sorted_dst[j]);
    }
  }
  free(sorted);
  return status;
}
