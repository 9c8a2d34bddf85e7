// The launches of launches.h: the runtime of launch.h on a CUDA device. No torch header here
// (see launches.h); errors are returned, not thrown.
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <utility>

#include "launch.h"
#include "launches.h"

namespace fastddp::cuda {
namespace {

// Runs launch.h's calls on `stream` and keeps the first error; after one it launches nothing.
struct CudaRuntime {
  int device;
  cudaStream_t stream;
  cudaError_t error = cudaSuccess;

  void keep(cudaError_t e) {
    if (error == cudaSuccess) {
      error = e;
    }
  }

  // The blocks of `kernel` the device runs at once: its multiprocessors times the blocks of
  // kThreads that fit on one (registers, shared memory). Cached per device and kernel: ops are
  // called from several threads (DDP's autograd threads, a side stream's callbacks).
  template <class Kernel>
  int resident(Kernel kernel) {
    static std::mutex lock;
    static std::map<std::pair<int, const void*>, int> cache;
    const auto key = std::make_pair(device, reinterpret_cast<const void*>(kernel));
    const std::lock_guard<std::mutex> held(lock);
    auto it = cache.find(key);
    if (it != cache.end()) {
      return it->second;
    }
    int sms = 0;
    int per_sm = 0;
    cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e == cudaSuccess) {
      e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kernels::kThreads, 0);
    }
    if (e != cudaSuccess) {
      keep(e);
      return 1;  // not cached, and nothing is launched after the error
    }
    return cache.emplace(key, sms * std::max(per_sm, 1)).first->second;
  }

  void zero_flag(int* flag) {
    if (error == cudaSuccess) {
      keep(cudaMemsetAsync(flag, 0, sizeof(int32_t), stream));
    }
  }

  template <class... P, class... A>
  void launch(void (*kernel)(P...), int grid, A... args) {
    if (error == cudaSuccess) {
      kernel<<<grid, kernels::kThreads, 0, stream>>>(static_cast<P>(args)...);
      keep(cudaGetLastError());
    }
  }
};

template <class Args>
cudaError_t run_args(int device, cudaStream_t stream, const Args& args) {
  CudaRuntime rt{device, stream};
  kernels::run(rt, args);
  return rt.error;
}

}  // namespace

cudaError_t run(int device, cudaStream_t stream, const CompressArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const DecompressArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const SumChunksArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const WidenSumArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const QuantizeArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const DequantizeArgs& args) {
  return run_args(device, stream, args);
}
cudaError_t run(int device, cudaStream_t stream, const UnpackArgs& args) {
  return run_args(device, stream, args);
}

}  // namespace fastddp::cuda
