// fastddp's CUDA kernels: every __global__ function, and nothing else. nvcc compiles this header
// into ops.cu; g++ compiles it unchanged into the CUDA grid emulator (csrc/emu), which runs the
// kernels on the CPU with CUDA's semantics. Launches go through launch.h.
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
// 16-bit ops take elements one by one up to the first where all their pointers are 16-byte
// aligned (a scalar head); chunks at the end that are not whole go element by element.
// Layouts a vector kernel cannot take (a block that is not a multiple of 4 elements, fp32
// pointers that are not 16-byte aligned) run the scalar kernels at the end of this file (and
// in packed_kernels.cuh).
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
constexpr int kRowsAtOnce = 4;  // rows whose codes a lane of dequantize loads before it adds
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
__device__ __forceinline__ float4 load16_rw(const float4* p) {
  float4 v;
  asm("ld.global.v4.f32 {%0, %1, %2, %3}, [%4];"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(p));
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
#else
template <class V>
V load16(const V* p) {
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
// lane loads all its chunks, load(chunk, values), before it finishes any, finish(chunk,
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
      load(k[u], x[u]);
    }
    FASTDDP_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      finish(k[u], x[u]);
    }
  });
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
      head, n, [&](const Chunk& k, float (&x)[kChunk]) { load_chunk(src, k, x); },
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
      head, n, [&](const Chunk& k, uint16_t (&w)[kChunk]) { load_wire(src, k, w); },
      [&](const Chunk& k, const uint16_t (&w)[kChunk]) {
        float x[kChunk];
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          x[j] = from_wire<K>(w[j]) * scale;
        }
        store_chunk(dst, k, x);
      });
}

// The rounding of compress (with error feedback or stochastic rounding) and of sum_chunks: the
// chunk's values x (before scale and residual) rounded by the shared element math into dst,
// the residual read and written 16 bytes at a time. Every lane of the warp must call it.
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

// The rounding ops (compress with error feedback or stochastic rounding, and sum_chunks): the n
// elements' values, input(i) (before scale and residual), rounded into dst in wire format kind.
// Elements [0, head) go one by one; from head on, chunks whose fp32 values load(chunk, x) gives.
template <class Input, class Load>
__device__ __forceinline__ void round_all(
    WireKind kind, math::Mode mode, int64_t n, float scale, int64_t head, uint16_t* dst, int* flag,
    Input input, Load load) {
  bool bad = false;
  grid_stride_loop(0, head, [&](int64_t i) {
    bad |= math::round_element(kind, mode, math::rounding_input(mode, input(i), scale, i), dst, i);
  });
  unrolled_chunks<float>(head, n, load, [&](const Chunk& k, const float (&x)[kChunk]) {
    bad |= round_chunk(kind, mode, k, x, scale, dst);
  });
  raise_flag(bad, flag);
}

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
  round_all(
      kind, mode_of(residual, seed), n, scale, head, dst, flag,
      [&](int64_t i) { return src[i]; },
      [&](const Chunk& k, float (&x)[kChunk]) { load_chunk(src, k, x); });
}

// Element i of the P rows of length m, summed in fp32 in order p = 0..P-1.
__device__ __forceinline__ float sum_rows(
    WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, int64_t i) {
  float acc = math::wire_to_float(kind, src[i]);
  for (int64_t p = 1; p < chunks; ++p) {
    acc = math::add(acc, math::wire_to_float(kind, src[p * m + i]));
  }
  return acc;
}

// The chunk's elements of the P rows, summed as sum_rows does, each row read 16 bytes at a time.
__device__ __forceinline__ void sum_chunk(
    WireKind kind, const uint16_t* __restrict__ src, int64_t chunks, int64_t m, const Chunk& k,
    float (&acc)[kChunk]) {
  uint16_t w[kChunk];
  load_wire(src, k, w);
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    acc[j] = math::wire_to_float(kind, w[j]);
  }
  for (int64_t p = 1; p < chunks; ++p) {
    load_wire(src + p * m, k, w);
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      acc[j] = math::add(acc[j], math::wire_to_float(kind, w[j]));
    }
  }
}

