// The CPU loops of the 16-bit ops: compress, decompress, sum_chunks, widen_sum. Each is one
// template over the wire format (fp16 or bf16) and, for the rounding ops, the rounding mode,
// written over the element math of fastddp/rounding.h that the CUDA kernels share; the selects
// in that math keep every loop free of branches, so that GCC vectorises it. Each instance is
// cloned per ISA (AVX-512, AVX2, baseline) and picked at load time.
//
// On x86 with AVX2 and F16C, compress to nearest (with error feedback or without) and decompress
// run hand-written vector loops over the aligned middle of their range instead, with the
// portable loop for the head and tail.
#include <algorithm>
#include <cstdlib>

#include "fastddp/dispatch.h"
#include "loops.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTDDP_HAVE_AVX2_PATH 1
#endif

namespace fastddp::cpu {
namespace {

using math::WireKind;

// Rounds elements [begin, end), whose fp32 values are x[0 .. end - begin), into dst.
template <WireKind K, bool kFeedback, bool kStochastic>
FASTDDP_INLINE bool round_range(
    const float* __restrict x, uint16_t* __restrict dst, float* __restrict residual,
    int64_t begin, int64_t end, float scale, uint64_t seed) {
  const math::Mode mode{kFeedback, residual, kStochastic, seed};
  uint16_t bad = 0;  // as wide as a wire value, so that the vectoriser keeps it in their lanes
  for (int64_t i = begin; i < end; ++i) {
    bad |= math::round_element(K, mode, math::rounding_input(mode, x[i - begin], scale, i), dst, i);
  }
  return bad != 0;
}

template <WireKind K, bool kFeedback, bool kStochastic>
FASTDDP_CLONES bool compress_loop(
    const float* __restrict src, uint16_t* __restrict dst, float* __restrict residual,
    int64_t begin, int64_t end, float scale, uint64_t seed) {
  return round_range<K, kFeedback, kStochastic>(
      src + begin, dst, residual, begin, end, scale, seed);
}

template <WireKind K>
FASTDDP_CLONES void decompress_loop(
    const uint16_t* __restrict src, float* __restrict dst, int64_t begin, int64_t end,
    float scale) {
  for (int64_t i = begin; i < end; ++i) {
    dst[i] = math::mul(math::wire_to_float(K, src[i]), scale);
  }
}

// Rows are summed a tile at a time into a small fp32 array: each pass over a row is then a
// plain vectorisable loop, instead of a gather across rows per element.
constexpr int64_t kTile = 1024;

// acc[j] = sum over rows p = 0..chunks-1, in order, of row p's element t + j, for j < len.
template <WireKind K>
FASTDDP_INLINE void sum_tile(
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

template <WireKind K, bool kFeedback, bool kStochastic>
FASTDDP_CLONES bool sum_loop(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, uint16_t* __restrict dst,
    float* __restrict residual, int64_t begin, int64_t end, float scale, uint64_t seed) {
  bool bad = false;
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    sum_tile<K>(src, chunks, m, t, len, acc);
    bad |= round_range<K, kFeedback, kStochastic>(acc, dst, residual, t, t + len, scale, seed);
  }
  return bad;
}

// As sum_loop, without the rounding: the fp32 sum itself, scaled, is the result.
template <WireKind K>
FASTDDP_CLONES void widen_sum_loop(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, float* __restrict dst,
    int64_t begin, int64_t end, float scale) {
  float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    sum_tile<K>(src, chunks, m, t, len, acc);
    for (int64_t j = 0; j < len; ++j) {
      dst[t + j] = math::mul(acc[j], scale);
    }
  }
}

#ifdef FASTDDP_HAVE_AVX2_PATH
#define FASTDDP_AVX2 __attribute__((target("avx2,f16c")))

// The vector form of each wire format: 16 fp32 values to 16 wire values (rounded to nearest
// even, as math::float_to_wire), and 8 wire values to fp32 (exactly).
template <WireKind K>
struct Avx2Wire;

template <>
struct Avx2Wire<WireKind::kBf16> {
  static constexpr uint16_t kExpMask = 0x7f80;

