// Every kernel launch of fastddp, once: the grid for the work, the choice of the vectorised
// path, the flag, the kernel. Each `run` takes an op's raw arguments (fastddp/layout.h) and
// `Rt`, the runtime that runs a launch:
//
//   int sms();                                 the device's multiprocessors
//   void zero_flag(int* flag);                 the flag to 0, in stream order
//   void launch(kernel, int grid, args...);    kernel<<<grid, kThreads, 0, stream>>>(args...)
//
// ops.cu gives the CUDA runtime (torch's current stream, the launch check); the emulator
// (csrc/emu) gives one that runs the grid on the CPU. Both run this code, so the emulator tests
// the launch decisions (grids, alignment, tails) with the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels.cuh"
#include "packed_kernels.cuh"

namespace fastddp::kernels {

constexpr int kThreads = 256;

inline bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

// Enough blocks to fill the device a few times over; the kernels stride over the rest.
inline int grid_for(int64_t work, int sms) {
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{sms} * 8)));
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

// compress and decompress: one thread per 16-byte vector of 8 elements when both pointers allow
// 16-byte accesses, else one per element; the kernel's instance for the wire format.
template <class Rt, class Kernel, class In, class Out, class... Flag>
void launch_convert(
    Rt& rt, const ConvertArgs<In, Out>& a, Kernel fp16, Kernel bf16, Flag... flag) {
  const bool vec = aligned16(a.src) && aligned16(a.dst);
  const int grid = grid_for(vec ? a.n / kVec + 1 : a.n, rt.sms());
  const Kernel kernel = a.kind == WireKind::kBf16 ? bf16 : fp16;
  rt.launch(kernel, grid, a.src, a.dst, a.n, a.scale, vec, flag...);
}

template <class Rt>
void run(Rt& rt, const CompressArgs& a) {
  const Rounding& r = a.rounding;
  if (!start(rt, a.n, r.flag)) {
    return;
  }
  if (r.residual != nullptr || r.seed >= 0) {
    rt.launch(compress_feedback_kernel, grid_for(a.n, rt.sms()), a.kind, a.src, a.dst,
              r.residual, a.n, a.scale, r.seed, r.flag);
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
  if (start(rt, a.m, r.flag)) {
    rt.launch(sum_chunks_kernel, grid_for(a.m, rt.sms()), a.kind, a.src, a.chunks, a.m, a.dst,
              r.residual, a.scale, r.seed, r.flag);
  }
}

template <class Rt>
void run(Rt& rt, const WidenSumArgs& a) {
  if (start(rt, a.m)) {
    rt.launch(widen_sum_kernel, grid_for(a.m, rt.sms()), a.kind, a.src, a.chunks, a.m, a.dst,
              a.scale);
  }
}

// The instance of a packed kernel for 4 or 2 bits (int8 has kernels of its own).
template <class Kernel>
Kernel for_bits(int bits, Kernel four, Kernel two) {
  return bits == 4 ? four : two;
}

// quantize: one warp per block of elements, kThreads / 32 blocks per CUDA block.
template <class Rt>
void run(Rt& rt, const QuantizeArgs& a) {
  const Rounding& r = a.rounding;
  if (!start(rt, a.n, r.flag)) {
    return;
  }
  const int grid = grid_for(blocks_of(a.n, a.block) * 32, rt.sms());
  if (a.bits == 8) {
    rt.launch(quantize_int8_kernel, grid, a.src, a.dst, a.scales, r.residual, a.n, a.block,
              a.rows, a.scale, r.seed, r.flag);
    return;
  }
  rt.launch(for_bits(a.bits, quantize_packed_kernel<4>, quantize_packed_kernel<2>), grid, a);
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
  if (!start(rt, a.src.rows.row_len)) {
    return;
  }
  with_codes(a.src, [&](auto codes) {
    rt.launch(dequantize_kernel<decltype(codes)>, grid_for(a.src.rows.row_len, rt.sms()), codes,
              a.dst, a.scale);
  });
}

template <class Rt>
void run(Rt& rt, const UnpackArgs& a) {
  if (!start(rt, a.n)) {
    return;
  }
  with_codes(a.src, [&](auto codes) {
    rt.launch(unpack_kernel<decltype(codes)>, grid_for(a.n, rt.sms()), codes, a.n, a.dst,
              a.scale);
  });
}

}  // namespace fastddp::kernels
