// Branch-free fp32 <-> fp16/bf16 conversions written with integer and select operations only,
// so that GCC and Clang vectorise every loop below. Results are bit-identical to c10::Half and
// c10::BFloat16 conversions (round to nearest even; NaN becomes the canonical quiet NaN).
#include "loops.h"

#include <cstring>

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

FASTDDP_INLINE uint16_t float_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  // Adding 0x7fff plus the lowest kept bit rounds half-way cases to even.
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
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
  uint32_t r = a < 0x38800000u ? subnormal : normal;
  const uint32_t special = a > 0x7f800000u ? 0x7e00u : 0x7c00u;
  r = a >= 0x47800000u ? special : r;
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
  normal = em >= 0x7c00u ? normal + 0x38000000u : normal;
  // Zero and subnormals are exactly em * 2^-24.
  const uint32_t subnormal = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return float_of((em < 0x400u ? subnormal : normal) | sign);
}

}  // namespace

FASTDDP_CLONES
bool compress_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t w = float_to_bf16(src[i] * scale);
    dst[i] = w;
    bad |= (w & 0x7fffu) >= 0x7f80u;
  }
  return bad != 0;
}

FASTDDP_CLONES
bool compress_fp16(const float* __restrict src, uint16_t* __restrict dst, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t w = float_to_fp16(src[i] * scale);
    dst[i] = w;
    bad |= (w & 0x7fffu) >= 0x7c00u;
  }
  return bad != 0;
}

FASTDDP_CLONES
void decompress_bf16(const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = bf16_to_float(src[i]) * scale;
  }
}

FASTDDP_CLONES
void decompress_fp16(const uint16_t* __restrict src, float* __restrict dst, int64_t n, float scale) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = fp16_to_float(src[i]) * scale;
  }
}

}  // namespace fastddp::cpu
