// The CUDA grid emulator's scheduler: one fiber per CUDA thread, blocks one after another.
//
// A block's fibers run in a random order until each finishes or waits: at a block barrier
// (__syncthreads*), or at a warp shuffle. When every live thread of the block waits at the
// barrier, it opens; when every lane named in a shuffle's mask waits at that shuffle, the
// values are exchanged. When nothing can run and nothing can open, the launch fails with what
// each waiting thread waits for: that is a hang on a GPU.
#include <algorithm>
#include <cstdlib>
#include <memory>
#include <random>
#include <sstream>
#include <vector>

#include "cuda_emu.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define FASTDDP_ASAN 1
#endif

// x86-64 switches fibers with the few instructions below; other machines with ucontext.
// swapcontext makes a system call at every switch (the signal mask), and under ASan its
// interceptor clears the shadow of the whole stack switched to: the two took three quarters of
// the emulator's time.
#if defined(__x86_64__) && !defined(FASTDDP_EMU_UCONTEXT)
#define FASTDDP_EMU_OWN_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace fastddp::emu {

thread_local const ThreadIds* current_ids = nullptr;

namespace {

enum class State { kReady, kBarrier, kShuffle, kDone, kFailed };

#if defined(FASTDDP_EMU_OWN_SWITCH)
// A suspended context is its stack pointer: the switch pushes the callee-saved registers and
// the SSE and x87 control words onto the stack it leaves, and pops them from the one it enters.
struct Context {
  void* sp = nullptr;
};

extern "C" void fastddp_emu_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .p2align 4
  .globl fastddp_emu_switch
  .hidden fastddp_emu_switch
  .type fastddp_emu_switch, @function
fastddp_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fastddp_emu_switch, .-fastddp_emu_switch
)");

// A context that enters `entry` (which never returns) on the stack [stack, stack + size).
void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t{15};
  // What the switch pops, from the stack pointer up: the control words, r15 to rbp, then the
  // address it returns to, 16-byte aligned so that `entry` starts as if called; above it a
  // null return address for `entry`.
  auto* frame = reinterpret_cast<uint64_t*>(top) - 9;
  frame[0] = 0x1F80 | (uint64_t{0x037F} << 32);  // MXCSR and the x87 control word at reset
  for (int i = 1; i <= 6; ++i) {
    frame[i] = 0;
  }
  frame[7] = reinterpret_cast<uint64_t>(entry);
  frame[8] = 0;
  c.sp = frame;
}

void switch_context(Context& from, Context& to) {
  fastddp_emu_switch(&from.sp, to.sp);
}
#else
using Context = ucontext_t;

void make_context(Context& c, char* stack, size_t size, void (*entry)()) {
  getcontext(&c);
  c.uc_stack.ss_sp = stack;
  c.uc_stack.ss_size = size;
  c.uc_link = nullptr;
  makecontext(&c, entry, 0);
}

void switch_context(Context& from, Context& to) {
  swapcontext(&from, &to);
}
#endif

struct Fiber {
  Context ctx;
  ThreadIds ids;
  int linear = 0;
  State state = State::kReady;
  int predicate = 0;  // at a barrier: this thread's predicate; after it: the count
  uint32_t mask = 0, value = 0, result = 0;
  int src_lane = 0;
  void* fake_stack = nullptr;
};

struct Block {
  std::vector<Fiber> fibers;
  Context scheduler;
  Fiber* running = nullptr;
  Body body = nullptr;
  void* ctx = nullptr;
  std::string error;
  const void* sched_stack = nullptr;  // the scheduler's stack, for ASan's fiber switches
  size_t sched_size = 0;
};

thread_local Block* g_block = nullptr;
int g_sms = 4;
uint64_t g_seed = 0;
uint64_t g_launch = 0;

#if defined(FASTDDP_ASAN)
constexpr size_t kStack = 256 * 1024;  // ASan's redzones need room
#else
constexpr size_t kStack = 64 * 1024;
#endif

// Stacks are kept between launches: a launch has up to 1024 threads per block.
std::vector<std::unique_ptr<char[]>>& stacks(size_t count) {
  static thread_local std::vector<std::unique_ptr<char[]>> pool;
  while (pool.size() < count) {
    pool.emplace_back(new char[kStack]);
  }
  return pool;
}

