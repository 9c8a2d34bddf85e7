// The scalar kernels of the packed ops: int4 and int2 codes, 8 / bits to a byte, one fp32 scale
// per block, for the layouts that the vector kernels of codes_kernels.cuh (quantize_vec_kernel,
// dequantize_vec_kernel, unpack_vec_kernel, which take int8, int4 and int2) cannot take. The
// element math is fastddp/rounding.h's, as in the CPU loops (cpu/packed_loops.cpp): the same
// bits on both. Compiled like kernels.cuh, by nvcc and by the grid emulator.
#pragma once

#include "codes_kernels.cuh"

namespace fastddp::kernels {

// One warp per block, as quantize_int8_kernel (warp_absmax), then each lane packs whole bytes
// of the block. A block holds whole bytes, so no two warps write one byte.
template <int kBits, class Values>
__global__ void quantize_packed_kernel(QuantizeArgs a, Values source) {
  constexpr int kPer = 8 / kBits;
  const float qmax = code_max(kBits);
  const math::Mode mode = a.rounding.mode();
  const Int8Rows& rows = a.rows;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = blocks_of(a.n, a.block);
  bool bad = false;
  for (int64_t b = thread_index() / 32; b < nblocks; b += warps) {
    const int64_t lo = b * a.block;
    const int64_t hi = lo + a.block < a.n ? lo + a.block : a.n;
    const int64_t row = lo / rows.row_len;
    const int64_t row_first = row * rows.row_len;
    const uint32_t absmax = warp_absmax(mode, source, a.scale, lo, hi, lane);
    const float step = math::block_scale(absmax, qmax);
    const float inverse = math::block_inverse(absmax, qmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      a.scales[row * rows.s_stride + (lo - row_first) / a.block] = step;
    }
    bad |= block_bad;
    // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
    uint8_t* bytes = reinterpret_cast<uint8_t*>(a.dst) + row * rows.q_stride;
    const int64_t end_byte = (hi - row_first + kPer - 1) / kPer;
    for (int64_t k = (lo - row_first) / kPer + lane; k < end_byte; k += 32) {
      uint32_t byte = 0;
      FASTDDP_UNROLL
      for (int j = 0; j < kPer; ++j) {
        const int64_t i = row_first + k * kPer + j;
        if (i < hi && !block_bad) {  // the last byte of the last block may be short
          const float v = math::rounding_input(mode, source.at(i), a.scale, i);
          byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, j);
        }
      }
      bytes[k] = static_cast<uint8_t>(byte);
    }
  }
  raise_flag(bad, a.rounding.flag);
}

// Reads packed codes as Int8Codes reads int8 ones (codes_kernels.cuh's dequantize_kernel and
// unpack_kernel take either).
template <int kBits>
struct PackedCodes {
  Int8Source src;

  __device__ __forceinline__ float operator()(int64_t row, int64_t col) const {
    constexpr int kPer = 8 / kBits;
    const auto* bytes = reinterpret_cast<const uint8_t*>(src.q) + row * src.rows.q_stride;
    const int32_t code = unpack_code(bytes[col / kPer], kBits, col % kPer);
    const float step = src.scales[row * src.rows.s_stride + col / src.block];
    return math::mul(static_cast<float>(code), step);
  }
};

}  // namespace fastddp::kernels
