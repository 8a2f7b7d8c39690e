/* pkv_page_manager: host allocations (with the test hook that makes them fail), hashing and the
 * open-addressing map behind the sequence index and the prefix table. */
#include "pkv_pm_internal.h"

/* ------------------------------------------------------------------------------------------ */
/* Allocation                                                                                 */
/* ------------------------------------------------------------------------------------------ */

#ifdef PKV_PM_ALLOC_FAILURE_INJECTION
/* Test hook (tests/c builds only): when > 0, the allocation that brings it to 0 fails. */
long pkv_pm_fail_allocation_after = 0;
static bool pkv_pm_allocation_fails(void) {
  return pkv_pm_fail_allocation_after > 0 && --pkv_pm_fail_allocation_after == 0;
}
#else
static bool pkv_pm_allocation_fails(void) { return false; }
#endif

void *pkv_pm_malloc(size_t size) { return pkv_pm_allocation_fails() ? NULL : malloc(size); }
void *pkv_pm_calloc(size_t count, size_t size) { return pkv_pm_allocation_fails() ? NULL : calloc(count, size); }
void *pkv_pm_realloc(void *pointer, size_t size) { return pkv_pm_allocation_fails() ? NULL : realloc(pointer, size); }

/* ------------------------------------------------------------------------------------------ */
/* Hashing                                                                                    */
/* ------------------------------------------------------------------------------------------ */

/* splitmix64 finaliser: spreads any 64-bit key over all bits (map slots, chain hashes). */
static uint64_t pkv_pm_mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}


/* hash(previous page's chain hash, this page's tokens). Only locates candidates: matches are
 * always confirmed by comparing tokens and predecessors. */
uint64_t pkv_pm_chain_hash(uint64_t previous, const int32_t *tokens, int64_t page_size) {
  uint64_t h = pkv_pm_mix64(previous + 0x9e3779b97f4a7c15ULL);
  for (int64_t i = 0; i < page_size; ++i) {
    h = (h ^ (uint32_t)tokens[i]) * 0x100000001b3ULL; /* FNV-1a step over 32-bit words */
  }
  return pkv_pm_mix64(h ^ (uint64_t)page_size);
}

/* ------------------------------------------------------------------------------------------ */
/* Open-addressing map uint64 -> int32 (linear probing, backward-shift deletion)              */
/* ------------------------------------------------------------------------------------------ */


static int64_t pkv_pm_map_home(const pkv_pm_map *map, uint64_t key) {
  return (int64_t)(pkv_pm_mix64(key) & (uint64_t)(map->capacity - 1));
}

/* Slot holding `key`, or -1. */
int64_t pkv_pm_map_slot(const pkv_pm_map *map, uint64_t key) {
  if (map->capacity == 0) return -1;
  const int64_t mask = map->capacity - 1;
  for (int64_t i = pkv_pm_map_home(map, key);; i = (i + 1) & mask) {
    if (map->values[i] < 0) return -1;
    if (map->keys[i] == key) return i;
  }
}

int32_t pkv_pm_map_find(const pkv_pm_map *map, uint64_t key) {
  const int64_t slot = pkv_pm_map_slot(map, key);
  return slot < 0 ? -1 : map->values[slot];
}

/* Inserts a key that is not present; capacity must have been reserved. */
void pkv_pm_map_insert(pkv_pm_map *map, uint64_t key, int32_t value) {
  const int64_t mask = map->capacity - 1;
  int64_t i = pkv_pm_map_home(map, key);
  while (map->values[i] >= 0) i = (i + 1) & mask;
  map->keys[i] = key;
  map->values[i] = value;
  map->count += 1;
}

void pkv_pm_map_remove(pkv_pm_map *map, uint64_t key) {
  int64_t hole = pkv_pm_map_slot(map, key);
  if (hole < 0) return;
  const int64_t mask = map->capacity - 1;
  /* Shift later members of the probe run back into the hole when their home slot allows. */
  for (int64_t j = (hole + 1) & mask; map->values[j] >= 0; j = (j + 1) & mask) {
    const int64_t home = pkv_pm_map_home(map, map->keys[j]);
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
bool pkv_pm_map_reserve(pkv_pm_map *map, int64_t count) {
  if (count * 2 <= map->capacity) return true;
  int64_t capacity = map->capacity > 0 ? map->capacity : 16;
  while (capacity < count * 2) capacity *= 2;
  uint64_t *keys = pkv_pm_malloc((size_t)capacity * sizeof(uint64_t));
  int32_t *values = pkv_pm_malloc((size_t)capacity * sizeof(int32_t));
  if (keys == NULL || values == NULL) {
    free(keys);
    free(values);
    return false;
  }
  for (int64_t i = 0; i < capacity; ++i) values[i] = -1;
  pkv_pm_map grown = {keys, values, capacity, 0};
  for (int64_t i = 0; i < map->capacity; ++i) {
    if (map->values[i] >= 0) pkv_pm_map_insert(&grown, map->keys[i], map->values[i]);
  }
  free(map->keys);
  free(map->values);
  *map = grown;
  return true;
}

void pkv_pm_map_free(pkv_pm_map *map) {
  free(map->keys);
  free(map->values);
  map->keys = NULL;
  map->values = NULL;
  map->capacity = 0;
  map->count = 0;
}
