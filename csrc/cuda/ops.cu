// The CUDA backend of the fastddp ops: each op's entry (fastddp/ops.h) checks the tensors, and
// this backend launches its kernel (launch.h, *kernels.cuh) on torch's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "fastddp/ops.h"
#include "launch.h"

namespace fastddp {
namespace {

// The runtime of launch.h on a CUDA device: torch's current stream, checked launches.
struct CudaRuntime {
  int device;
  cudaStream_t stream;

  // The blocks of `kernel` the device runs at once: its multiprocessors times the blocks of
  // kThreads that fit on one (registers, shared memory). Cached per device and kernel: ops are
  // called from several threads (DDP's autograd threads, a side stream's callbacks).
  template <class Kernel>
  int resident(Kernel kernel) const {
    static std::mutex lock;
    static std::map<std::pair<int, const void*>, int> cache;
    const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
    const std::lock_guard<std::mutex> held(lock);
    auto it = cache.find(key);
    if (it == cache.end()) {
      int sms = 0;
      int per_sm = 0;
      C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
      C10_CUDA_CHECK(
          cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kernels::kThreads, 0));
      it = cache.emplace(key, sms * std::max(per_sm, 1)).first;
    }
    return it->second;
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
