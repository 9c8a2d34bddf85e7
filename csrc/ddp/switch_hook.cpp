// The DDP comm hook of CompressState(dtype="auto") registered by fastddp.register_comm_hook.
//
// Each step runs either the Python hook (fastddp.compress_hook with its state), or, for the
// steps Python hands over, the fp32 all-reduce here: the bucket divided by the world size and
// summed, as PyTorch's allreduce_hook does. While auto's plan is fp32 throughout, a Python hook
// is pure overhead: the GIL taken per bucket on the autograd thread, and again on the
// collective's thread to complete a Python future. Over a fast link between nodes with several
// ranks each, that is 3-7 % of a step. Python keeps every decision: it runs one step in each
// CHECK_EVERY, reads the step periods stamped here, and says how many steps come next.
//
// CompletionStamp, below, stamps when a collective's future completes, for dtype="auto" to time
// each level of the network in its trial (fastddp/hooks/links.py).
//
// pybind11 is used here only to reach torch's Reducer, ProcessGroup and Future objects from
// Python and to hand Python the switch and the stamps; the ops stay pybind-free (fastddp.cpp).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <tuple>
#include <vector>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#if defined(FASTDDP_WITH_CUDA) && FASTDDP_WITH_CUDA
#include "../cuda/launches.h"
#endif

namespace fastddp::ddp {

// The tensor a hook's future holds: the tensor itself, the output list of an all-reduce (the
// bucket), the Python hook's tensor, or the output list of an all-reduce by a backend written
// in Python (its future holds a Python list).
at::Tensor hook_result(const c10::IValue& result) {
  if (result.isTensor()) {
    return result.toTensor();
  }
  if (!result.isPyObject()) {
    return result.toTensorVector()[0];
  }
  py::gil_scoped_acquire gil;
  py::object value = torch::jit::toPyObject(result);
  if (py::isinstance<py::list>(value) || py::isinstance<py::tuple>(value)) {
    value = value[py::int_(0)];
  }
  return value.cast<at::Tensor>();
}

namespace {

double now_seconds() {
  // steady_clock is CLOCK_MONOTONIC on Linux, the clock of Python's time.perf_counter.
  using seconds = std::chrono::duration<double>;
  return std::chrono::duration_cast<seconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What a measured step in C++ saw, per bucket, as auto's trial records a step in Python: when
// the bucket reached the hook and left it, its size, and when its last reduction completed.
struct StepRecord {
  std::vector<double> began, left;
  std::vector<int64_t> numel;
  double done = 0.0;
};

// What the hook and Python share. The hook reads it on the autograd thread without the GIL,
// Python writes it with the GIL: a mutex, held only for a few assignments.
class Switch {
 public:
  // Called at every bucket. The reducer launches a step's buckets in index order, so bucket 0
  // starts a step: stamp it, and decide there whether the whole step runs natively. Returns
  // the step's record where it is measured, else null.
  bool step_is_native(size_t bucket_index, std::shared_ptr<StepRecord>* record) {
    std::lock_guard<std::mutex> lock(mu_);
    if (bucket_index == 0) {
      starts_.push_back(now_seconds());
      native_now_ = native_left_ > 0;
      current_.reset();
      if (native_now_) {
        --native_left_;
        ++native_total_;
        if (measure_) {
          current_ = std::make_shared<StepRecord>();
          records_.push_back(current_);
        }
      }
    }
    *record = current_;
    return native_now_;
  }

  // A bucket of a measured step: reached the hook at `began`, left it at `left`.
  void add_bucket(StepRecord& record, double began, double left, int64_t numel) {
    std::lock_guard<std::mutex> lock(mu_);
    record.began.push_back(began);
    record.left.push_back(left);
    record.numel.push_back(numel);
  }

  // A reduction of `record`'s step completed (on the collective's thread).
  void finished(StepRecord& record) {
    const double now = now_seconds();
    std::lock_guard<std::mutex> lock(mu_);
    record.done = std::max(record.done, now);
  }

  // Run the next `steps` steps here; with `measure`, record each bucket of them.
  void run_native(int64_t steps, bool measure) {
    TORCH_CHECK(steps >= 0, "run_native: steps must be >= 0, got ", steps);
    std::lock_guard<std::mutex> lock(mu_);
    native_left_ = steps;
    measure_ = measure;
  }

  // (began, left, numel, done) of one step, as Python reads it.
  using Taken = std::tuple<std::vector<double>, std::vector<double>, std::vector<int64_t>, double>;

  // The records of the measured steps run here since the last call, oldest first.
  std::vector<Taken> take_records() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Taken> out;
    for (const auto& r : records_) {
      out.emplace_back(r->began, r->left, r->numel, r->done);
    }
    records_.clear();
    return out;
  }

  // The periods between consecutive step starts since the last call; the last start is kept.
  std::vector<double> take_periods() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<double> periods;
    for (size_t i = 1; i < starts_.size(); ++i) {
      periods.push_back(starts_[i] - starts_[i - 1]);
    }
    if (!starts_.empty()) {
      starts_.erase(starts_.begin(), starts_.end() - 1);
    }
    return periods;
  }

  int64_t native_total() {
    std::lock_guard<std::mutex> lock(mu_);
    return native_total_;
  }

  bool native_now() {
    std::lock_guard<std::mutex> lock(mu_);
    return native_now_;
  }

  // Whether a step's stamp waits for the device first (set by Python during a trial).
  void settle(bool on) {
    settle_.store(on);
  }
  bool settling() const {
    return settle_.load();
  }

