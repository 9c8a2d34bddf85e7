// fastddp's CUDA kernels: every __global__ function, and nothing else. nvcc compiles this header
// into ops.cu; g++ compiles it unchanged into the CUDA grid emulator (csrc/emu), which runs the
// kernels on the CPU with CUDA's semantics. Launches go through launch.h.
//
// Each op is one grid-stride kernel. compress and decompress make 16-byte loads and stores of 8
// elements per step when both pointers allow it, and a scalar loop for the rest; the other
// kernels are plain grid-stride loops over the element math in fastddp/rounding.h, which the
// CPU loops share: same results, bit for bit.
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

using math::WireKind;

constexpr int kVec = 8;  // elements per 16-byte wire access

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

// Every kernel's loop: body(i) for each index i in [begin, end) that this thread handles, from
// begin + its index in the grid, in steps of the grid's thread count.
template <class Body>
__device__ __forceinline__ void grid_stride_loop(int64_t begin, int64_t end, Body body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + thread_index(); i < end; i += stride) {
    body(i);
  }
}

// The flag was zeroed before the launch; any block in which a thread saw a non-finite value
// sets it.
__device__ __forceinline__ void raise_flag(bool bad, int* flag) {
  if (flag != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) {
    *flag = 1;
  }
}

// fp32 <-> wire format K with CUDA's conversion instructions: to nearest even, and a NaN
// becomes the canonical 0x7fff.
template <WireKind K>
__device__ __forceinline__ uint16_t to_wire(float f) {
  return K == WireKind::kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(f))
                              : __half_as_ushort(__float2half_rn(f));
}

template <WireKind K>
__device__ __forceinline__ float from_wire(uint16_t h) {
  return K == WireKind::kBf16 ? __bfloat162float(__ushort_as_bfloat16(h))
                              : __half2float(__ushort_as_half(h));
}

template <WireKind K>
__device__ __forceinline__ uint32_t pack2(float a, float b, float scale, bool& bad) {
  const uint16_t lo = to_wire<K>(a * scale);
  const uint16_t hi = to_wire<K>(b * scale);
  bad |= math::wire_nonfinite(K, lo) | math::wire_nonfinite(K, hi);
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}

template <WireKind K>
__device__ __forceinline__ float2 unpack2(uint32_t w, float scale) {
  return make_float2(
      from_wire<K>(static_cast<uint16_t>(w & 0xffffu)) * scale,
      from_wire<K>(static_cast<uint16_t>(w >> 16)) * scale);
}

// The loop of compress and decompress over n elements: vec(v) handles elements 8v .. 8v + 7
// with one 16-byte wire access when `vectorised` (both pointers 16-byte aligned), one(i)
// handles element i, for the elements past the last whole vector or, if not vectorised, all.
template <class Vec, class One>
__device__ __forceinline__ void vector_loop(int64_t n, bool vectorised, Vec vec, One one) {
  const int64_t nvec = vectorised ? n / kVec : 0;
  grid_stride_loop(0, nvec, vec);
  grid_stride_loop(nvec * kVec, n, one);
}

template <WireKind K>
__global__ void compress_kernel(
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    int64_t n,
    float scale,
    bool vectorised,
    int* __restrict__ found_nonfinite) {
  bool bad = false;
  const float4* in = reinterpret_cast<const float4*>(src);
  uint4* out = reinterpret_cast<uint4*>(dst);
  vector_loop(
      n, vectorised,
      [&](int64_t v) {
        const float4 a = in[2 * v];
        const float4 b = in[2 * v + 1];
        uint4 w;
        w.x = pack2<K>(a.x, a.y, scale, bad);
        w.y = pack2<K>(a.z, a.w, scale, bad);
        w.z = pack2<K>(b.x, b.y, scale, bad);
        w.w = pack2<K>(b.z, b.w, scale, bad);
        out[v] = w;
      },
      [&](int64_t i) {
        const uint16_t w = to_wire<K>(src[i] * scale);
        dst[i] = w;
        bad |= math::wire_nonfinite(K, w);
      });
  raise_flag(bad, found_nonfinite);
}

template <WireKind K>
__global__ void decompress_kernel(
    const uint16_t* __restrict__ src,
    float* __restrict__ dst,
    int64_t n,
    float scale,
    bool vectorised) {
  const uint4* in = reinterpret_cast<const uint4*>(src);
  float4* out = reinterpret_cast<float4*>(dst);
  vector_loop(
      n, vectorised,
      [&](int64_t v) {
        const uint4 w = in[v];
        const float2 p = unpack2<K>(w.x, scale);
        const float2 q = unpack2<K>(w.y, scale);
        const float2 r = unpack2<K>(w.z, scale);
        const float2 s = unpack2<K>(w.w, scale);
        out[2 * v] = make_float4(p.x, p.y, q.x, q.y);
        out[2 * v + 1] = make_float4(r.x, r.y, s.x, s.y);
      },
      [&](int64_t i) { dst[i] = from_wire<K>(src[i]) * scale; });
}

