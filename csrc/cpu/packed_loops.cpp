// The CPU loops of the packed ops (quantize_packed, dequantize_packed, unpack_packed): int4 and
// int2 codes, 8 / bits to a byte, with one fp32 scale per block. The element math is
// fastddp/rounding.h's, shared with the CUDA kernels; a block holds whole bytes, so the threads
// that quantise different blocks never write the same byte.
#include <algorithm>

#include "fastddp/dispatch.h"
#include "loops.h"

namespace fastddp::cpu {
namespace {

// Byte of flat element i within its row, which starts at flat element `row_first`.
template <int kBits>
FASTDDP_INLINE int64_t byte_of(int64_t i, int64_t row_first) {
  return (i - row_first) / (8 / kBits);
}

template <int kBits, bool kFeedback, bool kStochastic>
FASTDDP_CLONES bool quantize_loop(
    const float* __restrict src, uint8_t* __restrict q, float* __restrict scales,
    float* __restrict residual, int64_t n, int64_t block, Int8Rows rows, int64_t first,
    int64_t last, float scale, uint64_t seed) {
  constexpr int kPer = 8 / kBits;
  const float qmax = code_max(kBits);
  const math::Mode mode{kFeedback, residual, kStochastic, seed};
  bool bad = false;
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = std::min(lo + block, n);
    const int64_t row = lo / rows.row_len;
    const int64_t row_first = row * rows.row_len;
    uint8_t* bytes = q + row * rows.q_stride;
    float* scale_out = scales + row * rows.s_stride + (lo - row_first) / block;
    uint32_t absmax = 0;
    for (int64_t i = lo; i < hi; ++i) {
      absmax = math::abs_bits_max(absmax, math::rounding_input(mode, src[i], scale, i));
    }
    const float step = math::block_scale(absmax, qmax);
    const float inverse = math::block_inverse(absmax, qmax);
    *scale_out = step;
    const int64_t first_byte = byte_of<kBits>(lo, row_first);
    const int64_t end_byte = byte_of<kBits>(hi + kPer - 1, row_first);
    if (math::block_nonfinite(absmax)) {
      // Zeros and a NaN scale: the block dequantises to NaN; its residual is left alone.
      bad = true;
      std::fill(bytes + first_byte, bytes + end_byte, uint8_t{0});
      continue;
    }
    for (int64_t k = first_byte; k < end_byte; ++k) {
      const int64_t i0 = row_first + k * kPer;
      uint32_t byte = 0;
      for (int j = 0; j < kPer; ++j) {
        const int64_t i = i0 + j;
        if (i < hi) {  // the last byte of the last block may be short
          const float v = math::rounding_input(mode, src[i], scale, i);
          byte |= pack_code(math::quantize_element(mode, v, inverse, step, i, qmax), kBits, j);
        }
      }
      bytes[k] = static_cast<uint8_t>(byte);
    }
  }
  return bad;
}

// Element `col` of row `row`, times its block's scale.
template <int kBits>
FASTDDP_INLINE float code_value(const Int8Source& s, int64_t row, int64_t col) {
  constexpr int kPer = 8 / kBits;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(s.q) + row * s.rows.q_stride;
  const int32_t c = unpack_code(bytes[col / kPer], kBits, static_cast<int>(col % kPer));
  return math::mul(static_cast<float>(c), s.scales[row * s.rows.s_stride + col / s.block]);
}

// Rows summed in row order per column, as dequantize_int8 does.
template <int kBits>
FASTDDP_CLONES void dequantize_loop(
    const Int8Source s, float* __restrict dst, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) {
    float acc = code_value<kBits>(s, 0, i);
    for (int64_t p = 1; p < s.rows.rows; ++p) {
      acc = math::add(acc, code_value<kBits>(s, p, i));
    }
    dst[i] = math::mul(acc, scale);
  }
}

template <int kBits>
FASTDDP_CLONES void unpack_loop(
    const Int8Source s, float* __restrict dst, int64_t begin, int64_t end, float scale) {
  for (int64_t i = begin; i < end; ++i) {
    const int64_t row = i / s.rows.row_len;
    dst[i] = math::mul(code_value<kBits>(s, row, i - row * s.rows.row_len), scale);
  }
}

// f(std::integral_constant<int, 4>) or f(... 2>).
template <class F>
decltype(auto) with_bits(int bits, F&& f) {
  if (bits == 4) {
    return f(std::integral_constant<int, 4>{});
  }
  return f(std::integral_constant<int, 2>{});
}

}  // namespace

bool run_packed(const QuantizeArgs& a, int64_t first_block, int64_t last_block) {
  const math::Mode mode = a.rounding.mode();
  return with_bits(a.bits, [&](auto bits) {
    return with_mode(mode, [&](auto feedback, auto stochastic) {
      return quantize_loop<decltype(bits)::value, decltype(feedback)::value,
                           decltype(stochastic)::value>(
          a.src, reinterpret_cast<uint8_t*>(a.dst), a.scales, mode.residual, a.n, a.block, a.rows,
          first_block, last_block, a.scale, mode.seed);
    });
  });
}

bool run_packed(const DequantizeArgs& a, int64_t begin, int64_t end) {
  with_bits(a.src.bits, [&](auto bits) {
    dequantize_loop<decltype(bits)::value>(a.src, a.dst, begin, end, a.scale);
  });
  return false;
}

bool run_packed(const UnpackArgs& a, int64_t begin, int64_t end) {
  with_bits(a.src.bits, [&](auto bits) {
    unpack_loop<decltype(bits)::value>(a.src, a.dst, begin, end, a.scale);
  });
  return false;
}

}  // namespace fastddp::cpu
