// Element-wise math shared by the CPU loops and the CUDA kernels: fp32 <-> fp16/bf16 and
// fp32 -> int8/int4/int2 codes (to nearest even, or stochastic), the counter-based random numbers
// behind stochastic rounding, fp32 arithmetic that never contracts into an FMA, and what each
// rounding op does with one element. Both backends call exactly these functions, so they produce
// bit-identical results, and the Python reference in the tests can reproduce them with plain
// torch operations.
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

// The primitives, once for each side. On the device, CUDA's intrinsics: __fmul_rn, __fadd_rn
// and __fsub_rn each round once, and neither nvcc nor ptxas fuses them into an FMA. On the host,
// the plain operators: the build's -ffp-contract=off keeps the compiler from fusing them.
// select(c, a, b) is c ? a : b; on the host it is written with masks, because GCC will not
// if-convert a branch whose arm holds a float operation (it might raise an exception), and the
// CPU loops over these functions must be free of branches to vectorise.
#if defined(__CUDA_ARCH__)
FASTDDP_HD uint32_t bits_of(float f) { return __float_as_uint(f); }
FASTDDP_HD float float_of(uint32_t u) { return __uint_as_float(u); }
FASTDDP_HD float mul(float a, float b) { return __fmul_rn(a, b); }
FASTDDP_HD float add(float a, float b) { return __fadd_rn(a, b); }
FASTDDP_HD float sub(float a, float b) { return __fsub_rn(a, b); }
FASTDDP_HD float floor_of(float x) { return floorf(x); }
FASTDDP_HD float round_even(float x) { return rintf(x); }  // rint: half to even
FASTDDP_HD uint32_t select(bool c, uint32_t a, uint32_t b) { return c ? a : b; }
#else
FASTDDP_HD uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
FASTDDP_HD float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
FASTDDP_HD float mul(float a, float b) { return a * b; }
FASTDDP_HD float add(float a, float b) { return a + b; }
FASTDDP_HD float sub(float a, float b) { return a - b; }
FASTDDP_HD float floor_of(float x) { return __builtin_floorf(x); }
FASTDDP_HD float round_even(float x) { return __builtin_rintf(x); }  // the default rounding mode
FASTDDP_HD uint32_t select(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return b ^ ((a ^ b) & mask);
}
#endif

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

// Uniform in [0, 1) with 24 random bits (exactly representable in fp32). Converted as a signed
// integer, which it fits: x86 has no vector conversion from unsigned.
FASTDDP_HD float random_unit(uint32_t r) {
  return static_cast<float>(static_cast<int32_t>(r >> 8)) * 0x1p-24f;
}

// The conversions below are written with selects, not branches, so that the CPU loops over
// them vectorise; on the GPU they compile to predicated instructions.
FASTDDP_HD float wire_to_float(WireKind kind, uint16_t h) {
  if (kind == WireKind::kBf16) {
    return float_of(static_cast<uint32_t>(h) << 16);
  }
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  // Rebias 15 -> 127; inf and NaN need the exponent moved to 255 as well.
  const uint32_t normal = (em << 13) + 0x38000000u + select(em >= 0x7c00u, 0x38000000u, 0u);
  // Zero and subnormals are exactly em * 2^-24.
  const uint32_t subnormal = bits_of(static_cast<float>(static_cast<int32_t>(em)) * 0x1p-24f);
  return float_of(select(em < 0x400u, subnormal, normal) | sign);
}

FASTDDP_HD bool wire_nonfinite(WireKind kind, uint16_t h) {
  return (h & 0x7fffu) >= (kind == WireKind::kBf16 ? 0x7f80u : 0x7c00u);
}

// fp32 -> bf16, to nearest even, or stochastically when `stochastic`: then |v| rounds away from
// zero with probability equal to the dropped fraction of a bf16 step.
FASTDDP_HD uint16_t to_bf16(float v, bool stochastic, uint32_t r) {
  const uint32_t u = bits_of(v);
  // To nearest: adding 0x7fff plus the lowest kept bit rounds half-way cases to even. A NaN
  // becomes the canonical quiet NaN, 0x7fc0 (chosen before the shift, so that the CPU loops
  // narrow to 16 bits once).
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t add_bits = stochastic ? (r & 0xffffu) : 0x7fffu + ((u >> 16) & 1u);
  uint32_t wide = u + add_bits;
  if (stochastic) {
    // Overflow as to nearest (see to_fp16): past the largest bf16, up to the halfway point,
    // the largest; from there on, inf.
    const uint32_t edge = select(a >= 0x7f7f8000u, 0x7f800000u, 0x7f7f0000u) | (u & 0x80000000u);
    wide = select(a > 0x7f7f0000u && a < 0x7f800000u, edge, wide);
  }
  wide = select(a > 0x7f800000u, 0x7fc00000u, wide);
  return static_cast<uint16_t>(wide >> 16);
}

