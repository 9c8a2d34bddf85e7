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
#include <array>
#include <atomic>
#include <cstdint>
#include <optional>

#include "fastddp/checks.h"
#include "fastddp/dispatch.h"
#include "fastddp/rounding.h"

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

// The accumulating and error-feedback kernels below are plain grid-stride loops over the
// element math in fastddp/rounding.h, which the CPU loops share: same results, bit for bit.
__device__ __forceinline__ void raise_flag(bool bad, int* flag) {
  if (flag != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) {
    *flag = 1;
  }
}

__global__ void compress_feedback_kernel(
    math::WireKind kind,
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    int64_t n,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool stochastic = seed >= 0;
  bool bad = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    float v = math::mul(src[i], scale);
    if (residual != nullptr) {
      v = math::add(v, residual[i]);
    }
    const uint32_t r = stochastic ? math::random_bits(seed, i) : 0u;
    bad |= math::round_with_feedback(
        kind, v, dst + i, residual == nullptr ? nullptr : residual + i, stochastic, r);
  }
  raise_flag(bad, flag);
}

// Element i of the P rows of length m, summed in fp32 in order p = 0..P-1.
__device__ __forceinline__ float sum_rows(
    math::WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, int64_t i) {
  float acc = math::wire_to_float(kind, src[i]);
  for (int64_t p = 1; p < chunks; ++p) {
    acc = math::add(acc, math::wire_to_float(kind, src[p * m + i]));
  }
  return acc;
}

__global__ void sum_chunks_kernel(
    math::WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const bool stochastic = seed >= 0;
  bool bad = false;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += stride) {
    float v = math::mul(sum_rows(kind, src, chunks, m, i), scale);
    if (residual != nullptr) {
      v = math::add(v, residual[i]);
    }
    const uint32_t r = stochastic ? math::random_bits(seed, i) : 0u;
    bad |= math::round_with_feedback(
        kind, v, dst + i, residual == nullptr ? nullptr : residual + i, stochastic, r);
  }
  raise_flag(bad, flag);
}

__global__ void widen_sum_kernel(
    math::WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    float* __restrict__ dst,
    float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += stride) {
    dst[i] = math::mul(sum_rows(kind, src, chunks, m, i), scale);
  }
}

// One warp per int8 block: the lanes stride over the block, a butterfly of shuffles gives every
// lane the block's absolute maximum, then each lane quantises its elements.
// Rows of dst and scales may lie apart (see Int8Rows in checks.h); a block lies in one row.
__global__ void quantize_int8_kernel(
    const float* __restrict__ src,
    int8_t* __restrict__ dst_base,
    float* __restrict__ scales_base,
    float* __restrict__ residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const int64_t row_blocks = (rows.row_len + block - 1) / block;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = (n + block - 1) / block;
  const bool stochastic = seed >= 0;
  bool bad = false;
  for (int64_t b = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
       b < nblocks; b += warps) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    const int64_t row = lo / rows.row_len;
    int8_t* dst = dst_base + row * (rows.q_stride - rows.row_len);
    float* scales = scales_base + row * (rows.s_stride - row_blocks);
    uint32_t absmax = 0;
    for (int64_t i = lo + lane; i < hi; i += 32) {
      float v = math::mul(src[i], scale);
      if (residual != nullptr) {
        v = math::add(v, residual[i]);
      }
      absmax = math::abs_bits_max(absmax, v);
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, absmax, offset);
      absmax = other > absmax ? other : absmax;
    }
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      scales[b] = step;
    }
    bad |= block_bad;
    for (int64_t i = lo + lane; i < hi; i += 32) {
      float v = math::mul(src[i], scale);
      if (residual != nullptr) {
        v = math::add(v, residual[i]);
      }
      const uint32_t r = stochastic ? math::random_bits(seed, i) : 0u;
      const int8_t q = block_bad ? int8_t{0} : math::quantize_int8(v, inverse, stochastic, r);
      dst[i] = q;
      if (residual != nullptr && !block_bad) {
        residual[i] = math::sub(v, math::mul(static_cast<float>(q), step));
      }
    }
  }
  raise_flag(bad, flag);
}

__global__ void dequantize_int8_kernel(
    const int8_t* __restrict__ src,
    const float* __restrict__ scales,
    int64_t chunks,
    int64_t m,
    int64_t block,
    Int8Rows rows,
    float* __restrict__ dst,
    float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < m;
       i += stride) {
    const int64_t b = i / block;
    float acc = math::mul(static_cast<float>(src[i]), scales[b]);
    for (int64_t p = 1; p < chunks; ++p) {
      acc = math::add(
          acc, math::mul(static_cast<float>(src[p * rows.q_stride + i]),
                         scales[p * rows.s_stride + b]));
    }
    dst[i] = math::mul(acc, scale);
  }
}

