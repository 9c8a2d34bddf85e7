// fastddp's CUDA kernels, and nothing else: here the pieces every kernel shares (chunks of 4
// elements, 16-byte accesses, the warp loops, the flag) and the kernels of the 16-bit wire
// formats; the kernels of the integer codes in codes_kernels.cuh and packed_kernels.cuh, which
// build on this header. nvcc compiles them into launches.cu; g++ compiles them unchanged into the
// CUDA grid emulator (csrc/emu), which runs the kernels on the CPU with CUDA's semantics.
// Launches go through launch.h.
//
// Every op has a vector kernel that moves memory in 16-byte accesses, and the element math of
// fastddp/rounding.h, which the CPU loops share: same results, bit for bit. A lane of a warp
// takes a chunk of 4 elements, one 16-byte fp32 access, and the lanes of a warp take
// consecutive chunks, so that each warp-wide fp32 access covers 512 contiguous bytes. The
// narrower side of an op (16-bit wire values, int8/int4/int2 codes) is read 16 bytes at a time
// by the group of lanes that share those bytes (each keeps its own piece), and written by the
// group's first lane after the others' pieces reach it by warp shuffles: so every store covers
// whole 32-byte sectors, and nothing is written twice (where a row of codes is not 16-byte
// aligned, each lane reads and writes its own piece, still one coalesced access a warp). The
// row sums (sum_chunks, widen_sum) take 8 elements a lane instead, 16 bytes of each row. The
// 16-bit ops take elements one by one up to the first where all their pointers are 16-byte
// aligned (a scalar head); chunks at the end that are not whole go element by element.
// Layouts a vector kernel cannot take (a block that is not a multiple of 4 elements, fp32
// pointers that are not 16-byte aligned) run the scalar kernels of codes_kernels.cuh and
// packed_kernels.cuh.
#pragma once

#include <cstdint>

#if defined(FASTDDP_EMU)
#include "../emu/cuda_emu.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include "fastddp/layout.h"
#include "fastddp/rounding.h"

// Loops of a fixed count are unrolled whole: an array indexed by the counter of a loop nvcc
// leaves rolled lives in local memory, a round trip to L1 for each of its values.
#if defined(__CUDA_ARCH__)
#define FASTDDP_UNROLL _Pragma("unroll")
#else
#define FASTDDP_UNROLL
#endif

namespace fastddp::kernels {

using math::WireKind;

constexpr int kChunk = 4;   // elements a lane takes at a time: 16 bytes of fp32
constexpr int kUnroll = 2;  // chunks a lane of the 16-bit ops loads before it stores either
constexpr int kDequantUnroll = 4;  // chunks of each row a lane of dequantize takes a step
// and rows whose codes of them it loads before it adds: on an H200, 4 rows took the packed
// codes from 0.30-0.48 of a copy to 0.44-0.62 (100 MB, 1 GB), and int8's from 0.43-0.64 down
// to 0.32-0.39 (80 registers: 3 blocks an SM, not 4). Measured with a group's 16-byte loads;
// with a lane's own piece (load_own_piece) int8 takes 78 registers for 4 rows, 64 for 2.
template <int kBits>
constexpr int kDequantRows = kBits == 8 ? 2 : 4;
constexpr int kCodeUnroll = 2;    // steps of 32 chunks a warp of quantize takes at once
constexpr int kUnpackUnroll = 4;  // and of unpack, which loads a quarter of what it stores
constexpr unsigned kAllLanes = 0xffffffffu;
constexpr int kThreads = 256;  // a block's threads

__device__ __forceinline__ int64_t thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ int lane_index() {
  return static_cast<int>(threadIdx.x % 32);
}

// The scalar loops: body(i) for each index i in [begin, end) that this thread handles, from
// begin + its index in the grid, in steps of the grid's thread count.
template <class Body>
__device__ __forceinline__ void grid_stride_loop(int64_t begin, int64_t end, Body body) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + thread_index(); i < end; i += stride) {
    body(i);
  }
}

