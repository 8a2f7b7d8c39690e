/* pkv_page_manager: see pkv_page_manager.h for the contract. C11, no torch, no CUDA. Lifetime,
 * counters and the sequence operations; the state helpers are in pkv_pm_state.c. */
#include "pkv_pm_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Lifetime and counters                                                                      */
/* ------------------------------------------------------------------------------------------ */

pkv_status pkv_page_manager_create(int64_t num_pages, int64_t page_size, pkv_page_manager **out_manager,
                                      pkv_error *err) {
  if (err != NULL) err->message[0] = '\0';
  if (out_manager == NULL) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "out_manager must not be NULL");
  }
  *out_manager = NULL;
  /* Page ids are int32 and -1 is reserved as "no page". */
  if (num_pages < 1 || num_pages > INT32_MAX - 1) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "num_pages must be in [1, %d], got %lld", INT32_MAX - 1,
                    (long long)num_pages);
  }
  /* Lengths are exported as int32 cache_lengths. */
  if (page_size < 1 || page_size > INT32_MAX) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "page_size must be in [1, %d], got %lld", INT32_MAX,
                    (long long)page_size);
  }
  pkv_page_manager *manager = pkv_pm_calloc(1, sizeof(pkv_page_manager));
  if (manager != NULL) {
    manager->refcount = pkv_pm_calloc((size_t)num_pages, sizeof(int32_t));
    manager->generation = pkv_pm_calloc((size_t)num_pages, sizeof(uint32_t));
    manager->free_stack = pkv_pm_malloc((size_t)num_pages * sizeof(int32_t));
  }
  if (manager == NULL || manager->refcount == NULL || manager->generation == NULL || manager->free_stack == NULL) {
    pkv_page_manager_destroy(manager);
    return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot allocate a page manager for %lld pages",
                    (long long)num_pages);
  }
  manager->num_pages = num_pages;
  manager->page_size = page_size;
  atomic_flag_clear(&manager->busy);
  /* Stack top is page 0, so a fresh manager hands out pages 0, 1, 2, ... */
  for (int64_t i = 0; i < num_pages; ++i) manager->free_stack[i] = (int32_t)(num_pages - 1 - i);
  manager->free_count = num_pages;
  *out_manager = manager;
  return PKV_OK;
}

void pkv_page_manager_destroy(pkv_page_manager *manager) {
  if (manager == NULL) return;
  for (int64_t i = 0; i < manager->num_sequences; ++i) {
    free(manager->sequences[i].pages);
    free(manager->sequences[i].pending_tokens);
  }
  free(manager->sequences);
  pkv_pm_map_free(&manager->sequence_index);
  pkv_pm_map_free(&manager->prefix_index);
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

pkv_status pkv_page_manager_get_stats(pkv_page_manager *manager, pkv_page_manager_stats *out_stats, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  if (out_stats == NULL) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_stats must not be NULL");
  } else {
    out_stats->num_pages = manager->num_pages;
    out_stats->page_size = manager->page_size;
    out_stats->free_pages = manager->free_count;
    out_stats->used_pages = manager->num_pages - manager->free_count;
    out_stats->shared_pages = manager->shared_count;
    out_stats->num_sequences = manager->num_sequences;
    out_stats->prefix_pages = manager->prefix_index.count;
  }
  pkv_pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Sequences                                                                                  */
/* ------------------------------------------------------------------------------------------ */

static pkv_status pkv_pm_add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt_tokens,
                                     int64_t num_prompt_tokens, int64_t *out_cached_tokens, pkv_error *err) {
  if (out_cached_tokens == NULL) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "out_cached_tokens must not be NULL");
  }
  if (num_prompt_tokens < 0 || num_prompt_tokens > INT32_MAX) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "num_prompt_tokens must be in [0, %d], got %lld",
                    INT32_MAX, (long long)num_prompt_tokens);
  }
  if (num_prompt_tokens > 0 && prompt_tokens == NULL) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "prompt_tokens must not be NULL when num_prompt_tokens (%lld) > 0",
                    (long long)num_prompt_tokens);
  }
  if (pkv_pm_find_sequence(manager, seq_id) != NULL) {
    return pkv_fail(err, PKV_ERR_SEQUENCE_EXISTS, "seq_id: sequence %lld is already in the page manager",
                    (long long)seq_id);
  }
  /* Keep at least one prompt token to compute (its logits start generation). */
  const int64_t max_shared_pages = num_prompt_tokens > 0 ? (num_prompt_tokens - 1) / manager->page_size : 0;
  uint64_t hash;
  int32_t parent;
  uint32_t parent_generation;
  const int64_t matched =
      pkv_pm_prefix_match(manager, prompt_tokens, max_shared_pages, NULL, &hash, &parent, &parent_generation);

  pkv_pm_sequence sequence = {0};
  if (!pkv_pm_reserve_sequence_slot(manager) || !pkv_pm_sequence_reserve_pages(&sequence, matched)) {
    free(sequence.pages);
    return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot allocate sequence %lld", (long long)seq_id);
  }
  /* Same walk again, now recording the pages (the table has not changed in between). */
  pkv_pm_prefix_match(manager, prompt_tokens, matched, sequence.pages, &hash, &parent, &parent_generation);
  for (int64_t j = 0; j < matched; ++j) pkv_pm_page_ref(manager, sequence.pages[j]);
  sequence.id = seq_id;
  sequence.num_pages = matched;
  sequence.length = matched * manager->page_size;
  sequence.chain_known = true;
  sequence.chain_hash = hash;
  sequence.chain_parent = parent;
  sequence.chain_parent_generation = parent_generation;
  pkv_pm_append_sequence(manager, &sequence);
  *out_cached_tokens = sequence.length;
  return PKV_OK;
}

