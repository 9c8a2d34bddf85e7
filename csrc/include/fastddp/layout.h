// Plain data shared by the op entries (ops.h, which needs torch) and the code that runs the ops
// (the CPU loops, the CUDA launches and kernels, the emulator, none of which includes torch):
// the arguments of each op once its tensors are checked, and where int8 values lie.
#pragma once

#include <cstdint>

#include "fastddp/rounding.h"

namespace fastddp {

// Where integer codes and their scales lie. A flat sequence of elements is cut into `rows` rows
// of `row_len` elements; row r starts at byte q + r * q_stride, and its scales (one per block of
// `block` elements) at scales + r * s_stride. The rows of a tensor may be spaced apart, so that
// each rank's chunk and its scales can sit side by side in one byte buffer. int8 codes take a
// byte each; int4 and int2 codes are packed 8 / bits to a byte (see pack_code), and then a row of
// several holds whole blocks and a block whole bytes.
struct Int8Rows {
  int64_t rows;
  int64_t row_len;
  int64_t q_stride;
  int64_t s_stride;
};

// n / d for a divisor fixed before a launch, for the kernels' index arithmetic: a GPU has no
// integer divider, and a 64-bit division is a call of dozens of instructions. For n and d
// below 2^32 it is a multiply, an add and a shift: Granlund and Montgomery's method, with
// magic = floor(2^32 * (2^shift - d) / d) + 1 and shift = ceil(log2 d), exact for every such
// n (tests/ops/test_divider.py checks it); otherwise the plain division.
struct Divider {
  int64_t d;
  uint32_t magic;
  uint32_t shift;  // kPlain: d is 0 or at least 2^32

  static constexpr uint32_t kPlain = 64;

  static FASTDDP_HD Divider of(int64_t d) {
    if (d <= 0 || d >= (int64_t{1} << 32)) {
      return {d, 0, kPlain};
    }
    const auto ud = static_cast<uint64_t>(d);
    uint32_t shift = 0;
    while ((uint64_t{1} << shift) < ud) {
      ++shift;
    }
    const uint64_t magic = (uint64_t{1} << 32) * ((uint64_t{1} << shift) - ud) / ud + 1;
    return {d, static_cast<uint32_t>(magic), shift};
  }

  FASTDDP_HD int64_t div(int64_t n) const {
    const auto u = static_cast<uint64_t>(n);
    if (shift != kPlain && (u >> 32) == 0) {
      return static_cast<int64_t>((((u * magic) >> 32) + u) >> shift);
    }
    return n / d;
  }

  // div for 0 <= n < 2^32 and a divisor below 2^32 (of the ops' blocks, at most 2^20): the
  // multiply, the add and the shift of div, without its test of n and its call, which cost a
  // branch and a dozen instructions where a kernel divides each of a lane's chunks.
  FASTDDP_HD int64_t div_small(uint32_t n) const {
    const uint64_t u = n;
    return static_cast<int64_t>((((u * magic) >> 32) + u) >> shift);
  }
};

FASTDDP_HD int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

// Block b of a flat sequence of n elements laid out in `rows`: its elements [lo, hi) (the last
// block may be short), and the int8 values and scales of its row, shifted back so that flat
// element and block indices land in that row (a block lies in one row).
struct Int8Block {
  int64_t lo, hi;
  int8_t* q;
  float* scales;
};

FASTDDP_HD Int8Block int8_block(
    const Int8Rows& rows, int64_t n, int64_t block, int64_t b, int8_t* q, float* scales) {
  const int64_t lo = b * block;
  const int64_t row = lo / rows.row_len;
  return {lo, lo + block < n ? lo + block : n, q + row * (rows.q_stride - rows.row_len),
          scales + row * (rows.s_stride - blocks_of(rows.row_len, block))};
}

// Packed codes: code j of a byte sits in bits [j * bits, (j + 1) * bits), two's complement.
FASTDDP_HD int codes_per_byte(int bits) {
  return 8 / bits;
}

FASTDDP_HD float code_max(int bits) {
  return static_cast<float>((1 << (bits - 1)) - 1);  // 127, 7, 1
}

FASTDDP_HD uint32_t pack_code(int8_t q, int bits, int j) {
  return (static_cast<uint32_t>(q) & ((1u << bits) - 1u)) << (j * bits);
}

FASTDDP_HD int32_t unpack_code(uint8_t byte, int bits, int j) {
  const int32_t v = (byte >> (j * bits)) & ((1 << bits) - 1);
  return v - ((v & (1 << (bits - 1))) << 1);  // sign-extend
}

// The arguments of each op (csrc/fastddp.cpp has the schemas) as raw pointers and lengths.
// Wire values (fp16 or bf16, as `kind` says) are passed as their bits.

// The rounding mode of an op given its residual (null: no error feedback) and seed (< 0: to
// nearest even).
FASTDDP_HD math::Mode mode_of(float* residual, int64_t seed) {
  return {residual != nullptr, residual, seed >= 0, static_cast<uint64_t>(seed)};
}

// What the rounding ops (compress, sum_chunks, quantize_int8) take beyond their data.
struct Rounding {
  float* residual;  // error feedback: one fp32 per element; null for none
  int64_t seed;     // >= 0: round stochastically, with random bits drawn from this seed
  int* flag;        // set to 1 if a written value is inf or NaN, else to 0; null for none

