// Portable loops for the accumulating, error-feedback and int8 ops; the element math lives in
// fastddp/rounding.h and is shared with the CUDA kernels. Each loop is a template over what the
// call uses (wire format, residual, stochastic rounding), so that no per-element branch is left
// for the vectoriser to trip on, and each instantiation is cloned per ISA (AVX-512, AVX2,
// baseline) and picked at load time.
#include "accum.h"

namespace fastddp::cpu {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTDDP_ACCUM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTDDP_ACCUM_CLONES
#endif
#define FASTDDP_ACCUM_INLINE inline __attribute__((always_inline))

using math::WireKind;

namespace {

template <WireKind K, bool kResidual, bool kStochastic>
FASTDDP_ACCUM_INLINE bool compress_loop(
    const float* __restrict src, uint16_t* __restrict dst, float* __restrict residual,
    int64_t begin, int64_t end, float scale, uint64_t seed) {
  uint32_t bad = 0;
  for (int64_t i = begin; i < end; ++i) {
    float v = math::mul(src[i], scale);
    if constexpr (kResidual) {
      v = math::add(v, residual[i]);
    }
    const uint32_t r = kStochastic ? math::random_bits(seed, static_cast<uint64_t>(i)) : 0u;
    bad |= math::round_with_feedback(K, v, dst + i, kResidual ? residual + i : nullptr,
                                     kStochastic, r);  // fmt: skip
  }
  return bad != 0;
}

// Rows are summed a tile at a time into a small fp32 array: each pass over a row is then a
// plain vectorisable loop, instead of a gather across rows per element.
constexpr int64_t kTile = 1024;

// acc[j] = sum over rows p = 0..chunks-1, in order, of row p's element t + j, for j < len.
template <WireKind K>
FASTDDP_ACCUM_INLINE void sum_tile(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, int64_t t, int64_t len,
    float* __restrict acc) {
  const uint16_t* row = src + t;
  for (int64_t j = 0; j < len; ++j) {
    acc[j] = math::wire_to_float(K, row[j]);
  }
  for (int64_t p = 1; p < chunks; ++p) {
    row = src + p * m + t;
    for (int64_t j = 0; j < len; ++j) {
      acc[j] = math::add(acc[j], math::wire_to_float(K, row[j]));
    }
  }
}

template <WireKind K, bool kResidual, bool kStochastic>
FASTDDP_ACCUM_INLINE bool sum_loop(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, uint16_t* __restrict dst,
    float* __restrict residual, int64_t begin, int64_t end, float scale, uint64_t seed) {
  uint32_t bad = 0;
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = end - t < kTile ? end - t : kTile;
    sum_tile<K>(src, chunks, m, t, len, acc);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t i = t + j;
      float v = math::mul(acc[j], scale);
      if constexpr (kResidual) {
        v = math::add(v, residual[i]);
      }
      const uint32_t r = kStochastic ? math::random_bits(seed, static_cast<uint64_t>(i)) : 0u;
      bad |= math::round_with_feedback(K, v, dst + i, kResidual ? residual + i : nullptr,
                                       kStochastic, r);  // fmt: skip
    }
  }
  return bad != 0;
}

template <WireKind K>
FASTDDP_ACCUM_INLINE void widen_sum_loop(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, float* __restrict dst,
    int64_t begin, int64_t end, float scale) {
  // As sum_loop, without the rounding: the fp32 sum itself, scaled, is the result.
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = end - t < kTile ? end - t : kTile;
    sum_tile<K>(src, chunks, m, t, len, acc);
    for (int64_t j = 0; j < len; ++j) {
      dst[t + j] = math::mul(acc[j], scale);
    }
  }
}

template <bool kResidual, bool kStochastic>
FASTDDP_ACCUM_INLINE bool quantize_loop(
    const float* __restrict src, int8_t* __restrict dst_base, float* __restrict scales_base,
    float* __restrict residual, int64_t n, int64_t block, Rows rows, int64_t first, int64_t last,
    float scale, uint64_t seed) {
  bool bad = false;
  const int64_t row_blocks = (rows.row_len + block - 1) / block;
  for (int64_t b = first; b < last; ++b) {
    const int64_t lo = b * block;
    const int64_t hi = lo + block < n ? lo + block : n;
    // A block lies in one row: shift the bases so that flat indices land in that row.
    const int64_t row = lo / rows.row_len;
    int8_t* dst = dst_base + row * (rows.q_stride - rows.row_len);
    float* scales = scales_base + row * (rows.s_stride - row_blocks);
    // Pass 1 finds the block's absolute maximum; pass 2 recomputes v (bit-identically, the
    // block is in cache) rather than storing it.
    uint32_t absmax = 0;
    for (int64_t i = lo; i < hi; ++i) {
      float v = math::mul(src[i], scale);
      if constexpr (kResidual) {
        v = math::add(v, residual[i]);
      }
      absmax = math::abs_bits_max(absmax, v);
    }
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    scales[b] = step;
    if (math::block_nonfinite(absmax)) {
      // Zeros and a NaN scale: the block dequantises to NaN; its residual is left alone.
      bad = true;
      for (int64_t i = lo; i < hi; ++i) {
        dst[i] = 0;
      }
      continue;
    }
    for (int64_t i = lo; i < hi; ++i) {
      float v = math::mul(src[i], scale);
      if constexpr (kResidual) {
        v = math::add(v, residual[i]);
      }
      const uint32_t r = kStochastic ? math::random_bits(seed, static_cast<uint64_t>(i)) : 0u;
      const int8_t q = math::quantize_int8(v, inverse, kStochastic, r);
      dst[i] = q;
      if constexpr (kResidual) {
        residual[i] = math::sub(v, math::mul(static_cast<float>(q), step));
      }
    }
  }
  return bad;
}