// The vector kernels' loop: step(first) for the first chunk of each run of `span` chunks
// (a multiple of 32) that this warp takes, in steps of the grid's warps. The condition is the
// same for every lane of a warp, so all of them run every step, some with chunks past the end:
// the lanes exchange values by shuffles, which need every lane of the warp.
template <class Step>
__device__ __forceinline__ void warp_loop(int64_t nchunks, int64_t span, Step step) {
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  for (int64_t first = thread_index() / 32 * span; first < nchunks; first += warps * span) {
    step(first);
  }
}

// The flag was zeroed before the launch; any block in which a thread saw a non-finite value
// sets it.
__device__ __forceinline__ void raise_flag(bool bad, int* flag) {
  if (flag != nullptr && __syncthreads_or(bad) && threadIdx.x == 0) {
    *flag = 1;
  }
}

// ------------------------------------------------------------------ chunks of fp32 values

// Chunk c of a range whose chunks start at element `head`: elements [first, first + count)
// (count < 4 only for the last), and whether 8 elements from the start of its pair of chunks
// (2k, 2k + 1) exist, so that the pair's 16 bytes of wire values are one access.
struct Chunk {
  int64_t index;
  int64_t first;
  int count;
  bool pair_whole;
};

__device__ __forceinline__ Chunk chunk_at(int64_t head, int64_t n, int64_t c) {
  const int64_t first = head + c * kChunk;
  const int64_t left = n - first;
  const int count = left <= 0 ? 0 : (left >= kChunk ? kChunk : static_cast<int>(left));
  return {c, first, count, head + (c | 1) * kChunk + kChunk <= n};
}