  // math::to_bf16's rounding, in each 32-bit lane.
  FASTDDP_AVX2 static __m256i bits(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  }

  FASTDDP_AVX2 static __m256i narrow(__m256 lo, __m256 hi) {
    // packus works within 128-bit lanes; the permute puts the 16 results back in order.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(bits(lo), bits(hi)), 0xd8);
  }

  FASTDDP_AVX2 static __m256 widen(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

// x86 has had fp32 <-> fp16 conversion instructions (F16C, round to nearest even) since 2012;
// they beat the integer emulation by about 3x. Only NaN payloads may differ from math::to_fp16.
template <>
struct Avx2Wire<WireKind::kFp16> {
  static constexpr uint16_t kExpMask = 0x7c00;
  static constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

  FASTDDP_AVX2 static __m256i narrow(__m256 lo, __m256 hi) {
    return _mm256_set_m128i(_mm256_cvtps_ph(hi, kNearest), _mm256_cvtps_ph(lo, kNearest));
  }

  FASTDDP_AVX2 static __m256 widen(__m128i h) {
    return _mm256_cvtph_ps(h);
  }
};

// Streaming (non-temporal) stores skip the read-for-ownership of each destination line: for
// buckets far larger than the caches that saves a third of the memory traffic. Buckets of at
// least this many fp32 bytes are streamed; smaller ones stay cached for whatever reads them next
// (the all-reduce, the optimizer). FASTDDP_STREAM_MIN_BYTES overrides the threshold (0: always
// stream; a huge value: never).
int64_t stream_min_bytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("FASTDDP_STREAM_MIN_BYTES");
    return v != nullptr && v[0] != '\0' ? std::atoll(v) : int64_t{16} << 20;
  }();
  return bytes;
}

template <bool kStream>
FASTDDP_AVX2 inline void store(uint16_t* p, __m256i v) {
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

template <bool kStream>
FASTDDP_AVX2 inline void store(float* p, __m256 v) {
  if constexpr (kStream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

// The first index from `begin` at which dst is 32-byte aligned (at most end), so that the
// vector loop can use aligned, streaming stores.
template <typename T>
int64_t aligned_start(const T* dst, int64_t begin, int64_t end) {
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst + begin) % 32);
  const int64_t head = misaligned == 0 ? 0 : (32 - misaligned) / int64_t{sizeof(T)};
  return std::min(begin + head, end);
}

// The new residuals of 8 elements (math::residual_after): v minus its wire value, or the old
// residual where that is inf or NaN (`nonfinite`: 8 lanes of 16-bit masks, made 32 bits wide).
template <WireKind K>
FASTDDP_AVX2 inline __m256 residual_after(__m256 v, __m128i wire, __m128i nonfinite, __m256 kept) {
  const __m256 dropped = _mm256_sub_ps(v, Avx2Wire<K>::widen(wire));
  return _mm256_blendv_ps(dropped, kept, _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nonfinite)));
}

// kFeedback: v = src * scale + residual (two roundings, as math::rounding_input_of), and the
// residual stored back, unaligned and cached (it is read again at the next step), as
// math::round_element leaves it.
template <WireKind K, bool kStream, bool kFeedback>
FASTDDP_AVX2 bool compress_avx2(
    const float* __restrict src, uint16_t* __restrict dst, float* __restrict residual,
    int64_t begin, int64_t end, float scale) {
  using W = Avx2Wire<K>;
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i exp_mask = _mm256_set1_epi16(W::kExpMask);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = aligned_start(dst, begin, end);
  bool edge_bad = compress_loop<K, kFeedback, false>(src, dst, residual, begin, i, scale, 0);
  for (; i + 16 <= end; i += 16) {
    __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(src + i), s);
    __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(src + i + 8), s);
    __m256 kept_lo, kept_hi;
    if constexpr (kFeedback) {
      kept_lo = _mm256_loadu_ps(residual + i);
      kept_hi = _mm256_loadu_ps(residual + i + 8);
      lo = _mm256_add_ps(lo, kept_lo);
      hi = _mm256_add_ps(hi, kept_hi);
    }
    const __m256i h = W::narrow(lo, hi);
    store<kStream>(dst + i, h);
    // Exponent all ones: inf or NaN.
    const __m256i nonfinite = _mm256_cmpeq_epi16(_mm256_and_si256(h, exp_mask), exp_mask);
    bad = _mm256_or_si256(bad, nonfinite);
    if constexpr (kFeedback) {
      const __m128i h_lo = _mm256_castsi256_si128(h), h_hi = _mm256_extracti128_si256(h, 1);
      const __m128i n_lo = _mm256_castsi256_si128(nonfinite);
      const __m128i n_hi = _mm256_extracti128_si256(nonfinite, 1);
      _mm256_storeu_ps(residual + i, residual_after<K>(lo, h_lo, n_lo, kept_lo));
      _mm256_storeu_ps(residual + i + 8, residual_after<K>(hi, h_hi, n_hi, kept_hi));
    }
  }
  edge_bad |= compress_loop<K, kFeedback, false>(src, dst, residual, i, end, scale, 0);
  return edge_bad || !_mm256_testz_si256(bad, bad);
}

