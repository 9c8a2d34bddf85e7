// The fastddp ops on the CUDA grid emulator: the same launch code (../cuda/launch.h) and kernels
// (../cuda/*.cuh) as the CUDA backend, run on the CPU. A C interface over raw pointers,
// loaded by fastddp/testing/emu.py, which passes CPU tensors that the real ops' checks have
// accepted. Each function returns NULL, or what went wrong in the launch.
#include <dlfcn.h>

#include <cstring>
#include <set>
#include <string>
#include <tuple>

#include "../cuda/launch.h"
#include "cuda_emu.h"

namespace fastddp::emu {
namespace {

// The symbols of the kernels launched since fastddp_emu_launched last read them, so that the
// tests can tell which kernels their cases ran.
std::set<std::string>& launched() {
  static std::set<std::string> names;
  return names;
}

struct EmuRuntime {
  std::string error;

  // Eight blocks a multiprocessor, whatever the kernel: the emulator has no registers to count.
  template <class Kernel>
  int resident(Kernel) const {
    return sm_count() * 8;
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
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(kernel), &info) != 0 && info.dli_sname != nullptr) {
      launched().insert(info.dli_sname);
    }
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

// Runs an op's launch code on the emulator; NULL, or what went wrong.
template <class Args>
const char* run(const Args& args) {
  EmuRuntime rt;
  kernels::run(rt, args);
  g_error = rt.error;
  return g_error.empty() ? nullptr : g_error.c_str();
}

[[maybe_unused]] math::WireKind kind(int k) {
  return k == 1 ? math::WireKind::kBf16 : math::WireKind::kFp16;
}

[[maybe_unused]] Int8Rows rows_of(const int64_t* rows) {
  return {rows[0], rows[1], rows[2], rows[3]};
}

}  // namespace
}  // namespace fastddp::emu

using namespace fastddp;
using emu::kind;
using emu::rows_of;
using emu::run;

// A library for one op's checks, built with -DFASTDDP_EMU_ONLY -DFASTDDP_EMU_OP_<op>, holds that
// op alone: the others' launch code and kernels are not instantiated, which cuts the compile of
// a planted defect's copy by a half to three quarters.
extern "C" {

void fastddp_emu_configure(int sms, uint64_t seed) {
  emu::configure(sms, seed);
}

// The (mangled) names of the kernels launched since the last call, one a line.
const char* fastddp_emu_launched() {
  static std::string names;
  names.clear();
  for (const std::string& name : emu::launched()) {
    names += name + "\n";
  }
  emu::launched().clear();
  return names.c_str();
}

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_compress)
const char* fastddp_emu_compress(int k, const float* in, uint16_t* out, int64_t n, float scale,
                                 float* residual, int64_t seed, int* flag) {
  return run(CompressArgs{{kind(k), in, out, n, scale}, {residual, seed, flag}});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_decompress)
const char* fastddp_emu_decompress(int k, const uint16_t* in, float* out, int64_t n,
                                   float scale) {
  return run(DecompressArgs{kind(k), in, out, n, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_sum_chunks)
const char* fastddp_emu_sum_chunks(int k, const uint16_t* in, int64_t chunks, int64_t m,
                                   uint16_t* out, float* residual, float scale, int64_t seed,
                                   int* flag) {
  if (chunks < 1) {  // (the op refuses it before any launch: its kernels read row 0)
    return "sum_chunks needs at least one row";
  }
  return run(SumChunksArgs{{kind(k), in, chunks, m, out, scale}, {residual, seed, flag}});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_widen_sum)
const char* fastddp_emu_widen_sum(int k, const uint16_t* in, int64_t chunks, int64_t m,
                                  float* out, float scale) {
  if (chunks < 1) {
    return "widen_sum needs at least one row";
  }
  return run(WidenSumArgs{kind(k), in, chunks, m, out, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_quantize_int8)
const char* fastddp_emu_quantize_int8(const float* in, int8_t* out, float* scales,
                                      float* residual, int64_t n, int64_t block,
                                      const int64_t* rows, float scale, int64_t seed,
                                      int* flag) {
  return run(QuantizeArgs{in, out, scales, n, block, rows_of(rows), scale, {residual, seed, flag}});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_dequantize_int8)
// The rows' count and length (chunks, m) are in `rows` as well.
const char* fastddp_emu_dequantize_int8(const int8_t* in, const float* scales, int64_t /*chunks*/,
                                        int64_t /*m*/, int64_t block, const int64_t* rows,
                                        float* out, float scale) {
  return run(DequantizeArgs{{in, scales, block, rows_of(rows)}, out, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_unpack_int8)
const char* fastddp_emu_unpack_int8(const int8_t* in, const float* scales, int64_t n,
                                    int64_t block, const int64_t* rows, float* out, float scale) {
  return run(UnpackArgs{{in, scales, block, rows_of(rows)}, out, n, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_quantize_packed)
// The packed ops: `bits` 4 or 2; `out` / `in` are the codes' bytes.
const char* fastddp_emu_quantize_packed(int bits, const float* in, uint8_t* out, float* scales,
                                        float* residual, int64_t n, int64_t block,
                                        const int64_t* rows, float scale, int64_t seed,
                                        int* flag) {
  return run(QuantizeArgs{in, reinterpret_cast<int8_t*>(out), scales, n, block, rows_of(rows),
                          scale, {residual, seed, flag}, bits});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_dequantize_packed)
const char* fastddp_emu_dequantize_packed(int bits, const uint8_t* in, const float* scales,
                                          int64_t block, const int64_t* rows, float* out,
                                          float scale) {
  const Int8Source src{reinterpret_cast<const int8_t*>(in), scales, block, rows_of(rows), bits};
  return run(DequantizeArgs{src, out, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_unpack_packed)
const char* fastddp_emu_unpack_packed(int bits, const uint8_t* in, const float* scales,
                                      int64_t n, int64_t block, const int64_t* rows, float* out,
                                      float scale) {
  const Int8Source src{reinterpret_cast<const int8_t*>(in), scales, block, rows_of(rows), bits};
  return run(UnpackArgs{src, out, n, scale});
}
#endif

#if !defined(FASTDDP_EMU_ONLY) || defined(FASTDDP_EMU_OP_requantize)
// requantize: `bits` 8, 4 or 2; `in_rows` and `out_rows` the layouts of src and dst, n codes a
// row.
const char* fastddp_emu_requantize(int bits, const uint8_t* in, const float* in_scales,
                                   const int64_t* in_rows, uint8_t* out, float* out_scales,
                                   const int64_t* out_rows, float* residual, int64_t n,
                                   int64_t block, float scale, int64_t seed, int* flag) {
  const Int8Source src{reinterpret_cast<const int8_t*>(in), in_scales, block, rows_of(in_rows),
                       bits};
  return run(RequantizeArgs{src, scale,
                            {nullptr, reinterpret_cast<int8_t*>(out), out_scales, n, block,
                             rows_of(out_rows), 1.0f, {residual, seed, flag}, bits}});
}
#endif

}  // extern "C"