// One cloned entry point per instantiation.
#define FASTDDP_COMPRESS_ENTRY(NAME, K, RES, SR)                                            \
  FASTDDP_ACCUM_CLONES bool NAME(const float* src, uint16_t* dst, float* residual,          \
                                 int64_t begin, int64_t end, float scale, uint64_t seed) {  \
    return compress_loop<K, RES, SR>(src, dst, residual, begin, end, scale, seed);          \
  }
#define FASTDDP_SUM_ENTRY(NAME, K, RES, SR)                                                   \
  FASTDDP_ACCUM_CLONES bool NAME(const uint16_t* src, int64_t chunks, int64_t m,              \
                                 uint16_t* dst, float* residual, int64_t begin, int64_t end,  \
                                 float scale, uint64_t seed) {                                \
    return sum_loop<K, RES, SR>(src, chunks, m, dst, residual, begin, end, scale, seed);      \
  }
#define FASTDDP_QUANTIZE_ENTRY(NAME, RES, SR)                                                 \
  FASTDDP_ACCUM_CLONES bool NAME(const float* src, int8_t* dst, float* scales,                \
                                 float* residual, int64_t n, int64_t block, Rows rows,        \
                                 int64_t first, int64_t last, float scale, uint64_t seed) {   \
    return quantize_loop<RES, SR>(src, dst, scales, residual, n, block, rows, first, last,    \
                                  scale, seed);                                               \
  }

FASTDDP_COMPRESS_ENTRY(compress_h_nn, WireKind::kFp16, false, false)
FASTDDP_COMPRESS_ENTRY(compress_h_rn, WireKind::kFp16, true, false)
FASTDDP_COMPRESS_ENTRY(compress_h_ns, WireKind::kFp16, false, true)
FASTDDP_COMPRESS_ENTRY(compress_h_rs, WireKind::kFp16, true, true)
FASTDDP_COMPRESS_ENTRY(compress_b_nn, WireKind::kBf16, false, false)
FASTDDP_COMPRESS_ENTRY(compress_b_rn, WireKind::kBf16, true, false)
FASTDDP_COMPRESS_ENTRY(compress_b_ns, WireKind::kBf16, false, true)
FASTDDP_COMPRESS_ENTRY(compress_b_rs, WireKind::kBf16, true, true)
FASTDDP_SUM_ENTRY(sum_h_nn, WireKind::kFp16, false, false)
FASTDDP_SUM_ENTRY(sum_h_rn, WireKind::kFp16, true, false)
FASTDDP_SUM_ENTRY(sum_h_ns, WireKind::kFp16, false, true)
FASTDDP_SUM_ENTRY(sum_h_rs, WireKind::kFp16, true, true)
FASTDDP_SUM_ENTRY(sum_b_nn, WireKind::kBf16, false, false)
FASTDDP_SUM_ENTRY(sum_b_rn, WireKind::kBf16, true, false)
FASTDDP_SUM_ENTRY(sum_b_ns, WireKind::kBf16, false, true)
FASTDDP_SUM_ENTRY(sum_b_rs, WireKind::kBf16, true, true)
FASTDDP_QUANTIZE_ENTRY(quantize_nn, false, false)
FASTDDP_QUANTIZE_ENTRY(quantize_rn, true, false)
FASTDDP_QUANTIZE_ENTRY(quantize_ns, false, true)
FASTDDP_QUANTIZE_ENTRY(quantize_rs, true, true)

FASTDDP_ACCUM_CLONES void widen_sum_h(
    const uint16_t* src, int64_t chunks, int64_t m, float* dst, int64_t begin, int64_t end,
    float scale) {
  widen_sum_loop<WireKind::kFp16>(src, chunks, m, dst, begin, end, scale);
}
FASTDDP_ACCUM_CLONES void widen_sum_b(
    const uint16_t* src, int64_t chunks, int64_t m, float* dst, int64_t begin, int64_t end,
    float scale) {
  widen_sum_loop<WireKind::kBf16>(src, chunks, m, dst, begin, end, scale);
}

