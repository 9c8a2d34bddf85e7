// Every kernel launch of fastddp, once: the grid for the work, the choice of the vectorised
// path, the flag, the kernel. Each `run` takes an op's raw arguments (fastddp/layout.h) and
// `Rt`, the runtime that runs a launch:
//
//   int resident(kernel);                      blocks of kernel the device runs at once
//   void zero_flag(int* flag);                 the flag to 0, in stream order
//   void launch(kernel, int grid, args...);    kernel<<<grid, kThreads, 0, stream>>>(args...)
//
// launches.cu gives the CUDA runtime (a stream, the launch check); the emulator
// (csrc/emu) gives one that runs the grid on the CPU. Both run this code, so the emulator tests
// the launch decisions (grids, alignment, tails) with the kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "codes_kernels.cuh"
#include "kernels.cuh"
#include "packed_kernels.cuh"
#include "values.cuh"
#include "wide_kernels.cuh"

namespace fastddp::kernels {

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// A block for each kThreads of `work`, up to the blocks the device runs at once: the kernels
// stride over the rest. One wave and no more, since a grid-stride block's work is its share of
// the whole: a second, partial wave would leave the device part idle while it ran.
inline int grid_for(int64_t work, int resident) {
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, resident)));
}

// Launches kernel over `work` threads' worth of work.
template <class Rt, class Kernel, class... A>
void launch_over(Rt& rt, int64_t work, Kernel kernel, A... args) {
  rt.launch(kernel, grid_for(work, rt.resident(kernel)), args...);
}

// Threads for a vector kernel's `chunks` chunks of 4 elements, `per_lane` to a lane.
inline int64_t lanes_for(int64_t chunks, int64_t per_lane) {
  return (chunks + per_lane - 1) / per_lane;
}

// Zeroes the op's flag, if it has one (the kernels only ever set it, so it is zeroed even when
// there is nothing to do), and says whether there is any work to launch.
template <class Rt>
bool start(Rt& rt, int64_t work, int* flag = nullptr) {
  if (flag != nullptr) {
    rt.zero_flag(flag);
  }
  return work > 0;
}

// The head of a 16-bit op over n elements: the first element at which every pointer (null ones
// aside) is 16-byte aligned, the start of the kernel's vector body; n when there is none.
template <class T>
bool aligned_at(int64_t i, const T* p) {
  return p == nullptr || aligned16(p + i);
}
template <class... T>
int64_t head_of(int64_t n, const T*... p) {
  for (int64_t i = 0; i < 8 && i < n; ++i) {
    if ((aligned_at(i, p) && ...)) {
      return i;
    }
  }
  return n;
}

// The head of a row sum over `chunks` rows of m wire values at src: all rows align at the same
// element only when a row is whole 16-byte units long.
template <class... T>
int64_t row_head(int64_t chunks, int64_t m, const uint16_t* src, const T*... p) {
  return chunks > 1 && m % 8 != 0 ? m : head_of(m, src, p...);
}

// compress and decompress: the instance for the wire format, after a scalar head.
template <class Rt, class Kernel, class In, class Out, class... Flag>
void launch_convert(
    Rt& rt, const ConvertArgs<In, Out>& a, Kernel fp16, Kernel bf16, Flag... flag) {
  const int64_t head = head_of(a.n, a.src, a.dst);
  launch_over(rt, std::max(head, lanes_for(a.n / kChunk, kUnroll)),
              a.kind == WireKind::kBf16 ? bf16 : fp16, a.src, a.dst, a.n, a.scale, head, flag...);
}

template <class Rt>
void run(Rt& rt, const CompressArgs& a) {
  const Rounding& r = a.rounding;
  if (!start(rt, a.n, r.flag)) {
    return;
  }
  if (r.residual != nullptr || r.seed >= 0) {
    const int64_t head = head_of(a.n, a.src, a.dst, r.residual);
    launch_over(rt, std::max(head, lanes_for(a.n / kChunk, kUnroll)), compress_feedback_kernel,
                a.kind, a.src, a.dst, r.residual, a.n, a.scale, r.seed, head, r.flag);
    return;
  }
  launch_convert(rt, a, compress_kernel<WireKind::kFp16>, compress_kernel<WireKind::kBf16>,
                 r.flag);
}