  FASTDDP_HD math::Mode mode() const {
    return mode_of(residual, seed);
  }
};

// compress (In = float, Out = uint16_t) and decompress (In = uint16_t, Out = float): n values
// converted between fp32 and the wire format, times scale (before rounding, after widening).
template <class In, class Out>
struct ConvertArgs {
  math::WireKind kind;
  const In* src;
  Out* dst;
  int64_t n;
  float scale;
};

struct CompressArgs : ConvertArgs<float, uint16_t> {
  Rounding rounding;
};

using DecompressArgs = ConvertArgs<uint16_t, float>;

// sum_chunks (Out = uint16_t: rounded to the wire format again) and widen_sum (Out = float):
// the columns of `chunks` rows of m wire values, summed in fp32 in row order, times scale.
template <class Out>
struct RowSumArgs {
  math::WireKind kind;
  const uint16_t* src;  // [chunks, m], contiguous
  int64_t chunks, m;
  Out* dst;             // m values
  float scale;
};

struct SumChunksArgs : RowSumArgs<uint16_t> {
  Rounding rounding;
};

using WidenSumArgs = RowSumArgs<float>;

// quantize_int8 and quantize_packed: n fp32 values, times scale, to codes of `bits` bits laid
// out in `rows` (for bits < 8, dst is their bytes), with one fp32 scale (absmax / code_max)
// per block of `block` values.
struct QuantizeArgs {
  const float* src;
  int8_t* dst;
  float* scales;
  int64_t n;
  int64_t block;
  Int8Rows rows;
  float scale;
  Rounding rounding;
  int bits = 8;
};

// What dequantize_int8/_packed and unpack_int8/_packed read: codes of `bits` bits laid out in
// `rows`, and one fp32 scale per block of `block` values.
struct Int8Source {
  const int8_t* q;
  const float* scales;
  int64_t block;
  Int8Rows rows;
  int bits = 8;
};

// dequantize_int8: the rows (rows.rows of rows.row_len values) dequantised and summed per
// column in fp32, times scale, into the row_len values of dst.
struct DequantizeArgs {
  Int8Source src;
  float* dst;
  float scale;
};

// unpack_int8: the flat sequence of n values the rows hold, dequantised, times scale, into dst.
struct UnpackArgs {
  Int8Source src;
  float* dst;
  int64_t n;
  float scale;
};

// requantize: the rows of `src` (src.rows.rows rows of n = src.rows.row_len codes) summed per
// column in fp32, times scale, as dequantize sums them, then quantised as `out` says (one row
// of n codes of src.bits bits; its src null, its scale 1): the bits of a dequantize into fp32
// followed by a quantize of them with scale 1.
struct RequantizeArgs {
  Int8Source src;
  float scale;
  QuantizeArgs out;
};

}  // namespace fastddp
