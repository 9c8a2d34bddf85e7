// What the quantize kernels round, element by element (at) or a chunk of 4 at a time (load):
// quantize's fp32 values (FlatValues), or requantize's column sums of rows of codes
// (SummedRows), worked out as dequantize works them out, so that requantize writes the bits that
// dequantize followed by quantize would, without the fp32 sums' trip through memory. Compiled
// like kernels.cuh, by nvcc and by the grid emulator.
#pragma once

#include <type_traits>

#include "packed_kernels.cuh"

namespace fastddp::kernels {

// The blocks of quantize_vec_kernel a multiprocessor holds (kBlocksPerSm, its launch bounds),
// by what it rounds: 4 (64 registers) for fp32 values; 3 (80) for sums of rows, whose rows'
// pieces and scales in flight spilled 4 to 24 bytes a lane to local memory at 64. And whether
// one instance rounds to nearest or stochastically, as the call says (kStochasticAtRun): for
// the sums, so that they add 6 instances to the build rather than 12 (nvcc took twice as long
// for launches.cu with 12); stochastic rounding of a reduce step is the rarer setting.

// n fp32 values.
struct FlatValues {
  static constexpr int kBlocksPerSm = 4;
  static constexpr bool kStochasticAtRun = false;

  const float* src;

  __device__ __forceinline__ float at(int64_t i) const {
    return src[i];
  }

  // Chunk k's values, zeros past its count: one 16-byte access when it is whole.
  __device__ __forceinline__ void load(const Chunk& k, float (&x)[kChunk]) const {
    load_chunk(src, k, x);
  }
};

// The column sums of rows.rows rows of codes of kBits bits (n = rows.row_len columns) in fp32,
// in row order, times `scale`: element i is code i of each row times its block's scale, summed.
template <int kBits>
struct SummedRows {
  static constexpr int kBlocksPerSm = 3;
  static constexpr bool kStochasticAtRun = true;

  Int8Source src;
  Divider by_block;
  float scale;

  __device__ __forceinline__ float at(int64_t i) const {
    using Reader = std::conditional_t<kBits == 8, Int8Codes, PackedCodes<kBits>>;
    const Reader codes{src};
    float acc = codes(0, i);
    for (int64_t p = 1; p < src.rows.rows; ++p) {
      acc = math::add(acc, codes(p, i));
    }
    return math::mul(acc, scale);
  }

  // Chunk k's sums, zeros past its count: its piece of each row (the vector kernel's layouts:
  // each row's codes aligned to a piece), two rows at a time, both rows' loads in flight before
  // either is added; past the last row a lane loads it again and adds nothing of it.
  __device__ __forceinline__ void load(const Chunk& k, float (&x)[kChunk]) const {
    if (k.count == 0) {
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        x[j] = 0.0f;
      }
      return;
    }
    const int64_t rows = src.rows.rows;
    const int64_t b = by_block.div(k.first);  // the chunk's block, in every row
    const auto* q = reinterpret_cast<const uint8_t*>(src.q) + k.index * Pieces<kBits>::kBytes;
    auto piece_at = [&](int64_t p) {
      const uint8_t* at = q + p * src.rows.q_stride;
      return k.count == kChunk ? load_own_piece<kBits>(at)
                               : load_piece<kBits>(at, k.index, k.count, false);
    };
    float acc[kChunk];
    for (int64_t p0 = 0; p0 < rows; p0 += 2) {
      const int64_t p1 = p0 + 1 < rows ? p0 + 1 : p0;
      const uint32_t piece0 = piece_at(p0);
      const uint32_t piece1 = piece_at(p1);
      const float step0 = src.scales[p0 * src.rows.s_stride + b];
      const float step1 = src.scales[p1 * src.rows.s_stride + b];
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        const float term = math::mul(piece_code<kBits>(piece0, j), step0);
        acc[j] = p0 == 0 ? term : math::add(acc[j], term);
      }
      if (p0 + 1 < rows) {
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          acc[j] = math::add(acc[j], math::mul(piece_code<kBits>(piece1, j), step1));
        }
      }
    }
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      x[j] = j < k.count ? math::mul(acc[j], scale) : 0.0f;
    }
  }
};

}  // namespace fastddp::kernels
