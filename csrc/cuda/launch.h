// Every kernel launch of fastddp, once: the grid for the work, the choice of the vectorised
// path, the flag, the kernel. `Rt` is the runtime that runs a launch:
//
//   int sms();                                 the device's multiprocessors
//   void zero_flag(int* flag);                 the flag to 0, in stream order
//   void launch(kernel, int grid, args...);    kernel<<<grid, kThreads, 0, stream>>>(args...)
//
// ops.cu gives the CUDA runtime (torch's current stream, the launch check) and the tensor
// checks; the emulator (csrc/emu) gives one that runs the grid on the CPU. Both run this code,
// so the emulator tests the launch decisions (grids, alignment, tails) with the kernels.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels.cuh"

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

template <class Rt>
void compress(
    Rt& rt,
    math::WireKind kind,
    const float* in,
    uint16_t* out,
    int64_t n,
    float scale,
    float* residual,
    int64_t seed,
    int* flag) {
  if (flag != nullptr) {
    rt.zero_flag(flag);  // the kernels only ever set it
  }
  if (n == 0) {
    return;
  }
  if (residual != nullptr || seed >= 0) {
    rt.launch(compress_feedback_kernel, grid_for(n, rt.sms()), kind, in, out, residual, n, scale,
              seed, flag);
    return;
  }
  const bool vec = aligned16(in) && aligned16(out);
  const int grid = grid_for(vec ? n / kVec + 1 : n, rt.sms());
  if (kind == math::WireKind::kBf16) {
    rt.launch(compress_kernel<WireBf16>, grid, in, out, n, scale, vec, flag);
  } else {
    rt.launch(compress_kernel<WireFp16>, grid, in, out, n, scale, vec, flag);
  }
}

template <class Rt>
void decompress(
    Rt& rt, math::WireKind kind, const uint16_t* in, float* out, int64_t n, float scale) {
  if (n == 0) {
    return;
  }
  const bool vec = aligned16(in) && aligned16(out);
  const int grid = grid_for(vec ? n / kVec + 1 : n, rt.sms());
  if (kind == math::WireKind::kBf16) {
    rt.launch(decompress_kernel<WireBf16>, grid, in, out, n, scale, vec);
  } else {
    rt.launch(decompress_kernel<WireFp16>, grid, in, out, n, scale, vec);
  }
}

template <class Rt>
void sum_chunks(
    Rt& rt,
    math::WireKind kind,
    const uint16_t* in,
    int64_t chunks,
    int64_t m,
    uint16_t* out,
    float* residual,
    float scale,
    int64_t seed,
    int* flag) {
  if (flag != nullptr) {
    rt.zero_flag(flag);
  }
  if (m == 0) {
    return;
  }
  rt.launch(sum_chunks_kernel, grid_for(m, rt.sms()), kind, in, chunks, m, out, residual, scale,
            seed, flag);
}

template <class Rt>
void widen_sum(
    Rt& rt, math::WireKind kind, const uint16_t* in, int64_t chunks, int64_t m, float* out,
    float scale) {
  if (m == 0) {
    return;
  }
  rt.launch(widen_sum_kernel, grid_for(m, rt.sms()), kind, in, chunks, m, out, scale);
}

template <class Rt>
void quantize_int8(
    Rt& rt,
    const float* in,
    int8_t* out,
    float* scales,
    float* residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* flag) {
  if (flag != nullptr) {
    rt.zero_flag(flag);
  }
  if (n == 0) {
    return;
  }
  // One warp per block of elements: kThreads / 32 int8 blocks per CUDA block.
  rt.launch(quantize_int8_kernel, grid_for(blocks_of(n, block) * 32, rt.sms()), in, out, scales,
            residual, n, block, rows, scale, seed, flag);
}

template <class Rt>
void dequantize_int8(
    Rt& rt,
    const int8_t* in,
    const float* scales,
    int64_t chunks,
    int64_t m,
    int64_t block,
    Int8Rows rows,
    float* out,
    float scale) {
  if (m == 0) {
    return;
  }
  rt.launch(dequantize_int8_kernel, grid_for(m, rt.sms()), in, scales, chunks, m, block, rows,
            out, scale);
}

template <class Rt>
void unpack_int8(
    Rt& rt,
    const int8_t* in,
    const float* scales,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float* out,
    float scale) {
  if (n == 0) {
    return;
  }
  rt.launch(unpack_int8_kernel, grid_for(n, rt.sms()), in, scales, n, block, rows, out, scale);
}

}  // namespace fastddp::kernels