// sum_chunks: the row sum and its rounding in one pass. Rows start 16-byte aligned at `head`
// together (m is a multiple of 8, or there is one row) or head is m.
__global__ void sum_chunks_kernel(
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
  round_all(
      kind, mode_of(residual, seed), m, scale, head, dst, flag,
      [&](int64_t i) { return sum_rows(kind, src, chunks, m, i); },
      [&](const Chunk& k, float (&acc)[kChunk]) { sum_chunk(kind, src, chunks, m, k, acc); });
}

__global__ void widen_sum_kernel(
    WireKind kind,
    const uint16_t* __restrict__ src,
    int64_t chunks,
    int64_t m,
    float* __restrict__ dst,
    float scale,
    int64_t head) {
  grid_stride_loop(0, head, [&](int64_t i) {
    dst[i] = math::mul(sum_rows(kind, src, chunks, m, i), scale);
  });
  unrolled_chunks<float>(
      head, m,
      [&](const Chunk& k, float (&acc)[kChunk]) { sum_chunk(kind, src, chunks, m, k, acc); },
      [&](const Chunk& k, const float (&acc)[kChunk]) {
        float x[kChunk];
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          x[j] = math::mul(acc[j], scale);
        }
        store_chunk(dst, k, x);
      });
}

// ------------------------------------------------------------------ int8 / int4 / int2 codes

// A chunk's 4 codes of kBits bits are a piece of kBits / 2 bytes; kGroup = 32 / kBits lanes
// hold the pieces of 16 consecutive bytes.
template <int kBits>
struct Pieces {
  static constexpr int kBytes = kBits / 2;
  static constexpr int kGroup = 32 / kBits;
  static constexpr uint32_t kMask = kBits == 8 ? 0xffffffffu : (1u << (4 * kBits)) - 1u;
};

// The layout of codes with its two divisors, set up once at the launch (Divider): every chunk
// divides a flat element index by the row length (its row) and by the block length (its
// scale).
struct Codes {
  Int8Rows rows;
  Divider by_row;
  Divider by_block;

  static Codes of(const Int8Rows& rows, int64_t block) {
    return {rows, Divider::of(rows.row_len), Divider::of(block)};
  }

  // The index of the scale of flat element e (the first of its block or not).
  __device__ __forceinline__ int64_t scale_index(int64_t e) const {
    const int64_t row = by_row.div(e);
    return row * rows.s_stride + by_block.div(e - row * rows.row_len);
  }
};

// Where the codes of chunk c (flat elements 4c ..) lie in `rows`, whose row r starts at byte
// q + r * q_stride: the piece's address, and whether its group's 16 bytes are one aligned
// access that holds only codes of elements below `limit`, in one row.
struct CodeSpot {
  uint8_t* at;
  bool group_whole;
};

template <int kBits>
__device__ __forceinline__ uint8_t* code_byte(const Codes& codes, uint8_t* q, int64_t e) {
  const int64_t row = codes.by_row.div(e);
  return q + row * codes.rows.q_stride + (e - row * codes.rows.row_len) * kBits / 8;
}

template <int kBits>
__device__ __forceinline__ CodeSpot code_spot(
    const Codes& codes, uint8_t* q, int64_t c, int64_t limit) {
  using P = Pieces<kBits>;
  const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk;  // the group's first element
  const int64_t g1 = g0 + P::kGroup * kChunk - 1;              // and its last
  bool whole = g1 < limit && codes.by_row.div(g0) == codes.by_row.div(g1);
  if (whole) {
    whole = reinterpret_cast<uintptr_t>(code_byte<kBits>(codes, q, g0)) % 16 == 0;
  }
  return {code_byte<kBits>(codes, q, c * kChunk), whole};
}

