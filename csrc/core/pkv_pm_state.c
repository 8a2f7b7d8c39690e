/* pkv_page_manager: the manager's state helpers shared by its operations: entering a call,
 * finding sequences, page reference counts, the free stack and the prefix table. */
#include "pkv_pm_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Manager state                                                                              */
/* ------------------------------------------------------------------------------------------ */



pkv_status pkv_pm_enter(pkv_page_manager *manager, pkv_error *err) {
  if (err != NULL) err->message[0] = '\0';
  if (manager == NULL) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "manager must not be NULL");
  }
  if (atomic_flag_test_and_set_explicit(&manager->busy, memory_order_acquire)) {
    return pkv_fail(err, PKV_ERR_BUSY, "page manager is busy: another call is in progress (a manager is not "
                    "thread-safe; serialise calls)");
  }
  return PKV_OK;
}

void pkv_pm_leave(pkv_page_manager *manager) { atomic_flag_clear_explicit(&manager->busy, memory_order_release); }

pkv_pm_sequence *pkv_pm_find_sequence(pkv_page_manager *manager, int64_t seq_id) {
  const int32_t index = pkv_pm_map_find(&manager->sequence_index, (uint64_t)seq_id);
  return index < 0 ? NULL : &manager->sequences[index];
}

pkv_status pkv_pm_no_such_sequence(int64_t seq_id, const char *argument, pkv_error *err) {
  return pkv_fail(err, PKV_ERR_NO_SUCH_SEQUENCE, "%s: sequence %lld is not in the page manager",
                  argument, (long long)seq_id);
}


/* Grows a sequence's page array to hold `count` entries; the sequence is unchanged on failure. */
bool pkv_pm_sequence_reserve_pages(pkv_pm_sequence *sequence, int64_t count) {
  if (count <= sequence->pages_capacity) return true;
  int64_t capacity = sequence->pages_capacity > 0 ? sequence->pages_capacity * 2 : 4;
  if (capacity < count) capacity = count;
  int32_t *pages = pkv_pm_realloc(sequence->pages, (size_t)capacity * sizeof(int32_t));
  if (pages == NULL) return false;
  sequence->pages = pages;
  sequence->pages_capacity = capacity;
  return true;
}

/* Makes room for one more sequence (dense array and index). Logical state is unchanged. */
bool pkv_pm_reserve_sequence_slot(pkv_page_manager *manager) {
  if (manager->num_sequences >= INT32_MAX - 1) return false;
  if (manager->num_sequences == manager->sequences_capacity) {
    const int64_t capacity = manager->sequences_capacity > 0 ? manager->sequences_capacity * 2 : 8;
    pkv_pm_sequence *sequences = pkv_pm_realloc(manager->sequences, (size_t)capacity * sizeof(pkv_pm_sequence));
    if (sequences == NULL) return false;
    manager->sequences = sequences;
    manager->sequences_capacity = capacity;
  }
  return pkv_pm_map_reserve(&manager->sequence_index, manager->num_sequences + 1);
}

/* Appends a sequence; a slot must have been reserved. */
pkv_pm_sequence *pkv_pm_append_sequence(pkv_page_manager *manager, const pkv_pm_sequence *sequence) {
  const int64_t index = manager->num_sequences;
  manager->sequences[index] = *sequence;
  manager->num_sequences += 1;
  pkv_pm_map_insert(&manager->sequence_index, (uint64_t)sequence->id, (int32_t)index);
  return &manager->sequences[index];
}

