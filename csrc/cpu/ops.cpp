// The CPU backend of the fastddp ops: each op's entry (fastddp/ops.h) checks the tensors, and
// this backend splits the op's loop (loops.h) across threads with at::parallel_for.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "fastddp/ops.h"
#include "loops.h"

namespace fastddp {
namespace {

// Elements per thread's chunk: large enough that a chunk streams well past the L1/L2
// prefetchers, small enough to split a 1 MB bucket across cores.
constexpr int64_t kGrain = 1 << 15;

struct CpuBackend {
  explicit CpuBackend(const at::Tensor&) {}

  template <class Args>
  void run(const Args& args) const {
    const cpu::Work work = cpu::work(args);
    std::atomic<bool> bad{false};
    const int64_t grain = std::max<int64_t>(1, kGrain / work.cost);
    at::parallel_for(0, work.items, grain, [&](int64_t begin, int64_t end) {
      if (cpu::run(args, begin, end)) {
        bad.store(true, std::memory_order_relaxed);
      }
    });
    if (work.flag != nullptr) {
      *work.flag = bad.load() ? 1 : 0;
    }
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(fastddp, CPU, m) {
  ops::register_ops<CpuBackend>(m);
}

}  // namespace fastddp