// Back to the scheduler from the running fiber; returns when the scheduler resumes it.
void yield_to_scheduler(bool finished) {
  Block* b = g_block;
  Fiber* f = b->running;
#if defined(FASTDDP_ASAN)
  __sanitizer_start_switch_fiber(finished ? nullptr : &f->fake_stack, b->sched_stack,
                                 b->sched_size);
#endif
  switch_context(f->ctx, b->scheduler);
#if defined(FASTDDP_ASAN)
  __sanitizer_finish_switch_fiber(f->fake_stack, &b->sched_stack, &b->sched_size);
#endif
  (void)finished;
  current_ids = &f->ids;
}

void fiber_main() {
  Block* b = g_block;
#if defined(FASTDDP_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &b->sched_stack, &b->sched_size);
#endif
  b->body(b->ctx);
  b->running->state = State::kDone;
  yield_to_scheduler(true);
}

void fail(const std::string& why) {
  Block* b = g_block;
  if (b->error.empty()) {
    b->error = why;
  }
  b->running->state = State::kFailed;
  yield_to_scheduler(true);
  std::abort();  // a failed fiber is never resumed
}

std::string where(const Fiber& f) {
  std::ostringstream s;
  s << "thread (" << f.ids.thread_idx.x << "," << f.ids.thread_idx.y << ","
    << f.ids.thread_idx.z << ")";
  return s.str();
}

const char* state_name(State s) {
  switch (s) {
    case State::kReady:
      return "running";
    case State::kBarrier:
      return "waiting at __syncthreads";
    case State::kShuffle:
      return "waiting at a shuffle";
    case State::kDone:
      return "exited";
    default:
      return "failed";
  }
}

// Opens whatever can open; returns whether anything did.
bool release(Block& b) {
  bool opened = false;
  size_t live = 0, at_barrier = 0;
  for (const Fiber& f : b.fibers) {
    live += f.state != State::kDone;
    at_barrier += f.state == State::kBarrier;
  }
  if (at_barrier > 0 && at_barrier == live) {
    int count = 0;
    for (const Fiber& f : b.fibers) {
      count += f.state == State::kBarrier && f.predicate != 0;
    }
    if (live != b.fibers.size()) {
      b.error = "__syncthreads reached by " + std::to_string(at_barrier) + " of " +
                std::to_string(b.fibers.size()) + " threads: the others exited before it";
      return false;
    }
    for (Fiber& f : b.fibers) {
      f.predicate = count;
      f.state = State::kReady;
    }
    return true;
  }
  // Shuffles, warp by warp.
  for (size_t w = 0; w * 32 < b.fibers.size(); ++w) {
    Fiber* lanes[32] = {};
    uint32_t waiting = 0, mask = 0;
    for (size_t l = 0; l < 32 && w * 32 + l < b.fibers.size(); ++l) {
      Fiber& f = b.fibers[w * 32 + l];
      lanes[l] = &f;
      if (f.state == State::kShuffle) {
        waiting |= 1u << l;
        mask = f.mask;
      }
    }
    if (waiting == 0 || (waiting & mask) != mask) {
      continue;  // not every named lane has arrived (yet)
    }
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l) & 1u) {
        Fiber& f = *lanes[l];
        if (f.mask != mask) {
          b.error = "lanes of one warp call a shuffle with different masks";
          return false;
        }
        if (!((mask >> f.src_lane) & 1u)) {
          b.error = where(f) + " reads lane " + std::to_string(f.src_lane) +
                    ", which its shuffle's mask leaves out";
          return false;
        }
        f.result = lanes[f.src_lane]->value;
      }
    }
    for (int l = 0; l < 32; ++l) {
      if ((mask >> l) & 1u) {
        lanes[l]->state = State::kReady;
      }
    }
    opened = true;
  }
  return opened;
}

std::string stuck(const Block& b) {
  std::ostringstream s;
  s << "the block cannot go on (a hang on a GPU):";
  int shown = 0;
  for (size_t w = 0; w * 32 < b.fibers.size(); ++w) {
    for (size_t l = 0; l < 32 && w * 32 + l < b.fibers.size(); ++l) {
      const Fiber& f = b.fibers[w * 32 + l];
      if (f.state != State::kShuffle) {
        continue;
      }
      for (int k = 0; k < 32 && w * 32 + k < b.fibers.size(); ++k) {
        const Fiber& other = b.fibers[w * 32 + k];
        if (((f.mask >> k) & 1u) && other.state != State::kShuffle && shown < 4) {
          s << " lane " << k << " of warp " << w << " is named in the shuffle mask of lane " << l
            << " but is " << state_name(other.state) << ";";
          ++shown;
        }
      }
    }
  }
  if (shown == 0) {
    s << " threads wait at __syncthreads while others wait at a shuffle";
  }
  return s.str();
}