template <class Rt>
void run(Rt& rt, const DecompressArgs& a) {
  if (start(rt, a.n)) {
    launch_convert(rt, a, decompress_kernel<WireKind::kFp16>, decompress_kernel<WireKind::kBf16>);
  }
}

template <class Rt>
void run(Rt& rt, const SumChunksArgs& a) {
  const Rounding& r = a.rounding;
  if (!start(rt, a.m, r.flag)) {
    return;
  }
  const int64_t head = row_head(a.chunks, a.m, a.src, a.dst, r.residual);
  launch_over(rt, std::max(head, a.m / kOctet), sum_chunks_kernel, a.kind,
              a.src, a.chunks, a.m, a.dst, r.residual, a.scale, r.seed, head, r.flag);
}

template <class Rt>
void run(Rt& rt, const WidenSumArgs& a) {
  if (!start(rt, a.m)) {
    return;
  }
  const int64_t head = row_head(a.chunks, a.m, a.src, a.dst);
  launch_over(rt, std::max(head, a.m / kOctet), widen_sum_kernel, a.kind,
              a.src, a.chunks, a.m, a.dst, a.scale, head);
}

// The instance of a kernel for 8, 4 or 2 bits.
template <class Kernel>
Kernel for_bits(int bits, Kernel eight, Kernel four, Kernel two) {
  return bits == 8 ? eight : bits == 4 ? four : two;
}

// Whether the vector kernels of the codes can take this layout: fp32 pointers 16-byte aligned,
// blocks of whole chunks, and each row's codes aligned to a chunk's piece (bits / 2 bytes).
inline bool codes_vectorise(const void* q, const Int8Rows& rows, int64_t block, int bits,
                            const float* fp32, const float* residual = nullptr) {
  const int64_t piece = bits / 2;
  return aligned16(fp32) && (residual == nullptr || aligned16(residual)) && block % kChunk == 0 &&
         reinterpret_cast<uintptr_t>(q) % piece == 0 &&
         (rows.rows == 1 || (rows.q_stride % piece == 0 && rows.row_len % kChunk == 0));
}

// The instance of quantize_vec_kernel for kBits, the mode of `r` and what it rounds: where
// Values::kStochasticAtRun, one instance rounds either way (the kStochastic false one).
template <int kBits, class Values>
auto quantize_vec_for(const Rounding& r) {
  const bool feedback = r.residual != nullptr;
  if constexpr (Values::kStochasticAtRun) {
    return feedback ? quantize_vec_kernel<kBits, true, false, Values>
                    : quantize_vec_kernel<kBits, false, false, Values>;
  } else {
    const bool stochastic = r.seed >= 0;
    return feedback ? (stochastic ? quantize_vec_kernel<kBits, true, true, Values>
                                  : quantize_vec_kernel<kBits, true, false, Values>)
                    : (stochastic ? quantize_vec_kernel<kBits, false, true, Values>
                                  : quantize_vec_kernel<kBits, false, false, Values>);
  }
}

template <int kBits>
using Bits = std::integral_constant<int, kBits>;

// The bytes of a wide lane's 16 codes of `bits` bits (16, 8, 4): how codes must align for it.
inline int64_t wide_lane_bytes(int bits) {
  return kWide * bits / 8;
}

// Whether codes of `bits` bits at q, in `rows`, align for the wide kernel: q and each row's
// start at a multiple of a lane's codes.
inline bool wide_codes_align(const void* q, const Int8Rows& rows, int bits) {
  const int64_t lane = wide_lane_bytes(bits);
  return reinterpret_cast<uintptr_t>(q) % lane == 0 && (rows.rows == 1 || rows.q_stride % lane == 0);
}

