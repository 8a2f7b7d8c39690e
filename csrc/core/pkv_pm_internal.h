/* pkv_page_manager internals: the manager's state and the helpers its files share (not part of
 * the API; included only by pkv_page_manager.c and pkv_pm_*.c). One status convention: every
 * call returns a pkv_status and writes its message into a pkv_error (pkv_common.h). */
#ifndef PKV_PM_INTERNAL_H
#define PKV_PM_INTERNAL_H

#include <limits.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "pkv_page_manager.h"
#include "pkv_view.h"

/* Chain hash of the empty prefix. */
#define PKV_PM_CHAIN_ROOT 0x706b765f726f6f74ULL

typedef struct pkv_pm_map {
  uint64_t *keys;
  int32_t *values;  /* -1 marks an empty slot */
  int64_t capacity; /* 0 or a power of two; load kept <= 1/2 */
  int64_t count;
} pkv_pm_map;

typedef struct pkv_pm_sequence {
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
} pkv_pm_sequence;

struct pkv_page_manager {
  int64_t num_pages;
  int64_t page_size;
  atomic_flag busy;

  int32_t *refcount;    /* [N] holders of each page */
  uint32_t *generation; /* [N] bumped each time a page returns to the free list */
  int32_t *free_stack;  /* [N] free pages; the top is free_stack[free_count - 1] */
  int64_t free_count;
  int64_t shared_count; /* pages with refcount >= 2 */

  pkv_pm_sequence *sequences; /* dense array, order not meaningful */
  int64_t num_sequences;
  int64_t sequences_capacity;
  pkv_pm_map sequence_index; /* seq id -> index into sequences */

  /* Prefix table, allocated by the first commit that carries tokens. */
  bool prefix_ready;
  pkv_pm_map prefix_index;              /* chain hash -> registered page */
  bool *page_registered;            /* [N] */
  uint64_t *page_hash;              /* [N] chain hash of a registered page */
  int32_t *page_parent;             /* [N] registered predecessor (-1 at root) */
  uint32_t *page_parent_generation; /* [N] the predecessor's generation at registration */
  int32_t *page_tokens;             /* [N, P] tokens of a registered page */
};

/* ---- pkv_pm_memory.c: allocations (failing on request in test builds), hashing, the map ---- */
bool pkv_pm_map_reserve(pkv_pm_map *map, int64_t count);
int32_t pkv_pm_map_find(const pkv_pm_map *map, uint64_t key);
int64_t pkv_pm_map_slot(const pkv_pm_map *map, uint64_t key);
uint64_t pkv_pm_chain_hash(uint64_t previous, const int32_t *tokens, int64_t page_size);
void *pkv_pm_calloc(size_t count, size_t size);
void *pkv_pm_malloc(size_t size);
void *pkv_pm_realloc(void *pointer, size_t size);
void pkv_pm_map_free(pkv_pm_map *map);
void pkv_pm_map_insert(pkv_pm_map *map, uint64_t key, int32_t value);
void pkv_pm_map_remove(pkv_pm_map *map, uint64_t key);

/* ---- pkv_pm_state.c: entering a call, sequences, page references, the prefix table ---- */
bool pkv_pm_prefix_init(pkv_page_manager *manager);
bool pkv_pm_reserve_sequence_slot(pkv_page_manager *manager);
bool pkv_pm_sequence_reserve_pages(pkv_pm_sequence *sequence, int64_t count);
int32_t pkv_pm_page_allocate(pkv_page_manager *manager);
int64_t pkv_pm_prefix_match(const pkv_page_manager *manager, const int32_t *tokens, int64_t max_pages,
                               int32_t *out_pages, uint64_t *out_hash, int32_t *out_parent,
                               uint32_t *out_parent_generation);
pkv_pm_sequence *pkv_pm_append_sequence(pkv_page_manager *manager, const pkv_pm_sequence *sequence);
pkv_pm_sequence *pkv_pm_find_sequence(pkv_page_manager *manager, int64_t seq_id);
pkv_status pkv_pm_enter(pkv_page_manager *manager, pkv_error *err);
pkv_status pkv_pm_no_such_sequence(int64_t seq_id, const char *argument, pkv_error *err);
void pkv_pm_leave(pkv_page_manager *manager);
void pkv_pm_page_ref(pkv_page_manager *manager, int32_t page);
void pkv_pm_page_unref(pkv_page_manager *manager, int32_t page);
void pkv_pm_prefix_complete_page(pkv_page_manager *manager, pkv_pm_sequence *sequence, int64_t page_index);

#endif /* PKV_PM_INTERNAL_H */
