// Argument checks shared by the ops' entries (ops.h), which both backends register. Each check
// names the op and the tensor, and says how to fix the call.
#pragma once

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "fastddp/layout.h"

namespace fastddp {

inline bool is_wire_dtype(c10::ScalarType t) {
  return t == c10::ScalarType::Half || t == c10::ScalarType::BFloat16;
}

inline math::WireKind kind_of(const at::Tensor& wire) {
  return wire.scalar_type() == c10::ScalarType::BFloat16 ? math::WireKind::kBf16
                                                         : math::WireKind::kFp16;
}

inline void check_same_device(
    const char* op, const char* a_name, const at::Tensor& a, const char* b_name,
    const at::Tensor& b) {
  TORCH_CHECK(
      a.device() == b.device(),
      "fastddp.", op, ": ", a_name, " is on ", a.device(), " but ", b_name, " is on ", b.device(),
      "; allocate them on the same device");
}

// A tensor's bytes as `count` spans of `len` bytes, `stride` bytes apart (stride >= len, so
// the spans are sorted and disjoint): one span when contiguous, one a row for 2-D rows each
// contiguous and spaced apart (the codes ops' layouts).
struct Spans {
  uintptr_t base = 0, len = 0, stride = 0;
  int64_t count = 0;
  uintptr_t lo(int64_t i) const { return base + static_cast<uintptr_t>(i) * stride; }
};

// `t`'s spans, or nothing for other layouts.
inline std::optional<Spans> spans_of(const at::Tensor& t) {
  const auto size = static_cast<uintptr_t>(t.element_size());
  const auto base = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  if (t.is_contiguous()) {
    const auto len = static_cast<uintptr_t>(t.numel()) * size;
    return Spans{base, len, len, t.numel() > 0 ? 1 : 0};
  }
  if (t.dim() != 2 || (t.size(1) > 1 && t.stride(1) != 1) || t.stride(0) < t.size(1)) {
    return std::nullopt;
  }
  return Spans{
      base, static_cast<uintptr_t>(t.size(1)) * size,
      static_cast<uintptr_t>(t.stride(0)) * size, t.size(1) > 0 ? t.size(0) : 0};
}

// Whether any span of `a` shares a byte with one of `b` (both sorted: one walk).
inline bool spans_meet(const Spans& a, const Spans& b) {
  int64_t i = 0, j = 0;
  while (i < a.count && j < b.count) {
    if (a.lo(i) + a.len <= b.lo(j)) {
      ++i;
    } else if (b.lo(j) + b.len <= a.lo(i)) {
      ++j;
    } else {
      return true;
    }
  }
  return false;
}

// No two of `tensors` (an op's outputs and inputs; null: not given) may overlap in memory: a
// kernel would read one while writing the other. The codes ops' tensors may be views of one
// buffer (a wire row is [codes | scales], rows spaced apart), so byte ranges are compared,
// not storages: torch's check where it can tell, else row by row; a layout of neither kind
// is let through, as torch's own ops do.
inline void check_apart(
    const char* op, std::initializer_list<std::pair<const char*, const at::Tensor*>> tensors) {
  for (auto a = tensors.begin(); a != tensors.end(); ++a) {
    for (auto b = a + 1; b != tensors.end(); ++b) {
      if (a->second == nullptr || b->second == nullptr) continue;
      const auto status = at::get_overlap_status(*a->second, *b->second);
      bool meet = status == at::MemOverlapStatus::Full || status == at::MemOverlapStatus::Partial;
      if (status == at::MemOverlapStatus::TooHard) {
        const auto sa = spans_of(*a->second), sb = spans_of(*b->second);
        meet = sa && sb && spans_meet(*sa, *sb);
      }
      TORCH_CHECK(
          !meet, "fastddp.", op, ": ", a->first, " overlaps ", b->first,
          " in memory; give each its own memory");
    }
  }
}

// An output must not overlap an input: the kernels read one while writing the other. Views
// of one buffer that lie apart are taken, as for check_apart.
inline void check_own_memory(
    const char* op, const char* out_name, const at::Tensor& out, const char* in_name,
    const at::Tensor& in) {
  check_apart(op, {{out_name, &out}, {in_name, &in}});
}

// How to make a tensor contiguous: an input by .contiguous(); an output (`written`) by
// allocating it so, as a copy that .contiguous() made would receive the result instead of it.
inline const char* contiguous_fix(bool written) {
  return written ? "it is written in place, and a copy made by .contiguous() would receive the "
                   "result instead: allocate it contiguous (torch.empty) and copy_ from it"
                 : "pass .contiguous() of it";
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t, bool written) {
  TORCH_CHECK(
      t.is_contiguous(), "fastddp.", op, ": ", name, " must be contiguous; ",
      contiguous_fix(written));
}

inline void check_contiguous_fp32(
    const char* op, const char* name, const at::Tensor& t, bool written) {
  TORCH_CHECK(
      t.scalar_type() == c10::ScalarType::Float,
      "fastddp.", op, ": ", name, " must be float32, got ", t.scalar_type());
  check_contiguous(op, name, t, written);
}

// A bucket (fp32) and its 16-bit wire buffer: same device, same length, both contiguous; the
// wire is written (compress), or the bucket (decompress).
inline void check_bucket_and_wire(
    const char* op, const at::Tensor& bucket, const at::Tensor& wire, bool wire_written) {
  TORCH_CHECK(
      bucket.scalar_type() == c10::ScalarType::Float,
      "fastddp.", op, ": the fp32 bucket must be float32, got ", bucket.scalar_type(),
      wire_written ? "; cast it with .float() or keep the gradients in float32"
                   : "; allocate it as float32 (it is written in place)");
  TORCH_CHECK(
      is_wire_dtype(wire.scalar_type()),
      "fastddp.", op, ": the wire buffer must be float16 or bfloat16, got ", wire.scalar_type());
  check_same_device(op, "the bucket", bucket, "the wire buffer", wire);
  TORCH_CHECK(
      bucket.numel() == wire.numel(),
      "fastddp.", op, ": bucket has ", bucket.numel(), " elements but the wire buffer has ",
      wire.numel(), "; they must match");
  check_contiguous(op, "the bucket", bucket, !wire_written);
  check_contiguous(op, "the wire buffer", wire, wire_written);
  check_apart(op, {{"the bucket", &bucket}, {"the wire buffer", &wire}});
}

// P received 16-bit chunks, src of shape [P, m], summed per column into the m elements of dst,
// whose dtype must be `dst_dtype`; `dtypes` says what src and dst must be.
inline void check_row_sum(
    const char* op, const at::Tensor& src, const at::Tensor& dst, c10::ScalarType dst_dtype,
    const char* dtypes) {
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.", op, ": src must have shape [chunks, m] (one row per rank), got ", src.sizes());
  TORCH_CHECK(
      is_wire_dtype(src.scalar_type()) && dst.scalar_type() == dst_dtype,
      "fastddp.", op, ": ", dtypes, ", got ", src.scalar_type(), " and ", dst.scalar_type());
  check_same_device(op, "src", src, "dst", dst);
  TORCH_CHECK(
      dst.numel() == src.size(1),
      "fastddp.", op, ": dst has ", dst.numel(), " elements but each chunk has ", src.size(1));
  check_contiguous(op, "src", src, false);
  check_contiguous(op, "dst", dst, true);
  check_own_memory(op, "dst", dst, "src", src);
}

// The found_nonfinite, residual and seed of a rounding op, checked and as raw pointers: the flag
// one int32 on the device of `data`, the residual one contiguous fp32 per element rounded (`n`
// of them; data.numel() when not given), in memory of its own.
inline Rounding rounding_of(
    const char* op, const std::optional<at::Tensor>& flag,
    const std::optional<at::Tensor>& residual, int64_t seed, const at::Tensor& data,
    int64_t n = -1) {
  n = n < 0 ? data.numel() : n;
  // (Any negative seed rounded to nearest: a seed computed as a difference could turn it off.)
  TORCH_CHECK(
      seed >= -1, "fastddp.", op,
      ": seed must be -1 (round to nearest) or at least 0 (round stochastically), got ", seed);
  if (flag.has_value()) {
    TORCH_CHECK(
        flag->scalar_type() == c10::ScalarType::Int && flag->numel() == 1 &&
            flag->is_contiguous(),
        "fastddp.", op, ": found_nonfinite must be a one-element int32 tensor, got ",
        flag->scalar_type(), " with ", flag->numel(), " elements");
    check_same_device(op, "found_nonfinite", *flag, "the data", data);
  }
  if (residual.has_value()) {
    check_contiguous_fp32(op, "residual", *residual, true);
    TORCH_CHECK(
        residual->numel() == n,
        "fastddp.", op, ": residual has ", residual->numel(), " elements but ", n,
        " are rounded; allocate one residual per element");
    check_same_device(op, "residual", *residual, "the data", data);
    check_own_memory(op, "residual", *residual, "the data", data);
  }
  return {residual.has_value() ? residual->data_ptr<float>() : nullptr, seed,
          flag.has_value() ? flag->data_ptr<int32_t>() : nullptr};
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

// The layout shared by the int8 and packed ops: the codes `q`, of `dtype`, called `tensor` in
// messages (1-D: one row; 2-D [rows, `cols`]: one row per rank, rows may be spaced apart),
// holding `row_len` codes a row (`unit` in messages), and their fp32 `scales`, one per block.
inline Int8Rows code_rows(
    const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t block,
    c10::ScalarType dtype, const char* tensor, const char* cols, const char* unit,
    int64_t row_len) {
  check_block_size(op, block);
  TORCH_CHECK(
      q.scalar_type() == dtype,
      "fastddp.", op, ": the quantised tensor must be ",
      dtype == c10::ScalarType::Char ? "int8" : "uint8", ", got ", q.scalar_type());
  TORCH_CHECK(
      scales.scalar_type() == c10::ScalarType::Float,
      "fastddp.", op, ": scales must be float32, got ", scales.scalar_type());
  check_same_device(op, tensor, q, "scales", scales);
  TORCH_CHECK(
      q.dim() == 1 || q.dim() == 2,
      "fastddp.", op, ": ", tensor, " must be 1-D or [rows, ", cols, "], got ", q.sizes());
  const int64_t rows = q.dim() == 1 ? 1 : q.size(0);
  const int64_t m = q.dim() == 1 ? q.numel() : q.size(1);
  const int64_t q_stride = q.dim() == 1 ? (q.is_contiguous() ? m : -1) : row_stride(q, rows, m);
  TORCH_CHECK(
      q_stride >= 0,
      "fastddp.", op, ": each row of ", tensor, " must be contiguous (rows may be spaced "
      "apart); pass .contiguous() of an input, and allocate an output contiguous (a copy "
      "would receive the result instead)");
  const int64_t nb = blocks_of(row_len, block);
  const int64_t s_stride = row_stride(scales, rows, nb);
  TORCH_CHECK(
      s_stride >= 0,
      "fastddp.", op, ": ", rows, " row(s) of ", row_len, " ", unit, " need ", rows * nb,
      " scales (one per block of ", block, "), got ", scales.numel(), " shaped ", scales.sizes(),
      " (each row's scales contiguous)");
  return {rows, row_len, q_stride, s_stride};
}

// The layout of an int8 tensor `q` (named `tensor` in messages) and of its scales (code_rows:
// one byte a code).
inline Int8Rows int8_rows(
    const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t block,
    const char* tensor = "the int8 tensor") {
  const int64_t m = q.dim() == 1 ? q.numel() : q.dim() == 2 ? q.size(1) : 0;
  return code_rows(op, q, scales, block, c10::ScalarType::Char, tensor, "m", "int8 values", m);
}

// The flat fp32 side of an int8 layout (`written` by unpack): `n` elements spread over the rows
// in order. Several rows must hold whole blocks, so that no block straddles two rows.
inline void check_flat_side(
    const char* op, const at::Tensor& values, const at::Tensor& q, const Int8Rows& rows,
    int64_t block, bool written) {
  check_contiguous_fp32(op, "the fp32 tensor", values, written);
  check_same_device(op, "the fp32 tensor", values, "the int8 tensor", q);
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

// The layout of packed int4/int2 codes `q` (uint8, 8 / bits codes a byte; named `tensor` in
// messages) holding `row_len` codes a row, and of its scales (code_rows). A block holds whole
// bytes.
inline Int8Rows packed_rows(
    const char* op, const at::Tensor& q, const at::Tensor& scales, int64_t block, int64_t bits,
    int64_t row_len, const char* tensor = "the packed tensor") {
  TORCH_CHECK(
      bits == 4 || bits == 2,
      "fastddp.", op, ": bits must be 4 or 2, got ", bits, "; int8 codes use the int8 ops");
  const int64_t per = 8 / bits;
  TORCH_CHECK(
      block % per == 0,
      "fastddp.", op, ": block_size must be a multiple of ", per, " for ", bits,
      "-bit codes (a block holds whole bytes), got ", block);
  const Int8Rows rows =
      code_rows(op, q, scales, block, c10::ScalarType::Byte, tensor, "bytes", "codes", row_len);
  const int64_t bytes = q.dim() == 1 ? q.numel() : q.size(1);
  TORCH_CHECK(
      bytes == (row_len + per - 1) / per,
      "fastddp.", op, ": ", row_len, " codes of ", bits, " bits take ", (row_len + per - 1) / per,
      " bytes a row, but ", tensor, " has ", bytes);
  return rows;
}

// The flat fp32 side of a packed layout: `values` spread over the rows in order; several rows
// must hold whole blocks.
inline void check_packed_flat_side(
    const char* op, const at::Tensor& values, const at::Tensor& q, const Int8Rows& rows,
    int64_t block, bool written) {
  check_contiguous_fp32(op, "the fp32 tensor", values, written);
  check_same_device(op, "the fp32 tensor", values, "the packed tensor", q);
  TORCH_CHECK(
      rows.rows <= 1 || rows.row_len % block == 0,
      "fastddp.", op, ": rows of ", rows.row_len, " codes do not hold whole blocks of ", block,
      "; make the row length a multiple of block_size");
  TORCH_CHECK(
      values.numel() <= rows.rows * rows.row_len,
      "fastddp.", op, ": ", values.numel(), " elements do not fit in ", rows.rows, " row(s) of ",
      rows.row_len);
}

}  // namespace fastddp
