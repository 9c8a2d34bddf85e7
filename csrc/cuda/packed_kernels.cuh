// The CUDA kernels of the packed ops: int4 and int2 codes, 8 / bits to a byte, one fp32 scale
// per block. The element math is fastddp/rounding.h's, as in the CPU loops (cpu/packed_loops.cpp):
// the same bits on both. Compiled like kernels.cuh, by nvcc and by the grid emulator.
#pragma once

#include "kernels.cuh"

namespace fastddp::kernels {

// One warp per block, as quantize_int8_kernel: a butterfly of shuffles gives every lane the
// block's absolute maximum, then each lane packs whole bytes of the block. A block holds whole
// bytes, so no two warps write one byte.
template <int kBits>
__global__ void quantize_packed_kernel(
    const float* __restrict__ src,
    uint8_t* __restrict__ q,
    float* __restrict__ scales,
    float* __restrict__ residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  constexpr int kPer = 8 / kBits;
  const float qmax = code_max(kBits);
  const math::Mode mode = mode_of(residual, seed);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = blocks_of(n, block);
  bool bad = false;
  for (int64_t b = thread_index() / 32; b < nblocks; b += warps) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    const int64_t row = lo / rows.row_len;
    const int64_t row_first = row * rows.row_len;
    uint32_t absmax = 0;
    for (int64_t i = lo + lane; i < hi; i += 32) {
      absmax = math::abs_bits_max(absmax, math::rounding_input(mode, src[i], scale, i));
    }
    for (int offset = 16; offset > 0; offset /= 2) {
      const uint32_t other = __shfl_xor_sync(0xffffffffu, absmax, offset);
      absmax = other > absmax ? other : absmax;
    }
    const float step = math::block_scale(absmax, qmax);
    const float inverse = math::block_inverse(absmax, qmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      scales[row * rows.s_stride + (lo - row_first) / block] = step;
    }
    bad |= block_bad;
    // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
    uint8_t* bytes = q + row * rows.q_stride;
    const int64_t end_byte = (hi - row_first + kPer - 1) / kPer;
    for (int64_t k = (lo - row_first) / kPer + lane; k < end_byte; k += 32) {
      uint32_t byte = 0;
      for (int j = 0; j < kPer; ++j) {
        const int64_t i = row_first + k * kPer + j;
        if (i < hi && !block_bad) {  // the last byte of the last block may be short
          const float v = math::rounding_input(mode, src[i], scale, i);
          byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, j);
        }
      }
      bytes[k] = static_cast<uint8_t>(byte);
    }
  }
  raise_flag(bad, flag);
}

// Code `col` of row `row`, times its block's scale.
template <int kBits>
__device__ __forceinline__ float packed_value(
    const uint8_t* __restrict__ q, const float* __restrict__ scales, const Int8Rows& rows,
    int64_t block, int64_t row, int64_t col) {
  constexpr int kPer = 8 / kBits;
  const int32_t c = unpack_code(q[row * rows.q_stride + col / kPer], kBits, col % kPer);
  return math::mul(static_cast<float>(c), scales[row * rows.s_stride + col / block]);
}

// The rows.rows rows of rows.row_len codes, dequantised and summed per column in row order.
template <int kBits>
__global__ void dequantize_packed_kernel(
    const uint8_t* __restrict__ src,
    const float* __restrict__ scales,
    int64_t block,
    Int8Rows rows,
    float* __restrict__ dst,
    float scale) {
  grid_stride_loop(0, rows.row_len, [&](int64_t i) {
    float acc = packed_value<kBits>(src, scales, rows, block, 0, i);
    for (int64_t p = 1; p < rows.rows; ++p) {
      acc = math::add(acc, packed_value<kBits>(src, scales, rows, block, p, i));
    }
    dst[i] = math::mul(acc, scale);
  });
}

// The flat sequence of n values the rows hold, dequantised.
template <int kBits>
__global__ void unpack_packed_kernel(
    const uint8_t* __restrict__ src,
    const float* __restrict__ scales,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float* __restrict__ dst,
    float scale) {
  grid_stride_loop(0, n, [&](int64_t i) {
    const int64_t row = i / rows.row_len;
    const float v = packed_value<kBits>(src, scales, rows, block, row, i - row * rows.row_len);
    dst[i] = math::mul(v, scale);
  });
}

}  // namespace fastddp::kernels