// Index: wire (0 fp16, 1 bf16) * 4 + residual * 2 + stochastic.
using CompressFn = bool (*)(const float*, uint16_t*, float*, int64_t, int64_t, float, uint64_t);
using SumFn = bool (*)(const uint16_t*, int64_t, int64_t, uint16_t*, float*, int64_t, int64_t,
                       float, uint64_t);  // fmt: skip
using QuantizeFn = bool (*)(const float*, int8_t*, float*, float*, int64_t, int64_t, Rows,
                            int64_t, int64_t, float, uint64_t);  // fmt: skip
constexpr CompressFn kCompress[8] = {compress_h_nn, compress_h_ns, compress_h_rn, compress_h_rs,
                                     compress_b_nn, compress_b_ns, compress_b_rn, compress_b_rs};
constexpr SumFn kSum[8] = {sum_h_nn, sum_h_ns, sum_h_rn, sum_h_rs,
                           sum_b_nn, sum_b_ns, sum_b_rn, sum_b_rs};
constexpr QuantizeFn kQuantize[4] = {quantize_nn, quantize_ns, quantize_rn, quantize_rs};

int pick(WireKind kind, const float* residual, int64_t seed) {
  return (kind == WireKind::kBf16 ? 4 : 0) + (residual != nullptr ? 2 : 0) + (seed >= 0 ? 1 : 0);
}

FASTDDP_ACCUM_CLONES void dequantize_loop(
    const int8_t* __restrict src, const float* __restrict scales, int64_t chunks, int64_t m,
    int64_t block, Rows rows, float* __restrict dst, int64_t begin, int64_t end, float scale) {
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = end - t < kTile ? end - t : kTile;
    for (int64_t p = 0; p < chunks; ++p) {
      const int8_t* row = src + p * rows.q_stride;
      // Within one int8 block the scale is fixed: a plain loop per block segment.
      for (int64_t i = t; i < t + len;) {
        const int64_t b = i / block;
        const int64_t stop = (b + 1) * block < t + len ? (b + 1) * block : t + len;
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
      dst[t + j] = math::mul(acc[j], scale);
    }
  }
}

FASTDDP_ACCUM_CLONES void unpack_loop(
    const int8_t* __restrict src, const float* __restrict scales, int64_t block, Rows rows,
    float* __restrict dst, int64_t begin, int64_t end, float scale) {
  // Row by row, and within a row block by block: each segment is a plain loop.
  for (int64_t i = begin; i < end;) {
    const int64_t row = i / rows.row_len;
    const int64_t col = i - row * rows.row_len;
    const int64_t b = col / block;
    const int64_t block_end = row * rows.row_len + (b + 1) * block;
    const int64_t row_end = (row + 1) * rows.row_len;
    int64_t stop = block_end < row_end ? block_end : row_end;
    stop = stop < end ? stop : end;
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

}  // namespace

bool compress_feedback(
    WireKind kind, const float* src, uint16_t* dst, float* residual, int64_t begin,
    int64_t end, float scale, int64_t seed) {
  return kCompress[pick(kind, residual, seed)](
      src, dst, residual, begin, end, scale, static_cast<uint64_t>(seed));
}

bool sum_chunks(
    WireKind kind, const uint16_t* src, int64_t chunks, int64_t m, uint16_t* dst,
    float* residual, int64_t begin, int64_t end, float scale, int64_t seed) {
  return kSum[pick(kind, residual, seed)](
      src, chunks, m, dst, residual, begin, end, scale, static_cast<uint64_t>(seed));
}

void widen_sum(
    WireKind kind, const uint16_t* src, int64_t chunks, int64_t m, float* dst, int64_t begin,
    int64_t end, float scale) {
  if (kind == WireKind::kBf16) {
    widen_sum_b(src, chunks, m, dst, begin, end, scale);
  } else {
    widen_sum_h(src, chunks, m, dst, begin, end, scale);
  }
}

bool quantize_int8(
    const float* src, int8_t* dst, float* scales, float* residual, int64_t n, int64_t block,
    Rows rows, int64_t first, int64_t last, float scale, int64_t seed) {
  return kQuantize[pick(WireKind::kFp16, residual, seed)](
      src, dst, scales, residual, n, block, rows, first, last, scale,
      static_cast<uint64_t>(seed));
}

void dequantize_int8(
    const int8_t* src, const float* scales, int64_t chunks, int64_t m, int64_t block, Rows rows,
    float* dst, int64_t begin, int64_t end, float scale) {
  dequantize_loop(src, scales, chunks, m, block, rows, dst, begin, end, scale);
}

void unpack_int8(
    const int8_t* src, const float* scales, int64_t block, Rows rows, float* dst, int64_t begin,
    int64_t end, float scale) {
  unpack_loop(src, scales, block, rows, dst, begin, end, scale);
}

}  // namespace fastddp::cpu
