// The CUDA backend of the fastddp ops: the tensor checks, then the launch (launch.h) of a
// kernel (kernels.cuh) on torch's current stream.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <optional>

#include "fastddp/checks.h"
#include "launch.h"

namespace fastddp {
namespace {

// The runtime of launch.h on a CUDA device: torch's current stream, checked launches.
struct CudaRuntime {
  int device;
  cudaStream_t stream;

  explicit CudaRuntime(const at::Tensor& t)
      : device(t.get_device()), stream(c10::cuda::getCurrentCUDAStream(t.get_device())) {}

  int sms() const {
    // Cached per device in atomics: ops may be called from several threads (DDP's autograd
    // threads, a side stream's callbacks), and a query that races only repeats the same answer.
    static std::array<std::atomic<int>, 64> cache{};
    std::atomic<int>& cached = cache[static_cast<size_t>(device) % cache.size()];
    int count = cached.load(std::memory_order_relaxed);
    if (count == 0) {
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
      cached.store(count, std::memory_order_relaxed);
    }
    return count;
  }

  void zero_flag(int* flag) const {
    C10_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int32_t), stream));
  }

  template <class... P, class... A>
  void launch(void (*kernel)(P...), int grid, A... args) const {
    kernel<<<grid, kernels::kThreads, 0, stream>>>(static_cast<P>(args)...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

int* flag_of(const std::optional<at::Tensor>& flag) {
  return flag.has_value() ? flag->data_ptr<int32_t>() : nullptr;
}

void compress_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  check_compress(src, dst, found_nonfinite, residual);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::compress(
      rt, kind_of(dst.scalar_type()), src.const_data_ptr<float>(),
      static_cast<uint16_t*>(dst.data_ptr()), src.numel(), static_cast<float>(scale),
      residual_ptr(residual), seed, flag_of(found_nonfinite));
}

void decompress_cuda(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_bucket_and_wire("decompress", dst, src);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::decompress(
      rt, kind_of(src.scalar_type()), static_cast<const uint16_t*>(src.const_data_ptr()),
      dst.data_ptr<float>(), src.numel(), static_cast<float>(scale));
}

void sum_chunks_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  check_sum_chunks(src, dst, found_nonfinite, residual);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::sum_chunks(
      rt, kind_of(src.scalar_type()), static_cast<const uint16_t*>(src.const_data_ptr()),
      src.size(0), src.size(1), static_cast<uint16_t*>(dst.data_ptr()), residual_ptr(residual),
      static_cast<float>(scale), seed, flag_of(found_nonfinite));
}

void widen_sum_cuda(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_widen_sum(src, dst);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::widen_sum(
      rt, kind_of(src.scalar_type()), static_cast<const uint16_t*>(src.const_data_ptr()),
      src.size(0), src.size(1), dst.data_ptr<float>(), static_cast<float>(scale));
}

void quantize_int8_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& scales,
    int64_t block,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  const Int8Rows rows = check_quantize(src, dst, scales, block, found_nonfinite, residual);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::quantize_int8(
      rt, src.const_data_ptr<float>(), dst.data_ptr<int8_t>(), scales.data_ptr<float>(),
      residual_ptr(residual), src.numel(), block, rows, static_cast<float>(scale), seed,
      flag_of(found_nonfinite));
}

void dequantize_int8_cuda(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_dequantize(src, scales, dst, block);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::dequantize_int8(
      rt, src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), src.size(0),
      src.size(1), block, rows, dst.data_ptr<float>(), static_cast<float>(scale));
}

void unpack_int8_cuda(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_unpack(src, scales, dst, block);
  const c10::cuda::CUDAGuard guard(src.device());
  CudaRuntime rt(src);
  kernels::unpack_int8(
      rt, src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), dst.numel(), block,
      rows, dst.data_ptr<float>(), static_cast<float>(scale));
}

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CUDA, m) {
  m.impl("compress", &compress_cuda);
  m.impl("decompress", &decompress_cuda);
  m.impl("sum_chunks", &sum_chunks_cuda);
  m.impl("widen_sum", &widen_sum_cuda);
  m.impl("quantize_int8", &quantize_int8_cuda);
  m.impl("dequantize_int8", &dequantize_int8_cuda);
  m.impl("unpack_int8", &unpack_int8_cuda);
}

}  // namespace fastddp