// 16-byte global accesses, one instruction each: nvcc may split a plain 16-byte dereference into
// four where it merges the vector path of a chunk with the scalar path beside it. load16 is for
// data that the kernel only reads (the read-only data path); load16_rw and store16 are plain
// accesses. The emulator (no __CUDA_ARCH__) makes plain ones.
#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float4 load16(const float4* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint4 load16(const uint4* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint2 load8(const uint2* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint32_t load4(const uint32_t* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint32_t load2(const uint16_t* p) {
  return __ldg(p);
}
__device__ __forceinline__ uint32_t load1(const uint8_t* p) {
  return __ldg(p);
}
// Volatile, with a memory clobber: the asm's read of *p is invisible to nvcc, which could
// otherwise move it past a store to the same place or reuse an earlier load's value.
__device__ __forceinline__ float4 load16_rw(const float4* p) {
  float4 v;
  asm volatile("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ void store16(float4* p, const float4& v) {
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}
__device__ __forceinline__ void store16(uint4* p, const uint4& v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};"
               :
               : "l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
// The packed codes' narrower stores (a lane's 16 int4 or int2 codes), made as store16 is.
__device__ __forceinline__ void store8(uint2* p, const uint2& v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" : : "l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void store4(uint32_t* p, uint32_t v) {
  asm volatile("st.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}
#else
template <class V>
V load16(const V* p) {
  return *p;
}
inline uint2 load8(const uint2* p) {
  return *p;
}
inline uint32_t load4(const uint32_t* p) {
  return *p;
}
inline uint32_t load2(const uint16_t* p) {
  return *p;
}
inline uint32_t load1(const uint8_t* p) {
  return *p;
}
template <class V>
V load16_rw(const V* p) {
  return *p;
}
template <class V>
void store16(V* p, const V& v) {
  *p = v;
}
inline void store8(uint2* p, const uint2& v) {
  *p = v;
}
inline void store4(uint32_t* p, uint32_t v) {
  *p = v;
}
#endif

// Loads the chunk's fp32 values (zeros past its count): one 16-byte access when it is whole.
// kWritten: the kernel also writes them.
template <bool kWritten = false>
__device__ __forceinline__ void load_chunk(const float* p, const Chunk& k, float (&x)[kChunk]) {
  if (k.count == kChunk) {
    const auto* at = reinterpret_cast<const float4*>(p + k.first);
    const float4 v = kWritten ? load16_rw(at) : load16(at);
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
    return;
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    x[j] = j < k.count ? p[k.first + j] : 0.0f;
  }
}

__device__ __forceinline__ void store_chunk(float* p, const Chunk& k, const float (&x)[kChunk]) {
  if (k.count == kChunk) {
    store16(reinterpret_cast<float4*>(p + k.first), make_float4(x[0], x[1], x[2], x[3]));
    return;
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    if (j < k.count) {
      p[k.first + j] = x[j];
    }
  }
}

// ------------------------------------------------------------------ 16-bit wire values

// fp32 <-> wire format K with CUDA's conversion instructions: to nearest even, and a NaN
// becomes the canonical 0x7fff.
template <WireKind K>
__device__ __forceinline__ uint16_t to_wire(float f) {
  return K == WireKind::kBf16 ? __bfloat16_as_ushort(__float2bfloat16_rn(f))
                              : __half_as_ushort(__float2half_rn(f));
}

template <WireKind K>
__device__ __forceinline__ float from_wire(uint16_t h) {
  return K == WireKind::kBf16 ? __bfloat162float(__ushort_as_bfloat16(h))
                              : __half2float(__ushort_as_half(h));
}

// The chunk's 4 wire values from p: the 16 bytes of its pair of chunks in one access (both
// lanes of the pair load them), or one by one where the pair is not whole.
__device__ __forceinline__ void load_wire(const uint16_t* p, const Chunk& k, uint16_t (&w)[kChunk]) {
  if (k.pair_whole) {
    const bool odd = (k.index & 1) != 0;
    const uint4 v = load16(reinterpret_cast<const uint4*>(p + k.first - (odd ? kChunk : 0)));
    const uint32_t lo = odd ? v.z : v.x;
    const uint32_t hi = odd ? v.w : v.y;
    w[0] = static_cast<uint16_t>(lo & 0xffffu);
    w[1] = static_cast<uint16_t>(lo >> 16);
    w[2] = static_cast<uint16_t>(hi & 0xffffu);
    w[3] = static_cast<uint16_t>(hi >> 16);
    return;
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    w[j] = j < k.count ? p[k.first + j] : uint16_t{0};
  }
}

// Stores the chunk's 4 wire values at p: the even lane of a whole pair stores both chunks in
// one 16-byte access (the odd lane's values come by shuffle); otherwise one by one. Every lane
// of the warp must call it.
__device__ __forceinline__ void store_wire(uint16_t* p, const Chunk& k, const uint16_t (&w)[kChunk]) {
  const uint32_t lo = static_cast<uint32_t>(w[0]) | (static_cast<uint32_t>(w[1]) << 16);
  const uint32_t hi = static_cast<uint32_t>(w[2]) | (static_cast<uint32_t>(w[3]) << 16);
  const uint32_t odd_lo = __shfl_xor_sync(kAllLanes, lo, 1);
  const uint32_t odd_hi = __shfl_xor_sync(kAllLanes, hi, 1);
  if (k.pair_whole) {
    if ((k.index & 1) == 0) {
      uint4 v;
      v.x = lo;
      v.y = hi;
      v.z = odd_lo;
      v.w = odd_hi;
      store16(reinterpret_cast<uint4*>(p + k.first), v);
    }
    return;
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    if (j < k.count) {
      p[k.first + j] = w[j];
    }
  }
}

// The vector loop of the 16-bit ops over elements [head, n): chunks of 4, kUnroll a lane. The
// lane loads all its chunks, load(chunks, values), before it finishes any, finish(chunk,
// values), so that its 16-byte loads are in flight together. T: the type of the values loaded
// (float, or uint16_t wire values). Every lane of the warp calls finish.
template <class T, class Load, class Finish>
__device__ __forceinline__ void unrolled_chunks(int64_t head, int64_t n, Load load, Finish finish) {
  warp_loop((n - head + kChunk - 1) / kChunk, 32 * kUnroll, [&](int64_t first) {
    Chunk k[kUnroll];
    T x[kUnroll][kChunk];
    FASTDDP_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      k[u] = chunk_at(head, n, first + 32 * u + lane_index());
    }
    load(k, x);
    FASTDDP_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      finish(k[u], x[u]);
    }
  });
}

// A load for unrolled_chunks from one that loads a chunk, load(chunk, values).
template <class T, class Load>
__device__ __forceinline__ auto chunk_by_chunk(Load load) {
  return [=](const Chunk (&k)[kUnroll], T (&x)[kUnroll][kChunk]) {
    FASTDDP_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      load(k[u], x[u]);
    }
  };
}

// compress to nearest: n fp32 values times scale to wire format K. Elements [0, head) go one by
// one (all of them when the pointers never align); from head on, chunks of 4, kUnroll a lane.
template <WireKind K>
__global__ void compress_kernel(
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    int64_t n,
    float scale,
    int64_t head,
    int* __restrict__ found_nonfinite) {
  bool bad = false;
  grid_stride_loop(0, head, [&](int64_t i) {
    const uint16_t w = to_wire<K>(src[i] * scale);
    dst[i] = w;
    bad |= math::wire_nonfinite(K, w);
  });
  unrolled_chunks<float>(
      head, n,
      chunk_by_chunk<float>([&](const Chunk& k, float (&x)[kChunk]) { load_chunk(src, k, x); }),
      [&](const Chunk& k, const float (&x)[kChunk]) {
        uint16_t w[kChunk];
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          w[j] = to_wire<K>(x[j] * scale);
          bad |= j < k.count && math::wire_nonfinite(K, w[j]);
        }
        store_wire(dst, k, w);
      });
  raise_flag(bad, found_nonfinite);
}

