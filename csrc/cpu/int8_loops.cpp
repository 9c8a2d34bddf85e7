// The CPU loops of the int8 ops: quantize_int8, dequantize_int8, unpack_int8 and requantize's
// int8 codes, over the element math of fastddp/rounding.h that the CUDA kernels share.
// quantize_int8 is one template over the rounding mode and what it rounds; each loop is cloned
// per ISA (AVX-512, AVX2, baseline) and picked at load time.
#include <algorithm>

#include "fastddp/dispatch.h"
#include "loops.h"

namespace fastddp::cpu {
namespace {

// Blocks [first, last) of the n values that values(lo, hi) gives (FlatBlocks, SummedBlocks).
template <bool kFeedback, bool kStochastic, class Values>
FASTDDP_CLONES bool quantize_loop(
    Values&& values, int8_t* __restrict q, float* __restrict scales, float* __restrict residual,
    int64_t n, int64_t block, Int8Rows rows, int64_t first, int64_t last, float scale,
    uint64_t seed) {
  const math::Mode mode{kFeedback, residual, kStochastic, seed};
  bool bad = false;
  for (int64_t b = first; b < last; ++b) {
    const Int8Block blk = int8_block(rows, n, block, b, q, scales);
    const float* __restrict x = values(blk.lo, blk.hi);  // x[j]: element blk.lo + j
    const int64_t len = blk.hi - blk.lo;
    // Pass 1 finds the block's absolute maximum; pass 2 recomputes v (bit-identically, the
    // block is in cache) rather than storing it.
    uint32_t absmax = 0;
    for (int64_t j = 0; j < len; ++j) {
      absmax = math::abs_bits_max(absmax, math::rounding_input(mode, x[j], scale, blk.lo + j));
    }
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    blk.scales[b] = step;
    if (math::block_nonfinite(absmax)) {
      // Zeros and a NaN scale: the block dequantises to NaN; its residual is left alone.
      bad = true;
      std::fill(blk.q + blk.lo, blk.q + blk.hi, int8_t{0});
      continue;
    }
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = blk.lo + j;
      const float v = math::rounding_input(mode, x[j], scale, i);
      blk.q[i] = math::quantize_element(mode, v, inverse, step, i);
    }
  }
  return bad;
}

// Rows are summed a tile at a time into a small fp32 array, as in wire_loops.cpp.
constexpr int64_t kTile = 1024;

// Columns [begin, end) of the rows, summed, into out[0 .. end - begin).
FASTDDP_CLONES void dequantize_loop(
    const int8_t* __restrict src, const float* __restrict scales, int64_t block, Int8Rows rows,
    float* __restrict out, int64_t begin, int64_t end, float scale) {
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    for (int64_t p = 0; p < rows.rows; ++p) {
      const int8_t* row = src + p * rows.q_stride;
      // Within one int8 block the scale is fixed: a plain loop per block segment.
      for (int64_t i = t; i < t + len;) {
        const int64_t b = i / block;
        const int64_t stop = std::min((b + 1) * block, t + len);
        const float s = scales[p * rows.s_stride + b];
        float* a = acc + (i - t);
        const int8_t* q = row + i;
        const int64_t count = stop - i;
        if (p == 0) {
          for (int64_t j = 0; j < count; ++j) {
            a[j] = math::mul(static_cast<float>(q[j]), s);
          }
        } else {
          for (int64_t j = 0; j < count; ++j) {
            a[j] = math::add(a[j], math::mul(static_cast<float>(q[j]), s));
          }
        }
        i = stop;
      }
    }
    for (int64_t j = 0; j < len; ++j) {
      out[t - begin + j] = math::mul(acc[j], scale);
    }
  }
}

FASTDDP_CLONES void unpack_loop(
    const int8_t* __restrict src, const float* __restrict scales, int64_t block, Int8Rows rows,
    float* __restrict dst, int64_t begin, int64_t end, float scale) {
  // Row by row, and within a row block by block: each segment is a plain loop.
  for (int64_t i = begin; i < end;) {
    const int64_t row = i / rows.row_len;
    const int64_t col = i - row * rows.row_len;
    const int64_t b = col / block;
    const int64_t block_end = row * rows.row_len + (b + 1) * block;
    const int64_t stop = std::min({block_end, (row + 1) * rows.row_len, end});
    const float s = scales[row * rows.s_stride + b];
    const int8_t* q = src + row * rows.q_stride + col;
    float* out = dst + i;
    const int64_t count = stop - i;
    for (int64_t j = 0; j < count; ++j) {
      out[j] = math::mul(math::mul(static_cast<float>(q[j]), s), scale);
    }
    i = stop;
  }
}

template <class Values>
bool quantize(const QuantizeArgs& a, Values&& values, int64_t first_block, int64_t last_block) {
  const math::Mode mode = a.rounding.mode();
  return with_mode(mode, [&](auto feedback, auto stochastic) {
    return quantize_loop<decltype(feedback)::value, decltype(stochastic)::value>(
        values, a.dst, a.scales, mode.residual, a.n, a.block, a.rows, first_block, last_block,
        a.scale, mode.seed);
  });
}

}  // namespace

bool run(const QuantizeArgs& a, int64_t first_block, int64_t last_block) {
  if (a.bits != 8) {
    return run_packed(a, first_block, last_block);
  }
  return quantize(a, FlatBlocks{a.src}, first_block, last_block);
}

bool run(const RequantizeArgs& a, int64_t first_block, int64_t last_block) {
  if (a.src.bits != 8) {
    return run_packed(a, first_block, last_block);
  }
  const Int8Source& s = a.src;
  auto sum = [&](float* out, int64_t begin, int64_t end) {
    dequantize_loop(s.q, s.scales, s.block, s.rows, out, begin, end, a.scale);
  };
  const int64_t limit = std::min(a.out.n, last_block * a.out.block);
  return quantize(a.out, SummedBlocks(sum, limit, a.out.block), first_block, last_block);
}

bool run(const DequantizeArgs& a, int64_t begin, int64_t end) {
  if (a.src.bits != 8) {
    return run_packed(a, begin, end);
  }
  dequantize_loop(
      a.src.q, a.src.scales, a.src.block, a.src.rows, a.dst + begin, begin, end, a.scale);
  return false;
}

bool run(const UnpackArgs& a, int64_t begin, int64_t end) {
  if (a.src.bits != 8) {
    return run_packed(a, begin, end);
  }
  unpack_loop(a.src.q, a.src.scales, a.src.block, a.src.rows, a.dst, begin, end, a.scale);
  return false;
}

}  // namespace fastddp::cpu
