// Plain data shared by the op checks (checks.h, which needs torch) and the kernels (which do
// not): nothing here includes torch.
#pragma once

#include <cstdint>

namespace fastddp {

// Where int8 values and their scales lie. A flat sequence of elements is cut into `rows` rows
// of `row_len` elements; row r starts at q + r * q_stride, and its scales (one per block of
// `block` elements) at scales + r * s_stride. The rows of a tensor may be spaced apart, so that
// each rank's int8 chunk and its scales can sit side by side in one byte buffer.
struct Int8Rows {
  int64_t rows;
  int64_t row_len;
  int64_t q_stride;
  int64_t s_stride;
};

inline int64_t blocks_of(int64_t n, int64_t block) {
  return (n + block - 1) / block;
}

}  // namespace fastddp