// code_spot for one row of m codes at q, without dividing.
template <int kBits>
__device__ __forceinline__ CodeSpot row_spot(uint8_t* q, int64_t c, int64_t m) {
  using P = Pieces<kBits>;
  const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk;
  const bool whole = g0 + P::kGroup * kChunk <= m &&
                     reinterpret_cast<uintptr_t>(q + g0 * kBits / 8) % 16 == 0;
  return {q + c * kChunk * kBits / 8, whole};
}

// Where chunk c's codes and its block's scale lie, and whether it is its block's first chunk.
// The lanes of a warp take a run of 32 consecutive chunks (c - lane ..); when the run's 128
// elements lie below `limit` in one row, as they do but where a row ends inside it, their row
// is worked out once for the run and each chunk's place from its offset in the row, with one
// division (by the block); otherwise as code_spot and scale_index do, with seven.
struct Place {
  CodeSpot spot;
  int64_t scale;
  bool block_first;
};

template <int kBits>
__device__ __forceinline__ Place place_of(const Codes& codes, uint8_t* q, int64_t c, int64_t limit) {
  using P = Pieces<kBits>;
  const int64_t e = c * kChunk;
  const int64_t e0 = (c - lane_index()) * kChunk;
  const int64_t row = codes.by_row.div(e0);
  const int64_t start = row * codes.rows.row_len;
  const int64_t block = codes.by_block.d;
  if (e0 + 32 * kChunk <= limit && e0 + 32 * kChunk <= start + codes.rows.row_len) {
    uint8_t* row_q = q + row * codes.rows.q_stride;
    const int64_t offset = e - start;
    // The group's first element, as code_spot takes it (groups align in c, not in the row).
    const int64_t g0 = (c & ~int64_t{P::kGroup - 1}) * kChunk - start;
    const int64_t b = codes.by_block.div(offset);
    const bool whole = reinterpret_cast<uintptr_t>(row_q + g0 * kBits / 8) % 16 == 0;
    return {{row_q + offset * kBits / 8, whole}, row * codes.rows.s_stride + b, offset == b * block};
  }
  return {code_spot<kBits>(codes, q, c, limit), codes.scale_index(e),
          e - codes.by_block.div(e) * block == 0};
}

// The piece of the chunk whose codes start at `at` (count of them exist): the group's 16 bytes
// in one access that all its lanes make, or the piece alone.
template <int kBits>
__device__ __forceinline__ uint32_t load_piece(const uint8_t* at, int64_t c, int count, bool whole) {
  using P = Pieces<kBits>;
  if (whole) {
    const int byte = static_cast<int>(c & (P::kGroup - 1)) * P::kBytes;
    const uint4 v = load16(reinterpret_cast<const uint4*>(at - byte));
    const uint32_t word = byte < 8 ? (byte < 4 ? v.x : v.y) : (byte < 12 ? v.z : v.w);
    return (word >> (8 * (byte % 4))) & P::kMask;
  }
  const int nbytes = (count * kBits + 7) / 8;
  if (nbytes == P::kBytes) {  // a whole piece, aligned to its size
    if (P::kBytes == 4) {
      return *reinterpret_cast<const uint32_t*>(at);
    }
    if (P::kBytes == 2) {
      return *reinterpret_cast<const uint16_t*>(at);
    }
    return *at;
  }
  uint32_t piece = 0;
  FASTDDP_UNROLL
  for (int b = 0; b < P::kBytes; ++b) {
    if (b < nbytes) {
      piece |= static_cast<uint32_t>(at[b]) << (8 * b);
    }
  }
  return piece;
}

