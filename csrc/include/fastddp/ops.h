// Every op's C++ entry, once for both backends: check the tensors (checks.h), gather the raw
// arguments (layout.h), and hand them to a backend. A backend is built from the op's first
// tensor (the CUDA one holds a device guard and torch's current stream) and has a `run` for
// each argument struct. cpu/ops.cpp and cuda/ops.cpp register these entries with
// register_ops<TheirBackend>; the schemas are in csrc/fastddp.cpp.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "fastddp/checks.h"
#include "fastddp/layout.h"

namespace fastddp::ops {

using Tensor = at::Tensor;
using OptionalTensor = std::optional<at::Tensor>;

inline const uint16_t* wire_bits(const Tensor& t) {
  return static_cast<const uint16_t*>(t.const_data_ptr());
}

inline uint16_t* mutable_wire_bits(const Tensor& t) {
  return static_cast<uint16_t*>(t.data_ptr());
}

// A 16-bit rounding op's outputs (dst, flag, residual) apart from each other and from src.
inline void check_rounding_apart(
    const char* op, const Tensor& src, const Tensor& dst, const OptionalTensor& flag,
    const OptionalTensor& residual) {
  check_apart(
      op, {{"dst", &dst},
           {"found_nonfinite", flag.has_value() ? &*flag : nullptr},
           {"residual", residual.has_value() ? &*residual : nullptr},
           {"src", &src}});
}

template <class Backend>
void compress(
    const Tensor& src, const Tensor& dst, double scale, const OptionalTensor& found_nonfinite,
    const OptionalTensor& residual, int64_t seed) {
  check_bucket_and_wire("compress", src, dst, true);
  const Rounding rounding = rounding_of("compress", found_nonfinite, residual, seed, src);
  check_rounding_apart("compress", src, dst, found_nonfinite, residual);
  Backend(src).run(CompressArgs{
      {kind_of(dst), src.const_data_ptr<float>(), mutable_wire_bits(dst), src.numel(),
       static_cast<float>(scale)},
      rounding});
}

template <class Backend>
void decompress(const Tensor& src, const Tensor& dst, double scale) {
  check_bucket_and_wire("decompress", dst, src, false);
  Backend(src).run(DecompressArgs{
      kind_of(src), wire_bits(src), dst.data_ptr<float>(), src.numel(), static_cast<float>(scale)});
}

template <class Backend>
void sum_chunks(
    const Tensor& src, const Tensor& dst, double scale, const OptionalTensor& found_nonfinite,
    const OptionalTensor& residual, int64_t seed) {
  check_row_sum(
      "sum_chunks", src, dst, src.scalar_type(),
      "src and dst must both be float16 or both bfloat16");
  const Rounding rounding = rounding_of("sum_chunks", found_nonfinite, residual, seed, dst);
  check_rounding_apart("sum_chunks", src, dst, found_nonfinite, residual);
  Backend(src).run(SumChunksArgs{
      {kind_of(src), wire_bits(src), src.size(0), src.size(1), mutable_wire_bits(dst),
       static_cast<float>(scale)},
      rounding});
}

template <class Backend>
void widen_sum(const Tensor& src, const Tensor& dst, double scale) {
  check_row_sum(
      "widen_sum", src, dst, c10::ScalarType::Float,
      "src must be float16 or bfloat16 and dst float32");
  Backend(src).run(WidenSumArgs{
      kind_of(src), wire_bits(src), src.size(0), src.size(1), dst.data_ptr<float>(),
      static_cast<float>(scale)});
}

// A quantize's outputs (codes, scales, flag, residual) apart from each other and from src.
inline void check_quantize_apart(
    const char* op, const Tensor& src, const Tensor& dst, const Tensor& scales,
    const OptionalTensor& flag, const OptionalTensor& residual) {
  check_apart(
      op, {{"dst", &dst},
           {"scales", &scales},
           {"found_nonfinite", flag.has_value() ? &*flag : nullptr},
           {"residual", residual.has_value() ? &*residual : nullptr},
           {"src", &src}});
}

template <class Backend>
void quantize_int8(
    const Tensor& src, const Tensor& dst, const Tensor& scales, int64_t block, double scale,
    const OptionalTensor& found_nonfinite, const OptionalTensor& residual, int64_t seed) {
  const Int8Rows rows = int8_rows("quantize_int8", dst, scales, block);
  check_flat_side("quantize_int8", src, dst, rows, block, false);
  const Rounding rounding = rounding_of("quantize_int8", found_nonfinite, residual, seed, src);
  check_quantize_apart("quantize_int8", src, dst, scales, found_nonfinite, residual);
  Backend(src).run(QuantizeArgs{
      src.const_data_ptr<float>(), dst.data_ptr<int8_t>(), scales.data_ptr<float>(),
      src.numel(), block, rows, static_cast<float>(scale), rounding});
}

template <class Backend>
void dequantize_int8(
    const Tensor& src, const Tensor& scales, const Tensor& dst, int64_t block, double scale) {
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.dequantize_int8: src must have shape [chunks, m] with at least one row (one "
      "row per rank), got ",
      src.sizes());
  const Int8Rows rows = int8_rows("dequantize_int8", src, scales, block);
  check_contiguous_fp32("dequantize_int8", "dst", dst, true);
  check_same_device("dequantize_int8", "src", src, "dst", dst);
  TORCH_CHECK(
      dst.numel() == src.size(1),
      "fastddp.dequantize_int8: dst has ", dst.numel(), " elements but each row has ",
      src.size(1));
  check_apart("dequantize_int8", {{"dst", &dst}, {"src", &src}, {"scales", &scales}});
  Backend(src).run(DequantizeArgs{
      {src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), block, rows},
      dst.data_ptr<float>(), static_cast<float>(scale)});
}