template <WireKind K>
__global__ void decompress_kernel(
    const uint16_t* __restrict__ src,
    float* __restrict__ dst,
    int64_t n,
    float scale,
    int64_t head) {
  grid_stride_loop(0, head, [&](int64_t i) { dst[i] = from_wire<K>(src[i]) * scale; });
  unrolled_chunks<uint16_t>(
      head, n,
      chunk_by_chunk<uint16_t>([&](const Chunk& k, uint16_t (&w)[kChunk]) { load_wire(src, k, w); }),
      [&](const Chunk& k, const uint16_t (&w)[kChunk]) {
        float x[kChunk];
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          x[j] = from_wire<K>(w[j]) * scale;
        }
        store_chunk(dst, k, x);
      });
}

// The rounding of compress with error feedback or stochastic rounding: the chunk's values x
// (before scale and residual) rounded by the shared element math into dst, the residual read
// and written 16 bytes at a time. Every lane of the warp must call it.
__device__ __forceinline__ bool round_chunk(
    WireKind kind, const math::Mode& mode, const Chunk& k, const float (&x)[kChunk], float scale,
    uint16_t* dst) {
  float r[kChunk] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (mode.feedback) {
    load_chunk<true>(mode.residual, k, r);
  }
  bool bad = false;
  uint16_t w[kChunk];
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    const int64_t i = k.first + j;
    const float v = math::rounding_input_of(mode, x[j], scale, r[j]);
    w[j] = math::float_to_wire(kind, v, mode.stochastic, math::random_for(mode, i));
    bad |= j < k.count && math::wire_nonfinite(kind, w[j]);
    r[j] = math::residual_after(kind, v, w[j], r[j]);
  }
  if (mode.feedback) {
    store_chunk(mode.residual, k, r);
  }
  store_wire(dst, k, w);
  return bad;
}