// Stores the chunk's piece at `at`: the group's pieces gather by shuffles in its first lane,
// which stores the 16 bytes in one access when `whole`; otherwise each lane stores its own
// piece (count codes of it exist). Every lane of the warp must call it.
template <int kBits>
__device__ __forceinline__ void store_piece(
    uint8_t* at, uint32_t piece, int64_t c, int count, bool whole) {
  using P = Pieces<kBits>;
  constexpr int kPieceBits = 4 * kBits;
  constexpr int kLanesPerWord = 32 / kPieceBits;
  uint32_t word = piece;
  FASTDDP_UNROLL
  for (int bits = kPieceBits; bits < 32; bits *= 2) {
    // Lanes with bit (bits / kPieceBits) of their slot clear take their neighbour's half.
    word |= __shfl_xor_sync(kAllLanes, word, bits / kPieceBits) << bits;
  }
  const int lane = lane_index();
  const int lead = lane & ~(P::kGroup - 1);
  uint4 v;
  v.x = word;
  v.y = __shfl_sync(kAllLanes, word, lead + kLanesPerWord);
  v.z = __shfl_sync(kAllLanes, word, lead + 2 * kLanesPerWord);
  v.w = __shfl_sync(kAllLanes, word, lead + 3 * kLanesPerWord);
  if (whole) {
    if ((c & (P::kGroup - 1)) == 0) {
      store16(reinterpret_cast<uint4*>(at), v);
    }
    return;
  }
  const int nbytes = (count * kBits + 7) / 8;
  if (nbytes == P::kBytes) {
    if (P::kBytes == 4) {
      *reinterpret_cast<uint32_t*>(at) = piece;
    } else if (P::kBytes == 2) {
      *reinterpret_cast<uint16_t*>(at) = static_cast<uint16_t>(piece);
    } else {
      *at = static_cast<uint8_t>(piece);
    }
    return;
  }
  FASTDDP_UNROLL
  for (int b = 0; b < P::kBytes; ++b) {
    if (b < nbytes) {
      at[b] = static_cast<uint8_t>(piece >> (8 * b));
    }
  }
}

// Code j (0..3) of a piece, as a float.
template <int kBits>
__device__ __forceinline__ float piece_code(uint32_t piece, int j) {
  constexpr int kPer = 8 / kBits;
  const auto byte = static_cast<uint8_t>(piece >> (8 * (j / kPer)));
  return static_cast<float>(unpack_code(byte, kBits, j % kPer));
}

// The rounding inputs of chunk c of a quantize: 4c .. 4c + 3, zeros past n.
__device__ __forceinline__ Chunk quantize_inputs(
    const QuantizeArgs& a, const math::Mode& mode, int64_t c, float (&v)[kChunk]) {
  const Chunk k = chunk_at(0, a.n, c);
  float x[kChunk];
  float r[kChunk] = {0.0f, 0.0f, 0.0f, 0.0f};
  load_chunk(a.src, k, x);
  if (mode.feedback) {
    load_chunk<true>(mode.residual, k, r);
  }
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    v[j] = j < k.count ? math::rounding_input_of(mode, x[j], a.scale, r[j]) : 0.0f;
  }
  return k;
}

// Quantises chunk c (inputs v) of a block with the given scale: its codes, its residuals
// (16 bytes at a time), and the block's scale if c is the block's first chunk. Every lane of
// the warp must call it.
template <int kBits>
__device__ __forceinline__ void quantize_chunk(
    const QuantizeArgs& a, const Codes& codes, const math::Mode& mode, int64_t c,
    const float (&v)[kChunk], float step, float inverse, bool block_bad) {
  const float qmax = code_max(kBits);
  const Chunk k = chunk_at(0, a.n, c);
  auto* q = reinterpret_cast<uint8_t*>(a.dst);
  const Place place = place_of<kBits>(codes, q, c, a.n);
  const CodeSpot& spot = place.spot;
  // The first chunk of a block stores its scale.
  if (k.count > 0 && place.block_first) {
    a.scales[place.scale] = step;
  }
  // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
  uint32_t piece = 0;
  float r[kChunk];
  FASTDDP_UNROLL
  for (int j = 0; j < kChunk; ++j) {
    const int64_t i = k.first + j;
    int8_t code = 0;
    if (j < k.count && !block_bad) {
      code = math::quantize_code(v[j], inverse, qmax, mode.stochastic, math::random_for(mode, i));
    }
    r[j] = math::quantize_dropped(v[j], code, step);
    piece |= pack_code(code, kBits, j);
  }
  if (mode.feedback && !block_bad) {
    store_chunk(mode.residual, k, r);
  }
  store_piece<kBits>(spot.at, piece, c, k.count, spot.group_whole);
}

