// Element-wise math shared by the CPU and CUDA kernels of the accumulating and int8 ops:
// fp32 -> fp16/bf16/int8 rounding (to nearest even, or stochastic), the counter-based random
// numbers behind stochastic rounding, and fp32 arithmetic that never contracts into an FMA.
// Both backends call exactly these functions, so they produce bit-identical results, and the
// Python reference in the tests can reproduce them with plain torch operations.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FASTDDP_HD __host__ __device__ __forceinline__
#else
#define FASTDDP_HD inline
#endif

namespace fastddp::math {

enum class WireKind { kFp16, kBf16 };

FASTDDP_HD uint32_t bits_of(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FASTDDP_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// a * b and a + b, each rounded once: nvcc would otherwise fuse a * b + c into an FMA on the
// device but not on the host, and the two backends would disagree in the last bit.
FASTDDP_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FASTDDP_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FASTDDP_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FASTDDP_HD float floor_of(float x) {
#if defined(__CUDA_ARCH__)
  return floorf(x);
#else
  return __builtin_floorf(x);
#endif
}

// Round half to even (the default rounding mode on the host, rint's definition on the device).
FASTDDP_HD float round_even(float x) {
#if defined(__CUDA_ARCH__)
  return rintf(x);
#else
  return __builtin_rintf(x);
#endif
}

// 32 random bits for element `index` of a call seeded with `seed`: a stateless integer hash, so
// any thread of any backend can draw element i's number without coordination.
FASTDDP_HD uint32_t random_bits(uint64_t seed, uint64_t index) {
  uint64_t x = index * 0x9e3779b97f4a7c15ull + seed * 0xd1b54a32d192ed03ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 32;
  return static_cast<uint32_t>(x);
}

// Uniform in [0, 1) with 24 random bits (exactly representable in fp32).
FASTDDP_HD float random_unit(uint32_t r) {
  return static_cast<float>(r >> 8) * 0x1p-24f;
}

// The conversions below are written as selects, not branches, so that the CPU loops over them
// vectorise; on the GPU they compile to predicated instructions.
FASTDDP_HD float wire_to_float(WireKind kind, uint16_t h) {
  if (kind == WireKind::kBf16) {
    return float_of(static_cast<uint32_t>(h) << 16);
  }
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Rebias 15 -> 127; inf and NaN need the exponent moved to 255 as well.
  const uint32_t normal = (em << 13) + 0x38000000u + (em >= 0x7c00u ? 0x38000000u : 0u);
  // Zero and subnormals are exactly em * 2^-24.
  const uint32_t subnormal = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return float_of((em < 0x400u ? subnormal : normal) | sign);
}

FASTDDP_HD bool wire_nonfinite(WireKind kind, uint16_t h) {
  return (h & 0x7fffu) >= (kind == WireKind::kBf16 ? 0x7f80u : 0x7c00u);
}

// fp32 -> bf16, to nearest even, or stochastically when `stochastic`: then |v| rounds away from
// zero with probability equal to the dropped fraction of a bf16 step.
FASTDDP_HD uint16_t to_bf16(float v, bool stochastic, uint32_t r) {
  const uint32_t u = bits_of(v);
  const uint32_t add_bits = stochastic ? (r & 0xffffu) : 0x7fffu + ((u >> 16) & 1u);
  const uint32_t rounded = (u + add_bits) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// fp32 -> fp16, to nearest even or stochastically; past 65504 (after rounding) gives inf.
FASTDDP_HD uint16_t to_fp16(float v, bool stochastic, uint32_t r) {
  const uint32_t u = bits_of(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: rebias 127 -> 15 and round the 13 dropped bits (0xc8000000 is -(112 << 23)
  // modulo 2^32); an overflow past 65504 carries into 0x7c00, inf.
  const uint32_t add_bits = stochastic ? (r & 0x1fffu) : 0xfffu + ((a >> 13) & 1u);
  const uint32_t normal = (a + 0xc8000000u + add_bits) >> 13;
  // Below 2^-14 the result is subnormal, counted in units of 2^-24.
  uint32_t subnormal;
  if (stochastic) {
    // Exact, but written with mul/sub all the same: an unrounded m * 2^24 - whole is a pair
    // nvcc may fuse, and benchmarks/ptx_check.py refuses every such pair in the kernels.
    const float m = mul(float_of(a < 0x38800000u ? a : 0u), 0x1p24f);
    const float whole = floor_of(m);
    subnormal = static_cast<uint32_t>(whole) + (sub(m, whole) > random_unit(r) ? 1u : 0u);
  } else {
    // Adding 0.5f lines the value up with fp16's 2^-24 spacing and lets the FPU round to even.
    subnormal = bits_of(add(float_of(a), 0.5f)) - 0x3f000000u;
  }
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a >= 0x47800000u ? (a > 0x7f800000u ? 0x7e00u : 0x7c00u) : h;
  return static_cast<uint16_t>(h | sign);
}

FASTDDP_HD uint16_t float_to_wire(WireKind kind, float v, bool stochastic, uint32_t r) {
  return kind == WireKind::kBf16 ? to_bf16(v, stochastic, r) : to_fp16(v, stochastic, r);
}

// Rounds v into the wire format; with a residual (error feedback), v already includes it and
// the residual becomes what the rounding dropped. A non-finite result leaves the residual alone
// so that one overflow does not poison every later step. Returns true for a non-finite result.
FASTDDP_HD bool round_with_feedback(
    WireKind kind, float v, uint16_t* out, float* residual, bool stochastic, uint32_t r) {
  const uint16_t w = float_to_wire(kind, v, stochastic, r);
  *out = w;
  const bool bad = wire_nonfinite(kind, w);
  if (residual != nullptr) {
    const float dropped = sub(v, wire_to_float(kind, w));
    *residual = bad ? *residual : dropped;
  }
  return bad;
}

// int8 block quantisation: scale = absmax / 127, q = round(v * 127 / absmax) in [-127, 127].
// The absolute maximum is taken over the bit patterns so that a NaN anywhere wins.
FASTDDP_HD uint32_t abs_bits_max(uint32_t m, float v) {
  const uint32_t a = bits_of(v) & 0x7fffffffu;
  return a > m ? a : m;
}

FASTDDP_HD bool block_nonfinite(uint32_t absmax_bits) {
  return absmax_bits >= 0x7f800000u;
}

// The scale stored for a block: absmax / 127; NaN for a block holding inf or NaN, so that its
// dequantised values come out NaN and the step is visibly bad.
FASTDDP_HD float block_scale(uint32_t absmax_bits) {
  return block_nonfinite(absmax_bits) ? float_of(0x7fc00000u) : float_of(absmax_bits) / 127.0f;
}

// 127 / absmax, or 0 for a block that is all zeros, holds inf/NaN, or is so small (below about
// 3.7e-37) that the inverse overflows: such a block quantises to zeros (its values stay in the
// residual) instead of converting inf or NaN to an integer.
FASTDDP_HD float block_inverse(uint32_t absmax_bits) {
  if (block_nonfinite(absmax_bits) || absmax_bits == 0) {
    return 0.0f;
  }
  const float inverse = 127.0f / float_of(absmax_bits);
  return bits_of(inverse) < 0x7f800000u ? inverse : 0.0f;
}

FASTDDP_HD int8_t quantize_int8(float v, float inverse, bool stochastic, uint32_t r) {
  const float x = mul(v, inverse);
  float q;
  if (stochastic) {
    const float whole = floor_of(x);
    q = whole + ((x - whole) > random_unit(r) ? 1.0f : 0.0f);
  } else {
    q = round_even(x);
  }
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(static_cast<int32_t>(q));
}

}  // namespace fastddp::math