std::string run_block(Block& b, std::mt19937_64& rng) {
  const size_t n = b.fibers.size();
  auto& pool = stacks(n);
  for (size_t i = 0; i < n; ++i) {
#if defined(FASTDDP_ASAN)
    // A stack used before holds the poisoned redzones of the frames its fiber left (it ends
    // without returning). The switch keeps a live fiber's shadow, so this is cleared here,
    // once a fiber, rather than at every switch as ASan's swapcontext does.
    ASAN_UNPOISON_MEMORY_REGION(pool[i].get(), kStack);
#endif
    make_context(b.fibers[i].ctx, pool[i].get(), kStack, fiber_main);
  }
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) {
    order[i] = i;
  }
  while (true) {
    std::shuffle(order.begin(), order.end(), rng);
    bool ran = false;
    for (size_t i : order) {
      Fiber& f = b.fibers[i];
      if (f.state != State::kReady) {
        continue;
      }
      b.running = &f;
      current_ids = &f.ids;
#if defined(FASTDDP_ASAN)
      void* fake = nullptr;
      __sanitizer_start_switch_fiber(&fake, pool[i].get(), kStack);
#endif
      switch_context(b.scheduler, f.ctx);
#if defined(FASTDDP_ASAN)
      __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
      ran = true;
      if (!b.error.empty()) {
        return b.error;
      }
    }
    if (std::all_of(b.fibers.begin(), b.fibers.end(),
                    [](const Fiber& f) { return f.state == State::kDone; })) {
      return "";
    }
    if (!release(b) && !ran) {
      return b.error.empty() ? stuck(b) : b.error;
    }
    if (!b.error.empty()) {
      return b.error;
    }
  }
}

}  // namespace

int sync_block(int predicate) {
  Fiber* f = g_block->running;
  f->predicate = predicate;
  f->state = State::kBarrier;
  yield_to_scheduler(false);
  return f->predicate;
}

int lane_id() {
  return g_block->running->linear % 32;
}

uint32_t shuffle(uint32_t mask, uint32_t value, int src_lane) {
  Fiber* f = g_block->running;
  const int lane = f->linear % 32;
  if (!((mask >> lane) & 1u)) {
    fail(where(*f) + " calls a shuffle whose mask leaves out its own lane " +
         std::to_string(lane));
  }
  const size_t warp_base = static_cast<size_t>(f->linear - lane);
  if (warp_base + 32 > g_block->fibers.size() && (mask >> (g_block->fibers.size() - warp_base))) {
    fail(where(*f) + ": the shuffle mask names lanes past the end of the block");
  }
  f->mask = mask;
  f->value = value;
  f->src_lane = src_lane;
  f->state = State::kShuffle;
  yield_to_scheduler(false);
  return f->result;
}

void configure(int sms, uint64_t seed) {
  g_sms = sms;
  g_seed = seed;
  g_launch = 0;
}

int sm_count() {
  return g_sms;
}

std::string launch(unsigned grid, unsigned threads, Body body, void* ctx) {
  if (grid == 0 || threads == 0 || threads > 1024) {
    return "invalid launch: grid " + std::to_string(grid) + ", " + std::to_string(threads) +
           " threads per block (CUDA allows 1 to 1024)";
  }
  const uint64_t seed = g_seed * 1000003u + g_launch++;
  std::mt19937_64 rng(seed);
  std::vector<unsigned> blocks(grid);
  for (unsigned i = 0; i < grid; ++i) {
    blocks[i] = i;
  }
  std::shuffle(blocks.begin(), blocks.end(), rng);
  Block b;
  b.body = body;
  b.ctx = ctx;
  Block* saved = g_block;
  const ThreadIds* saved_ids = current_ids;
  g_block = &b;
  std::string error;
  for (unsigned blk : blocks) {
    b.fibers.assign(threads, Fiber{});
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = b.fibers[t];
      f.linear = static_cast<int>(t);
      f.ids.block_idx = {blk, 1, 1};
      f.ids.block_idx.y = 0;
      f.ids.block_idx.z = 0;
      f.ids.thread_idx = {t, 0, 0};
      f.ids.block_dim = {threads, 1, 1};
      f.ids.grid_dim = {grid, 1, 1};
    }
    error = run_block(b, rng);
    if (!error.empty()) {
      error = "block " + std::to_string(blk) + ": " + error + " (launch seed " +
              std::to_string(seed) + ")";
      break;
    }
  }
  g_block = saved;
  current_ids = saved_ids;
  return error;
}

}  // namespace fastddp::emu
