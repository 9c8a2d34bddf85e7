// Branch-free fp32 <-> fp16/bf16 conversions written with integer and select operations only,
// so that GCC and Clang vectorise every loop below. Results are bit-identical to c10::Half and
// c10::BFloat16 conversions (round to nearest even; NaN becomes the canonical quiet NaN).
#include "loops.h"

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FASTDDP_HAVE_AVX2_PATH 1
#endif

// One clone per ISA, picked at load time: a portable binary that still uses AVX-512 or AVX2.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define FASTDDP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTDDP_CLONES
#endif

#define FASTDDP_INLINE inline __attribute__((always_inline))

namespace fastddp::cpu {
namespace {

FASTDDP_INLINE uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

FASTDDP_INLINE float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// All-ones when `c` holds. Selects written as masks keep the loops free of branches that the
// vectoriser cannot if-convert (it will not speculate the float additions below).
FASTDDP_INLINE uint32_t mask(bool c) {
  return 0u - static_cast<uint32_t>(c);
}

FASTDDP_INLINE uint32_t select(bool c, uint32_t a, uint32_t b) {
  return (a & mask(c)) | (b & ~mask(c));
}

FASTDDP_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  // Adding 0x7fff plus the lowest kept bit rounds half-way cases to even.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(select(nan, 0x7fc0u, rounded));
}

FASTDDP_INLINE uint16_t float_to_fp16(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: rebias the exponent (127 -> 15) and round the 13 dropped bits to even.
  // 0xc8000000 is -(112 << 23) modulo 2^32. Overflow past 65504 carries into 0x7c00 (inf).
  const uint32_t normal = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
  // Below 2^-14 the result is subnormal: adding 0.5f lines the mantissa up with fp16's
  // 2^-24 spacing and lets the FPU round to even for us.
  const uint32_t subnormal = bits_of(float_of(a) + 0.5f) - 0x3f000000u;
  uint32_t r = select(a < 0x38800000u, subnormal, normal);
  const uint32_t special = select(a > 0x7f800000u, 0x7e00u, 0x7c00u);
  r = select(a >= 0x47800000u, special, r);
  return static_cast<uint16_t>(r | sign);
}

FASTDDP_INLINE float bf16_to_float(uint16_t h) {
  return float_of(static_cast<uint32_t>(h) << 16);
}

FASTDDP_INLINE float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Rebias 15 -> 127; inf and NaN need the exponent moved to 255 as well.
  uint32_t normal = (em << 13) + 0x38000000u;
  normal += 0x38000000u & mask(em >= 0x7c00u);
  // Zero and subnormals are exactly em * 2^-24.
  const uint32_t subnormal = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return float_of(select(em < 0x400u, subnormal, normal) | sign);
}

}  // namespace

namespace {

FASTDDP_CLONES
bool compress_bf16_generic(
    const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t w = float_to_bf16(src[i] * scale);
    dst[i] = w;
    bad |= (w & 0x7fffu) >= 0x7f80u;
  }
  return bad != 0;
}

FASTDDP_CLONES
void decompress_bf16_generic(
    const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = bf16_to_float(src[i]) * scale;
  }
}


FASTDDP_CLONES
bool compress_fp16_generic(
    const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t w = float_to_fp16(src[i] * scale);
    dst[i] = w;
    bad |= (w & 0x7fffu) >= 0x7c00u;
  }
  return bad != 0;
}

FASTDDP_CLONES
void decompress_fp16_generic(
    const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = fp16_to_float(src[i]) * scale;
  }
}

#ifdef FASTDDP_HAVE_AVX2_PATH
// Elements to handle one by one before `dst` reaches `align` bytes, so that the vector loop
// can use aligned (streaming) stores.
template <typename T>
int64_t head_to_align(const T* dst, int64_t n, int64_t align) {
  const int64_t misaligned = static_cast<int64_t>(reinterpret_cast<uintptr_t>(dst) % align);
  const int64_t head = misaligned == 0 ? 0 : (align - misaligned) / int64_t{sizeof(T)};
  return head < n ? head : n;
}

// Streaming (non-temporal) stores skip the read-for-ownership of each destination line: for
// buckets far larger than the caches that saves a third of the memory traffic.
template <bool kStream>
__attribute__((target("avx2"))) inline void store128(uint16_t* p, __m128i v) {
  if constexpr (kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), v);
  } else {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), v);
  }
}

template <bool kStream>
__attribute__((target("avx2"))) inline void store256(uint16_t* p, __m256i v) {
  if constexpr (kStream) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), v);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v);
  }
}

template <bool kStream>
__attribute__((target("avx2"))) inline void store256(float* p, __m256 v) {
  if constexpr (kStream) {
    _mm256_stream_ps(p, v);
  } else {
    _mm256_storeu_ps(p, v);
  }
}

