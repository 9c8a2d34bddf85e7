// fastddp's CUDA kernels: every __global__ function, and nothing else. nvcc compiles this header
// into ops.cu; g++ compiles it unchanged into the CUDA grid emulator (csrc/emu), which runs the
// kernels on the CPU with CUDA's semantics. Launches go through launch.h.
//
// Each op is one grid-stride kernel: 16-byte loads and stores of 8 elements per step when both
// pointers allow it, a scalar loop for the rest.
#pragma once

#include <cstdint>

#if defined(FASTDDP_EMU)
#include "../emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include "fastddp/layout.h"
#include "fastddp/rounding.h"

namespace fastddp::kernels {

constexpr int kVec = 8;  // elements per 16-byte wire access

struct WireFp16 {
  static constexpr uint16_t kExpMask = 0x7c00;
  __device__ static uint16_t from_float(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
  __device__ static float to_float(uint16_t h) {
    return __half2float(__ushort_as_half(h));
  }
};

struct WireBf16 {
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

}  // namespace fastddp::kernels