// sum_tile for fp16 rows, 8 at a time with F16C (the portable loop converts in integer code):
// acc[j] = the rows' element t + j summed in row order, as sum_tile<kFp16>.
FASTDDP_AVX2 void sum_tile_fp16(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, int64_t t, int64_t len,
    float* __restrict acc) {
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const uint16_t* at = src + t + j;
    __m256 sum = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    for (int64_t p = 1; p < chunks; ++p) {
      const auto* row = reinterpret_cast<const __m128i*>(at + p * m);
      sum = _mm256_add_ps(sum, _mm256_cvtph_ps(_mm_loadu_si128(row)));
    }
    _mm256_storeu_ps(acc + j, sum);
  }
  sum_tile<WireKind::kFp16>(src, chunks, m, t + j, len - j, acc + j);  // the last few
}

// sum_chunks (to nearest) and widen_sum of fp16 rows a tile at a time, as sum_loop and
// widen_sum_loop: the tile summed by sum_tile_fp16, then rounded as compress rounds
// (compress_avx2 over the tile, its outputs and residuals from element t on) or scaled.
template <bool kFeedback>
FASTDDP_AVX2 bool sum_fp16_avx2(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, uint16_t* __restrict dst,
    float* __restrict residual, int64_t begin, int64_t end, float scale) {
  bool bad = false;
  alignas(32) float acc[kTile];
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    sum_tile_fp16(src, chunks, m, t, len, acc);
    bad |= compress_avx2<WireKind::kFp16, false, kFeedback>(
        acc, dst + t, kFeedback ? residual + t : nullptr, 0, len, scale);
  }
  return bad;
}

FASTDDP_AVX2 void widen_sum_fp16_avx2(
    const uint16_t* __restrict src, int64_t chunks, int64_t m, float* __restrict dst,
    int64_t begin, int64_t end, float scale) {
  alignas(32) float acc[kTile];
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t len = std::min(end - t, kTile);
    sum_tile_fp16(src, chunks, m, t, len, acc);
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      _mm256_storeu_ps(dst + t + j, _mm256_mul_ps(_mm256_load_ps(acc + j), s));
    }
    for (; j < len; ++j) {
      dst[t + j] = math::mul(acc[j], scale);
    }
  }
}

template <WireKind K, bool kStream>
FASTDDP_AVX2 void decompress_avx2(
    const uint16_t* __restrict src, float* __restrict dst, int64_t begin, int64_t end,
    float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = aligned_start(dst, begin, end);
  decompress_loop<K>(src, dst, begin, i, scale);
  for (; i + 8 <= end; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    store<kStream>(dst + i, _mm256_mul_ps(Avx2Wire<K>::widen(h), s));
  }
  decompress_loop<K>(src, dst, i, end, scale);
}

