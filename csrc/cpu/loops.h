// Plain loops over raw memory for the CPU kernels. They live in their own translation unit,
// free of torch headers, so they compile fast and can carry per-ISA clones.
#pragma once

#include <cstdint>

namespace fastddp::cpu {

// dst[i] = wire(src[i] * scale), rounded to nearest even; returns true when any written
// value is inf or NaN (fp16 overflow, or a non-finite input). With `stream`, the vector loops
// write around the caches; call store_fence() once all threads are done.
bool compress_bf16(const float* src, uint16_t* dst, int64_t n, float scale, bool stream);
bool compress_fp16(const float* src, uint16_t* dst, int64_t n, float scale, bool stream);

// dst[i] = float(src[i]) * scale.
void decompress_bf16(const uint16_t* src, float* dst, int64_t n, float scale, bool stream);
void decompress_fp16(const uint16_t* src, float* dst, int64_t n, float scale, bool stream);

// Orders this thread's streaming stores before its later stores.
void store_fence();

}  // namespace fastddp::cpu
