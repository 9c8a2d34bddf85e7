// Every fastddp op schema, declared once. Backends register implementations with
// TORCH_LIBRARY_IMPL in csrc/cpu and csrc/cuda. Importing fastddp._C only runs these
// registrations; the Python wrappers live in fastddp/ops.py.
#include <Python.h>
#include <c10/core/AutogradState.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#ifndef FASTDDP_TORCH_VERSION
#define FASTDDP_TORCH_VERSION "unknown"
#endif
#ifndef FASTDDP_WITH_CUDA
#define FASTDDP_WITH_CUDA 0
#endif

TORCH_LIBRARY(fastddp, m) {
  // Scale an fp32 bucket and round it to fp16/bf16 into `dst` in one pass. When given,
  // `found_nonfinite` (int32, one element) is set to 1 if any written value is inf/NaN, else 0.
  // With `residual` (fp32, error feedback) the rounded value is src * scale + residual and the
  // residual becomes what the rounding dropped. `seed` >= 0 rounds stochastically.
  m.def(
      "compress(Tensor src, Tensor(a!) dst, float scale, Tensor(b!)? found_nonfinite=None, "
      "Tensor(c!)? residual=None, int seed=-1) -> ()");
  // Widen a fp16/bf16 buffer into the fp32 bucket `dst`, times `scale`, in one pass.
  m.def("decompress(Tensor src, Tensor(a!) dst, float scale) -> ()");
  // Sum the P rows of the 16-bit `src` [P, m] in fp32, times `scale`, and round once into the
  // 16-bit `dst` [m]; `found_nonfinite`, `residual` and `seed` as for compress.
  m.def(
      "sum_chunks(Tensor src, Tensor(a!) dst, float scale, Tensor(b!)? found_nonfinite=None, "
      "Tensor(c!)? residual=None, int seed=-1) -> ()");
  // Sum the P rows of the 16-bit `src` [P, m] in fp32, in order, times `scale`, into the fp32
  // `dst` [m]: the reduce step of a reduce-scatter whose result stays in fp32 (no rounding).
  m.def("widen_sum(Tensor src, Tensor(a!) dst, float scale) -> ()");
  // Quantise src * scale (+ residual) to int8 `dst` with one fp32 scale (absmax / 127) per
  // block of `block_size` elements; the last block may be short. `dst` is 1-D, or [R, m] rows
  // (which, like the rows of `scales`, may lie apart) that hold src's elements end to end.
  m.def(
      "quantize_int8(Tensor src, Tensor(a!) dst, Tensor(b!) scales, int block_size, float scale, "
      "Tensor(c!)? found_nonfinite=None, Tensor(d!)? residual=None, int seed=-1) -> ()");
  // Dequantise the P rows of int8 `src` [P, m] (scales [P, ceil(m / block_size)]) and sum them
  // in fp32 into `dst` [m], times `scale`.
  m.def(
      "dequantize_int8(Tensor src, Tensor scales, Tensor(a!) dst, int block_size, float scale) "
      "-> ()");
  // The inverse of quantize_int8 without a sum: the rows of int8 `src` (1-D, or [R, m] with
  // rows that may lie apart, as may the rows of `scales`), end to end, into the fp32 `dst`.
  m.def(
      "unpack_int8(Tensor src, Tensor scales, Tensor(a!) dst, int block_size, float scale) -> ()");
  // The int8 ops for 4- and 2-bit codes (`bits`), packed 8 / bits to a byte of the uint8 `dst`
  // / `src` (code j of a byte in bits [j * bits, (j + 1) * bits), two's complement), with one
  // fp32 scale (absmax / 7 or / 1) per block; block_size is a multiple of 8 / bits.
  m.def(
      "quantize_packed(Tensor src, Tensor(a!) dst, Tensor(b!) scales, int bits, int block_size, "
      "float scale, Tensor(c!)? found_nonfinite=None, Tensor(d!)? residual=None, int seed=-1) "
      "-> ()");
  m.def(
      "dequantize_packed(Tensor src, Tensor scales, Tensor(a!) dst, int bits, int block_size, "
      "float scale) -> ()");
  m.def(
      "unpack_packed(Tensor src, Tensor scales, Tensor(a!) dst, int bits, int block_size, "
      "float scale) -> ()");
  // dequantize_int8 / _packed (`bits` 8, 4 or 2) of the P rows of `src` [P, bytes] in fp32,
  // times `scale`, then quantize_int8 / _packed of that sum with scale 1 into the one row
  // `dst` (and `dst_scales`), in one pass: the same bits, without the fp32 sum in memory. A row
  // of `src` holds bytes * 8 / bits codes, as does `dst` (and `residual`, when given).
  m.def(
      "requantize(Tensor src, Tensor src_scales, Tensor(a!) dst, Tensor(b!) dst_scales, int bits, "
      "int block_size, float scale, Tensor(c!)? found_nonfinite=None, "
      "Tensor(d!)? residual=None, int seed=-1) -> ()");
}

