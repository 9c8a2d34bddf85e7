// Portable loops for the accumulating, error-feedback and int8 ops; the element math lives in
// fastddp/rounding.h and is shared with the CUDA kernels.
#include "accum.h"

namespace fastddp::cpu {

using math::WireKind;

bool compress_feedback(
    WireKind kind, const float* src, uint16_t* dst, float* residual, int64_t begin,
    int64_t end, float scale, int64_t seed) {
  const bool stochastic = seed >= 0;
  const uint64_t s = static_cast<uint64_t>(seed);
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    float v = math::mul(src[i], scale);
    if (residual != nullptr) {
      v = math::add(v, residual[i]);
    }
    const uint32_t r = stochastic ? math::random_bits(s, static_cast<uint64_t>(i)) : 0u;
    bad |= math::round_with_feedback(
        kind, v, dst + i, residual == nullptr ? nullptr : residual + i, stochastic, r);
  }
  return bad;
}

bool sum_chunks(
    WireKind kind, const uint16_t* src, int64_t chunks, int64_t m, uint16_t* dst,
    float* residual, int64_t begin, int64_t end, float scale, int64_t seed) {
  const bool stochastic = seed >= 0;
  const uint64_t s = static_cast<uint64_t>(seed);
  bool bad = false;
  for (int64_t i = begin; i < end; ++i) {
    float acc = math::wire_to_float(kind, src[i]);
    for (int64_t p = 1; p < chunks; ++p) {
      acc = math::add(acc, math::wire_to_float(kind, src[p * m + i]));
    }
    float v = math::mul(acc, scale);
    if (residual != nullptr) {
      v = math::add(v, residual[i]);
    }
    const uint32_t r = stochastic ? math::random_bits(s, static_cast<uint64_t>(i)) : 0u;
    bad |= math::round_with_feedback(
        kind, v, dst + i, residual == nullptr ? nullptr : residual + i, stochastic, r);
  }
  return bad;
}

bool quantize_int8(
    const float* src, int8_t* dst, float* scales, float* residual, int64_t n, int64_t block,
    int64_t first, int64_t last, float scale, int64_t seed) {
  const bool stochastic = seed >= 0;
  const uint64_t s = static_cast<uint64_t>(seed);
  bool bad = false;
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    // Pass 1 finds the block's absolute maximum; pass 2 recomputes v (bit-identically, the
    // block is in cache) rather than storing it.
    uint32_t absmax = 0;
    for (int64_t i = lo; i < hi; ++i) {
      float v = math::mul(src[i], scale);
      if (residual != nullptr) {
        v = math::add(v, residual[i]);
      }
      absmax = math::abs_bits_max(absmax, v);
    }
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    const bool block_bad = math::block_nonfinite(absmax);
    scales[b] = step;
    bad |= block_bad;
    for (int64_t i = lo; i < hi; ++i) {
      float v = math::mul(src[i], scale);
      if (residual != nullptr) {
        v = math::add(v, residual[i]);
      }
      const uint32_t r = stochastic ? math::random_bits(s, static_cast<uint64_t>(i)) : 0u;
      const int8_t q = block_bad ? int8_t{0} : math::quantize_int8(v, inverse, stochastic, r);
      dst[i] = q;
      // A non-finite block keeps its residual (see round_with_feedback).
      if (residual != nullptr && !block_bad) {
        residual[i] = math::sub(v, math::mul(static_cast<float>(q), step));
      }
    }
  }
  return bad;
}

void dequantize_int8(
    const int8_t* src, const float* scales, int64_t chunks, int64_t m, int64_t block,
    float* dst, int64_t begin, int64_t end, float scale) {
  const int64_t nb = (m + block - 1) / block;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t b = i / block;
    float acc = math::mul(static_cast<float>(src[i]), scales[b]);
    for (int64_t p = 1; p < chunks; ++p) {
      acc = math::add(acc, math::mul(static_cast<float>(src[p * m + i]), scales[p * nb + b]));
    }
    dst[i] = math::mul(acc, scale);
  }
}

}  // namespace fastddp::cpu
