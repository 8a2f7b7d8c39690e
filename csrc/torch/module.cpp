// pagedkv._C: the Python module. Importing it registers the torch ops (the
// TORCH_LIBRARY blocks in this library) and exposes host-only helpers.
#include <pybind11/pybind11.h>

#include "pkv_torch.h"
#ifdef PAGEDKV_WITH_CUDA
#include "pkv_cuda_shim.h"
#endif

void pkv_bind_page_manager(pybind11::module_ &m);  // page_manager_bind.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native library: registers torch.ops.pagedkv.*";
  m.def("set_checks", &pagedkv::set_checks_enabled, pybind11::arg("enabled"),
        "Check index values on the host before CUDA kernels run (always on for CPU).");
  m.def("checks_enabled", &pagedkv::checks_enabled);
  pkv_bind_page_manager(m);
#ifdef PAGEDKV_WITH_CUDA
  m.attr("with_cuda") = true;
  m.attr("cuda_loader_names") = pybind11::make_tuple("cp.async", "tma-pages", "tma-gather4");
  m.def("set_cuda_loader", &pagedkv::set_cuda_loader, pybind11::arg("loader"),
        "Force the K/V loader of flash_attn_paged and flash_attn_paged_sparse on CUDA: -1 auto, 0 cp.async, "
        "1 tma-pages (dense only), 2 tma-gather4.");
  m.def("cuda_loader", &pagedkv::cuda_loader);
  m.def("cuda_loader_available", &pagedkv::cuda_loader_available, pybind11::arg("device"), pybind11::arg("loader"),
        "Whether the loader was compiled for and runs on the CUDA device.");
#else
  m.attr("with_cuda") = false;
#endif
}