/* Allocates the prefix table's per-page arrays. Logical state is unchanged. */
bool pkv_pm_prefix_init(pkv_page_manager *manager) {
  if (manager->prefix_ready) return true;
  const size_t n = (size_t)manager->num_pages;
  const size_t p = (size_t)manager->page_size;
  if (p != 0 && n > SIZE_MAX / sizeof(int32_t) / p) return false;
  bool *registered = pkv_pm_calloc(n, sizeof(bool));
  uint64_t *hashes = pkv_pm_malloc(n * sizeof(uint64_t));
  int32_t *parents = pkv_pm_malloc(n * sizeof(int32_t));
  uint32_t *parent_generations = pkv_pm_malloc(n * sizeof(uint32_t));
  int32_t *tokens = pkv_pm_malloc(n * p * sizeof(int32_t));
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

void pkv_pm_page_ref(pkv_page_manager *manager, int32_t page) {
  manager->refcount[page] += 1;
  if (manager->refcount[page] == 2) manager->shared_count += 1;
}

int32_t pkv_pm_page_allocate(pkv_page_manager *manager) {
  manager->free_count -= 1;
  const int32_t page = manager->free_stack[manager->free_count];
  manager->refcount[page] = 1;
  return page;
}

/* Drops one reference; a page that reaches zero leaves the prefix table and becomes free. */
void pkv_pm_page_unref(pkv_page_manager *manager, int32_t page) {
  manager->refcount[page] -= 1;
  if (manager->refcount[page] == 1) manager->shared_count -= 1;
  if (manager->refcount[page] > 0) return;
  if (manager->prefix_ready && manager->page_registered[page]) {
    pkv_pm_map_remove(&manager->prefix_index, manager->page_hash[page]);
    manager->page_registered[page] = false;
  }
  /* Registered pages naming this page as predecessor no longer match through it. */
  manager->generation[page] += 1;
  manager->free_stack[manager->free_count] = page;
  manager->free_count += 1;
}

/* Is registered page `page` the continuation of (parent, parent_generation) with `tokens`? */
static bool pkv_pm_prefix_page_matches(const pkv_page_manager *manager, int32_t page, int32_t parent,
                                   uint32_t parent_generation, const int32_t *tokens) {
  if (!manager->page_registered[page]) return false;
  if (manager->page_parent[page] != parent) return false;
  if (parent >= 0 && manager->page_parent_generation[page] != parent_generation) return false;
  return memcmp(manager->page_tokens + (size_t)page * (size_t)manager->page_size, tokens,
                (size_t)manager->page_size * sizeof(int32_t)) == 0;
}

/* Walks the prompt's leading full pages through the prefix table, at most `max_pages` of them.
 * Writes matched pages to out_pages (when not NULL) and the chain state after the last match. */
int64_t pkv_pm_prefix_match(const pkv_page_manager *manager, const int32_t *tokens, int64_t max_pages,
                               int32_t *out_pages, uint64_t *out_hash, int32_t *out_parent,
                               uint32_t *out_parent_generation) {
  uint64_t hash = PKV_PM_CHAIN_ROOT;
  int32_t parent = -1;
  uint32_t parent_generation = 0;
  int64_t matched = 0;
  if (manager->prefix_ready) {
    for (; matched < max_pages; ++matched) {
      const int32_t *page_tokens = tokens + matched * manager->page_size;
      const uint64_t next_hash = pkv_pm_chain_hash(hash, page_tokens, manager->page_size);
      const int32_t page = pkv_pm_map_find(&manager->prefix_index, next_hash);
      if (page < 0 || !pkv_pm_prefix_page_matches(manager, page, parent, parent_generation, page_tokens)) {
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
void pkv_pm_prefix_complete_page(pkv_page_manager *manager, pkv_pm_sequence *sequence, int64_t page_index) {
  const int32_t page = sequence->pages[page_index];
  const int32_t *tokens = sequence->pending_tokens;
  const uint64_t hash = pkv_pm_chain_hash(sequence->chain_hash, tokens, manager->page_size);
  int32_t canonical = page;
  const int32_t existing = pkv_pm_map_find(&manager->prefix_index, hash);
  if (existing >= 0) {
    if (existing != page &&
        pkv_pm_prefix_page_matches(manager, existing, sequence->chain_parent, sequence->chain_parent_generation,
                                   tokens)) {
      pkv_pm_page_ref(manager, existing);
      sequence->pages[page_index] = existing;
      pkv_pm_page_unref(manager, page);
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
    pkv_pm_map_insert(&manager->prefix_index, hash, page);
  }
  sequence->chain_hash = hash;
  sequence->chain_parent = canonical;
  sequence->chain_parent_generation = manager->generation[canonical];
}
