// The wide decodes: dequantize and unpack of int8, int4 and int2 codes with 16 elements a lane,
// each lane's 16 codes of a row one aligned load (16, 8 or 4 bytes, as wide_kernels.cuh reads
// them) and its fp32 values four 16-byte stores. Compiled like kernels.cuh, by nvcc and by the
// grid emulator.
#pragma once

#include "wide_kernels.cuh"

namespace fastddp::kernels {

// ------------------------------------------------------------------ dequantize

// dequantize (int8, int4, int2) with 16 elements a lane: each row's 16 codes of a lane one load
// (16, 8 or 4 bytes), kSumRows rows in flight, summed as requantize sums them (load_wide of
// SummedRows, which sums as SummedRows::at and dequantize do), stored as four 16-byte stores.
// A warp's step is 512 columns; where all of them lie in the row (all steps but the last),
// whole accesses, else the lanes ask.
// Why: the vector kernel loads a lane's 16 columns of a row in 4 pieces of 4, 2 or 1 bytes, and
// on the H200 the packed codes reached 0.59-0.68 of a copy at 1 GB, writing 1.9 TB/s where
// unpack writes 3.2 TB/s (int8, 2 rows of 4 pieces in flight, 0.91). Giving a lane 16 bytes
// of each row (32 or 64 int4 or int2 sums, in registers across the rows) spilled to local
// memory.
// The layout (launch.h): codes and each row aligned to a lane's 16 codes, dst 16-byte
// aligned, blocks of a multiple of 16 elements.
template <int kBits>
__global__ void __launch_bounds__(kThreads, 4)
    dequantize_wide_kernel(Int8Source s, Divider by_block, float* __restrict__ dst, float scale) {
  const SummedRows<kBits> rows{s, by_block, scale};
  const int64_t m = s.rows.row_len;
  warp_loop((m + kWide - 1) / kWide, 32, [&](int64_t first) {
    const int64_t e = (first + lane_index()) * kWide;
    float x[kWide];
    if ((first + 32) * kWide <= m) {  // the same in every lane
      load_wide<true>(rows, e, kWide, x);
      FASTDDP_UNROLL
      for (int h = 0; h < kWide / 4; ++h) {
        store16(reinterpret_cast<float4*>(dst + e) + h,
                make_float4(x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]));
      }
      return;
    }
    const int count = e >= m ? 0 : (m - e >= kWide ? kWide : static_cast<int>(m - e));
    if (count > 0) {
      load_wide<false>(rows, e, count, x);
      FASTDDP_UNROLL
      for (int j = 0; j < kWide; ++j) {
        if (j < count) {
          dst[e + j] = x[j];
        }
      }
    }
  });
}

// ------------------------------------------------------------------ unpack

// Steps of 16 elements a lane of the wide unpack takes at once, their loads all issued before
// any value is stored: 64, 32 or 16 bytes of codes a lane in flight.
constexpr int kWideUnpackUnroll = 4;

// A lane's 16 codes of unpack from flat element e and their block's scale: one load where all
// of them exist (kWhole), byte by byte otherwise.
template <int kBits, bool kWhole>
struct WideUnpack {
  WideCodes<kBits> codes;
  float step;

  __device__ __forceinline__ void load(
      const Int8Source& s, const Divider& by_row, const Divider& by_block, int64_t e, int count) {
    step = 0.0f;
    if (!kWhole && count <= 0) {
      codes = {};
      return;
    }
    // A lane's 16 lie in one row and one block (rows of whole lanes: launch.h).
    const int64_t row = s.rows.rows == 1 ? 0 : by_row.div(e);
    const int64_t offset = e - row * s.rows.row_len;
    const auto* at = reinterpret_cast<const uint8_t*>(s.q) + row * s.rows.q_stride +
                     offset * kBits / 8;
    codes = load_codes<kBits, kWhole>(at, count);
    step = s.scales[row * s.rows.s_stride + by_block.div(offset)];
  }

  // Its values (code times step, times `scale`) to dst from e: four 16-byte stores where all
  // exist, the first `count` one by one otherwise.
  __device__ __forceinline__ void store(float* __restrict__ dst, float scale, int64_t e,
                                        int count) const {
    float x[kWide];
    FASTDDP_UNROLL
    for (int j = 0; j < kWide; ++j) {
      x[j] = math::mul(math::mul(codes.code(j), step), scale);
    }
    if (kWhole) {
      FASTDDP_UNROLL
      for (int h = 0; h < kWide / 4; ++h) {
        store16(reinterpret_cast<float4*>(dst + e) + h,
                make_float4(x[4 * h], x[4 * h + 1], x[4 * h + 2], x[4 * h + 3]));
      }
    } else {
      FASTDDP_UNROLL
      for (int j = 0; j < kWide; ++j) {
        if (j < count) {
          dst[e + j] = x[j];
        }
      }
    }
  }
};

// unpack (int8, int4, int2) with 16 elements a lane: a warp's step is kWideUnpackUnroll runs of
// 32 lanes' 16, every lane's codes and scales loaded before any value is stored; where all of
// them lie below n, whole accesses, else the lanes ask.
// The layout (launch.h): codes aligned to a lane's 16, one row or rows of whole lanes as far
// apart, dst 16-byte aligned, blocks of a multiple of 16 elements.
template <int kBits>
__global__ void unpack_wide_kernel(
    Int8Source s, Divider by_row, Divider by_block, int64_t n, float* __restrict__ dst,
    float scale) {
  constexpr int kU = kWideUnpackUnroll;
  warp_loop((n + kWide - 1) / kWide, 32 * kU, [&](int64_t first) {
    if ((first + 32 * kU) * kWide <= n) {  // the same in every lane
      WideUnpack<kBits, true> v[kU];
      FASTDDP_UNROLL
      for (int u = 0; u < kU; ++u) {
        v[u].load(s, by_row, by_block, (first + 32 * u + lane_index()) * kWide, kWide);
      }
      FASTDDP_UNROLL
      for (int u = 0; u < kU; ++u) {
        v[u].store(dst, scale, (first + 32 * u + lane_index()) * kWide, kWide);
      }
      return;
    }
    FASTDDP_UNROLL
    for (int u = 0; u < kU; ++u) {
      const int64_t e = (first + 32 * u + lane_index()) * kWide;
      const int count = e >= n ? 0 : (n - e >= kWide ? kWide : static_cast<int>(n - e));
      WideUnpack<kBits, false> v;
      v.load(s, by_row, by_block, e, count);
      v.store(dst, scale, e, count);
    }
  });
}

}  // namespace fastddp::kernels
