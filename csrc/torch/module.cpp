// pagedkv._C: the Python module. Importing it registers the torch ops (the
// TORCH_LIBRARY blocks in this library) and exposes host-only helpers.
#include <pybind11/pybind11.h>

#include <string>

#include "../core/pkv_settings.h"
#include "pkv_torch.h"
#ifdef PAGEDKV_WITH_CUDA
#include "pkv_cuda_shim.h"
#endif

void pkv_bind_page_manager(pybind11::module_ &m);  // page_manager_bind.cpp

namespace {

// The core settings (pkv_settings.h) as {field: int}; pagedkv.kernel_options names the values.
pybind11::dict kernel_settings() {
  const pkv_settings s = pkv_settings_get();
  pybind11::dict d;
  d["checks"] = s.checks;
  d["cpu_decode"] = static_cast<int>(s.cpu_decode);
  d["cuda_loader"] = s.cuda_loader;
  d["cuda_splits"] = s.cuda_splits;
  d["cuda_sparse_kernel"] = static_cast<int>(s.cuda_sparse);
  d["cuda_fp8_store_rows"] = s.cuda_fp8_store_rows;
  d["cuda_prefill_wgmma"] = s.cuda_prefill_wgmma;
  return d;
}

// Changes the fields named in `changes` ({field: int}, the names above); an unknown name or a value out
// of range raises ValueError and changes nothing.
void set_kernel_settings(const pybind11::dict &changes) {
  pkv_settings s = pkv_settings_get();
  for (const auto &item : changes) {
    const std::string name = pybind11::cast<std::string>(item.first);
    const int value = pybind11::cast<int>(item.second);
    if (name == "checks") s.checks = value;
    else if (name == "cpu_decode") s.cpu_decode = static_cast<pkv_cpu_decode>(value);
    else if (name == "cuda_loader") s.cuda_loader = value;
    else if (name == "cuda_splits") s.cuda_splits = value;
    else if (name == "cuda_sparse_kernel") s.cuda_sparse = static_cast<pkv_cuda_sparse_kernel>(value);
    else if (name == "cuda_fp8_store_rows") s.cuda_fp8_store_rows = value;
    else if (name == "cuda_prefill_wgmma") s.cuda_prefill_wgmma = value;
    else throw pybind11::value_error("pagedkv: no kernel setting named '" + name + "'");
  }
  pkv_error err{};
  if (pkv_settings_set(&s, &err) != PKV_OK) throw pybind11::value_error(std::string("pagedkv: ") + err.message);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pagedkv native library: registers torch.ops.pagedkv.*";
  m.def("set_checks", &pagedkv::set_checks_enabled, pybind11::arg("enabled"),
        "Check index values on the host before CUDA kernels run (always on for CPU).");
  m.def("checks_enabled", &pagedkv::checks_enabled);
  m.def("kernel_settings", &kernel_settings, "The process-wide kernel settings (pkv_settings) as {field: int}.");
  m.def("set_kernel_settings", &set_kernel_settings, pybind11::arg("changes"),
        "Change the kernel settings named in {field: int}; an unknown field or a value out of range raises.");
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
  m.def("cuda_wgmma_available", &pagedkv::cuda_wgmma_available, pybind11::arg("device"),
        "Whether the CUDA device runs the warpgroup-MMA attention kernels (sm_90a code on a cc 9.x device).");
#else
  m.attr("with_cuda") = false;
#endif
}
