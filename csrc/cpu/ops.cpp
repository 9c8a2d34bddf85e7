// CPU implementations of the fastddp ops: argument checks, then the vectorised loops in
// loops.cpp, split across threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <algorithm>
#include <optional>

#include "fastddp/checks.h"
#include "fastddp/dispatch.h"
#include "accum.h"
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

void set_flag(const std::optional<at::Tensor>& flag, const std::atomic<bool>& bad) {
  if (flag.has_value()) {
    *flag->data_ptr<int32_t>() = bad.load() ? 1 : 0;
  }
}

void compress_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  check_compress(src, dst, found_nonfinite, residual);
  const float* in = src.const_data_ptr<float>();
  const float s = static_cast<float>(scale);
  std::atomic<bool> bad{false};
  if (residual.has_value() || seed >= 0) {
    uint16_t* out = static_cast<uint16_t*>(dst.data_ptr());
    float* res = residual_ptr(residual);
    const math::WireKind kind = kind_of(dst.scalar_type());
    at::parallel_for(0, src.numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (cpu::compress_feedback(kind, in, out, res, begin, end, s, seed)) {
        bad.store(true, std::memory_order_relaxed);
      }
    });
    set_flag(found_nonfinite, bad);
    return;
  }
  char* out = static_cast<char*>(dst.data_ptr());
  const bool stream = src.numel() * 4 >= stream_min_bytes();
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
  set_flag(found_nonfinite, bad);
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

void sum_chunks_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  check_sum_chunks(src, dst, found_nonfinite, residual);
  const uint16_t* in = static_cast<const uint16_t*>(src.const_data_ptr());
  uint16_t* out = static_cast<uint16_t*>(dst.data_ptr());
  float* res = residual_ptr(residual);
  const math::WireKind kind = kind_of(src.scalar_type());
  const int64_t chunks = src.size(0);
  const int64_t m = src.size(1);
  std::atomic<bool> bad{false};
  at::parallel_for(0, m, std::max<int64_t>(1, kGrain / chunks), [&](int64_t begin, int64_t end) {
    if (cpu::sum_chunks(
            kind, in, chunks, m, out, res, begin, end, static_cast<float>(scale), seed)) {
      bad.store(true, std::memory_order_relaxed);
    }
  });
  set_flag(found_nonfinite, bad);
}

void widen_sum_cpu(const at::Tensor& src, const at::Tensor& dst, double scale) {
  check_widen_sum(src, dst);
  const uint16_t* in = static_cast<const uint16_t*>(src.const_data_ptr());
  float* out = dst.data_ptr<float>();
  const math::WireKind kind = kind_of(src.scalar_type());
  const int64_t chunks = src.size(0);
  const int64_t m = src.size(1);
  at::parallel_for(0, m, std::max<int64_t>(1, kGrain / chunks), [&](int64_t begin, int64_t end) {
    cpu::widen_sum(kind, in, chunks, m, out, begin, end, static_cast<float>(scale));
  });
}

cpu::Rows rows_of(const Int8Rows& r) {
  return {r.row_len, r.q_stride, r.s_stride};
}

void quantize_int8_cpu(
    const at::Tensor& src,
    const at::Tensor& dst,
    const at::Tensor& scales,
    int64_t block,
    double scale,
    const std::optional<at::Tensor>& found_nonfinite,
    const std::optional<at::Tensor>& residual,
    int64_t seed) {
  const Int8Rows rows = check_quantize(src, dst, scales, block, found_nonfinite, residual);
  const int64_t n = src.numel();
  const float* in = src.const_data_ptr<float>();
  int8_t* out = dst.data_ptr<int8_t>();
  float* sc = scales.data_ptr<float>();
  float* res = residual_ptr(residual);
  std::atomic<bool> bad{false};
  const int64_t grain = std::max<int64_t>(1, kGrain / block);
  at::parallel_for(0, blocks_of(n, block), grain, [&](int64_t first, int64_t last) {
    if (cpu::quantize_int8(
            in, out, sc, res, n, block, rows_of(rows), first, last, static_cast<float>(scale),
            seed)) {
      bad.store(true, std::memory_order_relaxed);
    }
  });
  set_flag(found_nonfinite, bad);
}

void dequantize_int8_cpu(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_dequantize(src, scales, dst, block);
  const int64_t chunks = src.size(0);
  const int64_t m = src.size(1);
  const int8_t* in = src.const_data_ptr<int8_t>();
  const float* sc = scales.const_data_ptr<float>();
  float* out = dst.data_ptr<float>();
  at::parallel_for(0, m, std::max<int64_t>(1, kGrain / chunks), [&](int64_t begin, int64_t end) {
    cpu::dequantize_int8(
        in, sc, chunks, m, block, rows_of(rows), out, begin, end, static_cast<float>(scale));
  });
}

void unpack_int8_cpu(
    const at::Tensor& src,
    const at::Tensor& scales,
    const at::Tensor& dst,
    int64_t block,
    double scale) {
  const Int8Rows rows = check_unpack(src, scales, dst, block);
  const int8_t* in = src.const_data_ptr<int8_t>();
  const float* sc = scales.const_data_ptr<float>();
  float* out = dst.data_ptr<float>();
  at::parallel_for(0, dst.numel(), kGrain, [&](int64_t begin, int64_t end) {
    cpu::unpack_int8(in, sc, block, rows_of(rows), out, begin, end, static_cast<float>(scale));
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CPU, m) {
  m.impl("compress", &compress_cpu);
  m.impl("decompress", &decompress_cpu);
  m.impl("sum_chunks", &sum_chunks_cpu);
  m.impl("widen_sum", &widen_sum_cpu);
  m.impl("quantize_int8", &quantize_int8_cpu);
  m.impl("dequantize_int8", &dequantize_int8_cpu);
  m.impl("unpack_int8", &unpack_int8_cpu);
}

}  // namespace fastddp