template <class Backend>
void unpack_int8(
    const Tensor& src, const Tensor& scales, const Tensor& dst, int64_t block, double scale) {
  const Int8Rows rows = int8_rows("unpack_int8", src, scales, block);
  check_flat_side("unpack_int8", dst, src, rows, block, true);
  check_apart("unpack_int8", {{"dst", &dst}, {"src", &src}, {"scales", &scales}});
  Backend(src).run(UnpackArgs{
      {src.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), block, rows},
      dst.data_ptr<float>(), dst.numel(), static_cast<float>(scale)});
}

// 1-D packed tensors hold the flat side's `n` codes; [rows, bytes] ones 8 / bits codes a byte.
// (Other shapes and bits are refused by packed_rows, which this runs before: `n` then.)
inline int64_t packed_row_len(const Tensor& q, int64_t n, int64_t bits) {
  return q.dim() == 2 && (bits == 4 || bits == 2) ? q.size(1) * (8 / bits) : n;
}

template <class Backend>
void quantize_packed(
    const Tensor& src, const Tensor& dst, const Tensor& scales, int64_t bits, int64_t block,
    double scale, const OptionalTensor& found_nonfinite, const OptionalTensor& residual,
    int64_t seed) {
  const char* op = "quantize_packed";
  const Int8Rows rows =
      packed_rows(op, dst, scales, block, bits, packed_row_len(dst, src.numel(), bits));
  check_packed_flat_side(op, src, dst, rows, block, false);
  const Rounding rounding = rounding_of(op, found_nonfinite, residual, seed, src);
  check_quantize_apart(op, src, dst, scales, found_nonfinite, residual);
  Backend(src).run(QuantizeArgs{
      src.const_data_ptr<float>(), static_cast<int8_t*>(dst.data_ptr()), scales.data_ptr<float>(),
      src.numel(), block, rows, static_cast<float>(scale), rounding, static_cast<int>(bits)});
}

template <class Backend>
void dequantize_packed(
    const Tensor& src, const Tensor& scales, const Tensor& dst, int64_t bits, int64_t block,
    double scale) {
  const char* op = "dequantize_packed";
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.dequantize_packed: src must have shape [chunks, bytes] with at least one row "
      "(one row per rank), got ",
      src.sizes());
  check_contiguous_fp32(op, "dst", dst, true);
  check_same_device(op, "src", src, "dst", dst);
  const Int8Rows rows = packed_rows(op, src, scales, block, bits, dst.numel());
  check_apart(op, {{"dst", &dst}, {"src", &src}, {"scales", &scales}});
  Backend(src).run(DequantizeArgs{
      {static_cast<const int8_t*>(src.const_data_ptr()), scales.const_data_ptr<float>(), block,
       rows, static_cast<int>(bits)},
      dst.data_ptr<float>(), static_cast<float>(scale)});
}