pkv_status pkv_page_manager_add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt_tokens,
                                            int64_t num_prompt_tokens, int64_t *out_cached_tokens, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  status = pkv_pm_add_sequence(manager, seq_id, prompt_tokens, num_prompt_tokens, out_cached_tokens, err);
  pkv_pm_leave(manager);
  return status;
}

/* What reserve(sequence, n) needs: new pages appended and shared pages copied. */
typedef struct pkv_pm_reserve_plan {
  int64_t new_pages;
  int64_t copy_pages;
  int64_t first_write_page; /* logical pages [first_write_page, end_write_page) are written */
  int64_t end_write_page;
} pkv_pm_reserve_plan;

static pkv_status pkv_pm_plan_reserve(const pkv_page_manager *manager, const pkv_pm_sequence *sequence,
                                     int64_t num_new_tokens, pkv_pm_reserve_plan *plan, pkv_error *err) {
  if (num_new_tokens < 0) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "num_new_tokens must be >= 0, got %lld",
                    (long long)num_new_tokens);
  }
  if (num_new_tokens > INT32_MAX - sequence->length) {
    return pkv_fail(err, PKV_ERR_ARGUMENT,
                    "num_new_tokens: sequence %lld (%lld tokens) cannot take %lld more: more than the "
                    "int32 limit %d of cache_lengths",
                    (long long)sequence->id, (long long)sequence->length, (long long)num_new_tokens, INT32_MAX);
  }
  const int64_t page_size = manager->page_size;
  const int64_t needed_pages = pkv_pages_for(sequence->length + num_new_tokens, page_size);
  plan->new_pages = needed_pages > sequence->num_pages ? needed_pages - sequence->num_pages : 0;
  plan->copy_pages = 0;
  plan->first_write_page = sequence->length / page_size;
  plan->end_write_page = num_new_tokens > 0 ? needed_pages : plan->first_write_page;
  const int64_t end_existing = plan->end_write_page < sequence->num_pages ? plan->end_write_page : sequence->num_pages;
  for (int64_t j = plan->first_write_page; j < end_existing; ++j) {
    if (manager->refcount[sequence->pages[j]] > 1) plan->copy_pages += 1;
  }
  return PKV_OK;
}

pkv_status pkv_page_manager_pages_needed(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                            int64_t *out_pages_needed, int64_t *out_copy_pages, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  const pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_id);
  pkv_pm_reserve_plan plan;
  if (out_pages_needed == NULL) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_pages_needed must not be NULL");
  } else if (sequence == NULL) {
    status = pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  } else {
    status = pkv_pm_plan_reserve(manager, sequence, num_new_tokens, &plan, err);
    if (status == PKV_OK) {
      *out_pages_needed = plan.new_pages + plan.copy_pages;
      if (out_copy_pages != NULL) *out_copy_pages = plan.copy_pages;
    }
  }
  pkv_pm_leave(manager);
  return status;
}

