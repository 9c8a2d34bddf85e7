// CPU implementations of the fastddp ops: argument checks, then the vectorised loops in
// loops.cpp, split across threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <optional>

#include "fastddp/checks.h"
#include "fastddp/dispatch.h"
#include "loops.h"

namespace fastddp {
namespace {

// Large enough that a chunk streams well past the L1/L2 prefetchers, small enough to split a
// 1 MB bucket across cores.
constexpr int64_t kGrain = 1 << 15;

// Buckets past this many bytes of fp32 are written with streaming stores: they do not fit in
// the caches anyway, and skipping the read-for-ownership saves memory traffic. Smaller ones
// stay cached for whatever reads them next (the all-reduce, the optimizer).
// FASTDDP_STREAM_MIN_BYTES overrides the threshold (0: always stream; a huge value: never).
int64_t stream_min_bytes() {
  static const int64_t bytes = [] {
    const char* v = std::getenv("FASTDDP_STREAM_MIN_BYTES");
    return v != nullptr && v[0] != '\0' ? std::atoll(v) : int64_t{16} << 20;
  }();
  return bytes;
}

bool compress_chunk(c10::Half*, const float* src, void* dst, int64_t n, float scale, bool st) {
  return cpu::compress_fp16(src, static_cast<uint16_t*>(dst), n, scale, st);
}
bool compress_chunk(c10::BFloat16*, const float* src, void* dst, int64_t n, float scale, bool st) {
  return cpu::compress_bf16(src, static_cast<uint16_t*>(dst), n, scale, st);
}
void decompress_chunk(c10::Half*, const void* src, float* dst, int64_t n, float scale, bool st) {
  cpu::decompress_fp16(static_cast<const uint16_t*>(src), dst, n, scale, st);
}
void decompress_chunk(
    c10::BFloat16*, const void* src, float* dst, int64_t n, float scale, bool st) {
  cpu::decompress_bf16(static_cast<const uint16_t*>(src), dst, n, scale, st);
}

void compress_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite) {
  check_bucket_and_wire("compress", src, dst);
  check_flag("compress", found_nonfinite, src);
  const float* in = src.const_data_ptr<float>();
  char* out = static_cast<char*>(dst.data_ptr());
  const float s = static_cast<float>(scale);
  const bool stream = src.numel() * 4 >= stream_min_bytes();
  std::atomic<bool> bad{false};
  FASTDDP_DISPATCH_WIRE(dst.scalar_type(), "compress", [&] {
    at::parallel_for(0, src.numel(), kGrain, [&](int64_t begin, int64_t end) {
      const bool chunk_bad = compress_chunk(
          static_cast<wire_t*>(nullptr), in + begin, out + begin * sizeof(wire_t), end - begin, s,
          stream);
      if (stream) {
        cpu::store_fence();
      }
      if (chunk_bad) {
        bad.store(true, std::memory_order_relaxed);
      }
    });
  });
  if (found_nonfinite.has_value()) {
    *found_nonfinite->data_ptr<int32_t>() = bad.load() ? 1 : 0;
  }
}

void decompress_cpu(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_bucket_and_wire("decompress", dst, src);
  const char* in = static_cast<const char*>(src.const_data_ptr());
  float* out = dst.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const bool stream = src.numel() * 4 >= stream_min_bytes();
  FASTDDP_DISPATCH_WIRE(src.scalar_type(), "decompress", [&] {
    at::parallel_for(0, src.numel(), kGrain, [&](int64_t begin, int64_t end) {
      decompress_chunk(
          static_cast<wire_t*>(nullptr), in + begin * sizeof(wire_t), out + begin, end - begin, s,
          stream);
      if (stream) {
        cpu::store_fence();
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CPU, m) {
  m.impl("compress", &compress_cpu);
  m.impl("decompress", &decompress_cpu);
}

}  // namespace fastddp