// quantize (int8, int4, int2): the lanes of a block share its absolute maximum by shuffles.
// A block of up to 128 elements (block / 4 lanes, a power of two) takes part of a warp, so that
// a warp quantises 128 elements at a time, kCodeUnroll such runs a step, all loaded before any
// is reduced; a longer block (a multiple of 128) takes a warp, each lane block / 128 chunks,
// which it reads again after the maximum is known.
// At most 64 registers, so that 4 blocks fit on a multiprocessor (66 gave 3).
template <int kBits>
__global__ void __launch_bounds__(kThreads, 4) quantize_vec_kernel(QuantizeArgs a, Codes codes) {
  const math::Mode mode = a.rounding.mode();
  const float qmax = code_max(kBits);
  const int64_t per_block = a.block / kChunk;
  const int64_t chunks = (a.n + kChunk - 1) / kChunk;
  bool bad = false;
  if (per_block <= 32) {
    const int width = static_cast<int>(per_block);
    warp_loop(chunks, 32 * kCodeUnroll, [&](int64_t first) {
      float v[kCodeUnroll][kChunk];
      uint32_t absmax[kCodeUnroll];
      FASTDDP_UNROLL
      for (int u = 0; u < kCodeUnroll; ++u) {
        quantize_inputs(a, mode, first + 32 * u + lane_index(), v[u]);
        absmax[u] = 0;
        FASTDDP_UNROLL
        for (int j = 0; j < kChunk; ++j) {
          absmax[u] = math::abs_bits_max(absmax[u], v[u][j]);
        }
      }
      for (int offset = width / 2; offset > 0; offset /= 2) {
        FASTDDP_UNROLL
        for (int u = 0; u < kCodeUnroll; ++u) {
          const uint32_t other = __shfl_xor_sync(kAllLanes, absmax[u], offset);
          absmax[u] = other > absmax[u] ? other : absmax[u];
        }
      }
      FASTDDP_UNROLL
      for (int u = 0; u < kCodeUnroll; ++u) {
        const bool block_bad = math::block_nonfinite(absmax[u]);
        bad |= block_bad;
        quantize_chunk<kBits>(a, codes, mode, first + 32 * u + lane_index(), v[u],
                              math::block_scale(absmax[u], qmax),
                              math::block_inverse(absmax[u], qmax), block_bad);
      }
    });
    raise_flag(bad, a.rounding.flag);
    return;
  }
  warp_loop(chunks, per_block, [&](int64_t first) {
    const int64_t c = first + lane_index();
    float v[kChunk];
    uint32_t absmax = 0;
    quantize_inputs(a, mode, c, v);
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      absmax = math::abs_bits_max(absmax, v[j]);
    }
    for (int64_t more = c + 32; more < first + per_block; more += 32) {
      float w[kChunk];
      quantize_inputs(a, mode, more, w);
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        absmax = math::abs_bits_max(absmax, w[j]);
      }
    }
    FASTDDP_UNROLL
    for (int offset = 32 / 2; offset > 0; offset /= 2) {  // a block takes the whole warp
      const uint32_t other = __shfl_xor_sync(kAllLanes, absmax, offset);
      absmax = other > absmax ? other : absmax;
    }
    const float step = math::block_scale(absmax, qmax);
    const float inverse = math::block_inverse(absmax, qmax);
    const bool block_bad = math::block_nonfinite(absmax);
    bad |= block_bad;
    quantize_chunk<kBits>(a, codes, mode, c, v, step, inverse, block_bad);
    for (int64_t more = c + 32; more < first + per_block; more += 32) {
      float w[kChunk];
      quantize_inputs(a, mode, more, w);
      quantize_chunk<kBits>(a, codes, mode, more, w, step, inverse, block_bad);
    }
  });
  raise_flag(bad, a.rounding.flag);
}