bool use_avx2_f16c() {
  // FASTDDP_DISABLE_SIMD=1 forces the portable loops (the tests check both paths).
  const char* off = std::getenv("FASTDDP_DISABLE_SIMD");
  const bool disabled = off != nullptr && off[0] != '\0' && off[0] != '0';
  return !disabled && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const bool kHaveAvx2F16C = use_avx2_f16c();

// Runs `loop(Bool<stream>{})`, one of the vector loops over part of an op of n fp32 values
// written to dst: streaming its stores when n is large, and then fencing them, since streaming
// stores are weakly ordered and must be published before this thread's part of the op counts
// as done. Only where dst is aligned to its element size (a tensor of torch.frombuffer with an
// odd offset is not): otherwise no element starts at a 32-byte boundary, as streaming needs.
template <typename T, class F>
decltype(auto) vectorised(int64_t n, const T* dst, F&& loop) {
  if (n * 4 < stream_min_bytes() || reinterpret_cast<uintptr_t>(dst) % sizeof(T) != 0) {
    return loop(Bool<false>{});
  }
  struct Fence {
    ~Fence() { _mm_sfence(); }
  } fence_after_the_loop;
  return loop(Bool<true>{});
}
#else
constexpr bool kHaveAvx2F16C = false;
#endif

}  // namespace

bool run(const CompressArgs& a, int64_t begin, int64_t end) {
  const math::Mode mode = a.rounding.mode();
  return with_kind(a.kind, [&](auto kind) {
    constexpr WireKind K = decltype(kind)::value;
#ifdef FASTDDP_HAVE_AVX2_PATH
    if (kHaveAvx2F16C && !mode.stochastic) {
      return vectorised(a.n, a.dst, [&](auto stream) {
        constexpr bool kStream = decltype(stream)::value;
        return mode.feedback ? compress_avx2<K, kStream, true>(
                                   a.src, a.dst, mode.residual, begin, end, a.scale)
                             : compress_avx2<K, kStream, false>(
                                   a.src, a.dst, nullptr, begin, end, a.scale);
      });
    }
#endif
    return with_mode(mode, [&](auto feedback, auto stochastic) {
      return compress_loop<K, decltype(feedback)::value, decltype(stochastic)::value>(
          a.src, a.dst, mode.residual, begin, end, a.scale, mode.seed);
    });
  });
}

bool run(const DecompressArgs& a, int64_t begin, int64_t end) {
  with_kind(a.kind, [&](auto kind) {
    constexpr WireKind K = decltype(kind)::value;
#ifdef FASTDDP_HAVE_AVX2_PATH
    if (kHaveAvx2F16C) {
      vectorised(a.n, a.dst, [&](auto stream) {
        decompress_avx2<K, decltype(stream)::value>(a.src, a.dst, begin, end, a.scale);
      });
      return;
    }
#endif
    decompress_loop<K>(a.src, a.dst, begin, end, a.scale);
  });
  return false;
}

bool run(const SumChunksArgs& a, int64_t begin, int64_t end) {
  const math::Mode mode = a.rounding.mode();
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C && a.kind == WireKind::kFp16 && !mode.stochastic) {
    return mode.feedback
               ? sum_fp16_avx2<true>(a.src, a.chunks, a.m, a.dst, mode.residual, begin, end, a.scale)
               : sum_fp16_avx2<false>(a.src, a.chunks, a.m, a.dst, nullptr, begin, end, a.scale);
  }
#endif
  return with_kind(a.kind, [&](auto kind) {
    return with_mode(mode, [&](auto feedback, auto stochastic) {
      return sum_loop<decltype(kind)::value, decltype(feedback)::value,
                      decltype(stochastic)::value>(
          a.src, a.chunks, a.m, a.dst, mode.residual, begin, end, a.scale, mode.seed);
    });
  });
}

bool run(const WidenSumArgs& a, int64_t begin, int64_t end) {
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C && a.kind == WireKind::kFp16) {
    widen_sum_fp16_avx2(a.src, a.chunks, a.m, a.dst, begin, end, a.scale);
    return false;
  }
#endif
  with_kind(a.kind, [&](auto kind) {
    widen_sum_loop<decltype(kind)::value>(a.src, a.chunks, a.m, a.dst, begin, end, a.scale);
  });
  return false;
}

}  // namespace fastddp::cpu
