// The CUDA backend of the fastddp ops: each op's entry (fastddp/ops.h) checks the tensors, and
// this backend launches its kernel (launch.h, kernels.cuh) on torch's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <cstdint>

#include "fastddp/ops.h"
#include "launch.h"

namespace fastddp {
namespace {

// The runtime of launch.h on a CUDA device: torch's current stream, checked launches.
struct CudaRuntime {
  int device;
  cudaStream_t stream;

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

// An op's launch on the device of its tensors, which stays current until the launch is done.
struct CudaBackend {
  c10::cuda::CUDAGuard guard;
  CudaRuntime rt;

  explicit CudaBackend(const at::Tensor& t)
      : guard(t.device()),
        rt{t.get_device(), c10::cuda::getCurrentCUDAStream(t.get_device()).stream()} {}

  template <class Args>
  void run(const Args& args) {
    kernels::run(rt, args);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CUDA, m) {
  ops::register_ops<CudaBackend>(m);
}

}  // namespace fastddp
