// pagedkv bindings: pagedkv._C.PageManager, a thin pybind11 class over the C page manager
// (csrc/core/pkv_page_manager.h). Host-only bookkeeping: no tensors cross this boundary; the
// Python front (python/pagedkv/page_manager.py) validates arguments, builds tensors and applies
// copy-on-write copies with torch.ops.pagedkv.copy_pages.
//
// Status -> Python exception: NO_SUCH_SEQUENCE -> KeyError, BAD_ARGUMENT and SEQUENCE_EXISTS ->
// ValueError, OUT_OF_PAGES -> _C.PageManagerOutOfPagesError (a RuntimeError), OUT_OF_MEMORY ->
// MemoryError, BUSY / INVARIANT_VIOLATED -> RuntimeError. Calls keep the GIL: the manager is not
// thread-safe, and the GIL serialises Python callers.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../core/pkv_page_manager.h"

namespace py = pybind11;

namespace pagedkv {
namespace {

struct OutOfPages : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] void raise_status(pkv_status status, const char *message) {
  switch (status) {
  case PKV_ERR_NO_SUCH_SEQUENCE: throw py::key_error(message);
  case PKV_ERR_ARGUMENT:
  case PKV_ERR_SEQUENCE_EXISTS: throw py::value_error(message);
  case PKV_ERR_OUT_OF_PAGES: throw OutOfPages(message);
  case PKV_ERR_OUT_OF_MEMORY: PyErr_SetString(PyExc_MemoryError, message); throw py::error_already_set();
  default: throw std::runtime_error(std::string(pkv_status_name(status)) + ": " + message);
  }
}

// Runs a core call with an error record and raises on failure.
template <typename Call>
void call_core(Call &&call) {
  pkv_error err{};
  const pkv_status status = call(&err);
  if (status != PKV_OK) raise_status(status, err.message);
}

class PageManager {
 public:
  PageManager(int64_t num_pages, int64_t page_size) {
    call_core([&](pkv_error *e) { return pkv_page_manager_create(num_pages, page_size, &manager_, e); });
  }
  ~PageManager() { pkv_page_manager_destroy(manager_); }
  PageManager(const PageManager &) = delete;
  PageManager &operator=(const PageManager &) = delete;

  py::dict stats() {
    pkv_page_manager_stats s{};
    call_core([&](pkv_error *e) { return pkv_page_manager_get_stats(manager_, &s, e); });
    py::dict d;
    d["num_pages"] = s.num_pages;
    d["page_size"] = s.page_size;
    d["free_pages"] = s.free_pages;
    d["used_pages"] = s.used_pages;
    d["shared_pages"] = s.shared_pages;
    d["num_sequences"] = s.num_sequences;
    d["prefix_pages"] = s.prefix_pages;
    return d;
  }

  int64_t free_pages() { return get_stats().free_pages; }
  int64_t used_pages() { return get_stats().used_pages; }
  int64_t shared_pages() { return get_stats().shared_pages; }

  // Returns the number of prompt tokens already cached.
  int64_t add_sequence(int64_t seq_id, const std::vector<int32_t> &prompt_tokens) {
    int64_t cached = 0;
    call_core([&](pkv_error *e) {
      return pkv_page_manager_add_sequence(manager_, seq_id, prompt_tokens.data(),
                                           static_cast<int64_t>(prompt_tokens.size()), &cached, e);
    });
    return cached;
  }

  int64_t pages_needed(int64_t seq_id, int64_t num_new_tokens) {
    int64_t needed = 0;
    call_core([&](pkv_error *e) {
      return pkv_page_manager_pages_needed(manager_, seq_id, num_new_tokens, &needed, nullptr, e);
    });
    return needed;
  }

  // Copy-on-write copies that reserve(seq_id, num_new_tokens) would make (part of pages_needed).
  int64_t copies_needed(int64_t seq_id, int64_t num_new_tokens) {
    int64_t needed = 0, copies = 0;
    call_core([&](pkv_error *e) {
      return pkv_page_manager_pages_needed(manager_, seq_id, num_new_tokens, &needed, &copies, e);
    });
    return copies;
  }

  // Returns the copy-on-write pairs (src pages, dst pages) the caller must copy.
  std::pair<std::vector<int32_t>, std::vector<int32_t>> reserve(int64_t seq_id, int64_t num_new_tokens) {
    // A sequence never needs more copies than the pages it holds.
    const size_t capacity = pages(seq_id).size();
    std::vector<int32_t> src(capacity), dst(capacity);
    int64_t copies = 0;
    call_core([&](pkv_error *e) {
      return pkv_page_manager_reserve(manager_, seq_id, num_new_tokens, src.data(), dst.data(),
                                      static_cast<int64_t>(capacity), &copies, e);
    });
    src.resize(static_cast<size_t>(copies));
    dst.resize(static_cast<size_t>(copies));
    return {std::move(src), std::move(dst)};
  }

  void commit(int64_t seq_id, int64_t num_new_tokens, const std::optional<std::vector<int32_t>> &tokens) {
    if (tokens.has_value() && static_cast<int64_t>(tokens->size()) != num_new_tokens) {
      throw py::value_error("tokens: got " + std::to_string(tokens->size()) + " token ids for num_new_tokens " +
                            std::to_string(num_new_tokens));
    }
    call_core([&](pkv_error *e) {
      return pkv_page_manager_commit(manager_, seq_id, num_new_tokens, tokens ? tokens->data() : nullptr, e);
    });
  }

  void fork(int64_t src_seq, int64_t dst_seq) {
    call_core([&](pkv_error *e) { return pkv_page_manager_fork(manager_, src_seq, dst_seq, e); });
  }

