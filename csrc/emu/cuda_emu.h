// A CUDA grid emulator for the CPU: just enough of CUDA's built-ins to compile fastddp's kernel
// header with g++ unchanged and run it with CUDA's semantics.
//
// Every CUDA thread of a block is a fiber with its own stack; the fibers of a block
// run in a random order, and blocks in a random order, drawn from the seed of the launch.
// __syncthreads* is a real barrier over the block's threads, __shfl_*_sync a real exchange
// over the lanes named in its mask: a named lane that never arrives (it exited, or waits at
// another barrier) is an error, as is a thread that calls a shuffle without its own lane in the
// mask. Vector types carry CUDA's alignment, so a misaligned vector access is undefined
// behaviour that UBSan reports. Half and bfloat16 conversions round as CUDA's do.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "fastddp/rounding.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};

namespace fastddp::emu {

// What a running fiber sees as its built-ins.
struct ThreadIds {
  dim3 block_idx, thread_idx, block_dim, grid_dim;
};

extern thread_local const ThreadIds* current_ids;

// Block barrier: returns how many threads of the block passed a non-zero predicate.
int sync_block(int predicate);
// Warp exchange: lane `src_lane` of the calling warp's value; checks the mask.
uint32_t shuffle(uint32_t mask, uint32_t value, int src_lane);
int lane_id();

// A kernel launch: `grid` blocks of `threads` threads, each running `body(ctx)`.
using Body = void (*)(void* ctx);
// Returns "" on success, else what went wrong (the seed and the block are named).
std::string launch(unsigned grid, unsigned threads, Body body, void* ctx);

// The emulated device: how many SMs it has (settable, so that grid-stride loops take several
// passes at small sizes) and the seed of the next launch's order.
void configure(int sm_count, uint64_t seed);
int sm_count();

}  // namespace fastddp::emu

#define blockIdx (::fastddp::emu::current_ids->block_idx)
#define threadIdx (::fastddp::emu::current_ids->thread_idx)
#define blockDim (::fastddp::emu::current_ids->block_dim)
#define gridDim (::fastddp::emu::current_ids->grid_dim)

inline void __syncthreads() {
  ::fastddp::emu::sync_block(0);
}
inline int __syncthreads_or(int p) {
  return ::fastddp::emu::sync_block(p != 0) != 0;
}
inline int __syncthreads_count(int p) {
  return ::fastddp::emu::sync_block(p != 0);
}
inline int __syncthreads_and(int p) {
  return ::fastddp::emu::sync_block(p != 0) ==
         static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}

inline uint32_t __shfl_sync(uint32_t mask, uint32_t v, int src, int width = 32) {
  const int lane = ::fastddp::emu::lane_id();
  return ::fastddp::emu::shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
inline uint32_t __shfl_xor_sync(uint32_t mask, uint32_t v, int lane_mask, int width = 32) {
  const int lane = ::fastddp::emu::lane_id();
  const int src = lane ^ lane_mask;
  // A source outside the caller's width segment reads the caller's own value, as on CUDA.
  return ::fastddp::emu::shuffle(mask, v, (src / width == lane / width) ? src : lane);
}
inline float __shfl_sync(uint32_t mask, float v, int src, int width = 32) {
  return ::fastddp::math::float_of(
      __shfl_sync(mask, ::fastddp::math::bits_of(v), src, width));
}
inline float __shfl_xor_sync(uint32_t mask, float v, int lane_mask, int width = 32) {
  return ::fastddp::math::float_of(
      __shfl_xor_sync(mask, ::fastddp::math::bits_of(v), lane_mask, width));
}
// Any other type is refused at compile time: converted to uint32_t, a float or a 64-bit value
// would lose what CUDA's overloads keep.
template <class T>
T __shfl_sync(uint32_t mask, T v, int src, int width = 32) = delete;
template <class T>
T __shfl_xor_sync(uint32_t mask, T v, int lane_mask, int width = 32) = delete;

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
inline float4 make_float4(float x, float y, float z, float w) {
  return {x, y, z, w};
}
inline float2 make_float2(float x, float y) {
  return {x, y};
}
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) {
  return {x, y, z, w};
}
inline uint2 make_uint2(uint32_t x, uint32_t y) {
  return {x, y};
}

// Half and bfloat16 as CUDA's headers define them: round to nearest even, and a NaN becomes
// the canonical 0x7fff (cuda_fp16.hpp / cuda_bf16.hpp), not a quiet copy of its payload.
struct __half {
  uint16_t x;
};
struct __nv_bfloat16 {
  uint16_t x;
};
inline bool emu_isnan(float f) {
  return (::fastddp::math::bits_of(f) & 0x7fffffffu) > 0x7f800000u;
}
inline __half __float2half_rn(float f) {
  return {emu_isnan(f) ? uint16_t{0x7fff} : ::fastddp::math::to_fp16(f, false, 0)};
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  return {emu_isnan(f) ? uint16_t{0x7fff} : ::fastddp::math::to_bf16(f, false, 0)};
}
inline float __half2float(__half h) {
  return ::fastddp::math::wire_to_float(::fastddp::math::WireKind::kFp16, h.x);
}
inline float __bfloat162float(__nv_bfloat16 h) {
  return ::fastddp::math::wire_to_float(::fastddp::math::WireKind::kBf16, h.x);
}
inline uint16_t __half_as_ushort(__half h) {
  return h.x;
}
inline __half __ushort_as_half(uint16_t u) {
  return {u};
}
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 h) {
  return h.x;
}
inline __nv_bfloat16 __ushort_as_bfloat16(uint16_t u) {
  return {u};
}