// unpack (int8, int4, int2): the flat sequence of n values the rows hold, dequantised; a lane
// takes kUnpackUnroll chunks a step, their codes and scales all loaded before any is stored.
template <int kBits>
__global__ void unpack_vec_kernel(
    Int8Source s, Codes codes, int64_t n, float* __restrict__ dst, float scale) {
  auto* q = const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(s.q));
  warp_loop((n + kChunk - 1) / kChunk, 32 * kUnpackUnroll, [&](int64_t first) {
    Chunk k[kUnpackUnroll];
    uint32_t piece[kUnpackUnroll];
    float step[kUnpackUnroll];
    FASTDDP_UNROLL
    for (int u = 0; u < kUnpackUnroll; ++u) {
      k[u] = chunk_at(0, n, first + 32 * u + lane_index());
      piece[u] = 0;
      step[u] = 0.0f;
      if (k[u].count > 0) {
        const Place place = place_of<kBits>(codes, q, k[u].index, n);
        piece[u] = load_piece<kBits>(place.spot.at, k[u].index, k[u].count,
                                     place.spot.group_whole);
        step[u] = s.scales[place.scale];
      }
    }
    FASTDDP_UNROLL
    for (int u = 0; u < kUnpackUnroll; ++u) {
      float x[kChunk];
      FASTDDP_UNROLL
      for (int j = 0; j < kChunk; ++j) {
        x[j] = math::mul(math::mul(piece_code<kBits>(piece[u], j), step[u]), scale);
      }
      store_chunk(dst, k[u], x);
    }
  });
}

// dequantize (int8, int4, int2): the rows dequantised and summed per column in row order.
template <int kBits>
__global__ void dequantize_vec_kernel(
    Int8Source s, Codes codes, float* __restrict__ dst, float scale) {
  auto* q = const_cast<uint8_t*>(reinterpret_cast<const uint8_t*>(s.q));
  const int64_t m = s.rows.row_len;
  // Row p of the rows seen as one row of m codes at q + p * q_stride.
  warp_loop((m + kChunk - 1) / kChunk, 32, [&](int64_t first) {
    const Chunk k = chunk_at(0, m, first + lane_index());
    if (k.count == 0) {
      return;
    }
    const int64_t b = codes.by_block.div(k.first);  // the chunk's block, in every row
    float acc[kChunk];
    for (int64_t p0 = 0; p0 < s.rows.rows; p0 += kRowsAtOnce) {
      // kRowsAtOnce rows' loads first, in flight together; then their sums, in row order.
      // Past the last row a lane loads the last row again (no branch before the loads) and
      // adds nothing of it. (The same batching made sum_chunks slower on the H100, 0.47 of a
      // copy at 1 GB against 0.37, so its rows go one by one.)
      uint32_t piece[kRowsAtOnce];
      float step[kRowsAtOnce];
      FASTDDP_UNROLL
      for (int u = 0; u < kRowsAtOnce; ++u) {
        const int64_t p = p0 + u < s.rows.rows ? p0 + u : s.rows.rows - 1;
        const CodeSpot spot = row_spot<kBits>(q + p * s.rows.q_stride, k.index, m);
        piece[u] = load_piece<kBits>(spot.at, k.index, k.count, spot.group_whole);
        step[u] = s.scales[p * s.rows.s_stride + b];
      }
      FASTDDP_UNROLL
      for (int u = 0; u < kRowsAtOnce; ++u) {
        if (p0 + u < s.rows.rows) {
          FASTDDP_UNROLL
          for (int j = 0; j < kChunk; ++j) {
            const float term = math::mul(piece_code<kBits>(piece[u], j), step[u]);
            acc[j] = p0 + u == 0 ? term : math::add(acc[j], term);
          }
        }
      }
    }
    FASTDDP_UNROLL
    for (int j = 0; j < kChunk; ++j) {
      acc[j] = math::mul(acc[j], scale);
    }
    store_chunk(dst, k, acc);
  });
}

// ------------------------------------------------------------------ scalar kernels

