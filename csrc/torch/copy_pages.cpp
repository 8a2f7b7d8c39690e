// pagedkv torch shims: copy_pages, the block copy behind the page manager's copy-on-write.
//
//   copy_pages(Tensor(a!) pool, Tensor src_pages, Tensor dst_pages) -> ()
//   pool [N, ...] any strides: pool[dst_pages[i]] = pool[src_pages[i]] along dim 0.
//   src_pages, dst_pages: int32 [C] on pool's device, values in [0, N), dst distinct and
//   disjoint from src (so the copies are order-independent). Checked before anything is written.
//
// Implemented with ATen ops (index_select + index_copy_), registered for CPU and CUDA. The index
// values are always checked on the host through the core's pkv_copy_pages_check (one small
// device-to-host copy on CUDA): the op runs outside graphs, after PageManager.reserve, and a bad
// index on CUDA would otherwise be a device-side assert.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "../core/pkv_page_manager.h"
#include "pkv_torch.h"

namespace pagedkv {
namespace {

void check_page_list(const at::Tensor &pool, const at::Tensor &pages, const char *name) {
  TORCH_CHECK(pages.scalar_type() == at::kInt, "copy_pages: ", name, " must be int32, got ",
              pkv_dtype_name(to_pkv_dtype(pages.scalar_type())));
  TORCH_CHECK(pages.dim() == 1, "copy_pages: ", name, " must be 1-D [num_copies], got ", pages.dim(), "-D");
  TORCH_CHECK(pages.device() == pool.device(), "copy_pages: ", name, " must be on pool's device ", pool.device(),
              ", got ", pages.device());
}

void copy_pages(const at::Tensor &pool, const at::Tensor &src_pages, const at::Tensor &dst_pages) {
  TORCH_CHECK(pool.dim() >= 1, "copy_pages: pool must have a page dim 0 ([N, ...]), got a 0-D tensor");
  check_page_list(pool, src_pages, "src_pages");
  check_page_list(pool, dst_pages, "dst_pages");
  TORCH_CHECK(src_pages.size(0) == dst_pages.size(0),
              "copy_pages: src_pages and dst_pages must have the same length, got ", src_pages.size(0), " and ",
              dst_pages.size(0));
  const int64_t num_copies = src_pages.size(0);
  if (num_copies == 0) return;

  const at::Tensor src_host = src_pages.to(at::kCPU).contiguous();
  const at::Tensor dst_host = dst_pages.to(at::kCPU).contiguous();
  char message[512] = {0};
  const pkv_pm_status status = pkv_copy_pages_check(pool.size(0), src_host.data_ptr<int32_t>(),
                                                    dst_host.data_ptr<int32_t>(), num_copies, message, sizeof message);
  TORCH_CHECK(status == PKV_PM_OK, "copy_pages: ", message);

  // A copy moves bytes: view FP8 pools as bytes so the indexing ops need no FP8 kernels.
  at::Tensor target = pool;
  if (pool.scalar_type() == at::kFloat8_e4m3fn || pool.scalar_type() == at::kFloat8_e5m2) {
    target = pool.view(at::kByte);
  }
  const at::Tensor rows = target.index_select(0, src_pages.to(at::kLong));
  target.index_copy_(0, dst_pages.to(at::kLong), rows);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) { m.def("copy_pages(Tensor(a!) pool, Tensor src_pages, Tensor dst_pages) -> ()"); }

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("copy_pages", &pagedkv::copy_pages); }

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("copy_pages", &pagedkv::copy_pages); }
