// The CPU loops of the packed ops (quantize_packed, dequantize_packed, unpack_packed, and
// requantize's packed codes): int4 and int2 codes, 8 / bits to a byte, with one fp32 scale per
// block. The element math is
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

// Blocks [first, last) of the n values that values(lo, hi) gives (FlatBlocks, SummedBlocks).
template <int kBits, bool kFeedback, bool kStochastic, class Values>
FASTDDP_CLONES bool quantize_loop(
    Values&& values, uint8_t* __restrict q, float* __restrict scales, float* __restrict residual,
    int64_t n, int64_t block, Int8Rows rows, int64_t first, int64_t last, float scale,
    uint64_t seed) {
  constexpr int kPer = 8 / kBits;
  constexpr int64_t kChunk = 256;  // a multiple of kPer
  const float qmax = code_max(kBits);
  const math::Mode mode{kFeedback, residual, kStochastic, seed};
  int8_t codes[kChunk];
  bool bad = false;
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = std::min(lo + block, n);
    const int64_t row = lo / rows.row_len;
    const int64_t row_first = row * rows.row_len;
    uint8_t* bytes = q + row * rows.q_stride;
    float* scale_out = scales + row * rows.s_stride + (lo - row_first) / block;
    const float* __restrict x = values(lo, hi);  // x[j]: element lo + j
    uint32_t absmax = 0;
    for (int64_t i = lo; i < hi; ++i) {
      absmax = math::abs_bits_max(absmax, math::rounding_input(mode, x[i - lo], scale, i));
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
    // The codes of up to kChunk elements into a small array (the same loop as int8's, which
    // vectorises), then packed kPer to a byte; chunks start on whole bytes.
    for (int64_t c0 = lo; c0 < hi; c0 += kChunk) {
      const int64_t len = std::min(kChunk, hi - c0);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t i = c0 + j;
        const float v = math::rounding_input(mode, x[i - lo], scale, i);
        codes[j] = math::quantize_element(mode, v, inverse, step, i, qmax);
      }
      const int64_t nbytes = (len + kPer - 1) / kPer;
      for (int64_t j = len; j < nbytes * kPer; ++j) {
        codes[j] = 0;  // the last byte of the last block may be short
      }
      uint8_t* out = bytes + byte_of<kBits>(c0, row_first);
      for (int64_t k = 0; k < nbytes; ++k) {
        uint32_t byte = 0;
        for (int j = 0; j < kPer; ++j) {
          byte |= pack_code(codes[k * kPer + j], kBits, j);
        }
        out[k] = static_cast<uint8_t>(byte);
      }
    }
  }
  return bad;
}

// What decode_segment does with each decoded value v = code * s.
enum class Put { kStoreScaled, kStore, kAdd };  // out = v * post; out = v; out += v

// out[j] for j < count from codes col .. col + count of one row, all in one block (scale s).
// Whole bytes in the middle, so that the loop over them unrolls and vectorises; the codes
// before the first whole byte and after the last one are done one at a time.
template <int kBits, Put kPut>
FASTDDP_INLINE void decode_segment(
    const uint8_t* __restrict bytes, int64_t col, int64_t count, float s, float post,
    float* __restrict out) {
  constexpr int kPer = 8 / kBits;
  auto put = [&](float* o, int32_t code) {
    const float v = math::mul(static_cast<float>(code), s);
    if constexpr (kPut == Put::kStoreScaled) {
      *o = math::mul(v, post);
    } else if constexpr (kPut == Put::kStore) {
      *o = v;
    } else {
      *o = math::add(*o, v);
    }
  };
  auto one = [&](int64_t j) {
    const int64_t c = col + j;
    put(out + j, unpack_code(bytes[c / kPer], kBits, static_cast<int>(c % kPer)));
  };
  int64_t j = 0;
  for (; j < count && (col + j) % kPer != 0; ++j) {
    one(j);
  }
  const int64_t whole = (count - j) / kPer;
  const uint8_t* b = bytes + (col + j) / kPer;
  float* o = out + j;
  for (int64_t k = 0; k < whole; ++k) {
    const uint8_t byte = b[k];
    for (int q = 0; q < kPer; ++q) {
      put(o + k * kPer + q, unpack_code(byte, kBits, q));
    }
  }
  for (j += whole * kPer; j < count; ++j) {
    one(j);
  }
}