// The absolute maximum (as bits) of the rounding inputs of elements [lo, hi), for one warp: the
// lanes stride over the range, then a butterfly of shuffles gives every lane the result.
__device__ __forceinline__ uint32_t warp_absmax(
    const math::Mode& mode, const float* __restrict__ src, float scale, int64_t lo, int64_t hi,
    int lane) {
  uint32_t absmax = 0;
  for (int64_t i = lo + lane; i < hi; i += 32) {
    absmax = math::abs_bits_max(absmax, math::rounding_input(mode, src[i], scale, i));
  }
  FASTDDP_UNROLL
  for (int offset = 16; offset > 0; offset /= 2) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, absmax, offset);
    absmax = other > absmax ? other : absmax;
  }
  return absmax;
}

// quantize_int8 for the layouts quantize_vec_kernel cannot take: one warp per int8 block;
// every lane gets the block's absolute maximum (warp_absmax), then each lane quantises its
// elements. Rows of q and scales may lie apart (see Int8Rows in layout.h); a block lies in one
// row.
__global__ void quantize_int8_kernel(
    const float* __restrict__ src,
    int8_t* __restrict__ q,
    float* __restrict__ scales,
    float* __restrict__ residual,
    int64_t n,
    int64_t block,
    Int8Rows rows,
    float scale,
    int64_t seed,
    int* __restrict__ flag) {
  const math::Mode mode = mode_of(residual, seed);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = blocks_of(n, block);
  bool bad = false;
  for (int64_t b = thread_index() / 32; b < nblocks; b += warps) {
    const Int8Block blk = int8_block(rows, n, block, b, q, scales);
    const uint32_t absmax = warp_absmax(mode, src, scale, blk.lo, blk.hi, lane);
    const float step = math::block_scale(absmax);
    const float inverse = math::block_inverse(absmax);
    const bool block_bad = math::block_nonfinite(absmax);
    if (lane == 0) {
      blk.scales[b] = step;
    }
    bad |= block_bad;
    // A block holding inf or NaN gets zeros (and a NaN scale); its residual is left alone.
    for (int64_t i = blk.lo + lane; i < blk.hi; i += 32) {
      const float v = math::rounding_input(mode, src[i], scale, i);
      blk.q[i] = block_bad ? int8_t{0} : math::quantize_element(mode, v, inverse, step, i);
    }
  }
  raise_flag(bad, flag);
}

// Reads int8 codes laid out as Int8Source says: code `col` of row `row`, times its block's
// scale. PackedCodes (packed_kernels.cuh) reads int4 and int2 codes the same way.
struct Int8Codes {
  Int8Source src;

  __device__ __forceinline__ float operator()(int64_t row, int64_t col) const {
    const float code = static_cast<float>(src.q[row * src.rows.q_stride + col]);
    return math::mul(code, src.scales[row * src.rows.s_stride + col / src.block]);
  }
};

// dequantize for the layouts dequantize_vec_kernel cannot take: the rows.rows rows of
// rows.row_len codes, dequantised and summed per column in row order.
template <class Codes>
__global__ void dequantize_kernel(Codes codes, float* __restrict__ dst, float scale) {
  const Int8Rows& rows = codes.src.rows;
  grid_stride_loop(0, rows.row_len, [&](int64_t i) {
    float acc = codes(0, i);
    for (int64_t p = 1; p < rows.rows; ++p) {
      acc = math::add(acc, codes(p, i));
    }
    dst[i] = math::mul(acc, scale);
  });
}

// unpack for the layouts unpack_vec_kernel cannot take: the flat sequence of n values the rows
// hold, dequantised.
template <class Codes>
__global__ void unpack_kernel(Codes codes, int64_t n, float* __restrict__ dst, float scale) {
  const int64_t row_len = codes.src.rows.row_len;
  grid_stride_loop(0, n, [&](int64_t i) {
    const int64_t row = i / row_len;
    dst[i] = math::mul(codes(row, i - row * row_len), scale);
  });
}

}  // namespace fastddp::kernels
