// Argument checks shared by the CPU and CUDA implementations of every op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

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

}  // namespace fastddp
