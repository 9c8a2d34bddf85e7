// The fastddp ops on the CUDA grid emulator: the same launch code (../cuda/launch.h) and kernels
// (../cuda/kernels.cuh) as the CUDA backend, run on the CPU. A C interface over raw pointers,
// loaded by fastddp/testing/emu.py, which passes CPU tensors that the real ops' checks have
// accepted. Each function returns NULL, or what went wrong in the launch.
#include <cstring>
#include <string>
#include <tuple>

#include "../cuda/launch.h"
#include "cuda_emu.h"

namespace fastddp::emu {
namespace {

struct EmuRuntime {
  std::string error;

  int sms() const {
    return sm_count();
  }

  void zero_flag(int* flag) const {
    *flag = 0;
  }

  template <class... P, class... A>
  void launch(void (*kernel)(P...), int grid, A... args) {
    struct Call {
      void (*kernel)(P...);
      std::tuple<P...> args;
    } call{kernel, std::tuple<P...>(static_cast<P>(args)...)};
    const std::string why = emu::launch(
        static_cast<unsigned>(grid), kernels::kThreads,
        [](void* p) {
          auto* c = static_cast<Call*>(p);
          std::apply(c->kernel, c->args);
        },
        &call);
    if (error.empty()) {
      error = why;
    }
  }
};

thread_local std::string g_error;

const char* result(const EmuRuntime& rt) {
  g_error = rt.error;
  return g_error.empty() ? nullptr : g_error.c_str();
}

math::WireKind kind(int k) {
  return k == 1 ? math::WireKind::kBf16 : math::WireKind::kFp16;
}

}  // namespace
}  // namespace fastddp::emu

using fastddp::Int8Rows;
using fastddp::emu::EmuRuntime;
using fastddp::emu::kind;
using fastddp::emu::result;
namespace kernels = fastddp::kernels;

extern "C" {

void fastddp_emu_configure(int sms, uint64_t seed) {
  fastddp::emu::configure(sms, seed);
}

const char* fastddp_emu_compress(int k, const float* in, uint16_t* out, int64_t n, float scale,
                                 float* residual, int64_t seed, int* flag) {
  EmuRuntime rt;
  kernels::compress(rt, kind(k), in, out, n, scale, residual, seed, flag);
  return result(rt);
}

const char* fastddp_emu_decompress(int k, const uint16_t* in, float* out, int64_t n,
                                   float scale) {
  EmuRuntime rt;
  kernels::decompress(rt, kind(k), in, out, n, scale);
  return result(rt);
}

const char* fastddp_emu_sum_chunks(int k, const uint16_t* in, int64_t chunks, int64_t m,
                                   uint16_t* out, float* residual, float scale, int64_t seed,
                                   int* flag) {
  EmuRuntime rt;
  kernels::sum_chunks(rt, kind(k), in, chunks, m, out, residual, scale, seed, flag);
  return result(rt);
}

const char* fastddp_emu_widen_sum(int k, const uint16_t* in, int64_t chunks, int64_t m,
                                  float* out, float scale) {
  EmuRuntime rt;
  kernels::widen_sum(rt, kind(k), in, chunks, m, out, scale);
  return result(rt);
}

const char* fastddp_emu_quantize_int8(const float* in, int8_t* out, float* scales,
                                      float* residual, int64_t n, int64_t block,
                                      const int64_t* rows, float scale, int64_t seed,
                                      int* flag) {
  EmuRuntime rt;
  kernels::quantize_int8(rt, in, out, scales, residual, n, block,
                         Int8Rows{rows[0], rows[1], rows[2], rows[3]}, scale, seed, flag);
  return result(rt);
}

const char* fastddp_emu_dequantize_int8(const int8_t* in, const float* scales, int64_t chunks,
                                        int64_t m, int64_t block, const int64_t* rows,
                                        float* out, float scale) {
  EmuRuntime rt;
  kernels::dequantize_int8(rt, in, scales, chunks, m, block,
                           Int8Rows{rows[0], rows[1], rows[2], rows[3]}, out, scale);
  return result(rt);
}

const char* fastddp_emu_unpack_int8(const int8_t* in, const float* scales, int64_t n,
                                    int64_t block, const int64_t* rows, float* out, float scale) {
  EmuRuntime rt;
  kernels::unpack_int8(rt, in, scales, n, block, Int8Rows{rows[0], rows[1], rows[2], rows[3]},
                       out, scale);
  return result(rt);
}

}  // extern "C"