// What compress (with error feedback or stochastic rounding) and sum_chunks do: each element
// i < n, whose fp32 value is value(i), rounded into dst by the shared element math.
template <class Value>
__device__ __forceinline__ void round_elements(
    WireKind kind, Value value, int64_t n, uint16_t* dst, float* residual, float scale,
    int64_t seed, int* flag) {
  const math::Mode mode = mode_of(residual, seed);
  bool bad = false;
  grid_stride_loop(0, n, [&](int64_t i) {
    bad |= math::round_element(kind, mode, math::rounding_input(mode, value(i), scale, i), dst, i);
  });
  raise_flag(bad, flag);
}

__global__ void compress_feedback_kernel(
    WireKind kind,
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    int64_t n,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  round_elements(kind, [&](int64_t i) { return src[i]; }, n, dst, residual, scale, seed, flag);
}

// Element i of the P rows of length m, summed in fp32 in order p = 0..P-1.
__device__ __forceinline__ float sum_rows(
    WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, int64_t i) {
  float acc = math::wire_to_float(kind, src[i]);
  for (int64_t p = 1; p < chunks; ++p) {
    acc = math::add(acc, math::wire_to_float(kind, src[p * m + i]));
  }
  return acc;
}

__global__ void sum_chunks_kernel(
    WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const auto row_sum = [&](int64_t i) { return sum_rows(kind, src, chunks, m, i); };
  round_elements(kind, row_sum, m, dst, residual, scale, seed, flag);
}

__global__ void widen_sum_kernel(
    WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    float* __restrict__ dst,
    float scale) {
  grid_stride_loop(0, m, [&](int64_t i) {
    dst[i] = math::mul(sum_rows(kind, src, chunks, m, i), scale);
  });
}

// The absolute maximum (as bits) of the rounding inputs of elements [lo, hi), for one warp: the
// lanes stride over the range, then a butterfly of shuffles gives every lane the result.
__device__ __forceinline__ uint32_t warp_absmax(
    const math::Mode& mode, const float* __restrict__ src, float scale, int64_t lo, int64_t hi,
    int lane) {
  uint32_t absmax = 0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    absmax = math::abs_bits_max(absmax, math::rounding_input(mode, src[i], scale, i));
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, absmax, offset);
    absmax = other > absmax ? other : absmax;
  }
  return absmax;
}

// One warp per int8 block: every lane gets the block's absolute maximum (warp_absmax), then
// each lane quantises its elements.
// Rows of q and scales may lie apart (see Int8Rows in layout.h); a block lies in one row.
__global__ void quantize_int8_kernel(
    const float* __restrict__ src,
    int8_t* __restrict__ q,
    float* __restrict__ scales,
    float* __restrict__ residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const math::Mode mode = mode_of(residual, seed);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = blocks_of(n, block);
  bool bad = false;
  for (int64_t b = thread_index() / 32; b < nblocks; b += warps) {
    const Int8Block blk = int8_block(rows, n, block, b, q, scales);
    const uint32_t absmax = warp_absmax(mode, src, scale, blk.lo, blk.hi, lane);
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      blk.scales[b] = step;
    }
    bad |= block_bad;
    // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
    for (int64_t i = blk.lo + lane; i < blk.hi; i += 32) {
      const float v = math::rounding_input(mode, src[i], scale, i);
      blk.q[i] = block_bad ? int8_t{0} : math::quantize_element(mode, v, inverse, step, i);
    }
  }
  raise_flag(bad, flag);
}

// Reads int8 codes laid out as Int8Source says: code `col` of row `row`, times its block's
// scale. PackedCodes (packed_kernels.cuh) reads int4 and int2 codes the same way.
struct Int8Codes {
  Int8Source src;

  __device__ __forceinline__ float operator()(int64_t row, int64_t col) const {
    const float code = static_cast<float>(src.q[row * src.rows.q_stride + col]);
    return math::mul(code, src.scales[row * src.rows.s_stride + col / src.block]);
  }
};

// The rows.rows rows of rows.row_len codes, dequantised and summed per column in row order.
template <class Codes>
__global__ void dequantize_kernel(Codes codes, float* __restrict__ dst, float scale) {
  const Int8Rows& rows = codes.src.rows;
  grid_stride_loop(0, rows.row_len, [&](int64_t i) {
    float acc = codes(0, i);
    for (int64_t p = 1; p < rows.rows; ++p) {
      acc = math::add(acc, codes(p, i));
    }
    dst[i] = math::mul(acc, scale);
  });
}

// The flat sequence of n values the rows hold, dequantised.
template <class Codes>
__global__ void unpack_kernel(Codes codes, int64_t n, float* __restrict__ dst, float scale) {
  const int64_t row_len = codes.src.rows.row_len;
  grid_stride_loop(0, n, [&](int64_t i) {
    const int64_t row = i / row_len;
    dst[i] = math::mul(codes(row, i - row * row_len), scale);
  });
}

}  // namespace fastddp::kernels
