/*
 * pkv_page_manager: host-side bookkeeping for a paged KV cache pool.
 *
 * A pool of `num_pages` physical pages of `page_size` tokens each. Sequences (identified by
 * int64 ids) own ordered lists of page ids; pages carry reference counts so that sequences can
 * share them (fork, prefix sharing). The manager never touches cache memory: when a shared page
 * must be written, `reserve` allocates a private copy and reports the (src, dst) pair so the
 * caller copies the page data (torch op `pagedkv::copy_pages`).
 *
 * Terms used below, per sequence:
 *   length    tokens committed (already in the cache)
 *   capacity  pages held * page_size; reserve() grows it, commit() advances length within it
 *
 * Prefix sharing: commit() may be given the token ids it commits. Every page that becomes full
 * while the sequence's token history is known is registered in a prefix table under the hash of
 * its chain, hash(previous page's hash, this page's tokens). If that prefix already has a
 * registered page, the sequence switches to the registered page instead and its own copy is
 * freed (same tokens after the same prefix: same KV), so there is one page per cached prefix.
 * add_sequence() walks a prompt's leading full pages through the table and shares every page
 * whose tokens *and* predecessor match (tokens are compared, hashes only locate candidates).
 * A page leaves the table when its reference count drops to zero.
 *
 * Errors: the core's one convention (pkv_common.h): every function returns a pkv_status and, on
 * failure, writes a human-readable message into the caller's pkv_error (`err`, may be NULL). The
 * manager's own outcomes are PKV_ERR_OUT_OF_PAGES, PKV_ERR_NO_SUCH_SEQUENCE,
 * PKV_ERR_SEQUENCE_EXISTS, PKV_ERR_OUT_OF_MEMORY, PKV_ERR_BUSY and PKV_ERR_INVARIANT_VIOLATED;
 * bad arguments are PKV_ERR_ARGUMENT. A failed call changes no state at all: each operation
 * computes everything it needs (pages, memory) before it
 * applies anything. The core never aborts.
 *
 * Threads: a manager is NOT thread-safe. Callers must serialise all calls on one manager (the
 * Python front holds the GIL). Misuse is detected, not tolerated: each call takes an atomic
 * "busy" flag for its duration, and a call that finds it taken returns PKV_ERR_BUSY without
 * touching anything. Different managers are independent.
 */
#ifndef PKV_PAGE_MANAGER_H
#define PKV_PAGE_MANAGER_H

#include <stddef.h>
#include <stdint.h>

#include "pkv_common.h"

