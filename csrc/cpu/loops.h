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

#include <algorithm>
#include <cstdint>
#include <vector>

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
inline Work work(const RequantizeArgs& a) {
  return {blocks_of(a.out.n, a.out.block), a.out.block * a.src.rows.rows, a.out.rounding.flag};
}

// What a quantize loop rounds, a block at a time: values(lo, hi) points at elements [lo, hi).
// This is quantize's: its fp32 src.
struct FlatBlocks {
  const float* src;

  const float* operator()(int64_t lo, int64_t) const {
    return src + lo;
  }
};

// requantize's: the sums of rows of codes, which sum(out, begin, end) (the op's dequantize
// loop) writes for elements [begin, end) below `limit` (the end of a thread's blocks), worked
// out a tile of kTile elements (or a block, where longer) at a time into a buffer: a call per
// block cost its set-up, per row and segment, for 128 elements.
template <class Sum>
class SummedBlocks {
 public:
  static constexpr int64_t kTile = 4096;

  SummedBlocks(Sum sum, int64_t limit, int64_t block)
      : sum_(sum),
        limit_(limit),
        buffer_(static_cast<size_t>(std::min(limit, std::max(kTile, block)))) {}

  const float* operator()(int64_t lo, int64_t hi) {
    if (lo < begin_ || hi > end_) {
      begin_ = lo;
      end_ = std::min(limit_, lo + static_cast<int64_t>(buffer_.size()));
      sum_(buffer_.data(), begin_, end_);
    }
    return buffer_.data() + (lo - begin_);
  }

 private:
  Sum sum_;
  int64_t limit_;
  std::vector<float> buffer_;
  int64_t begin_ = 0, end_ = 0;  // the elements in the buffer
};

bool run(const CompressArgs& a, int64_t begin, int64_t end);
bool run(const DecompressArgs& a, int64_t begin, int64_t end);
bool run(const SumChunksArgs& a, int64_t begin, int64_t end);
bool run(const WidenSumArgs& a, int64_t begin, int64_t end);
bool run(const QuantizeArgs& a, int64_t first_block, int64_t last_block);
bool run(const DequantizeArgs& a, int64_t begin, int64_t end);
bool run(const UnpackArgs& a, int64_t begin, int64_t end);
bool run(const RequantizeArgs& a, int64_t first_block, int64_t last_block);

// The int4 and int2 loops (packed_loops.cpp), which the int8 ops' `run` hands bits < 8 to.
bool run_packed(const QuantizeArgs& a, int64_t first_block, int64_t last_block);
bool run_packed(const DequantizeArgs& a, int64_t begin, int64_t end);
bool run_packed(const UnpackArgs& a, int64_t begin, int64_t end);
bool run_packed(const RequantizeArgs& a, int64_t first_block, int64_t last_block);

}  // namespace fastddp::cpu
