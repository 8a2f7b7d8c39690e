/* pkv_page_manager: exporting lookup tables and checking the manager's invariants. */
#include "pkv_pm_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Export                                                                                     */
/* ------------------------------------------------------------------------------------------ */

/* Largest page count among the sequences, or an error naming the first unknown id. */
static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static pkv_status pkv_pm_max_pages(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                  int64_t *out_max_pages, pkv_error *err) {
  if (num_seqs < 0 || (num_seqs > 0 && seq_ids == NULL)) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "seq_ids: need num_seqs >= 0 ids, got num_seqs %lld and %s",
                    (long long)num_seqs,
                    seq_ids == NULL ? "NULL" : "an array");
  }
  int64_t max_pages = 0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_ids[b]);
    if (sequence == NULL) {
      return pkv_fail(err, PKV_ERR_NO_SUCH_SEQUENCE, "seq_ids[%lld]: sequence %lld is not in the page manager",
                      (long long)b, (long long)seq_ids[b]);
    }
    if (sequence->num_pages > max_pages) max_pages = sequence->num_pages;
  }
  *out_max_pages = max_pages;
  return PKV_OK;
}

pkv_status pkv_page_manager_export_width(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                            int64_t *out_width, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  int64_t max_pages = 0;
  if (out_width == NULL) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "out_width must not be NULL");
  } else {
    status = pkv_pm_max_pages(manager, seq_ids, num_seqs, &max_pages, err);
  }
  if (status == PKV_OK) {
    const int64_t multiple = PKV_PM_EXPORT_WIDTH_MULTIPLE;
    const int64_t groups = max_pages > 0 ? ceil_div(max_pages, multiple) : 1;
    *out_width = groups * multiple;
  }
  pkv_pm_leave(manager);
  return status;
}

pkv_status pkv_page_manager_export(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                      int32_t *lookup_table, int64_t width, int32_t *cache_lengths, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  int64_t max_pages = 0;
  status = pkv_pm_max_pages(manager, seq_ids, num_seqs, &max_pages, err);
  if (status == PKV_OK && width < max_pages) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "width: lookup_table rows hold %lld entries, a sequence holds %lld pages",
                      (long long)width,
                      (long long)max_pages);
  }
  if (status == PKV_OK && num_seqs > 0 && ((width > 0 && lookup_table == NULL) || cache_lengths == NULL)) {
    status = pkv_fail(err, PKV_ERR_ARGUMENT, "lookup_table and cache_lengths must not be NULL");
  }
  if (status == PKV_OK) {
    for (int64_t b = 0; b < num_seqs; ++b) {
      const pkv_pm_sequence *sequence = pkv_pm_find_sequence(manager, seq_ids[b]);
      int32_t *row = lookup_table + b * width;
      if (sequence->num_pages > 0) {
        memcpy(row, sequence->pages, (size_t)sequence->num_pages * sizeof(int32_t));
      }
      for (int64_t j = sequence->num_pages; j < width; ++j) row[j] = PKV_PM_PADDING_PAGE;
      cache_lengths[b] = (int32_t)sequence->length;
    }
  }
  pkv_pm_leave(manager);
  return status;
}

/* ------------------------------------------------------------------------------------------ */
/* Invariants                                                                                 */
/* ------------------------------------------------------------------------------------------ */

