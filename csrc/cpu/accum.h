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

// Elements [begin, end) of P chunks of length m: dst[i] = (sum_p src[p * m + i]) * scale, summed
// in fp32 in order p = 0..P-1; dst is fp32, so nothing is rounded to the wire format.
void widen_sum(
    math::WireKind kind, const uint16_t* src, int64_t chunks, int64_t m, float* dst,
    int64_t begin, int64_t end, float scale);

// Where int8 rows lie (see Int8Rows in fastddp/checks.h): element i of the flat sequence is at
// row i / row_len, column i % row_len; rows are q_stride int8 values and s_stride scales apart.
struct Rows {
  int64_t row_len;
  int64_t q_stride;
  int64_t s_stride;
};

// Blocks [first, last) of `block` elements (the final block may be short) of n elements:
// v = src[i] * scale (+ residual[i]); scales[b] = absmax(v) / 127; dst[i] = round(v / scale);
// residual[i] = v - dst[i] * scales[b]. dst and scales are laid out in `rows` (no block
// straddles two rows). Returns true when a block held inf or NaN.
bool quantize_int8(
    const float* src, int8_t* dst, float* scales, float* residual, int64_t n, int64_t block,
    Rows rows, int64_t first, int64_t last, float scale, int64_t seed);

// Elements [begin, end) of P rows of length m with ceil(m / block) scales each:
// dst[i] = (sum_p src[p, i] * scales[p, i / block]) * scale, with the rows laid out as `rows`.
void dequantize_int8(
    const int8_t* src, const float* scales, int64_t chunks, int64_t m, int64_t block,
    Rows rows, float* dst, int64_t begin, int64_t end, float scale);

// Elements [begin, end) of the flat sequence laid out in `rows`, no sum:
// dst[i] = (src[i] * scales[i / block]) * scale.
void unpack_int8(
    const int8_t* src, const float* scales, int64_t block, Rows rows, float* dst,
    int64_t begin, int64_t end, float scale);

}  // namespace fastddp::cpu