// Calls f(row, col, count, scale) for the pieces of elements [begin, end) of `rows` that lie
// in one block of one row (flat element i is column i - row * row_len of its row).
template <class F>
FASTDDP_INLINE void for_each_segment(const Int8Source& s, int64_t begin, int64_t end, F&& f) {
  for (int64_t i = begin; i < end;) {
    const int64_t row = i / s.rows.row_len;
    const int64_t col = i - row * s.rows.row_len;
    const int64_t b = col / s.block;
    const int64_t stop = std::min({(b + 1) * s.block, s.rows.row_len, col + (end - i)});
    f(row, col, stop - col, s.scales[row * s.rows.s_stride + b]);
    i += stop - col;
  }
}

template <int kBits>
FASTDDP_INLINE const uint8_t* row_bytes(const Int8Source& s, int64_t row) {
  return reinterpret_cast<const uint8_t*>(s.q) + row * s.rows.q_stride;
}

// Rows summed in row order per column, as dequantize_int8 does: a tile at a time into a small
// fp32 array (columns [begin, end) of every row lie in one "row" of the segment walk).
constexpr int64_t kTile = 1024;

// Columns [begin, end) of the rows, summed, into out[0 .. end - begin).
template <int kBits>
FASTDDP_CLONES void dequantize_loop(
    const Int8Source s, float* __restrict out, int64_t begin, int64_t end, float scale) {
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    for (int64_t p = 0; p < s.rows.rows; ++p) {
      const uint8_t* bytes = row_bytes<kBits>(s, p);
      // Columns t .. t + len of row p, in segments of one block (as row 0 of a one-row walk).
      for (int64_t c = t; c < t + len;) {
        const int64_t b = c / s.block;
        const int64_t stop = std::min((b + 1) * s.block, t + len);
        const float sc = s.scales[p * s.rows.s_stride + b];
        if (p == 0) {
          decode_segment<kBits, Put::kStore>(bytes, c, stop - c, sc, 1.0f, acc + (c - t));
        } else {
          decode_segment<kBits, Put::kAdd>(bytes, c, stop - c, sc, 1.0f, acc + (c - t));
        }
        c = stop;
      }
    }
    for (int64_t j = 0; j < len; ++j) {
      out[t - begin + j] = math::mul(acc[j], scale);
    }
  }
}

template <int kBits>
FASTDDP_CLONES void unpack_loop(
    const Int8Source s, float* __restrict dst, int64_t begin, int64_t end, float scale) {
  for_each_segment(s, begin, end, [&](int64_t row, int64_t col, int64_t count, float sc) {
    float* out = dst + row * s.rows.row_len + col;
    decode_segment<kBits, Put::kStoreScaled>(row_bytes<kBits>(s, row), col, count, sc, scale, out);
  });
}

// f(std::integral_constant<int, 4>) or f(... 2>).
template <class F>
decltype(auto) with_bits(int bits, F&& f) {
  if (bits == 4) {
    return f(std::integral_constant<int, 4>{});
  }
  return f(std::integral_constant<int, 2>{});
}

// values(bits) (an integral_constant) gives what the loop rounds.
template <class ValuesOf>
bool quantize(const QuantizeArgs& a, ValuesOf values, int64_t first_block, int64_t last_block) {
  const math::Mode mode = a.rounding.mode();
  return with_bits(a.bits, [&](auto bits) {
    return with_mode(mode, [&](auto feedback, auto stochastic) {
      return quantize_loop<decltype(bits)::value, decltype(feedback)::value,
                           decltype(stochastic)::value>(
          values(bits), reinterpret_cast<uint8_t*>(a.dst), a.scales, mode.residual, a.n, a.block,
          a.rows, first_block, last_block, a.scale, mode.seed);
    });
  });
}

}  // namespace

bool run_packed(const QuantizeArgs& a, int64_t first_block, int64_t last_block) {
  return quantize(a, [&](auto) { return FlatBlocks{a.src}; }, first_block, last_block);
}

bool run_packed(const RequantizeArgs& a, int64_t first_block, int64_t last_block) {
  return quantize(
      a.out,
      [&](auto bits) {
        auto sum = [&](float* out, int64_t begin, int64_t end) {
          dequantize_loop<decltype(bits)::value>(a.src, out, begin, end, a.scale);
        };
        return SummedBlocks(sum, std::min(a.out.n, last_block * a.out.block), a.out.block);
      },
      first_block, last_block);
}

bool run_packed(const DequantizeArgs& a, int64_t begin, int64_t end) {
  with_bits(a.src.bits, [&](auto bits) {
    dequantize_loop<decltype(bits)::value>(a.src, a.dst + begin, begin, end, a.scale);
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