static pkv_status pkv_pm_check_invariants(pkv_page_manager *manager, int32_t *holders, pkv_error *err) {
  const pkv_status bad = PKV_ERR_INVARIANT_VIOLATED;
  const int64_t n = manager->num_pages;
  const int64_t page_size = manager->page_size;
  if (manager->free_count < 0 || manager->free_count > n) {
    return pkv_fail(err, bad, "free count %lld outside [0, %lld]", (long long)manager->free_count,
                    (long long)n);
  }
  /* holders[p]: -1 once seen on the free list, else the number of sequence slots holding p. */
  for (int64_t i = 0; i < manager->free_count; ++i) {
    const int32_t page = manager->free_stack[i];
    if (page < 0 || page >= n) {
      return pkv_fail(err, bad, "free list entry %lld is page %d, not in [0, %lld)", (long long)i,
                      page, (long long)n);
    }
    if (holders[page] != 0) return pkv_fail(err, bad, "page %d is on the free list twice", page);
    holders[page] = -1;
  }
  if (manager->sequence_index.count != manager->num_sequences) {
    return pkv_fail(err, bad, "sequence index holds %lld ids for %lld sequences",
                    (long long)manager->sequence_index.count, (long long)manager->num_sequences);
  }
  for (int64_t s = 0; s < manager->num_sequences; ++s) {
    const pkv_pm_sequence *sequence = &manager->sequences[s];
    const long long id = (long long)sequence->id;
    if (pkv_pm_map_find(&manager->sequence_index, (uint64_t)sequence->id) != s) {
      return pkv_fail(err, bad, "sequence %lld is not indexed at slot %lld", id, (long long)s);
    }
    if (sequence->num_pages < 0 || sequence->num_pages > sequence->pages_capacity) {
      return pkv_fail(err, bad, "sequence %lld holds %lld pages in an array of %lld", id,
                      (long long)sequence->num_pages, (long long)sequence->pages_capacity);
    }
    if (sequence->length < 0 || sequence->length > sequence->num_pages * page_size) {
      return pkv_fail(err, bad, "sequence %lld has length %lld outside its capacity %lld", id,
                      (long long)sequence->length, (long long)(sequence->num_pages * page_size));
    }
    for (int64_t j = 0; j < sequence->num_pages; ++j) {
      const int32_t page = sequence->pages[j];
      if (page < 0 || page >= n) {
        return pkv_fail(err, bad, "sequence %lld page %lld is %d, not in [0, %lld)", id, (long long)j,
                        page, (long long)n);
      }
      if (holders[page] < 0) {
        return pkv_fail(err, bad, "page %d is both free and held by sequence %lld", page, id);
      }
      holders[page] += 1;
      /* One page per cached prefix: whoever holds a registered page holds its predecessor just before it. */
      const int32_t previous = j > 0 ? sequence->pages[j - 1] : -1;
      if (manager->prefix_ready && manager->page_registered[page] && manager->page_parent[page] != previous) {
        return pkv_fail(err, bad,
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
      return pkv_fail(err, bad, "page %lld has reference count %d but %d holders%s", (long long)p,
                      manager->refcount[p], expected, holders[p] < 0 ? " (it is free)" : "");
    }
    if (holders[p] == 0) {
      return pkv_fail(err, bad, "page %lld is neither free nor held (leaked)", (long long)p);
    }
    used += holders[p] > 0;
    shared += holders[p] > 1;
    if (manager->prefix_ready && manager->page_registered[p]) {
      registered += 1;
      if (holders[p] <= 0) {
        return pkv_fail(err, bad, "free page %lld is in the prefix table", (long long)p);
      }
      if (pkv_pm_map_find(&manager->prefix_index, manager->page_hash[p]) != p) {
        return pkv_fail(err, bad, "registered page %lld is not indexed under its hash", (long long)p);
      }
      const int32_t parent = manager->page_parent[p];
      if (parent >= 0 && manager->page_parent_generation[p] != manager->generation[parent]) {
        return pkv_fail(err, bad, "registered page %lld outlived its predecessor %d", (long long)p,
                        parent);
      }
    }
  }
  if (manager->free_count + used != n) {
    return pkv_fail(err, bad, "free %lld + used %lld != %lld pages", (long long)manager->free_count,
                    (long long)used, (long long)n);
  }
  if (shared != manager->shared_count) {
    return pkv_fail(err, bad, "shared counter %lld, but %lld pages are shared",
                    (long long)manager->shared_count, (long long)shared);
  }
  if (registered != manager->prefix_index.count) {
    return pkv_fail(err, bad, "prefix table holds %lld entries for %lld registered pages",
                    (long long)manager->prefix_index.count, (long long)registered);
  }
  return PKV_OK;
}

pkv_status pkv_page_manager_check_invariants(pkv_page_manager *manager, pkv_error *err) {
  pkv_status status = pkv_pm_enter(manager, err);
  if (status != PKV_OK) return status;
  int32_t *holders = pkv_pm_calloc((size_t)manager->num_pages, sizeof(int32_t));
  if (holders == NULL) {
    status = pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "cannot allocate %lld counters to check invariants",
                      (long long)manager->num_pages);
  } else {
    status = pkv_pm_check_invariants(manager, holders, err);
    free(holders);
  }
  pkv_pm_leave(manager);
  return status;
}