// Whether quantize_wide_kernel can write this layout: codes aligned to a lane's 16, residual
// 16-byte aligned, a block a power of two from 16 to 512 elements (a power of two of lanes, up
// to a warp), one row or rows of whole blocks. What it reads is the caller's to check.
inline bool wide_layout(const QuantizeArgs& a) {
  const bool pow2 = a.block >= kWide && a.block <= 32 * kWide && (a.block & (a.block - 1)) == 0;
  return pow2 && wide_codes_align(a.dst, a.rows, a.bits) &&
         (a.rounding.residual == nullptr || aligned16(a.rounding.residual)) &&
         (a.rows.rows == 1 || a.rows.row_len % a.block == 0);
}

// The instance of quantize_wide_kernel for kBits, the mode of `r` and what it rounds, as
// quantize_vec_for picks.
template <int kBits, class Values>
auto quantize_wide_for(const Rounding& r) {
  const bool feedback = r.residual != nullptr;
  if constexpr (Values::kStochasticAtRun) {
    return feedback ? quantize_wide_kernel<kBits, true, false, Values>
                    : quantize_wide_kernel<kBits, false, false, Values>;
  } else {
    const bool stochastic = r.seed >= 0;
    return feedback ? (stochastic ? quantize_wide_kernel<kBits, true, true, Values>
                                  : quantize_wide_kernel<kBits, true, false, Values>)
                    : (stochastic ? quantize_wide_kernel<kBits, false, true, Values>
                                  : quantize_wide_kernel<kBits, false, false, Values>);
  }
}

// quantize_wide_kernel for codes of kBits bits, over a's elements.
template <int kBits, class Rt, class Values>
void quantize_wide(Rt& rt, const QuantizeArgs& a, const Values& source) {
  launch_over(rt, (a.n + kWide - 1) / kWide, quantize_wide_for<kBits, Values>(a.rounding), a,
              Divider::of(a.rows.row_len), source);
}

// quantize for codes of kBits bits: quantize_vec_kernel when `vector`, else one warp per block
// of elements. `values` is what the kernels round (values.cuh).
template <int kBits, class Rt, class Values>
void quantize_with(Rt& rt, const QuantizeArgs& a, bool vector, const Values& values) {
  const Rounding& r = a.rounding;
  if (vector) {
    const int64_t per_block = a.block / kChunk;
    const int64_t chunks = (a.n + kChunk - 1) / kChunk;
    const int64_t span = per_block <= 32 ? 32 * kCodeUnroll : per_block;
    launch_over(rt, (chunks + span - 1) / span * 32, quantize_vec_for<kBits, Values>(r), a,
                Codes::of(a.rows, a.block), values);
    return;
  }
  const int64_t warps = blocks_of(a.n, a.block) * 32;
  if constexpr (kBits == 8) {
    launch_over(rt, warps, quantize_int8_kernel<Values>, values, a.dst, a.scales, r.residual, a.n,
                a.block, a.rows, a.scale, r.seed, r.flag);
  } else {
    launch_over(rt, warps, quantize_packed_kernel<kBits, Values>, a, values);
  }
}

// quantize: the vector kernel where `vectorise` (the layout allows it) and a block is a power of
// two of chunks up to a warp's, or whole warps of chunks. values(Bits<b>{}) is what the kernels
// round for codes of b bits.
// `wide`: the layout and what is read allow quantize_wide_kernel, which takes it.
template <class Rt, class ValuesOf>
void quantize(Rt& rt, const QuantizeArgs& a, bool vectorise, ValuesOf values, bool wide = false) {
  if (!start(rt, a.n, a.rounding.flag)) {
    return;
  }
  if (wide) {
    if (a.bits == 8) {
      quantize_wide<8>(rt, a, values(Bits<8>{}));
    } else if (a.bits == 4) {
      quantize_wide<4>(rt, a, values(Bits<4>{}));
    } else {
      quantize_wide<2>(rt, a, values(Bits<2>{}));
    }
    return;
  }
  const int64_t per_block = a.block / kChunk;
  const bool grouped = per_block <= 32 && 32 % std::max<int64_t>(per_block, 1) == 0;
  const bool vector = vectorise && (grouped || per_block % 32 == 0);
  if (a.bits == 8) {
    quantize_with<8>(rt, a, vector, values(Bits<8>{}));
  } else if (a.bits == 4) {
    quantize_with<4>(rt, a, vector, values(Bits<4>{}));
  } else {
    quantize_with<2>(rt, a, vector, values(Bits<2>{}));
  }
}