static pkv_status pkv_pm_reserve(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens, int32_t *copy_src,
                                int32_t *copy_dst, int64_t copy_capacity, int64_t *out_num_copies, pkv_error *err) {
  pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_id);
  if (sequence == NULL) return pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  if (out_num_copies == NULL) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "out_num_copies must not be NULL");
  }
  pkv_pm_reserve_plan plan;
  const pkv_status status = pkv_pm_plan_reserve(manager, sequence, num_new_tokens, &plan, err);
  if (status != PKV_OK) return status;
  const int64_t needed = plan.new_pages + plan.copy_pages;
  if (needed > manager->free_count) {
    return pkv_fail(err, PKV_ERR_OUT_OF_PAGES, "out of pages: sequence %lld needs %lld free pages for %lld new tokens "
                    "(%lld new, %lld copy-on-write) but only %lld of %lld are free",
                    (long long)seq_id, (long long)needed, (long long)num_new_tokens, (long long)plan.new_pages,
                    (long long)plan.copy_pages, (long long)manager->free_count, (long long)manager->num_pages);
  }
  if (plan.copy_pages > copy_capacity || (plan.copy_pages > 0 && (copy_src == NULL || copy_dst == NULL))) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "copy_capacity: %lld copy-on-write pairs needed, buffers hold %lld",
                    (long long)plan.copy_pages,
                    (long long)copy_capacity);
  }
  if (!pkv_pm_sequence_reserve_pages(sequence, sequence->num_pages + plan.new_pages)) {
    return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot grow the page list of sequence %lld",
                    (long long)seq_id);
  }
  /* Everything is checked and allocated: apply. */
  int64_t copies = 0;
  const int64_t end_existing = plan.end_write_page < sequence->num_pages ? plan.end_write_page : sequence->num_pages;
  for (int64_t j = plan.first_write_page; j < end_existing; ++j) {
    const int32_t shared = sequence->pages[j];
    if (manager->refcount[shared] <= 1) continue;
    const int32_t copy = pkv_pm_page_allocate(manager);
    pkv_pm_page_unref(manager, shared); /* stays >= 1: another holder keeps it */
    sequence->pages[j] = copy;
    copy_src[copies] = shared;
    copy_dst[copies] = copy;
    copies += 1;
  }
  for (int64_t i = 0; i < plan.new_pages; ++i) {
    sequence->pages[sequence->num_pages] = pkv_pm_page_allocate(manager);
    sequence->num_pages += 1;
  }
  *out_num_copies = copies;
  return PKV_OK;
}

pkv_status pkv_page_manager_reserve(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                       int32_t *copy_src, int32_t *copy_dst, int64_t copy_capacity,
                                       int64_t *out_num_copies, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  status = pkv_pm_reserve(manager, seq_id, num_new_tokens, copy_src, copy_dst, copy_capacity, out_num_copies, err);
  pkv_pm_leave(manager);
  return status;
}

static pkv_status pkv_pm_commit(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                const int32_t *tokens,
                               pkv_error *err) {
  pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_id);
  if (sequence == NULL) return pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  const int64_t page_size = manager->page_size;
  const int64_t capacity = sequence->num_pages * page_size;
  if (num_new_tokens < 0) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "num_new_tokens must be >= 0, got %lld",
                    (long long)num_new_tokens);
  }
  if (num_new_tokens > capacity - sequence->length) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "num_new_tokens: committing %lld tokens to sequence %lld (length %lld) "
                    "exceeds its reserved capacity %lld; reserve() first",
                    (long long)num_new_tokens, (long long)seq_id, (long long)sequence->length, (long long)capacity);
  }
  if (num_new_tokens == 0) return PKV_OK;
  const int64_t first_page = sequence->length / page_size;
  const int64_t end_page = pkv_pages_for(sequence->length + num_new_tokens, page_size);
  for (int64_t j = first_page; j < end_page; ++j) {
    const int32_t page = sequence->pages[j];
    if (manager->refcount[page] > 1) {
      return pkv_fail(err, PKV_ERR_ARGUMENT, "num_new_tokens: sequence %lld would write into page %d (its page %lld) "
                      "that %d sequences share; reserve() first so it is copied",
                      (long long)seq_id, page, (long long)j, manager->refcount[page]);
    }
  }
  const bool register_pages = tokens != NULL && sequence->chain_known;
  if (register_pages) {
    /* Pages that become full in this commit, each possibly a new prefix-table entry. */
    const int64_t completed = (sequence->length + num_new_tokens) / page_size - sequence->length / page_size;
    bool ok =
        pkv_pm_prefix_init(manager) && pkv_pm_map_reserve(&manager->prefix_index,
                           manager->prefix_index.count + completed);
    if (ok && sequence->pending_tokens == NULL) {
      sequence->pending_tokens = pkv_pm_malloc((size_t)page_size * sizeof(int32_t));
      ok = sequence->pending_tokens != NULL;
    }
    if (!ok) {
      return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot allocate the prefix table");
    }
  }
  /* Everything is checked and allocated: apply. */
  if (register_pages) {
    int64_t position = sequence->length;
    int64_t consumed = 0;
    while (consumed < num_new_tokens) {
      const int64_t offset = pkv_slot_of(position, page_size);
      int64_t take = page_size - offset;
      if (take > num_new_tokens - consumed) take = num_new_tokens - consumed;
      memcpy(sequence->pending_tokens + offset, tokens + consumed, (size_t)take * sizeof(int32_t));
      position += take;
      consumed += take;
      if (pkv_slot_of(position, page_size) == 0) {
        pkv_pm_prefix_complete_page(manager, sequence, position / page_size - 1);
      }
    }
  } else if (tokens == NULL) {
    /* Token history now has a gap: no later page of this sequence can be registered. */
    sequence->chain_known = false;
  }
  sequence->length += num_new_tokens;
  return PKV_OK;
}

