// The CPU loops of the ops, over the raw arguments of fastddp/layout.h and free of torch
// headers, so that they compile fast and can carry per-ISA clones. wire_loops.cpp has the
// 16-bit ops, int8_loops.cpp the int8 ones, packed_loops.cpp int4 and int2; cpu/ops.cpp splits
// their work across threads.
//
// Each `run` handles the items [begin, end) of its op (elements, or int8 blocks for
// quantize_int8), so that the caller can split the work; random numbers are drawn by absolute
// element index, so the split does not change the result. It returns true when it wrote an inf
// or NaN (for an op without found_nonfinite, false).
#pragma once

#include <cstdint>

#include "fastddp/layout.h"

// One clone per ISA, picked at load time: a portable binary that still uses AVX-512 or AVX2.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define FASTDDP_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTDDP_CLONES
#endif

#define FASTDDP_INLINE inline __attribute__((always_inline))

namespace fastddp::cpu {

// An op's work for the threads: `items` to hand out, `cost` elements each, and the
// found_nonfinite flag to set once all are done (null for none).
struct Work {
  int64_t items;
  int64_t cost;
  int* flag;
};

inline Work work(const CompressArgs& a) {
  return {a.n, 1, a.rounding.flag};
}
inline Work work(const DecompressArgs& a) {
  return {a.n, 1, nullptr};
}
inline Work work(const SumChunksArgs& a) {
  return {a.m, a.chunks, a.rounding.flag};
}
inline Work work(const WidenSumArgs& a) {
  return {a.m, a.chunks, nullptr};
}
inline Work work(const QuantizeArgs& a) {
  return {blocks_of(a.n, a.block), a.block, a.rounding.flag};
}
inline Work work(const DequantizeArgs& a) {
  return {a.src.rows.row_len, a.src.rows.rows, nullptr};
}
inline Work work(const UnpackArgs& a) {
  return {a.n, 1, nullptr};
}

bool run(const CompressArgs& a, int64_t begin, int64_t end);
bool run(const DecompressArgs& a, int64_t begin, int64_t end);
bool run(const SumChunksArgs& a, int64_t begin, int64_t end);
bool run(const WidenSumArgs& a, int64_t begin, int64_t end);
bool run(const QuantizeArgs& a, int64_t first_block, int64_t last_block);
bool run(const DequantizeArgs& a, int64_t begin, int64_t end);
bool run(const UnpackArgs& a, int64_t begin, int64_t end);

// The int4 and int2 loops (packed_loops.cpp), which the int8 ops' `run` hands bits < 8 to.
bool run_packed(const QuantizeArgs& a, int64_t first_block, int64_t last_block);
bool run_packed(const DequantizeArgs& a, int64_t begin, int64_t end);
bool run_packed(const UnpackArgs& a, int64_t begin, int64_t end);

}  // namespace fastddp::cpu