#ifdef __cplusplus
extern "C" {
#endif


/* Width of exported lookup tables is a multiple of this many entries, so that vectorised
 * page-table loads of up to 16 int32 entries (64 bytes) never leave the row. */
#define PKV_PM_EXPORT_WIDTH_MULTIPLE 16

/* Page id written into lookup-table entries past a sequence's last page: a valid page, so a
 * kernel that loads (but does not use) a padded entry still computes an in-bounds address. */
#define PKV_PM_PADDING_PAGE 0

typedef struct pkv_page_manager pkv_page_manager;

typedef struct pkv_page_manager_stats {
  int64_t num_pages;     /* N */
  int64_t page_size;     /* P */
  int64_t free_pages;    /* on the free list (reference count 0) */
  int64_t used_pages;    /* reference count >= 1; free + used == N */
  int64_t shared_pages;  /* reference count >= 2 */
  int64_t num_sequences; /* sequences currently in the manager */
  int64_t prefix_pages;  /* pages registered in the prefix table */
} pkv_page_manager_stats;

/* Creates a manager of `num_pages` (1 .. INT32_MAX - 1) pages of `page_size` (>= 1) tokens.
 * All pages start free; allocation order is page 0, 1, 2, ... until pages are released. */
pkv_status pkv_page_manager_create(int64_t num_pages, int64_t page_size, pkv_page_manager **out_manager,
                                      pkv_error *err);

/* Frees the manager and everything it owns. NULL is accepted. */
void pkv_page_manager_destroy(pkv_page_manager *manager);

pkv_status pkv_page_manager_get_stats(pkv_page_manager *manager, pkv_page_manager_stats *out_stats, pkv_error *err);

/* Creates sequence `seq_id` with the prompt `prompt_tokens[0 .. num_prompt_tokens)` (may be NULL
 * when num_prompt_tokens == 0). Shares the longest chain of registered pages that equal the
 * prompt's leading full pages, but never all of the prompt: at least one prompt token is left
 * to compute. On success the sequence's length and capacity are `*out_cached_tokens` (a multiple
 * of page_size, < num_prompt_tokens unless the prompt is empty). The rest of the prompt is then
 * reserved and committed like any other tokens (commit with token ids to register its pages). */
pkv_status pkv_page_manager_add_sequence(pkv_page_manager *manager, int64_t seq_id, const int32_t *prompt_tokens,
                                            int64_t num_prompt_tokens, int64_t *out_cached_tokens, pkv_error *err);

/* Number of free pages that reserve(seq_id, num_new_tokens) would take (new pages plus
 * copy-on-write copies), and how many of those are copy-on-write copies. Changes nothing. */
pkv_status pkv_page_manager_pages_needed(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                            int64_t *out_pages_needed, int64_t *out_copy_pages, pkv_error *err);

/* Ensures capacity for `num_new_tokens` more tokens after the sequence's length. Pages are
 * allocated only when the capacity is short. Every page that the new tokens would write into
 * and that is shared (reference count > 1) is replaced in this sequence by a private copy; each
 * such replacement is reported as copy_src[i] -> copy_dst[i], i < *out_num_copies, and the
 * caller must copy the page data before writing. `copy_capacity` is the length of the two
 * arrays (a sequence holding k pages never needs more than k entries; the arrays may be NULL
 * when copy_capacity == 0 and no copy is needed).
 * PKV_ERR_OUT_OF_PAGES (or any other error) leaves all state unchanged. */
pkv_status pkv_page_manager_reserve(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                       int32_t *copy_src, int32_t *copy_dst, int64_t copy_capacity,
                                       int64_t *out_num_copies, pkv_error *err);

/* Advances the sequence's length by `num_new_tokens` (length + n must be <= capacity, and none of
 * the pages written may be shared: reserve first). When `tokens` (n entries) is given and the
 * sequence's whole token history is known (every earlier commit had tokens, or the sequence
 * came from add_sequence/fork of such a sequence), each page that becomes full is registered
 * for prefix sharing, or, when its prefix is already registered, replaced in this sequence by
 * the registered page (its own page is freed: re-read the page list / re-export after commit).
 * A commit without tokens ends prefix registration for this sequence. */
pkv_status pkv_page_manager_commit(pkv_page_manager *manager, int64_t seq_id, int64_t num_new_tokens,
                                      const int32_t *tokens, pkv_error *err);

/* Creates `dst_seq_id` sharing the pages of `src_seq_id` that hold its committed tokens
 * (ceil(length / page_size) pages, reference counts + 1) with the same length. Pages that src
 * reserved beyond its length are not shared. */
pkv_status pkv_page_manager_fork(pkv_page_manager *manager, int64_t src_seq_id, int64_t dst_seq_id, pkv_error *err);

/* Drops the sequence; pages whose reference count reaches 0 return to the free list and leave
 * the prefix table. */
pkv_status pkv_page_manager_release(pkv_page_manager *manager, int64_t seq_id, pkv_error *err);

pkv_status pkv_page_manager_length(pkv_page_manager *manager, int64_t seq_id, int64_t *out_length, pkv_error *err);

/* Copies the sequence's page ids (capacity / page_size of them) into out_pages when
 * out_capacity is large enough, and always writes the count to *out_num_pages. A too-small
 * buffer is PKV_ERR_ARGUMENT (with *out_num_pages set so the caller can retry). */
pkv_status pkv_page_manager_pages(pkv_page_manager *manager, int64_t seq_id, int32_t *out_pages,
                                     int64_t out_capacity, int64_t *out_num_pages, pkv_error *err);

/* Lookup-table width for exporting `seq_ids[0 .. num_seqs)`: the largest page count among them
 * rounded up to a multiple of PKV_PM_EXPORT_WIDTH_MULTIPLE, at least one multiple (also for an
 * empty list, so a kernel's vector load of row 0 .. 15 is always legal). */
pkv_status pkv_page_manager_export_width(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                            int64_t *out_width, pkv_error *err);

/* Fills lookup_table [num_seqs, width] (row-major, int32) with each sequence's page ids and
 * PKV_PM_PADDING_PAGE after them, and cache_lengths [num_seqs] with each length. `width` must be
 * at least the sequences' largest page count (export_width gives the padded value). Ids may
 * repeat. Nothing is written on error. */
pkv_status pkv_page_manager_export(pkv_page_manager *manager, const int64_t *seq_ids, int64_t num_seqs,
                                      int32_t *lookup_table, int64_t width, int32_t *cache_lengths, pkv_error *err);

/* Verifies the manager's internal consistency: every page is either free (reference count 0,
 * once on the free list) or used; each page's reference count equals the number of
 * (sequence, page slot) pairs holding it; free + used == N; counters match; each length is
 * within its capacity; the sequence map and prefix table are consistent. O(N + held slots).
 * Returns PKV_ERR_INVARIANT_VIOLATED with the first violation described. */
pkv_status pkv_page_manager_check_invariants(pkv_page_manager *manager, pkv_error *err);

#ifdef __cplusplus
}
#endif

#endif /* PKV_PAGE_MANAGER_H */