// fp32 -> fp16, to nearest even or stochastically. Either way 65520 and above give inf (to
// nearest, what lies past 65504 by half a step) and every value below it a finite one: rounded
// up stochastically, a value between 65504 and 65520 would become inf where rounding to
// nearest keeps it, and the step would be flagged, skipped or clipped for noise.
FASTDDP_HD uint16_t to_fp16(float v, bool stochastic, uint32_t r) {
  const uint32_t u = bits_of(v);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal range: rebias 127 -> 15 and round the 13 dropped bits (0xc8000000 is -(112 << 23)
  // modulo 2^32); an overflow past 65504 carries into 0x7c00, inf.
  const uint32_t add_bits = stochastic ? (r & 0x1fffu) : 0xfffu + ((a >> 13) & 1u);
  uint32_t normal = (a + 0xc8000000u + add_bits) >> 13;
  if (stochastic) {
    normal = select(a >= 0x477fe000u, select(a >= 0x477ff000u, 0x7c00u, 0x7bffu), normal);
  }
  // Below 2^-14 the result is subnormal, counted in units of 2^-24.
  uint32_t subnormal;
  if (stochastic) {
    // Exact, but written with mul/sub all the same: an unrounded m * 2^24 - whole is a pair
    // nvcc may fuse, and benchmarks/ptx_check.py refuses every such pair in the kernels. m is
    // in [0, 1024), so truncating it to an int32 is its floor (and vectorises on x86).
    const float m = mul(float_of(select(a < 0x38800000u, a, 0u)), 0x1p24f);
    const int32_t whole = static_cast<int32_t>(m);
    const float above = sub(m, static_cast<float>(whole));
    subnormal = static_cast<uint32_t>(whole) + (above > random_unit(r) ? 1u : 0u);
  } else {
    // Adding 0.5f lines the value up with fp16's 2^-24 spacing and lets the FPU round to even.
    subnormal = bits_of(add(float_of(a), 0.5f)) - 0x3f000000u;
  }
  const uint32_t h = select(a < 0x38800000u, subnormal, normal);
  const uint32_t special = select(a > 0x7f800000u, 0x7e00u, 0x7c00u);
  return static_cast<uint16_t>(select(a >= 0x47800000u, special, h) | sign);
}

FASTDDP_HD uint16_t float_to_wire(WireKind kind, float v, bool stochastic, uint32_t r) {
  return kind == WireKind::kBf16 ? to_bf16(v, stochastic, r) : to_fp16(v, stochastic, r);
}

// Block quantisation to signed integer codes in [-qmax, qmax]: 127 for int8, 7 for int4, 1 for
// int2. scale = absmax / qmax, q = round(v * qmax / absmax). The absolute maximum is taken over
// the bit patterns so that a NaN anywhere wins.
constexpr float kInt8Max = 127.0f;

FASTDDP_HD uint32_t abs_bits_max(uint32_t m, float v) {
  const uint32_t a = bits_of(v) & 0x7fffffffu;
  return a > m ? a : m;
}

FASTDDP_HD bool block_nonfinite(uint32_t absmax_bits) {
  return absmax_bits >= 0x7f800000u;
}

// The scale stored for a block: absmax / qmax; NaN for a block holding inf or NaN, so that its
// dequantised values come out NaN and the step is visibly bad. Near FLT_MAX, qmax times the
// rounded quotient can overflow: the float below it then, so that every code of a finite block
// decodes to a finite value and what the rounding dropped stays finite.
FASTDDP_HD float block_scale(uint32_t absmax_bits, float qmax = kInt8Max) {
  if (block_nonfinite(absmax_bits)) {
    return float_of(0x7fc00000u);
  }
  const float step = float_of(absmax_bits) / qmax;
  return bits_of(mul(step, qmax)) < 0x7f800000u ? step : float_of(bits_of(step) - 1u);
}

// qmax / absmax, or 0 for a block that is all zeros, holds inf/NaN, or is so small that the
// inverse overflows (below about 3.7e-37 for int8): such a block quantises to zeros (its values
// stay in the residual) instead of converting inf or NaN to an integer.
FASTDDP_HD float block_inverse(uint32_t absmax_bits, float qmax = kInt8Max) {
  if (block_nonfinite(absmax_bits) || absmax_bits == 0) {
    return 0.0f;
  }
  const float inverse = qmax / float_of(absmax_bits);
  return bits_of(inverse) < 0x7f800000u ? inverse : 0.0f;
}

// block_scale(absmax_bits, qmax) when `inverse` is false, block_inverse(absmax_bits, qmax) when
// true, bit for bit, with one division whose operands the flag picks: the GPU's quantize has
// each lane work out one of a step's values, its scales and inverses alike.
FASTDDP_HD float block_scale_or_inverse(uint32_t absmax_bits, float qmax, bool inverse) {
  const float absmax = float_of(absmax_bits);
  const float quotient = (inverse ? qmax : absmax) / (inverse ? absmax : qmax);
  const uint32_t q = bits_of(quotient);
  if (inverse) {
    const bool zero = block_nonfinite(absmax_bits) || absmax_bits == 0 || q >= 0x7f800000u;
    return zero ? 0.0f : quotient;
  }
  const float step = bits_of(mul(quotient, qmax)) < 0x7f800000u ? quotient : float_of(q - 1u);
  return block_nonfinite(absmax_bits) ? float_of(0x7fc00000u) : step;
}

// The code of v in a block whose absmax is finite and at least |v|, inverse its
// block_inverse. To nearest, it needs no clamp: inverse = RN(qmax / absmax) is at most
// (qmax / absmax)(1 + 2^-24), so |v| * inverse rounds to qmax plus at most one ulp of qmax
// (qmax * 2^-24 is below that ulp for qmax 127, 7 and 1), which rounds to qmax. A stochastic
// draw can carry that ulp up to qmax + 1: clamped.
FASTDDP_HD int8_t quantize_code(float v, float inverse, float qmax, bool stochastic, uint32_t r) {
  const float x = mul(v, inverse);
  float q;
  if (stochastic) {
    const float whole = floor_of(x);
    q = whole + ((x - whole) > random_unit(r) ? 1.0f : 0.0f);
    q = q > qmax ? qmax : (q < -qmax ? -qmax : q);
  } else {
    q = round_even(x);
  }
  return static_cast<int8_t>(static_cast<int32_t>(q));
}

FASTDDP_HD int8_t quantize_int8(float v, float inverse, bool stochastic, uint32_t r) {
  return quantize_code(v, inverse, kInt8Max, stochastic, r);
}

// How a rounding op (compress, sum_chunks, quantize_int8) treats its elements: with error
// feedback when `feedback` (`residual` holds one fp32 per element), stochastically when
// `stochastic` (random bits from `seed` and the element's index). The kernels fill it in at run
// time; the CPU loops with compile-time constants, so that each of their instances is one loop
// without a branch in it.
struct Mode {
  bool feedback;
  float* residual;
  bool stochastic;
  uint64_t seed;
};

// The value an element is rounded from: x * scale, plus its residual under error feedback.
FASTDDP_HD float rounding_input_of(const Mode& mode, float x, float scale, float residual) {
  const float v = mul(x, scale);
  return mode.feedback ? add(v, residual) : v;
}

// The same for element i, its residual read here.
FASTDDP_HD float rounding_input(const Mode& mode, float x, float scale, int64_t i) {
  return rounding_input_of(mode, x, scale, mode.feedback ? mode.residual[i] : 0.0f);
}

FASTDDP_HD uint32_t random_for(const Mode& mode, int64_t i) {
  return mode.stochastic ? random_bits(mode.seed, static_cast<uint64_t>(i)) : 0u;
}

// The residual that rounding v to the wire value w leaves under error feedback: what the
// rounding dropped, or `kept` (the residual before) where w is inf or NaN.
FASTDDP_HD float residual_after(WireKind kind, float v, uint16_t w, float kept) {
  const float dropped = sub(v, wire_to_float(kind, w));
  return float_of(select(wire_nonfinite(kind, w), bits_of(kept), bits_of(dropped)));
}

// Rounds element i (v from rounding_input) into out[i]; under error feedback residual[i]
// becomes what the rounding dropped, except where the result is inf or NaN: one overflow must
// not poison every later step. Returns true for an inf or NaN result.
FASTDDP_HD bool round_element(WireKind kind, const Mode& mode, float v, uint16_t* out, int64_t i) {
  const uint16_t w = float_to_wire(kind, v, mode.stochastic, random_for(mode, i));
  out[i] = w;
  const bool bad = wire_nonfinite(kind, w);
  if (mode.feedback) {
    mode.residual[i] = residual_after(kind, v, w, mode.residual[i]);
  }
  return bad;
}

// What quantising v to code q of a block with scale `step` dropped: the residual it leaves.
FASTDDP_HD float quantize_dropped(float v, int8_t q, float step) {
  return sub(v, mul(static_cast<float>(q), step));
}

// Quantises element i (v from rounding_input) of a block whose absmax is finite to a code in
// [-qmax, qmax]; under error feedback residual[i] becomes what the quantisation dropped.
FASTDDP_HD int8_t quantize_element(
    const Mode& mode, float v, float inverse, float step, int64_t i, float qmax = kInt8Max) {
  const int8_t q = quantize_code(v, inverse, qmax, mode.stochastic, random_for(mode, i));
  if (mode.feedback) {
    mode.residual[i] = quantize_dropped(v, q, step);
  }
  return q;
}

}  // namespace fastddp::math
