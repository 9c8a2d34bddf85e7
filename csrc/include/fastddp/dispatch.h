// Dtype dispatch for the wire (16-bit) side of an op. The fp32 side is fixed, so the
// launchers dispatch only on the wire dtype; math is always done in fp32.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

// Calls __VA_ARGS__ with `wire_t` bound to c10::Half or c10::BFloat16.
#define FASTDDP_DISPATCH_WIRE(DTYPE, OP, ...)                                   \
  [&] {                                                                         \
    switch (DTYPE) {                                                            \
      case c10::ScalarType::Half: {                                             \
        using wire_t = c10::Half;                                               \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      case c10::ScalarType::BFloat16: {                                         \
        using wire_t = c10::BFloat16;                                           \
        return __VA_ARGS__();                                                   \
      }                                                                         \
      default:                                                                  \
        TORCH_CHECK(false, "fastddp.", OP, ": unsupported wire dtype ", DTYPE,  \
                    "; use torch.float16 or torch.bfloat16");                   \
    }                                                                           \
  }()
