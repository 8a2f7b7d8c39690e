// pagedkv torch shims: the ops' kernels for the dispatch keys above the backends (Autograd,
// ADInplaceOrView, Negative). The backend kernels (ops_cpu.cpp, ops_cuda.cpp, copy_pages.cpp) only
// see raw memory: data_ptr, sizes, strides. What torch tracks beside the memory is handled here,
// where torch's defaults for custom ops got it wrong:
//
// - Autograd. pagedkv's ops have no backward. torch's default for an op without an autograd kernel
//   only warns at backward and gives no gradient (q.grad stayed None: a silent wrong result). Here an
//   attention output computed from an input that requires grad gets a grad_fn that raises, naming
//   the op and the inputs, when a backward reaches it (the forward still works, as in inference
//   without torch.no_grad()). An op that writes into tensors it is given (paged_store, paged_load,
//   flash_attn_paged.out, copy_pages) is refused at the call under grad mode when any of its tensors
//   requires grad: its results land in tensors autograd does not track, so a key stored into a cache
//   would silently lose its gradient, and a written tensor requiring grad would change under autograd.
//   A forward-mode tangent (dual tensor) on any argument is refused at the call: it was dropped.
// - ADInplaceOrView. A written tensor's version counter is bumped after the write, as torch's own
//   in-place ops do: a tensor saved for some other op's backward and then overwritten by paged_store
//   made that backward use the new values silently; now autograd raises its "modified by an inplace
//   operation" error. Inference tensors have no counter (and cannot be saved for backward): skipped.
// - Negative. A torch._neg_view tensor holds x in memory while its value is -x. torch's fallback for
//   the bit resolves read arguments into copies (correct), but for a written one it tripped an
//   internal assert meant for ops that return their written input, and the process then aborted or
//   crashed. Here read arguments are resolved as the fallback does, and a written one is refused by
//   name before anything runs (writing -x into memory is not something a cache user wants).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace pagedkv {
namespace {

// The op as the core's messages name it: "flash_attn_paged" for pagedkv::flash_attn_paged.out too.
std::string op_name(const c10::FunctionSchema &schema) {
  const std::string &full = schema.name();
  const auto colons = full.find("::");
  return colons == std::string::npos ? full : full.substr(colons + 2);
}

bool is_written(const c10::Argument &arg) { return arg.alias_info() != nullptr && arg.alias_info()->isWrite(); }

// The stack slot of argument i (the arguments are the last schema.arguments().size() entries).
c10::IValue &argument(torch::jit::Stack *stack, const c10::FunctionSchema &schema, size_t i) {
  return (*stack)[stack->size() - schema.arguments().size() + i];
}

void autograd_kernel(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
  const c10::FunctionSchema &schema = op.schema();
  std::vector<at::Tensor> requiring_grad;
  std::string names;  // of the arguments in requiring_grad, comma separated
  bool writes = false;
  for (size_t i = 0; i < schema.arguments().size(); i++) {
    writes = writes || is_written(schema.arguments()[i]);
    const c10::IValue &v = argument(stack, schema, i);
    // Forward-mode AD runs with the call (and under torch.no_grad() too): an output without a tangent
    // was a silent zero derivative (torch.func.jvp returned zeros).
    TORCH_CHECK(!(v.isTensor() && v.toTensor()._fw_grad(/*level=*/0).defined()), op_name(schema), ": ",
                schema.arguments()[i].name(), " has a forward-mode tangent (torch.autograd.forward_ad, "
                "torch.func.jvp), but pagedkv's ops have no derivative; pass a tensor without one");
    if (at::GradMode::is_enabled() && v.isTensor() && v.toTensor().requires_grad()) {
      requiring_grad.push_back(v.toTensor());
      names += (names.empty() ? "" : ", ") + schema.arguments()[i].name();
    }
  }
  if (requiring_grad.empty()) {
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  const std::string name = op_name(schema);
  const std::string first = names.substr(0, names.find(','));
  const char *require = requiring_grad.size() == 1 ? " requires grad" : " require grad";
  const std::string advice = "call it under torch.no_grad() or torch.inference_mode(), or pass " + first + ".detach()";
  TORCH_CHECK(!writes, name, ": ", names, require, ", but ", name,
              " writes its results into tensors autograd does not track (pagedkv's ops have no backward); ", advice);
  auto grad_fn = c10::make_intrusive<torch::autograd::Error>(
      name + " has no backward (pagedkv's ops are inference only), and " + names + require + "; " + advice +
          " where no gradient should flow",
      torch::autograd::collect_next_edges(requiring_grad));
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  const size_t num_returns = schema.returns().size();
  for (size_t j = stack->size() - num_returns; j < stack->size(); j++) {
    if ((*stack)[j].isTensor()) torch::autograd::set_history((*stack)[j].toTensor(), grad_fn);
  }
}

void bump_written_versions(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
  const c10::FunctionSchema &schema = op.schema();
  std::vector<at::Tensor> written;  // taken before the call pops its arguments
  for (size_t i = 0; i < schema.arguments().size(); i++) {
    const c10::IValue &v = argument(stack, schema, i);
    if (is_written(schema.arguments()[i]) && v.isTensor()) written.push_back(v.toTensor());
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::ADInplaceOrView),
                       stack);
  }
  for (const at::Tensor &t : written) {
    if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  }
}

void resolve_negative_views(const c10::OperatorHandle &op, c10::DispatchKeySet keys, torch::jit::Stack *stack) {
  const c10::FunctionSchema &schema = op.schema();
  for (size_t i = 0; i < schema.arguments().size(); i++) {
    const c10::IValue &v = argument(stack, schema, i);
    const std::string &arg = schema.arguments()[i].name();
    TORCH_CHECK(!(is_written(schema.arguments()[i]) && v.isTensor() && v.toTensor().is_neg()), op_name(schema),
                ": ", arg, " must not be a negative view (torch._neg_view: its memory holds the negated values), "
                "which cannot be written in place; pass a tensor without the neg bit");
  }
  for (size_t i = 0; i < schema.arguments().size(); i++) {
    c10::IValue &v = argument(stack, schema, i);
    if (v.isTensor() && v.toTensor().is_neg()) v = v.toTensor().resolve_neg();
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::Negative), stack);
}

}  // namespace
}  // namespace pagedkv

// Every op of ops_schema.cpp (debug_load_tile and _vllm_cpu_fp8_values included: they are ops too).
TORCH_LIBRARY_IMPL(pagedkv, Autograd, m) {
  for (const char *op : {"paged_store", "paged_load", "flash_attn_paged", "flash_attn_paged.out",
                         "flash_attn_paged_lse", "merge_attn_states", "flash_attn_paged_sparse", "copy_pages",
                         "_vllm_cpu_fp8_values", "debug_load_tile"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&pagedkv::autograd_kernel>());
  }
}

// The ops that write into their arguments.
TORCH_LIBRARY_IMPL(pagedkv, ADInplaceOrView, m) {
  for (const char *op : {"paged_store", "paged_load", "flash_attn_paged.out", "copy_pages"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&pagedkv::bump_written_versions>());
  }
}

TORCH_LIBRARY_IMPL(pagedkv, Negative, m) {
  for (const char *op : {"paged_store", "paged_load", "flash_attn_paged.out", "copy_pages"}) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&pagedkv::resolve_negative_views>());
  }
}
