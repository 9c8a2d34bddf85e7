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

cudaError_t new_stream(int device, bool high_priority, cudaStream_t* out) {
  // The caller makes `device` current (fastddp/hooks/runtime.py): a cudaSetDevice here, to
  // another device and back, would make a context on a device this process may not use.
  int current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess) {
    return e;
  }
  if (current != device) {
    return cudaErrorInvalidDevice;
  }
  int least = 0, greatest = 0;  // (numerically: greatest priority is the lowest number)
  e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  if (e != cudaSuccess) {
    return e;
  }
  return cudaStreamCreateWithPriority(out, cudaStreamNonBlocking, high_priority ? greatest : least);
}

cudaError_t synchronize(int device) {
  // The bucket's device, which the autograd thread that runs the hook has made current; DDP
  // may run a hook on the caller's thread too (at the end of backward), whose device may be
  // another: switched to for the wait, and back (the bucket's device has its context).
  int current = 0;
  cudaError_t e = cudaGetDevice(&current);
  if (e != cudaSuccess || current == device) {
    return e != cudaSuccess ? e : cudaDeviceSynchronize();
  }
  e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    return e;
  }
  e = cudaDeviceSynchronize();
  const cudaError_t back = cudaSetDevice(current);
  return e != cudaSuccess ? e : back;
}

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

}  // namespace

template <class Args>
cudaError_t run(int device, cudaStream_t stream, const Args& args) {
  CudaRuntime rt{device, stream};
  kernels::run(rt, args);
  return rt.error;
}

template cudaError_t run(int, cudaStream_t, const CompressArgs&);
template cudaError_t run(int, cudaStream_t, const DecompressArgs&);
template cudaError_t run(int, cudaStream_t, const SumChunksArgs&);
template cudaError_t run(int, cudaStream_t, const WidenSumArgs&);
template cudaError_t run(int, cudaStream_t, const QuantizeArgs&);
template cudaError_t run(int, cudaStream_t, const RequantizeArgs&);
template cudaError_t run(int, cudaStream_t, const DequantizeArgs&);
template cudaError_t run(int, cudaStream_t, const UnpackArgs&);

}  // namespace fastddp::cuda