__global__ void unpack_int8_kernel(
    const int8_t* __restrict__ src,
    const float* __restrict__ scales,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float* __restrict__ dst,
    float scale) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const int64_t row = i / rows.row_len;
    const int64_t col = i - row * rows.row_len;
    const float s = scales[row * rows.s_stride + col / block];
    dst[i] = math::mul(math::mul(static_cast<float>(src[row * rows.q_stride + col]), s), scale);
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Enough blocks to fill the device a few times over; the kernels stride over the rest.
int grid_for(int64_t work, int device) {
  // Cached per device in atomics: ops may be called from several threads (DDP's autograd
  // threads, a side stream's callbacks), and a query that races only repeats the same answer.
  static std::array<std::atomic<int>, 64> sms{};
  std::atomic<int>& cached = sms[static_cast<size_t>(device) % sms.size()];
  int count = cached.load(std::memory_order_relaxed);
  if (count == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    cached.store(count, std::memory_order_relaxed);
  }
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{count} * 8)));
}

// Zeroes the flag on the stream (the kernels only ever set it) and returns its pointer.
int* flag_ptr(const std::optional<at::Tensor>& flag, cudaStream_t stream) {
  if (!flag.has_value()) {
    return nullptr;
  }
  int* p = flag->data_ptr<int32_t>();
  C10_CUDA_CHECK(cudaMemsetAsync(p, 0, sizeof(int32_t), stream));
  return p;
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int* flag = flag_ptr(found_nonfinite, stream);
  const int64_t n = src.numel();
  if (n == 0) {
    return;
  }
  const float* in = src.const_data_ptr<float>();
  uint16_t* out = static_cast<uint16_t*>(dst.data_ptr());
  if (residual.has_value() || seed >= 0) {
    compress_feedback_kernel<<<grid_for(n, src.get_device()), kThreads, 0, stream>>>(
        kind_of(dst.scalar_type()), in, out, residual_ptr(residual), n,
        static_cast<float>(scale), seed, flag);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
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

void sum_chunks_cuda(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  check_sum_chunks(src, dst, found_nonfinite, residual);
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int* flag = flag_ptr(found_nonfinite, stream);
  const int64_t m = src.size(1);
  if (m == 0) {
    return;
  }
  sum_chunks_kernel<<<grid_for(m, src.get_device()), kThreads, 0, stream>>>(
      kind_of(src.scalar_type()), static_cast<const uint16_t*>(src.const_data_ptr()),
      src.size(0), m, static_cast<uint16_t*>(dst.data_ptr()), residual_ptr(residual),
      static_cast<float>(scale), seed, flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void widen_sum_cuda(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_widen_sum(src, dst);
  const int64_t m = src.size(1);
  if (m == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  widen_sum_kernel<<<grid_for(m, src.get_device()), kThreads, 0, stream>>>(
      kind_of(src.scalar_type()), static_cast<const uint16_t*>(src.const_data_ptr()),
      src.size(0), m, dst.data_ptr<float>(), static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  int* flag = flag_ptr(found_nonfinite, stream);
  const int64_t n = src.numel();
  if (n == 0) {
    return;
  }
  // One warp per block of elements: kThreads / 32 int8 blocks per CUDA block.
  const int grid = grid_for(blocks_of(n, block) * 32, src.get_device());
  quantize_int8_kernel<<<grid, kThreads, 0, stream>>>(
      src.const_data_ptr<float>(), dst.data_ptr<int8_t>(), scales.data_ptr<float>(),
      residual_ptr(residual), n, block, rows, static_cast<float>(scale), seed, flag);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_int8_cuda(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_dequantize(src, scales, dst, block);
  const int64_t m = src.size(1);
  if (m == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  dequantize_int8_kernel<<<grid_for(m, src.get_device()), kThreads, 0, stream>>>(
      src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), src.size(0), m, block,
      rows, dst.data_ptr<float>(), static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void unpack_int8_cuda(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_unpack(src, scales, dst, block);
  const int64_t n = dst.numel();
  if (n == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(src.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  unpack_int8_kernel<<<grid_for(n, src.get_device()), kThreads, 0, stream>>>(
      src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), n, block, rows,
      dst.data_ptr<float>(), static_cast<float>(scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
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