namespace fastddp {
namespace {

// Every op writes into its `!` arguments and none has a derivative. Without kernels for the
// Autograd and ADInplaceOrView keys the dispatcher skips autograd for custom ops, so a write
// went unseen: a backward that had saved the tensor used the overwritten values without a
// word. (torch's own fallbacks for custom ops track the writes of returned tensors only, and
// these ops return nothing.) As for an in-place aten op, the Autograd kernel refuses a tensor
// that requires grad while grad mode is on (nothing could carry its gradient), and the
// ADInplaceOrView one, which runs in inference mode too, moves on the version counter of every
// tensor written, so that a backward that saved one of them raises instead.
void refuse_grad(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  // Forward mode too (dual tensors, torch.func.jvp, whose levels autograd sees as level 0):
  // an output's tangent would be left as it was, a silently wrong derivative.
  const bool backward = c10::GradMode::is_enabled();
  const bool forward = c10::AutogradState::get_tls_state().get_fw_grad_mode();
  for (size_t i = 0; i < arguments.size() && (backward || forward); ++i) {
    const c10::IValue& value = (*stack)[first + i];
    if (!value.isTensor()) {
      continue;
    }
    const at::Tensor& tensor = value.toTensor();
    TORCH_CHECK(
        !(backward && tensor.requires_grad()),
        "fastddp.", op.schema().name().substr(9), ": argument '", arguments[i].name(),
        "' requires grad, but the op has no derivative; call it under torch.no_grad(), or "
        "pass a tensor that does not require grad (.detach())");
    TORCH_CHECK(
        !(forward && tensor.defined() && tensor._fw_grad(/*level=*/0).defined()),
        "fastddp.", op.schema().name().substr(9), ": argument '", arguments[i].name(),
        "' carries a forward-mode derivative (a dual tensor, or torch.func.jvp), but the op "
        "has none; pass its primal (torch.autograd.forward_ad.unpack_dual(t).primal)");
  }
  c10::impl::ExcludeDispatchKeyGuard below(c10::autograd_dispatch_keyset);
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

void bump_versions(
    const c10::OperatorHandle& op,
    c10::DispatchKeySet keys,
    torch::jit::Stack* stack) {
  const auto& arguments = op.schema().arguments();
  const size_t first = stack->size() - arguments.size();
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const c10::IValue& value = (*stack)[first + i];  // an absent optional is no tensor
    const at::AliasInfo* alias = arguments[i].alias_info();
    if (value.isTensor() && alias != nullptr && alias->isWrite()) {
      const at::Tensor& t = value.toTensor();
      if (t.is_inference()) {
        TORCH_CHECK(
            c10::InferenceMode::is_enabled(),
            "fastddp.", op.schema().name().substr(9), ": argument '", arguments[i].name(),
            "' is an inference tensor, which may be written only inside torch.inference_mode(); "
            "write it there, or pass a clone made outside it");
        continue;  // it has no version counter
      }
      written.push_back(t);
    }
  }
  {
    c10::impl::ExcludeDispatchKeyGuard below(c10::DispatchKeySet(c10::DispatchKey::ADInplaceOrView));
    op.redispatchBoxed(keys & c10::after_ADInplaceOrView_keyset, stack);
  }
  for (const auto& t : written) {
    t.unsafeGetTensorImpl()->bump_version();
  }
}

constexpr const char* kOps[] = {
    "compress",        "decompress",      "sum_chunks",        "widen_sum",
    "quantize_int8",   "dequantize_int8", "unpack_int8",       "quantize_packed",
    "dequantize_packed", "unpack_packed", "requantize"};

}  // namespace
}  // namespace fastddp

TORCH_LIBRARY_IMPL(fastddp, Autograd, m) {
  for (const char* name : fastddp::kOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fastddp::refuse_grad>());
  }
}

TORCH_LIBRARY_IMPL(fastddp, ADInplaceOrView, m) {
  for (const char* name : fastddp::kOps) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&fastddp::bump_versions>());
  }
}

namespace fastddp::ddp {
#if defined(FASTDDP_WITHOUT_DDP_HOOKS)
// A build of the ops alone: `make cuda-check` compiles the CUDA sources this way (CMake's
// FASTDDP_DDP_HOOKS=OFF), as the hooks are host code that the extension's build compiles.
inline int add_ddp_hooks(PyObject*) {
  return 0;
}
#else
int add_ddp_hooks(PyObject* module);  // csrc/ddp/switch_hook.cpp
#endif
}  // namespace fastddp::ddp

extern "C" {
// A module whose import loads this library (and so the registrations above), plus what it was
// built against so that fastddp/_extension.py can refuse a stale build, and the DDP comm hook
// of fastddp.register_comm_hook (csrc/ddp).
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) {
    return nullptr;
  }
  if (PyModule_AddStringConstant(m, "torch_version", FASTDDP_TORCH_VERSION) < 0 ||
      PyModule_AddIntConstant(m, "with_cuda", FASTDDP_WITH_CUDA) < 0 ||
      fastddp::ddp::add_ddp_hooks(m) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
}