 private:
  std::mutex mu_;
  int64_t native_left_ = 0;   // steps still to run here, set by Python
  int64_t native_total_ = 0;  // steps run here so far
  bool native_now_ = false;   // whether the current step runs here
  bool measure_ = false;      // whether the steps handed over are recorded
  std::vector<double> starts_;
  std::shared_ptr<StepRecord> current_;  // the current step's record, if it is measured
  std::vector<std::shared_ptr<StepRecord>> records_;
  std::atomic<bool> settle_{false};  // read without the mutex, before the stamp
};

// Waits for the work queued on the bucket's device before a step of a trial is stamped. The
// host runs ahead of the kernels: without it, the period between two stamps would be the
// host's, or the backlog of another candidate's turn, not the step's. (A build without CUDA
// cannot wait here; it refuses CUDA buckets when a candidate first compresses one.)
void settle(const at::Tensor& buffer) {
#if defined(FASTDDP_WITH_CUDA) && FASTDDP_WITH_CUDA
  if (buffer.is_cuda()) {
    const cudaError_t e = fastddp::cuda::synchronize(buffer.get_device());
    TORCH_CHECK(e == cudaSuccess, "fastddp: could not synchronize CUDA device ",
                buffer.get_device(), " before timing a step: ", cudaGetErrorString(e));
  }
#else
  (void)buffer;
#endif
}

class SwitchHook final : public c10d::CommHookInterface {
 public:
  SwitchHook(
      c10::intrusive_ptr<c10d::ProcessGroup> group,
      py::object state,
      py::object hook,
      std::shared_ptr<Switch> control)
      : group_(std::move(group)),
        python_(std::move(state), std::move(hook)),
        control_(std::move(control)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    std::shared_ptr<StepRecord> record;
    if (bucket.getIndex() == 0 && control_->settling()) {
      settle(bucket.getBufferRef());
    }
    if (!control_->step_is_native(bucket.getIndex(), &record)) {
      return python_.runHook(bucket);  // takes the GIL itself
    }
    const double began = now_seconds();
    at::Tensor& buffer = bucket.getBufferRef();
    buffer.div_(group_->getSize());
    std::vector<at::Tensor> tensors{buffer};
    auto future = group_->allreduce(tensors)->getFuture();
    if (record) {
      control_->add_bucket(*record, began, now_seconds(), buffer.numel());
      future->addCallback(
          [control = control_, record](c10::ivalue::Future&) { control->finished(*record); });
    }
    return future;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return hook_result(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  c10d::PythonCommHook python_;
  std::shared_ptr<Switch> control_;
};

// When a collective's future completed, stamped on the thread that completes it, without the
// GIL: a Python callback there would wait for the GIL, which the training thread holds while
// it runs Python, and stamp late. dtype="auto" times each level's collectives with it.
class CompletionStamp {
 public:
  void stamp() {
    done_.store(now_seconds());
  }
  // perf_counter seconds at completion; 0 while the future is pending.
  double done() const {
    return done_.load();
  }

 private:
  std::atomic<double> done_{0.0};
};

std::shared_ptr<CompletionStamp> stamp_completion(const py::object& future) {
  auto wrapper = py::cast<std::shared_ptr<torch::jit::PythonFutureWrapper>>(future);
  auto stamp = std::make_shared<CompletionStamp>();
  wrapper->fut->addCallback([stamp](c10::ivalue::Future&) { stamp->stamp(); });
  return stamp;
}

std::shared_ptr<Switch> register_switch_hook(
    const std::shared_ptr<c10d::Reducer>& reducer,
    const c10::intrusive_ptr<c10d::ProcessGroup>& group,
    py::object state,
    py::object hook) {
  auto control = std::make_shared<Switch>();
  // The reducer refuses a second hook ("can only be called once"), as for DDP's own.
  reducer->register_comm_hook(
      std::make_unique<SwitchHook>(group, std::move(state), std::move(hook), control));
  return control;
}

}  // namespace

void define_native_hook(py::module_& m);  // native_hook.cpp

// Add the DDP hooks' names (the switch hook's, the native runner's) to the _C module; returns
// -1 with a Python error set on failure.
int add_ddp_hooks(PyObject* module) {
  try {
    auto m = py::reinterpret_borrow<py::module_>(module);
    define_native_hook(m);
    py::class_<Switch, std::shared_ptr<Switch>>(m, "SwitchHookControl")
        .def("run_native", &Switch::run_native, py::arg("steps"), py::arg("measure") = false)
        .def("take_periods", &Switch::take_periods)
        .def("take_records", &Switch::take_records)
        .def_property_readonly("native_total", &Switch::native_total)
        .def_property_readonly("native_now", &Switch::native_now)
        .def_property("settling", &Switch::settling, &Switch::settle);
    py::class_<CompletionStamp, std::shared_ptr<CompletionStamp>>(m, "CompletionStamp")
        .def_property_readonly("done", &CompletionStamp::done);
    m.def("stamp_completion", &stamp_completion, py::arg("future"));
#if defined(FASTDDP_WITH_CUDA) && FASTDDP_WITH_CUDA
    // fastddp/hooks/runtime.py wraps it in torch.cuda.ExternalStream.
    m.def(
        "new_stream",
        [](int device, bool high_priority) {
          cudaStream_t stream = nullptr;
          const cudaError_t e = fastddp::cuda::new_stream(device, high_priority, &stream);
          TORCH_CHECK(e == cudaSuccess, "fastddp: could not create a CUDA stream on device ",
                      device, ": ", cudaGetErrorString(e));
          return reinterpret_cast<std::intptr_t>(stream);
        },
        py::arg("device"), py::arg("high_priority"));
#endif
    m.def(
        "register_switch_hook",
        &register_switch_hook,
        py::arg("reducer"),
        py::arg("process_group"),
        py::arg("state"),
        py::arg("hook"));
    return 0;
  } catch (py::error_already_set& e) {
    e.restore();
    return -1;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return -1;
  }
}

}  // namespace fastddp::ddp
