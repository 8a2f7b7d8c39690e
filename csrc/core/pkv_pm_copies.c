/* pkv_page_manager: the value rule of a page copy list (the copy_pages op's index check, called
 * by pkv_copy_pages_check in pkv_check.c; the manager's reserve makes such lists). Its scratch
 * comes from the manager's allocator, so the tests' allocation-failure hook reaches it. */
#include "pkv_ops.h"
#include "pkv_pm_internal.h"

static int compare_i32(const void *a, const void *b) {
  const int32_t x = *(const int32_t *)a;
  const int32_t y = *(const int32_t *)b;
  return (x > y) - (x < y);
}

pkv_status pkv_copy_pages_check_values(int64_t num_pages, const int32_t *src_pages, const int32_t *dst_pages,
                                       int64_t num_copies, pkv_error *err) {
  if (err != NULL) err->message[0] = '\0';
  if (num_copies < 0 || (num_copies > 0 && (src_pages == NULL || dst_pages == NULL))) {
    return pkv_fail(err, PKV_ERR_ARGUMENT, "copy_pages: src_pages/dst_pages: need num_copies >= 0 entries, got %lld",
                    (long long)num_copies);
  }
  for (int64_t i = 0; i < num_copies; ++i) {
    if (src_pages[i] < 0 || src_pages[i] >= num_pages) {
      return pkv_fail(err, PKV_ERR_ARGUMENT,
                      "copy_pages: src_pages[%lld] = %d is not a page of the pool, expected [0, %lld)",
                      (long long)i, src_pages[i], (long long)num_pages);
    }
    if (dst_pages[i] < 0 || dst_pages[i] >= num_pages) {
      return pkv_fail(err, PKV_ERR_ARGUMENT,
                      "copy_pages: dst_pages[%lld] = %d is not a page of the pool, expected [0, %lld)",
                      (long long)i, dst_pages[i], (long long)num_pages);
    }
  }
  if (num_copies == 0) return PKV_OK;
  if (num_copies == 1) {
    if (src_pages[0] != dst_pages[0]) return PKV_OK;
    return pkv_fail(err, PKV_ERR_ARGUMENT, "copy_pages: dst_pages must not overlap src_pages, page %d is in both",
                    dst_pages[0]);
  }
  int32_t *sorted = pkv_pm_malloc((size_t)num_copies * 2 * sizeof(int32_t));
  if (sorted == NULL) {
    return pkv_fail(err, PKV_ERR_OUT_OF_MEMORY, "copy_pages: cannot allocate %lld entries to check page copies",
                    (long long)num_copies);
  }
  int32_t *sorted_src = sorted;
  int32_t *sorted_dst = sorted + num_copies;
  memcpy(sorted_src, src_pages, (size_t)num_copies * sizeof(int32_t));
  memcpy(sorted_dst, dst_pages, (size_t)num_copies * sizeof(int32_t));
  qsort(sorted_src, (size_t)num_copies, sizeof(int32_t), compare_i32);
  qsort(sorted_dst, (size_t)num_copies, sizeof(int32_t), compare_i32);
  pkv_status status = PKV_OK;
  for (int64_t i = 1; i < num_copies && status == PKV_OK; ++i) {
    if (sorted_dst[i] == sorted_dst[i - 1]) {
      status = pkv_fail(err, PKV_ERR_ARGUMENT, "copy_pages: dst_pages must be distinct, page %d appears more than once",
                        sorted_dst[i]);
    }
  }
  for (int64_t i = 0, j = 0; i < num_copies && j < num_copies && status == PKV_OK;) {
    if (sorted_src[i] < sorted_dst[j]) {
      ++i;
    } else if (sorted_dst[j] < sorted_src[i]) {
      ++j;
    } else {
      status = pkv_fail(err, PKV_ERR_ARGUMENT, "copy_pages: dst_pages must not overlap src_pages, page %d is in both",
                        sorted_dst[j]);
    }
  }
  free(sorted);
  return status;
}