// compress with error feedback or stochastic rounding: n fp32 values times scale rounded by the
// shared element math into dst. Elements [0, head) go one by one; from head on, chunks of 4,
// kUnroll a lane.
__global__ void compress_feedback_kernel(
    WireKind kind,
    const float* __restrict__ src,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    int64_t n,
    float scale,
    int64_t seed,
    int64_t head,
    int* __restrict__ flag) {
  const math::Mode mode = mode_of(residual, seed);
  bool bad = false;
  grid_stride_loop(0, head, [&](int64_t i) {
    bad |= math::round_element(kind, mode, math::rounding_input(mode, src[i], scale, i), dst, i);
  });
  unrolled_chunks<float>(
      head, n,
      chunk_by_chunk<float>([&](const Chunk& k, float (&x)[kChunk]) { load_chunk(src, k, x); }),
      [&](const Chunk& k, const float (&x)[kChunk]) {
        bad |= round_chunk(kind, mode, k, x, scale, dst);
      });
  raise_flag(bad, flag);
}

// ------------------------------------------------------------------ row sums

// The row sums (sum_chunks, widen_sum) take 8 elements a lane, an octet: 16 bytes of each row
// of wire values. With the chunks of 4 of the ops above, the two lanes of a pair both loaded
// the pair's 16 bytes, so half of every request was a copy, and each lane had half the bytes
// in flight that its loads moved (H200: 0.33-0.45 of a copy, its warps waiting on L1TEX). An
// octet is the lane's own 16 bytes of each row, and its rounded values one 16-byte store,
// with no shuffle.
constexpr int kOctet = 8;
// Rows of an octet a lane loads before it adds any, so that all of them are in flight at once:
// 64 bytes a lane, 16 registers.
constexpr int kSumRows = 4;

// Element i of the P rows of length m, summed in fp32 in order p = 0..P-1.
__device__ __forceinline__ float sum_rows(
    WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, int64_t i) {
  float acc = math::wire_to_float(kind, src[i]);
  for (int64_t p = 1; p < chunks; ++p) {
    acc = math::add(acc, math::wire_to_float(kind, src[p * m + i]));
  }
  return acc;
}

// Wire value j (0..7) of a 16-byte access.
__device__ __forceinline__ uint16_t wire_of(const uint4& v, int j) {
  const uint32_t word = j < 4 ? (j < 2 ? v.x : v.y) : (j < 6 ? v.z : v.w);
  return static_cast<uint16_t>((j % 2) == 0 ? word & 0xffffu : word >> 16);
}

// The octet at element e of the P rows, summed as sum_rows sums (in row order), kSumRows rows'
// loads issued before any of them is added. A load past the last row is predicated off, not
// branched around (the loads stay back to back): 2 rows, as the two-level path's step between
// two nodes has, load 2 octets a lane, not 4 with the last row's twice.
__device__ __forceinline__ void sum_octet(
    WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, int64_t e,
    float (&acc)[kOctet]) {
  for (int64_t p = 0; p < chunks; p += kSumRows) {
    uint4 v[kSumRows] = {};
    FASTDDP_UNROLL
    for (int r = 0; r < kSumRows; ++r) {
      if (p + r < chunks) {
        v[r] = load16(reinterpret_cast<const uint4*>(src + (p + r) * m + e));
      }
    }
    FASTDDP_UNROLL
    for (int r = 0; r < kSumRows; ++r) {
      if (p + r < chunks) {
        FASTDDP_UNROLL
        for (int j = 0; j < kOctet; ++j) {
          const float x = math::wire_to_float(kind, wire_of(v[r], j));
          acc[j] = p + r == 0 ? x : math::add(acc[j], x);
        }
      }
    }
  }
}

// The row sums' loop over elements [0, m): elements before `head` (where every row and output
// aligns to 16 bytes) and past the last whole octet one by one, element(i); the octets between,
// a thread's octet(e) with e the first of its elements, consecutive threads on consecutive
// octets (a warp's load is 512 contiguous bytes of a row). The head's elements go to the grid's
// first threads and the tail's to its last (which take an octet fewer where the octets do not
// fill the grid evenly): an element is a pass over every row, and a thread taking one of each
// would hold its warp, and the kernel's end, two passes.
template <class Element, class Octet>
__device__ __forceinline__ void octet_loop(int64_t m, int64_t head, Element element, Octet octet) {
  const int64_t octets = (m - head) / kOctet;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  grid_stride_loop(0, head, element);
  for (int64_t i = head + octets * kOctet + (threads - 1 - thread_index()); i < m; i += threads) {
    element(i);
  }
  grid_stride_loop(0, octets, [&](int64_t o) { octet(head + o * kOctet); });
}