pkv_status pkv_page_manager_commit(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                      const int32_t *tokens, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  status = pkv_pm_commit(manager, seq_id, num_new_tokens, tokens, err);
  pkv_pm_leave(manager);
  return status;
}

static pkv_status pkv_pm_fork(pkv_page_manager *manager, int64_t src_seq_id, int64_t dst_seq_id, pkv_error *err) {
  if (pkv_pm_find_sequence(manager, src_seq_id) == NULL) {
    return pkv_pm_no_such_sequence(src_seq_id, "src_seq", err);
  }
  if (pkv_pm_find_sequence(manager, dst_seq_id) != NULL) {
    return pkv_fail(err, PKV_ERR_SEQUENCE_EXISTS, "dst_seq: sequence %lld is already in the page manager",
                    (long long)dst_seq_id);
  }
  pkv_pm_sequence copy = {0};
  bool ok = pkv_pm_reserve_sequence_slot(manager);
  /* The dense array may have moved: look src up after reserving. */
  const pkv_pm_sequence *source = pkv_pm_find_sequence(manager, src_seq_id);
  const int64_t shared_pages = pkv_pages_for(source->length, manager->page_size);
  ok = ok && pkv_pm_sequence_reserve_pages(&copy, shared_pages);
  if (ok && source->chain_known && source->pending_tokens != NULL) {
    copy.pending_tokens = pkv_pm_malloc((size_t)manager->page_size * sizeof(int32_t));
    ok = copy.pending_tokens != NULL;
  }
  if (!ok) {
    free(copy.pages);
    free(copy.pending_tokens);
    return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot allocate sequence %lld", (long long)dst_seq_id);
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
    pkv_pm_page_ref(manager, source->pages[j]);
  }
  pkv_pm_append_sequence(manager, &copy);
  return PKV_OK;
}

pkv_status pkv_page_manager_fork(pkv_page_manager *manager, int64_t src_seq_id, int64_t dst_seq_id, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  status = pkv_pm_fork(manager, src_seq_id, dst_seq_id, err);
  pkv_pm_leave(manager);
  return status;
}

static pkv_status pkv_pm_release(pkv_page_manager *manager, int64_t seq_id, pkv_error *err) {
  const int32_t index = pkv_pm_map_find(&manager->sequence_index, (uint64_t)seq_id);
  if (index < 0) return pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  pkv_pm_sequence *sequence = &manager->sequences[index];
  /* Reverse order: the sequence's first page ends on top of the free stack. */
  for (int64_t j = sequence->num_pages - 1; j >= 0; --j) pkv_pm_page_unref(manager, sequence->pages[j]);
  free(sequence->pages);
  free(sequence->pending_tokens);
  pkv_pm_map_remove(&manager->sequence_index, (uint64_t)seq_id);
  const int64_t last = manager->num_sequences - 1;
  if (index != last) {
    manager->sequences[index] = manager->sequences[last];
    const int64_t slot = pkv_pm_map_slot(&manager->sequence_index, (uint64_t)manager->sequences[index].id);
    manager->sequence_index.values[slot] = index;
  }
  manager->num_sequences -= 1;
  return PKV_OK;
}

pkv_status pkv_page_manager_release(pkv_page_manager *manager, int64_t seq_id, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  status = pkv_pm_release(manager, seq_id, err);
  pkv_pm_leave(manager);
  return status;
}

pkv_status pkv_page_manager_length(pkv_page_manager *manager, int64_t seq_id, int64_t *out_length, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  const pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_id);
  if (out_length == NULL) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_length must not be NULL");
  } else if (sequence == NULL) {
    status = pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  } else {
    *out_length = sequence->length;
  }
  pkv_pm_leave(manager);
  return status;
}

pkv_status pkv_page_manager_pages(pkv_page_manager *manager, int64_t seq_id, int32_t *out_pages,
                                     int64_t out_capacity, int64_t *out_num_pages, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  const pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_id);
  if (out_num_pages == NULL) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_num_pages must not be NULL");
  } else if (sequence == NULL) {
    status = pkv_pm_no_such_sequence(seq_id, "seq_id", err);
  } else {
    *out_num_pages = sequence->num_pages;
    if (sequence->num_pages > out_capacity || (sequence->num_pages > 0 && out_pages == NULL)) {
      status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_capacity: sequence %lld holds %lld pages, buffer holds %lld",
                        (long long)seq_id,
                        (long long)sequence->num_pages, (long long)out_capacity);
    } else if (sequence->num_pages > 0) {
      memcpy(out_pages, sequence->pages, (size_t)sequence->num_pages * sizeof(int32_t));
    }
  }
  pkv_pm_leave(manager);
  return status;
}
