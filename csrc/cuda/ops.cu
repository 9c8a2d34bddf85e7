// CUDA implementations of the fastddp ops. Each op is one grid-stride kernel: 16-byte loads and
// stores of 8 elements per step when both pointers allow it, a scalar loop for the rest.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "fastddp/checks.h"
#include "fastddp/dispatch.h"

namespace fastddp {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 8;  // elements per 16-byte wire access

template <typename T>
struct Wire;

template <>
struct Wire<c10::Half> {
  static constexpr uint16_t kExpMask = 0x7c00;
  __device__ static uint16_t from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
  __device__ static float to_float(uint16_t h) {
    return __half2float(__ushort_as_half(h));
  }
};

template <>
struct Wire<c10::BFloat16> {
  static constexpr uint16_t kExpMask = 0x7f80;
  __device__ static uint16_t from_float(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
  __device__ static float to_float(uint16_t h) {
    return __bfloat162float(__ushort_as_bfloat16(h));
  }
};

template <typename W>
__device__ __forceinline__ bool nonfinite(uint16_t w) {
  return (w & 0x7fffu) >= W::kExpMask;
}

template <typename W>
__device__ __forceinline__ uint32_t pack2(float a, float b, float scale, bool& bad) {
  const uint16_t lo = W::from_float(a * scale);
  const uint16_t hi = W::from_float(b * scale);
  bad |= nonfinite<W>(lo) | nonfinite<W>(hi);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

template <typename W>
__global__ void compress_kernel(
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    int64_t n,
    float scale,
    bool vectorised,
    int* __restrict__ found_nonfinite) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  bool bad = false;
  int64_t tail = 0;
  if (vectorised) {
    const int64_t nvec = n / kVec;
    const float4* in = reinterpret_cast<const float4*>(src);
    uint4* out = reinterpret_cast<uint4*>(dst);
    for (int64_t v = tid; v < nvec; v += stride) {
      const float4 a = in[2 * v];
      const float4 b = in[2 * v + 1];
      uint4 w;
      w.x = pack2<W>(a.x, a.y, scale, bad);
      w.y = pack2<W>(a.z, a.w, scale, bad);
      w.z = pack2<W>(b.x, b.y, scale, bad);
      w.w = pack2<W>(b.z, b.w, scale, bad);
      out[v] = w;
    }
    tail = nvec * kVec;
  }
  for (int64_t i = tail + tid; i < n; i += stride) {
    const uint16_t w = W::from_float(src[i] * scale);
    dst[i] = w;
    bad |= nonfinite<W>(w);
  }
  // The flag was zeroed before launch; any block that saw a non-finite value sets it.
  if (found_nonfinite != nullptr) {
    if (__syncthreads_or(bad) && threadIdx.x == 0) {
      *found_nonfinite = 1;
    }
  }
}

template <typename W>
__device__ __forceinline__ float2 unpack2(uint32_t w, float scale) {
  return make_float2(
      W::to_float(static_cast<uint16_t>(w & 0xffffu)) * scale,
      W::to_float(static_cast<uint16_t>(w >> 16)) * scale);
}

template <typename W>
__global__ void decompress_kernel(
    const uint16_t* __restrict__ src,
    float* __restrict__ dst,
    int64_t n,
    float scale,
    bool vectorised) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t tail = 0;
  if (vectorised) {
    const int64_t nvec = n / kVec;
    const uint4* in = reinterpret_cast<const uint4*>(src);
    float4* out = reinterpret_cast<float4*>(dst);
    for (int64_t v = tid; v < nvec; v += stride) {
      const uint4 w = in[v];
      const float2 p = unpack2<W>(w.x, scale);
      const float2 q = unpack2<W>(w.y, scale);
      const float2 r = unpack2<W>(w.z, scale);
      const float2 s = unpack2<W>(w.w, scale);
      out[2 * v] = make_float4(p.x, p.y, q.x, q.y);
      out[2 * v + 1] = make_float4(r.x, r.y, s.x, s.y);
    }
    tail = nvec * kVec;
  }
  for (int64_t i = tail + tid; i < n; i += stride) {
    dst[i] = W::to_float(src[i]) * scale;
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Enough blocks to fill the device a few times over; the kernels stride over the rest.
int grid_for(int64_t work, int device) {
  static int sms[64] = {0};
  int& count = sms[device % 64];
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  }
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{count} * 8)));
}

void compress_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite) {
  check_bucket_and_wire("compress", src, dst);
  check_flag("compress", found_nonfinite, src);
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int* flag = nullptr;
  if (found_nonfinite.has_value()) {
    flag = found_nonfinite->data_ptr<int32_t>();
    C10_CUDA_CHECK(cudaMemsetAsync(flag, 0, sizeof(int32_t), stream));
  }
  const int64_t n = src.numel();
  if (n == 0) {
    return;
  }
  const float* in = src.const_data_ptr<float>();
  uint16_t* out = static_cast<uint16_t*>(dst.data_ptr());
  const bool vec = aligned16(in) && aligned16(out);
  const int grid = grid_for(vec ? n / kVec + 1 : n, src.get_device());
  FASTDDP_DISPATCH_WIRE(dst.scalar_type(), "compress", [&] {
    compress_kernel<Wire<wire_t>><<<grid, kThreads, 0, stream>>>(
        in, out, n, static_cast<float>(scale), vec, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void decompress_cuda(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_bucket_and_wire("decompress", dst, src);
  const int64_t n = src.numel();
  if (n == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const uint16_t* in = static_cast<const uint16_t*>(src.const_data_ptr());
  float* out = dst.data_ptr<float>();
  const bool vec = aligned16(in) && aligned16(out);
  const int grid = grid_for(vec ? n / kVec + 1 : n, src.get_device());
  FASTDDP_DISPATCH_WIRE(src.scalar_type(), "decompress", [&] {
    decompress_kernel<Wire<wire_t>><<<grid, kThreads, 0, stream>>>(
        in, out, n, static_cast<float>(scale), vec);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CUDA, m) {
  m.impl("compress", &compress_cuda);
  m.impl("decompress", &decompress_cuda);
}

}  // namespace fastddp