// The octet's sums x at element e rounded as round_chunk rounds a chunk: the residual read and
// written 16 bytes at a time, the 8 wire values stored in one access.
__device__ __forceinline__ bool round_octet(
    WireKind kind, const math::Mode& mode, int64_t e, const float (&x)[kOctet], float scale,
    uint16_t* dst) {
  float r[kOctet] = {};
  if (mode.feedback) {
    FASTDDP_UNROLL
    for (int h = 0; h < 2; ++h) {
      const float4 v = load16_rw(reinterpret_cast<const float4*>(mode.residual + e) + h);
      r[4 * h] = v.x;
      r[4 * h + 1] = v.y;
      r[4 * h + 2] = v.z;
      r[4 * h + 3] = v.w;
    }
  }
  bool bad = false;
  uint32_t word[kOctet / 2] = {};
  FASTDDP_UNROLL
  for (int j = 0; j < kOctet; ++j) {
    const float v = math::rounding_input_of(mode, x[j], scale, r[j]);
    const uint16_t w = math::float_to_wire(kind, v, mode.stochastic, math::random_for(mode, e + j));
    bad |= math::wire_nonfinite(kind, w);
    r[j] = math::residual_after(kind, v, w, r[j]);
    word[j / 2] |= static_cast<uint32_t>(w) << (16 * (j % 2));
  }
  if (mode.feedback) {
    FASTDDP_UNROLL
    for (int h = 0; h < 2; ++h) {
      store16(reinterpret_cast<float4*>(mode.residual + e) + h,
              make_float4(r[4 * h], r[4 * h + 1], r[4 * h + 2], r[4 * h + 3]));
    }
  }
  uint4 out;
  out.x = word[0];
  out.y = word[1];
  out.z = word[2];
  out.w = word[3];
  store16(reinterpret_cast<uint4*>(dst + e), out);
  return bad;
}

// sum_chunks: the row sum and its rounding in one pass. Rows start 16-byte aligned at `head`
// together (m is a multiple of 8, or there is one row) or head is m.
__global__ void __launch_bounds__(kThreads, 4) sum_chunks_kernel(
    WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    uint16_t* __restrict__ dst,
    float* __restrict__ residual,
    float scale,
    int64_t seed,
    int64_t head,
    int* __restrict__ flag) {
  const math::Mode mode = mode_of(residual, seed);
  bool bad = false;
  octet_loop(
      m, head,
      [&](int64_t i) {
        const float x = math::rounding_input(mode, sum_rows(kind, src, chunks, m, i), scale, i);
        bad |= math::round_element(kind, mode, x, dst, i);
      },
      [&](int64_t e) {
        float acc[kOctet];
        sum_octet(kind, src, chunks, m, e, acc);
        bad |= round_octet(kind, mode, e, acc, scale, dst);
      });
  raise_flag(bad, flag);
}

__global__ void __launch_bounds__(kThreads, 4) widen_sum_kernel(
    WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    float* __restrict__ dst,
    float scale,
    int64_t head) {
  octet_loop(
      m, head,
      [&](int64_t i) { dst[i] = math::mul(sum_rows(kind, src, chunks, m, i), scale); },
      [&](int64_t e) {
        float acc[kOctet];
        sum_octet(kind, src, chunks, m, e, acc);
        FASTDDP_UNROLL
        for (int h = 0; h < 2; ++h) {
          store16(reinterpret_cast<float4*>(dst + e) + h,
                  make_float4(math::mul(acc[4 * h], scale), math::mul(acc[4 * h + 1], scale),
                              math::mul(acc[4 * h + 2], scale), math::mul(acc[4 * h + 3], scale)));
        }
      });
}

}  // namespace fastddp::kernels