template <class Backend>
void unpack_packed(
    const Tensor& src, const Tensor& scales, const Tensor& dst, int64_t bits, int64_t block,
    double scale) {
  const char* op = "unpack_packed";
  const Int8Rows rows =
      packed_rows(op, src, scales, block, bits, packed_row_len(src, dst.numel(), bits));
  check_packed_flat_side(op, dst, src, rows, block, true);
  check_apart(op, {{"dst", &dst}, {"src", &src}, {"scales", &scales}});
  Backend(src).run(UnpackArgs{
      {static_cast<const int8_t*>(src.const_data_ptr()), scales.const_data_ptr<float>(), block,
       rows, static_cast<int>(bits)},
      dst.data_ptr<float>(), dst.numel(), static_cast<float>(scale)});
}

// The layout of requantize's codes `q` of `bits` bits (int8, or packed int4 or int2) holding
// row_len codes a row, named `tensor` (src or dst) in messages.
inline Int8Rows requantize_rows(
    const Tensor& q, const Tensor& scales, int64_t bits, int64_t block, int64_t row_len,
    const char* tensor) {
  const auto want = bits == 8 ? c10::ScalarType::Char : c10::ScalarType::Byte;
  TORCH_CHECK(
      q.scalar_type() == want, "fastddp.requantize: ", tensor, " must be ",
      bits == 8 ? "int8" : "uint8 (packed codes)", " for ", bits, "-bit codes, got ",
      q.scalar_type());
  return bits == 8 ? int8_rows("requantize", q, scales, block, tensor)
                   : packed_rows("requantize", q, scales, block, bits, row_len, tensor);
}

template <class Backend>
void requantize(
    const Tensor& src, const Tensor& src_scales, const Tensor& dst, const Tensor& dst_scales,
    int64_t bits, int64_t block, double scale, const OptionalTensor& found_nonfinite,
    const OptionalTensor& residual, int64_t seed) {
  const char* op = "requantize";
  TORCH_CHECK(
      bits == 8 || bits == 4 || bits == 2, "fastddp.requantize: bits must be 8, 4 or 2, got ",
      bits);
  TORCH_CHECK(
      src.dim() == 2 && src.size(0) >= 1,
      "fastddp.requantize: src must have shape [chunks, bytes] with at least one row (one row "
      "per rank), got ",
      src.sizes());
  // A row of src holds n codes, whole bytes of them; dst holds them once.
  const int64_t n = src.size(1) * (bits == 4 || bits == 2 ? 8 / bits : 1);
  const Int8Rows in = requantize_rows(src, src_scales, bits, block, n, "src");
  TORCH_CHECK(
      (dst.dim() == 1 || (dst.dim() == 2 && dst.size(0) == 1)) && dst.numel() == src.size(1),
      "fastddp.requantize: dst must be one row of the ", n, " codes a row of src holds (",
      src.size(1), " bytes), got ", dst.sizes());
  const Int8Rows out = requantize_rows(dst, dst_scales, bits, block, n, "dst");
  check_same_device(op, "src", src, "dst", dst);
  const Rounding rounding = rounding_of(op, found_nonfinite, residual, seed, dst, n);
  check_apart(
      op, {{"dst", &dst},
           {"dst_scales", &dst_scales},
           {"found_nonfinite", found_nonfinite.has_value() ? &*found_nonfinite : nullptr},
           {"residual", residual.has_value() ? &*residual : nullptr},
           {"src", &src},
           {"src_scales", &src_scales}});
  const auto b = static_cast<int>(bits);
  Backend(src).run(RequantizeArgs{
      {static_cast<const int8_t*>(src.const_data_ptr()), src_scales.const_data_ptr<float>(), block,
       in, b},
      static_cast<float>(scale),
      {nullptr, static_cast<int8_t*>(dst.data_ptr()), dst_scales.data_ptr<float>(), n, block, out,
       1.0f, rounding, b}});
}

// Every op of the library on one backend:
//   TORCH_LIBRARY_IMPL(fastddp, CPU, m) { ops::register_ops<CpuBackend>(m); }
template <class Backend>
void register_ops(torch::Library& m) {
  m.impl("compress", &compress<Backend>);
  m.impl("decompress", &decompress<Backend>);
  m.impl("sum_chunks", &sum_chunks<Backend>);
  m.impl("widen_sum", &widen_sum<Backend>);
  m.impl("quantize_int8", &quantize_int8<Backend>);
  m.impl("dequantize_int8", &dequantize_int8<Backend>);
  m.impl("unpack_int8", &unpack_int8<Backend>);
  m.impl("quantize_packed", &quantize_packed<Backend>);
  m.impl("dequantize_packed", &dequantize_packed<Backend>);
  m.impl("unpack_packed", &unpack_packed<Backend>);
  m.impl("requantize", &requantize<Backend>);
}

}  // namespace fastddp::ops