// x86 has had fp32<->fp16 conversion instructions (F16C, round to nearest even) since 2012;
// they beat the integer emulation by about 3x. Only NaN payloads may differ from c10::Half.
template <bool kStream>
__attribute__((target("avx2,f16c"))) bool compress_fp16_f16c(
    const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m128i exp_mask = _mm_set1_epi16(0x7c00);
  __m128i bad = _mm_setzero_si128();
  int64_t i = head_to_align(dst, n, 16);
  bool edge_bad = compress_fp16_generic(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(src + i), s);
    const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    store128<kStream>(dst + i, h);
    // Exponent all ones: inf or NaN.
    bad = _mm_or_si128(bad, _mm_cmpeq_epi16(_mm_and_si128(h, exp_mask), exp_mask));
  }
  edge_bad |= compress_fp16_generic(src + i, dst + i, n - i, scale);
  return edge_bad || !_mm_testz_si128(bad, bad);
}

template <bool kStream>
__attribute__((target("avx2,f16c"))) void decompress_fp16_f16c(
    const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = head_to_align(dst, n, 32);
  decompress_fp16_generic(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    store256<kStream>(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
  }
  decompress_fp16_generic(src + i, dst + i, n - i, scale);
}

template <bool kStream>
__attribute__((target("avx2"))) void decompress_bf16_avx2(
    const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = head_to_align(dst, n, 32);
  decompress_bf16_generic(src, dst, i, scale);
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
    store256<kStream>(dst + i, _mm256_mul_ps(_mm256_castsi256_ps(wide), s));
  }
  decompress_bf16_generic(src + i, dst + i, n - i, scale);
}

bool use_avx2_f16c() {
  // FASTDDP_DISABLE_SIMD=1 forces the portable loops (the tests check both paths).
  const char* off = std::getenv("FASTDDP_DISABLE_SIMD");
  const bool disabled = off != nullptr && off[0] != '\0' && off[0] != '0';
  return !disabled && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

const bool kHaveAvx2F16C = use_avx2_f16c();

// The same rounding as float_to_bf16, 16 values per step; the auto-vectorised loop loses time
// narrowing 32-bit lanes to 16 bits one register at a time.
__attribute__((target("avx2"))) inline __m256i bf16_bits_avx2(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

template <bool kStream>
__attribute__((target("avx2"))) bool compress_bf16_avx2(
    const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  const __m256i exp_mask = _mm256_set1_epi16(0x7f80);
  __m256i bad = _mm256_setzero_si256();
  int64_t i = head_to_align(dst, n, 32);
  bool edge_bad = compress_bf16_generic(src, dst, i, scale);
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = bf16_bits_avx2(_mm256_mul_ps(_mm256_loadu_ps(src + i), s));
    const __m256i hi = bf16_bits_avx2(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8), s));
    // packus works within 128-bit lanes; the permute puts the 16 results back in order.
    const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xd8);
    store256<kStream>(dst + i, h);
    bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(h, exp_mask), exp_mask));
  }
  edge_bad |= compress_bf16_generic(src + i, dst + i, n - i, scale);
  return edge_bad || !_mm256_testz_si256(bad, bad);
}
#else
constexpr bool kHaveAvx2F16C = false;
#endif

}  // namespace

bool compress_bf16(const float* src, uint16_t* dst, int64_t n, float scale, bool stream) {
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C) {
    return stream ? compress_bf16_avx2<true>(src, dst, n, scale)
                  : compress_bf16_avx2<false>(src, dst, n, scale);
  }
#endif
  return compress_bf16_generic(src, dst, n, scale);
}

bool compress_fp16(const float* src, uint16_t* dst, int64_t n, float scale, bool stream) {
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C) {
    return stream ? compress_fp16_f16c<true>(src, dst, n, scale)
                  : compress_fp16_f16c<false>(src, dst, n, scale);
  }
#endif
  return compress_fp16_generic(src, dst, n, scale);
}

void decompress_bf16(const uint16_t* src, float* dst, int64_t n, float scale, bool stream) {
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C) {
    return stream ? decompress_bf16_avx2<true>(src, dst, n, scale)
                  : decompress_bf16_avx2<false>(src, dst, n, scale);
  }
#endif
  decompress_bf16_generic(src, dst, n, scale);
}

void decompress_fp16(const uint16_t* src, float* dst, int64_t n, float scale, bool stream) {
#ifdef FASTDDP_HAVE_AVX2_PATH
  if (kHaveAvx2F16C) {
    return stream ? decompress_fp16_f16c<true>(src, dst, n, scale)
                  : decompress_fp16_f16c<false>(src, dst, n, scale);
  }
#endif
  decompress_fp16_generic(src, dst, n, scale);
}

void store_fence() {
#ifdef FASTDDP_HAVE_AVX2_PATH
  _mm_sfence();  // streaming stores are weakly ordered: publish them before returning
#endif
}

}  // namespace fastddp::cpu
