// pagedkv torch shims: copy_pages, the block copy behind the page manager's copy-on-write
// (schema in ops_schema.cpp).
//
//   copy_pages(Tensor(a!) pool, Tensor src_pages, Tensor dst_pages) -> ()
//   pool [N, ...] any strides: pool[dst_pages[i]] = pool[src_pages[i]] along dim 0.
//   src_pages, dst_pages: int32 [C] on pool's device, values in [0, N), dst distinct and
//   disjoint from src (so the copies are order-independent). Checked before anything is written.
//
// Implemented with ATen ops (index_select + index_copy_), registered for CPU and CUDA. The core's
// pkv_copy_pages_check validates the arguments and, always, the index values on the host (one
// small device-to-host copy on CUDA): the op runs outside graphs, after PageManager.reserve, and
// a bad index on CUDA would otherwise be a device-side assert.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "pkv_torch.h"

namespace pagedkv {
namespace {

void copy_pages(const at::Tensor &pool, const at::Tensor &src_pages, const at::Tensor &dst_pages) {
  pkv_copy_pages_args a{};
  a.pool = describe(pool);
  a.src_pages = describe(src_pages);
  a.dst_pages = describe(dst_pages);
  pkv_error err{};
  raise_if_failed(pkv_copy_pages_check(&a, /*check_values=*/0, &err), err);
  if (src_pages.size(0) == 0) return;

  // The values are checked on host copies (described with the original device, so the
  // same-device rule still holds).
  const at::Tensor src_host = src_pages.to(at::kCPU).contiguous();
  const at::Tensor dst_host = dst_pages.to(at::kCPU).contiguous();
  pkv_copy_pages_args h = a;
  h.src_pages = describe(src_host);
  h.dst_pages = describe(dst_host);
  h.src_pages.device = h.dst_pages.device = a.pool.device;
  raise_if_failed(pkv_copy_pages_check(&h, /*check_values=*/1, &err), err);

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

TORCH_LIBRARY_IMPL(pagedkv, CPU, m) { m.impl("copy_pages", &pagedkv::copy_pages); }

TORCH_LIBRARY_IMPL(pagedkv, CUDA, m) { m.impl("copy_pages", &pagedkv::copy_pages); }
