// Loops behind the accumulating, error-feedback and int8 ops, over raw memory and free of torch
// headers. Each handles one range of elements (or of int8 blocks) so that the caller can split
// the work across threads; random numbers are drawn by absolute element index, so the split
// does not change the result.
#pragma once

#include <cstdint>

#include "fastddp/rounding.h"

namespace fastddp::cpu {

// Elements [begin, end): v = src[i] * scale (+ residual[i]); dst[i] = wire(v), rounded to
// nearest even or, when seed >= 0, stochastically; residual[i] = v - dst[i]. Returns true when
// a written value is inf or NaN. `residual` may be null.
bool compress_feedback(
    math::WireKind kind, const float* src, uint16_t* dst, float* residual, int64_t begin,
    int64_t end, float scale, int64_t seed);

// Elements [begin, end) of P chunks of length m: v = (sum_p src[p * m + i]) * scale
// (+ residual[i]), summed in fp32 in order p = 0..P-1; dst[i] = wire(v) as above.
bool sum_chunks(
    math::WireKind kind, const uint16_t* src, int64_t chunks, int64_t m, uint16_t* dst,
    float* residual, int64_t begin, int64_t end, float scale, int64_t seed);

// Blocks [first, last) of `block` elements (the final block may be short) of n elements:
// v = src[i] * scale (+ residual[i]); scales[b] = absmax(v) / 127; dst[i] = round(v / scale);
// residual[i] = v - dst[i] * scales[b]. Returns true when a block held inf or NaN.
bool quantize_int8(
    const float* src, int8_t* dst, float* scales, float* residual, int64_t n, int64_t block,
    int64_t first, int64_t last, float scale, int64_t seed);

// Elements [begin, end) of P chunks of length m with ceil(m / block) scales each:
// dst[i] = (sum_p src[p * m + i] * scales[p * nb + i / block]) * scale.
void dequantize_int8(
    const int8_t* src, const float* scales, int64_t chunks, int64_t m, int64_t block,
    float* dst, int64_t begin, int64_t end, float scale);

}  // namespace fastddp::cpu
