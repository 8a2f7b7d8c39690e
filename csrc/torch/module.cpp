// pagedkv._C: the Python module. Importing it registers the torch ops (the
// TORCH_LIBRARY blocks in this library) and exposes host-only helpers.
#include <pybind11/pybind11.h>

#include "pkv_torch.h"

void pkv_bind_page_manager(pybind11::module_ &m);  // page_manager_bind.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native library: registers torch.ops.pagedkv.*";
  m.def("set_checks", &pagedkv::set_checks_enabled, pybind11::arg("enabled"),
        "Check index values on the host before CUDA kernels run (always on for CPU).");
  m.def("checks_enabled", &pagedkv::checks_enabled);
  pkv_bind_page_manager(m);
#ifdef PAGEDKV_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