  void release(int64_t seq_id) {
    call_core([&](pkv_error *e) { return pkv_page_manager_release(manager_, seq_id, e); });
  }

  int64_t length(int64_t seq_id) {
    int64_t length = 0;
    call_core([&](pkv_error *e) { return pkv_page_manager_length(manager_, seq_id, &length, e); });
    return length;
  }

  bool contains(int64_t seq_id) {
    pkv_error err{};
    int64_t length = 0;
    const pkv_status status = pkv_page_manager_length(manager_, seq_id, &length, &err);
    if (status == PKV_ERR_NO_SUCH_SEQUENCE) return false;
    if (status != PKV_OK) raise_status(status, err.message);
    return true;
  }

  std::vector<int32_t> pages(int64_t seq_id) {
    int64_t count = 0;
    pkv_error err{};
    // First call learns the count (a too-small buffer is reported with the count filled in).
    pkv_status status = pkv_page_manager_pages(manager_, seq_id, nullptr, 0, &count, &err);
    if (status != PKV_OK && status != PKV_ERR_ARGUMENT) raise_status(status, err.message);
    std::vector<int32_t> out(static_cast<size_t>(count));
    call_core(
        [&](pkv_error *e) { return pkv_page_manager_pages(manager_, seq_id, out.data(), count, &count, e); });
    return out;
  }

  int64_t export_width(const std::vector<int64_t> &seq_ids) {
    int64_t width = 0;
    call_core([&](pkv_error *e) {
      return pkv_page_manager_export_width(manager_, seq_ids.data(), static_cast<int64_t>(seq_ids.size()), &width, e);
    });
    return width;
  }

  // Fills lookup_table [B, width] and cache_lengths [B]: writable, C-contiguous int32 buffers
  // (the front passes numpy views of freshly allocated CPU tensors).
  void export_into(const std::vector<int64_t> &seq_ids, int64_t width, const py::buffer &lookup_table,
                   const py::buffer &cache_lengths) {
    const int64_t batch = static_cast<int64_t>(seq_ids.size());
    py::buffer_info table = lookup_table.request(/*writable=*/true);
    py::buffer_info lengths = cache_lengths.request(/*writable=*/true);
    check_int32_buffer(table, "lookup_table", batch * width);
    check_int32_buffer(lengths, "cache_lengths", batch);
    call_core([&](pkv_error *e) {
      return pkv_page_manager_export(manager_, seq_ids.data(), batch, static_cast<int32_t *>(table.ptr), width,
                                     static_cast<int32_t *>(lengths.ptr), e);
    });
  }

  void check_invariants() {
    call_core([&](pkv_error *e) { return pkv_page_manager_check_invariants(manager_, e); });
  }

 private:
  pkv_page_manager_stats get_stats() {
    pkv_page_manager_stats s{};
    call_core([&](pkv_error *e) { return pkv_page_manager_get_stats(manager_, &s, e); });
    return s;
  }

  static void check_int32_buffer(const py::buffer_info &info, const char *name, int64_t expected_size) {
    bool contiguous = true;
    int64_t stride = info.itemsize;
    for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
      if (info.shape[d] > 1 && info.strides[d] != stride) contiguous = false;
      stride *= info.shape[d];
    }
    // numpy writes int32 as "i", with a byte-order prefix in some cases ("<i", "=i").
    if (info.itemsize != 4 || info.format.empty() || info.format.back() != 'i') {
      throw py::value_error(std::string(name) + ": expected an int32 buffer, got format '" + info.format + "'");
    }
    if (!contiguous || info.size != expected_size) {
      throw py::value_error(std::string(name) + ": expected a contiguous buffer of " + std::to_string(expected_size) +
                            " int32 entries, got " + std::to_string(info.size));
    }
  }

  pkv_page_manager *manager_ = nullptr;
};

}  // namespace
}  // namespace pagedkv

void pkv_bind_page_manager(py::module_ &m) {
  using pagedkv::PageManager;
  py::register_exception<pagedkv::OutOfPages>(m, "PageManagerOutOfPagesError", PyExc_RuntimeError);
  py::class_<PageManager>(m, "PageManager",
                          "Native page manager (pkv_page_manager). Use pagedkv.page_manager.PageManager.")
      .def(py::init<int64_t, int64_t>(), py::arg("num_pages"), py::arg("page_size"))
      .def("stats", &PageManager::stats)
      .def_property_readonly("free_pages", &PageManager::free_pages)
      .def_property_readonly("used_pages", &PageManager::used_pages)
      .def_property_readonly("shared_pages", &PageManager::shared_pages)
      .def("add_sequence", &PageManager::add_sequence, py::arg("seq_id"), py::arg("prompt_tokens"))
      .def("pages_needed", &PageManager::pages_needed, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("copies_needed", &PageManager::copies_needed, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("reserve", &PageManager::reserve, py::arg("seq_id"), py::arg("num_new_tokens"))
      .def("commit", &PageManager::commit, py::arg("seq_id"), py::arg("num_new_tokens"), py::arg("tokens"))
      .def("fork", &PageManager::fork, py::arg("src_seq"), py::arg("dst_seq"))
      .def("release", &PageManager::release, py::arg("seq_id"))
      .def("length", &PageManager::length, py::arg("seq_id"))
      .def("contains", &PageManager::contains, py::arg("seq_id"))
      .def("pages", &PageManager::pages, py::arg("seq_id"))
      .def("export_width", &PageManager::export_width, py::arg("seq_ids"))
      .def("export_into", &PageManager::export_into, py::arg("seq_ids"), py::arg("width"), py::arg("lookup_table"),
           py::arg("cache_lengths"))
      .def("check_invariants", &PageManager::check_invariants);
}
