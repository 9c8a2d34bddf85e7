// Argument checks shared by the CPU and CUDA implementations of every op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "fastddp/layout.h"
#include "fastddp/rounding.h"

namespace fastddp {

inline bool is_wire_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

// A bucket (fp32) and its 16-bit wire buffer: same device, same length, both contiguous.
inline void check_bucket_and_wire(
    const char* op,
    const at::Tensor& bucket,
    const at::Tensor& wire) {
  TORCH_CHECK(
      bucket.scalar_type() == c10::ScalarType::Float,
      "fastddp.", op, ": the fp32 bucket must be float32, got ", bucket.scalar_type(),
      "; cast it with .float() or keep the gradients in float32");
  TORCH_CHECK(
      is_wire_dtype(wire.scalar_type()),
      "fastddp.", op, ": the wire buffer must be float16 or bfloat16, got ", wire.scalar_type());
  TORCH_CHECK(
      bucket.device() == wire.device(),
      "fastddp.", op, ": bucket is on ", bucket.device(), " but the wire buffer is on ",
      wire.device(), "; allocate both on the same device");
  TORCH_CHECK(
      bucket.numel() == wire.numel(),
      "fastddp.", op, ": bucket has ", bucket.numel(), " elements but the wire buffer has ",
      wire.numel(), "; they must match");
  TORCH_CHECK(
      bucket.is_contiguous() && wire.is_contiguous(),
      "fastddp.", op, ": bucket and wire buffer must be contiguous; call .contiguous() first");
  // Both kernels read one buffer while writing the other in a single pass.
  TORCH_CHECK(
      bucket.numel() == 0 || !bucket.is_alias_of(wire),
      "fastddp.", op, ": bucket and wire buffer share storage; use a separate wire buffer");
}

inline void check_flag(
    const char* op,
    const std::optional<at::Tensor>& flag,
    const at::Tensor& like) {
  if (!flag.has_value()) {
    return;
  }
  TORCH_CHECK(
      flag->scalar_type() == c10::ScalarType::Int && flag->numel() == 1 &&
          flag->is_contiguous(),
      "fastddp.", op, ": found_nonfinite must be a one-element int32 tensor, got ",
      flag->scalar_type(), " with ", flag->numel(), " elements");
  TORCH_CHECK(
      flag->device() == like.device(),
      "fastddp.", op, ": found_nonfinite is on ", flag->device(), " but the bucket is on ",
      like.device());
}

// An error-feedback residual: fp32, one per element of `like`, contiguous, same device.
inline void check_residual(
    const char* op,
    const std::optional<at::Tensor>& residual,
    const at::Tensor& like) {
  if (!residual.has_value()) {
    return;
  }
  TORCH_CHECK(
      residual->scalar_type() == c10::ScalarType::Float && residual->is_contiguous(),
      "fastddp.", op, ": residual must be a contiguous float32 tensor, got ",
      residual->scalar_type());
  TORCH_CHECK(
      residual->numel() == like.numel(),
      "fastddp.", op, ": residual has ", residual->numel(), " elements but ", like.numel(),
      " are rounded; allocate one residual per element");
  TORCH_CHECK(
      residual->device() == like.device(),
      "fastddp.", op, ": residual is on ", residual->device(), " but the data is on ",
      like.device());
  TORCH_CHECK(
      like.numel() == 0 || !residual->is_alias_of(like),
      "fastddp.", op, ": residual shares storage with the data; give it its own buffer");
}

inline void check_same_device(const char* op, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(
      a.device() == b.device(),
      "fastddp.", op, ": tensors on different devices (", a.device(), " and ", b.device(),
      "); allocate them on the same device");
}

// P received 16-bit chunks, src of shape [P, m], summed into the 16-bit dst of m elements.
inline void check_chunks_and_shard(const char* op, const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.", op, ": src must have shape [chunks, m] (one row per rank), got ", src.sizes());
  TORCH_CHECK(
      is_wire_dtype(src.scalar_type()) && dst.scalar_type() == src.scalar_type(),
      "fastddp.", op, ": src and dst must both be float16 or both bfloat16, got ",
      src.scalar_type(), " and ", dst.scalar_type());
  check_same_device(op, src, dst);
  TORCH_CHECK(
      dst.numel() == src.size(1),
      "fastddp.", op, ": dst has ", dst.numel(), " elements but each chunk has ", src.size(1));
  TORCH_CHECK(
      src.is_contiguous() && dst.is_contiguous(),
      "fastddp.", op, ": src and dst must be contiguous; call .contiguous() first");
  TORCH_CHECK(
      dst.numel() == 0 || !dst.is_alias_of(src),
      "fastddp.", op, ": dst shares storage with src; use a separate output buffer");
}

inline void check_block_size(const char* op, int64_t block) {
  TORCH_CHECK(
      block >= 1 && block <= (int64_t{1} << 20),
      "fastddp.", op, ": block_size must be between 1 and 2^20 elements, got ", block);
}

// Elements between the rows of `t` seen as [rows, cols] with contiguous rows, or -1.
inline int64_t row_stride(const at::Tensor& t, int64_t rows, int64_t cols) {
  if (t.is_contiguous() && t.numel() == rows * cols) {
    return cols;
  }
  if (t.dim() == 2 && t.size(0) == rows && t.size(1) == cols && (cols <= 1 || t.stride(1) == 1) &&
      t.stride(0) >= cols) {
    return t.stride(0);
  }
  return -1;
}

// The layout of an int8 tensor `q` (1-D: one row; 2-D: one row per rank, rows may be spaced
// apart) and of its fp32 `scales`, with all the checks shared by the int8 ops.
inline Int8Rows int8_rows(
    const char* op,
    const at::Tensor& q,
    const at::Tensor& scales,
    int64_t block) {
  check_block_size(op, block);
  TORCH_CHECK(
      q.scalar_type() == c10::ScalarType::Char,
      "fastddp.", op, ": the quantised tensor must be int8, got ", q.scalar_type());
  TORCH_CHECK(
      scales.scalar_type() == c10::ScalarType::Float,
      "fastddp.", op, ": scales must be float32, got ", scales.scalar_type());
  check_same_device(op, q, scales);
  TORCH_CHECK(
      q.dim() == 1 || q.dim() == 2,
      "fastddp.", op, ": the int8 tensor must be 1-D or [rows, m], got ", q.sizes());
  const int64_t rows = q.dim() == 1 ? 1 : q.size(0);
  const int64_t m = q.dim() == 1 ? q.numel() : q.size(1);
  const int64_t q_stride = q.dim() == 1 ? (q.is_contiguous() ? m : -1) : row_stride(q, rows, m);
  TORCH_CHECK(
      q_stride >= 0,
      "fastddp.", op, ": each row of the int8 tensor must be contiguous (rows may be spaced "
      "apart); call .contiguous() first");
  const int64_t nb = blocks_of(m, block);
  const int64_t s_stride = row_stride(scales, rows, nb);
  TORCH_CHECK(
      s_stride >= 0,
      "fastddp.", op, ": ", rows, " row(s) of ", m, " int8 values need ", rows * nb,
      " scales (one per block of ", block, "), got ", scales.numel(), " shaped ", scales.sizes(),
      " (each row's scales contiguous)");
  return {rows, m, q_stride, s_stride};
}

// The flat fp32 side of an int8 layout: `n` elements spread over the rows in order. Several
// rows must hold whole blocks, so that no block straddles two rows.
inline void check_flat_side(
    const char* op,
    const at::Tensor& values,
    const at::Tensor& q,
    const Int8Rows& rows,
    int64_t block) {
  TORCH_CHECK(
      values.scalar_type() == c10::ScalarType::Float && values.is_contiguous(),
      "fastddp.", op, ": the fp32 tensor must be contiguous float32, got ", values.scalar_type());
  check_same_device(op, values, q);
  if (q.dim() == 1) {
    TORCH_CHECK(
        values.numel() == q.numel(),
        "fastddp.", op, ": the fp32 tensor has ", values.numel(), " elements but the int8 one has ",
        q.numel());
    return;
  }
  TORCH_CHECK(
      rows.rows <= 1 || rows.row_len % block == 0,
      "fastddp.", op, ": rows of ", rows.row_len, " int8 values do not hold whole blocks of ",
      block, "; make the row length a multiple of block_size");
  TORCH_CHECK(
      values.numel() <= rows.rows * rows.row_len,
      "fastddp.", op, ": ", values.numel(), " elements do not fit in ", rows.rows, " row(s) of ",
      rows.row_len);
}

// The op-level checks of compress and sum_chunks, for both backends.
inline void check_compress(
    const at::Tensor& src,
    const at::Tensor& dst,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual) {
  check_bucket_and_wire("compress", src, dst);
  check_flag("compress", found_nonfinite, src);
  check_residual("compress", residual, src);
}

inline void check_sum_chunks(
    const at::Tensor& src,
    const at::Tensor& dst,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual) {
  check_chunks_and_shard("sum_chunks", src, dst);
  check_flag("sum_chunks", found_nonfinite, src);
  check_residual("sum_chunks", residual, dst);
}

inline void check_widen_sum(const at::Tensor& src, const at::Tensor& dst) {
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.widen_sum: src must have shape [chunks, m] (one row per rank), got ", src.sizes());
  TORCH_CHECK(
      is_wire_dtype(src.scalar_type()) && dst.scalar_type() == at::kFloat,
      "fastddp.widen_sum: src must be float16 or bfloat16 and dst float32, got ",
      src.scalar_type(), " and ", dst.scalar_type());
  check_same_device("widen_sum", src, dst);
  TORCH_CHECK(
      dst.numel() == src.size(1),
      "fastddp.widen_sum: dst has ", dst.numel(), " elements but each chunk has ", src.size(1));
  TORCH_CHECK(
      src.is_contiguous() && dst.is_contiguous(),
      "fastddp.widen_sum: src and dst must be contiguous; call .contiguous() first");
  TORCH_CHECK(
      dst.numel() == 0 || !dst.is_alias_of(src),
      "fastddp.widen_sum: dst shares storage with src; use a separate output buffer");
}

// The op-level checks of the int8 ops, for both backends; they return the int8 layout.
inline Int8Rows check_quantize(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& scales,
    int64_t block,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual) {
  const Int8Rows rows = int8_rows("quantize_int8", dst, scales, block);
  check_flat_side("quantize_int8", src, dst, rows, block);
  check_flag("quantize_int8", found_nonfinite, src);
  check_residual("quantize_int8", residual, src);
  return rows;
}

inline Int8Rows check_dequantize(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block) {
  TORCH_CHECK(
      src.dim() == 2,
      "fastddp.dequantize_int8: src must have shape [chunks, m] (one row per rank), got ",
      src.sizes());
  const Int8Rows rows = int8_rows("dequantize_int8", src, scales, block);
  TORCH_CHECK(
      dst.scalar_type() == c10::ScalarType::Float && dst.is_contiguous(),
      "fastddp.dequantize_int8: dst must be contiguous float32, got ", dst.scalar_type());
  check_same_device("dequantize_int8", src, dst);
  TORCH_CHECK(
      dst.numel() == src.size(1),
      "fastddp.dequantize_int8: dst has ", dst.numel(), " elements but each row has ",
      src.size(1));
  return rows;
}

inline Int8Rows check_unpack(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block) {
  const Int8Rows rows = int8_rows("unpack_int8", src, scales, block);
  check_flat_side("unpack_int8", dst, src, rows, block);
  return rows;
}

inline math::WireKind kind_of(c10::ScalarType t) {
  return t == c10::ScalarType::BFloat16 ? math::WireKind::kBf16 : math::WireKind::kFp16;
}

inline float* residual_ptr(const std::optional<at::Tensor>& residual) {
  return residual.has_value() ? residual->data_ptr<float>() : nullptr;
}

}  // namespace fastddp