template <class Rt>
void run(Rt& rt, const QuantizeArgs& a) {
  const bool vectorise = codes_vectorise(a.dst, a.rows, a.block, a.bits, a.src, a.rounding.residual);
  const bool wide = wide_layout(a) && aligned16(a.src);
  quantize(rt, a, vectorise, [&](auto) { return FlatValues{a.src}; }, wide);
}

// requantize: the vector kernel where the row written allows it and each row read starts
// aligned to a chunk's piece of codes (the rows line up by column, whatever their length).
template <class Rt>
void run(Rt& rt, const RequantizeArgs& a) {
  const QuantizeArgs& out = a.out;
  const int64_t piece = a.src.bits / 2;
  const bool vectorise =
      codes_vectorise(out.dst, out.rows, out.block, out.bits, nullptr, out.rounding.residual) &&
      reinterpret_cast<uintptr_t>(a.src.q) % piece == 0 &&
      (a.src.rows.rows == 1 || a.src.rows.q_stride % piece == 0);
  // The wide kernel: each row's 16 codes of a lane one aligned load, in one block of scales.
  const bool wide = wide_layout(out) && wide_codes_align(a.src.q, a.src.rows, a.src.bits) &&
                    a.src.block % kWide == 0;
  const Divider by_block = Divider::of(a.src.block);
  quantize(
      rt, out, vectorise,
      [&](auto bits) { return SummedRows<decltype(bits)::value>{a.src, by_block, a.scale}; },
      wide);
}

// f(codes) with the reader of s's codes: Int8Codes, or PackedCodes of 4 or 2 bits.
template <class F>
void with_codes(const Int8Source& s, F&& f) {
  if (s.bits == 8) {
    f(Int8Codes{s});
  } else if (s.bits == 4) {
    f(PackedCodes<4>{s});
  } else {
    f(PackedCodes<2>{s});
  }
}

template <class Rt>
void run(Rt& rt, const DequantizeArgs& a) {
  const int64_t m = a.src.rows.row_len;
  if (!start(rt, m)) {
    return;
  }
  if (codes_vectorise(a.src.q, a.src.rows, a.src.block, a.src.bits, a.dst)) {
    launch_over(rt, lanes_for(m, kChunk * kDequantUnroll),
                for_bits(a.src.bits, dequantize_vec_kernel<8>, dequantize_vec_kernel<4>,
                         dequantize_vec_kernel<2>),
                a.src, Codes::of(a.src.rows, a.src.block), a.dst, a.scale);
    return;
  }
  with_codes(a.src, [&](auto codes) {
    launch_over(rt, m, dequantize_kernel<decltype(codes)>, codes, a.dst, a.scale);
  });
}

template <class Rt>
void run(Rt& rt, const UnpackArgs& a) {
  if (!start(rt, a.n)) {
    return;
  }
  if (codes_vectorise(a.src.q, a.src.rows, a.src.block, a.src.bits, a.dst)) {
    launch_over(rt, lanes_for(a.n, kChunk * kUnpackUnroll),
                for_bits(a.src.bits, unpack_vec_kernel<8>, unpack_vec_kernel<4>,
                         unpack_vec_kernel<2>),
                a.src, Codes::of(a.src.rows, a.src.block), a.n, a.dst, a.scale);
    return;
  }
  with_codes(a.src, [&](auto codes) {
    launch_over(rt, a.n, unpack_kernel<decltype(codes)>, codes, a.n, a.dst, a.scale);
  });
}

}  // namespace fastddp::kernels
