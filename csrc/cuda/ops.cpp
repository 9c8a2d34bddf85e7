// The CUDA backend of the fastddp ops: each op's entry (fastddp/ops.h) checks the tensors, and
// this backend runs its launches (launches.h, compiled by nvcc) on torch's current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fastddp/ops.h"
#include "launches.h"

namespace fastddp {
namespace {

// An op's launches on the device of its tensors, which stays current until they are done.
struct CudaBackend {
  c10::cuda::CUDAGuard guard;
  int device;
  cudaStream_t stream;

  explicit CudaBackend(const at::Tensor& t)
      : guard(t.device()),
        device(t.get_device()),
        stream(c10::cuda::getCurrentCUDAStream(device).stream()) {}

  template <class Args>
  void run(const Args& args) {
    C10_CUDA_CHECK(cuda::run(device, stream, args));
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CUDA, m) {
  ops::register_ops<CudaBackend>(m);
}

}  // namespace fastddp
