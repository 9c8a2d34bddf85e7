// The steady state of compress_hook's fixed modes, run without Python: fastddp.hooks.native.
//
// Python sets a bucket up (its slot, buffers, residuals, groups) and then hands this runner the
// bucket's *plan*: per stage, the op calls that run before its collective (encode, fp32 row
// sums, the non-finite count) and the collective itself, then the calls that decode the result
// into the bucket. The calls are the ones the Python path runs (fastddp/hooks/paths.py and
// two_level.py build them for both), bound to the slot's persistent tensors, so both paths
// compute the same bits.
// Per bucket, this runner then costs a map lookup, one dispatcher call per op and one
// collective per stage: no Python frame, and, registered through fastddp.register_comm_hook,
// not even the GIL.
//
// Ordering is the Python pipeline's (fastddp/hooks/pipeline.py): a path's first stage runs in
// the call that submits the bucket; its later stages run at the next submission, newest job
// first, after that bucket's first stage; everything pending runs at the bucket DDP marks
// last, or at the end of the backward pass. A later stage waits for the collective before it:
// Work::wait(), which on NCCL makes the current stream (a side stream) wait for it. On CUDA
// the decode runs in a callback of the last collective's future, whose streams wait for the
// collective's CUDA events (NCCL completes its futures when the work is enqueued); on the CPU,
// on the thread that calls the hook, once the collective is done (at a later bucket, the last
// one, or the end of the backward pass), so that nothing runs on Gloo's threads. A bucket whose buffer has
// no plan is declined (Python runs it) after everything pending here is issued, so every rank
// issues its collectives in the same order.
#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/python_comm_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/version.h>

namespace fastddp::ddp {

at::Tensor hook_result(const c10::IValue& result);  // switch_hook.cpp

namespace {

using Future = c10::ivalue::Future;

// A tensor argument that views the bucket buffer the plan was made with: rebuilt on the
// buffer of the call (the same tensor in steady state, so this is rare).
struct BucketView {
  size_t arg;
  int64_t offset;
  std::vector<int64_t> sizes, strides;
};

bool views_storage(const at::Tensor& t, const at::Tensor& buffer) {
  return t.defined() && t.has_storage() && buffer.has_storage() &&
      t.storage().is_alias_of(buffer.storage());
}

BucketView view_of(size_t arg, const at::Tensor& t, const at::Tensor& buffer) {
  return {
      arg,
      t.storage_offset() - buffer.storage_offset(),
      t.sizes().vec(),
      t.strides().vec()};
}

at::Tensor rebuild(const BucketView& v, const at::Tensor& bucket) {
  return bucket.as_strided(v.sizes, v.strides, bucket.storage_offset() + v.offset);
}

// One op call: its schema, its arguments bound but for views of the bucket.
struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<BucketView> views;

  void run(const at::Tensor& bucket, bool same_buffer) const {
    std::vector<c10::IValue> stack = args;
    if (!same_buffer) {
      for (const auto& v : views) {
        stack[v.arg] = rebuild(v, bucket);
      }
    }
    op.callBoxed(stack);
  }
};

enum class Kind { kAllReduce, kAllToAll, kAllGather };

// A Python object that may be released on any thread (it takes the GIL to let go).
std::shared_ptr<py::object> held(py::object obj) {
  return std::shared_ptr<py::object>(new py::object(std::move(obj)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
}

// The Work a Python process group returned, with its Python object kept alive (torch's
// trampoline looks its methods up on that object).
class HeldWork final : public c10d::Work {
 public:
  explicit HeldWork(py::object work)
      : work_(work.cast<c10::intrusive_ptr<c10d::Work>>()), python_(held(std::move(work))) {}

  bool wait(std::chrono::milliseconds timeout) override {
    return work_->wait(timeout);
  }

  bool isCompleted() override {
    return work_->isCompleted();
  }

  c10::intrusive_ptr<Future> getFuture() override {
    return work_->getFuture();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::shared_ptr<py::object> python_;
};

struct Collective {
  Kind kind;
  // Held weakly: Python owns the group. A plan that held the last reference would destroy it
  // wherever the plan goes, and Gloo's destructor joins its worker threads: with the GIL held
  // (a state dropped in Python) while a worker waits for the GIL to free a Work, a deadlock;
  // on a worker itself (a callback's last reference), a thread joining itself.
  c10::weak_intrusive_ptr<c10d::ProcessGroup> weak_group{
      c10::intrusive_ptr<c10d::ProcessGroup>()};
  // A process group written in Python (a weakref.ref to it, for the reason above): torch's
  // trampoline forwards allreduce and all_to_all_single to its methods, but not
  // all_gather_single, which is called here.
  std::shared_ptr<py::object> python_group;
  at::Tensor out, in;  // all-reduce: out, in place
  std::vector<int64_t> out_splits, in_splits;
  std::vector<BucketView> views;  // arg 0: out, 1: in

  c10::intrusive_ptr<c10d::Work> issue(const at::Tensor& bucket, bool same_buffer) const {
    const auto group = weak_group.lock();
    TORCH_CHECK(
        group, "fastddp: the process group of a planned bucket has been destroyed; after "
        "destroy_process_group (or a new init), make a new CompressState and register it again");
    at::Tensor o = out, i = in;
    if (!same_buffer) {
      for (const auto& v : views) {
        (v.arg == 0 ? o : i) = rebuild(v, bucket);
      }
    }
    switch (kind) {
      case Kind::kAllReduce: {
        std::vector<at::Tensor> tensors{o};
        return group->allreduce(tensors);
      }
      case Kind::kAllToAll: {
        auto out_splits_ = out_splits;
        auto in_splits_ = in_splits;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
        return group->all_to_all_single(o, i, out_splits_, in_splits_);
#else
        return group->alltoall_base(o, i, out_splits_, in_splits_);
#endif
      }
      case Kind::kAllGather:
        if (python_group) {
          py::gil_scoped_acquire gil;
          py::object pg = (*python_group)();
          TORCH_CHECK(!pg.is_none(), "fastddp: the process group of a planned bucket has been "
                      "destroyed; make a new CompressState and register it again");
          py::object work = pg.attr("all_gather_single")(o, i);
          return c10::make_intrusive<HeldWork>(std::move(work));
        }
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13)
        return group->all_gather_single(o, i);
#else
        return group->_allgather_base(o, i);
#endif
    }
    TORCH_CHECK(false, "fastddp: unknown collective");
  }
};

struct Stage {
  std::vector<Call> calls;
  Collective collective;
};

struct Job;

// One bucket's plan, made by Python for its slot.
struct Plan {
  int64_t id = 0;      // Python's name for the slot
  at::Tensor buffer;   // the bucket buffer it was made with; held, so its address stays unique
  std::vector<Stage> stages;
  std::vector<Call> finish;
  bool wait_in_callback = false;  // call Work::wait() before the decode (see add())
  bool on_caller = false;  // decode on the thread that calls the hook (see add())
  // `buffer` as a Python object, what futures returned to Python hold: made once, so that a
  // reduction takes no Python reference (which only the GIL may drop, on any thread).
  c10::IValue python_value;
  int64_t runs = 0;    // reductions run here since Python last took the count
  std::shared_ptr<Job> job;  // the latest reduction
  // The Python path's last reduction of this bucket, until the first one here: its decode
  // read the slot's tensors that this plan's first stage overwrites.
  c10::intrusive_ptr<Future> previous;
};

struct Job {
  std::shared_ptr<Plan> plan;
  at::Tensor bucket;
  bool same_buffer = true;
  size_t stage = 0;  // the next stage to issue
  int64_t order = 0;
  c10::intrusive_ptr<c10d::Work> work;
  c10::intrusive_ptr<Future> result;
  c10::IValue value;  // what the result holds: the bucket (a Python object for Python hooks)
};

std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown error";
  }
}

// A blocking wait that lets other Python threads run (the simulated NCCL needs them).
void wait_work(const c10::intrusive_ptr<c10d::Work>& work) {
  if (PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    work->wait();
  } else {
    work->wait();
  }
}

void wait_future(const c10::intrusive_ptr<Future>& fut) {
  if (PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    fut->wait();
  } else {
    fut->wait();
  }
}

class Runner : public std::enable_shared_from_this<Runner> {
 public:
  ~Runner() {
    for (auto& [key, plan] : plans_) {
      plan->job.reset();  // the cycle remove() breaks
    }
  }

  // Add a plan for the bucket buffer `buffer`. `stages`: [(calls, collective)]; a call is
  // (qualified name, overload, args, kwargs); a collective is (kind, group, out, in,
  // out_splits, in_splits, the group if it is written in Python, else None). `finish`: the
  // calls that decode into the bucket.
  // `wait_in_callback`: the backend's future completes before the output can be read, and
  // only Work::wait() makes it readable (the simulated NCCL of the tests; on Gloo, wait()
  // inside the future's callback would wait for the callback itself). `on_caller`: decode on
  // the thread that calls the hook, once the collective is done, rather than in a callback
  // of its future (CPU tensors: then nothing of fastddp's, and nothing chained on its
  // futures, runs on Gloo's threads, where it could be left running at interpreter exit).
  // `previous`: the result future of the Python path's last reduction of the bucket, or None.
  void add(
      int64_t id,
      const at::Tensor& buffer,
      const py::list& stages,
      const py::list& finish,
      bool wait_in_callback,
      bool on_caller,
      const py::object& previous) {
    auto plan = std::make_shared<Plan>();
    plan->id = id;
    if (!previous.is_none()) {
      plan->previous =
          torch::jit::toIValue(previous, c10::FutureType::create(c10::AnyType::get())).toFuture();
    }
    plan->buffer = buffer;
    plan->wait_in_callback = wait_in_callback;
    plan->on_caller = on_caller;
    plan->python_value = torch::jit::toIValue(py::cast(buffer), c10::PyObjectType::get());
    for (const auto& s : stages) {
      auto pair = s.cast<py::tuple>();
      Stage stage;
      stage.calls = calls_of(pair[0].cast<py::list>(), buffer);
      stage.collective = collective_of(pair[1].cast<py::tuple>(), buffer);
      plan->stages.push_back(std::move(stage));
    }
    TORCH_CHECK(!plan->stages.empty(), "fastddp: a plan needs at least one stage");
    plan->finish = calls_of(finish, buffer);
    std::lock_guard<std::mutex> lock(mu_);
    plans_[buffer.unsafeGetTensorImpl()] = std::move(plan);
  }

  // Drop the plan of `buffer` (its slot was retired); returns its uncounted runs. The current
  // stream is ordered after its last decode first: the Python path, or the allocator, may
  // hand the slot's tensors out next.
  int64_t remove(const at::Tensor& buffer) {
    std::shared_ptr<Job> last;
    int64_t runs = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(buffer.unsafeGetTensorImpl());
      if (it == plans_.end()) {
        return 0;
      }
      runs = it->second->runs;
      // A plan and its latest job hold each other: without this, neither would be freed, nor
      // the bucket buffer and slot tensors the plan's calls hold (1-2x the bucket on a GPU).
      last = std::move(it->second->job);
      plans_.erase(it);
    }
    if (last && last->result) {
      wait_future(last->result);
    }
    return runs;
  }

  // Python's slot ids with the runs since the last call.
  std::vector<std::pair<int64_t, int64_t>> take_runs() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::pair<int64_t, int64_t>> out;
    for (auto& [key, plan] : plans_) {
      if (plan->runs > 0) {
        out.emplace_back(plan->id, plan->runs);
        plan->runs = 0;
      }
    }
    return out;
  }

  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return plans_.size();
  }

  // Reduce `bucket` by its plan and return the future of the result, or null if it has none
  // (the caller runs it; whatever was pending here has been issued).
  // `python`: the future holds the bucket as a Python object, as futures that Python hooks
  // return must (PythonCommHook wants one); else the tensor. Call it without the GIL: Gloo's
  // worker threads may take the GIL while they hold the lock that issuing a collective takes.
  c10::intrusive_ptr<Future> run(c10d::GradBucket& bucket, bool python) {
    check();
    at::Tensor& buffer = bucket.getBufferRef();
    std::shared_ptr<Plan> plan;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = plans_.find(buffer.unsafeGetTensorImpl());
      if (it != plans_.end()) {
        plan = it->second;
      }
    }
    if (!plan) {
      guarded([&] {
        issue_pending();
        if (!completing_.empty()) {
          finish_by_end_of_backward();
        }
      });
      return {};
    }
    std::vector<std::shared_ptr<Job>> earlier(pending_.begin(), pending_.end());
    pending_.clear();
    auto job = std::make_shared<Job>();
    guarded([&] {
      if (plan->job && plan->job->stage < plan->stages.size()) {
        // The previous reduction of this bucket never finished issuing (its stages are among
        // the jobs taken above): issue them all before this one's first stage, newest first
        // as everywhere, as Python's settle does. What decides this is which stages were
        // issued, the same on every rank, so every rank issues its collectives in one order.
        step_newest_first(earlier);
        earlier.clear();
        issue_pending();
      }
      if (plan->job && !plan->job->result->completed()) {
        finish_all();  // decodes that wait on this thread (nothing is left to issue here)
      }
      if (plan->job) {
        // Stage 0 overwrites what the previous decode read (the wire row, the flag, the
        // residual). On CUDA that decode ran on a pool stream and its future completed at
        // once: wait() makes this stream wait for its events (no host wait once completed).
        wait_future(plan->job->result);
      } else if (plan->previous) {
        wait_future(plan->previous);  // the same, for the Python path's last decode
        plan->previous.reset();
      }
      job->plan = plan;
      job->bucket = buffer;
      job->same_buffer = buffer.is_same(plan->buffer);
      job->order = ++submitted_;
      std::vector<c10::Device> devices;
      if (buffer.is_cuda()) {
        devices.push_back(buffer.device());
      }
      if (python) {
        if (job->same_buffer) {
          job->value = plan->python_value;
        } else {
          py::gil_scoped_acquire gil;
          job->value = torch::jit::toIValue(py::cast(buffer), c10::PyObjectType::get());
        }
        job->result = c10::make_intrusive<Future>(c10::PyObjectType::get(), devices);
      } else {
        job->value = buffer;
        job->result = c10::make_intrusive<Future>(c10::TensorType::get(), devices);
      }
      plan->job = job;
      ++plan->runs;
      step(job);
    }, &earlier);
    guarded([&] {
      step_newest_first(earlier);  // as the Python pipeline steps them
      earlier.clear();
      poll();
      if (bucket.isLast()) {
        finish_all();
      } else if (!pending_.empty() || !completing_.empty()) {
        finish_by_end_of_backward();
      }
    });
    return job->result;
  }

  // The Python pipeline of the same state failed (a bucket reduced there): refuse further
  // work too, as it does. Its collectives and this runner's are one sequence on every rank.
  // `in_callback`: a decode failed in a completion callback, which may run on a backend's
  // thread (Gloo with CUDA tensors) while the hook's thread steps this runner: only refuse().
  // Every job in pending_ or completing_ is its plan's latest (run() issues and finishes a
  // plan's job before it makes the next), so each fails all the same; the hook's thread steps
  // none of them again (run(), flush() and the end-of-backward callback check first).
  void fail_with(const std::string& why, bool in_callback) {
    auto error = std::make_exception_ptr(std::runtime_error(why));
    if (in_callback) {
      refuse(error);
    } else {
      fail(error);
    }
  }

  // Issue everything pending and wait for every reduction started here. On CUDA the current
  // stream is then ordered after every decode: those of completed futures too, which ran on
  // streams of their own (each plan's latest; earlier ones were waited for by the next).
  void flush() {
    check();
    guarded([&] { finish_all(); });
    std::vector<c10::intrusive_ptr<Future>> results;
    {
      std::lock_guard<std::mutex> lock(mu_);
      results.swap(in_flight_);
      for (auto& [key, plan] : plans_) {
        if (plan->job && plan->job->result) {
          results.push_back(plan->job->result);
        }
      }
    }
    for (auto& r : results) {
      wait_future(r);
    }
    check();
  }

  // Tests plant these defects to prove that the simulated NCCL catches them.
  static constexpr int kNoWaitBeforeLaterStage = 1;  // read a collective's output unwaited
  static constexpr int kDecodeAtOnce = 2;  // decode when issued, not when the output is ready

  // Run later stages on `stream` (the Python pipeline's side stream, fastddp's own) rather
  // than on one of torch's pool, whose streams the completion callbacks take in turn.
  void use_side_stream(c10::Stream stream) {
    given_side_ = stream;
  }

  void plant_defect(int defect) {
    defect_ = defect;
  }

  bool busy() {
    std::lock_guard<std::mutex> lock(mu_);
    prune();
    return !pending_.empty() || !in_flight_.empty();
  }

 private:
  static std::vector<Call> calls_of(const py::list& calls, const at::Tensor& buffer) {
    std::vector<Call> out;
    for (const auto& c : calls) {
      auto t = c.cast<py::tuple>();
      auto name = t[0].cast<std::string>();
      auto overload = t[1].cast<std::string>();
      auto args = t[2].cast<py::tuple>();
      auto kwargs = t[3].cast<py::dict>();
      Call call{c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str()),
                {}, {}};
      const auto& schema = call.op.schema();
      const auto& params = schema.arguments();
      TORCH_CHECK(args.size() <= params.size(), "fastddp: too many arguments for ", name);
      for (size_t i = 0; i < params.size(); ++i) {
        const auto& p = params[i];
        py::object value;
        if (i < args.size()) {
          value = args[i];
        } else if (kwargs.contains(p.name().c_str())) {
          value = kwargs[p.name().c_str()];
        } else {
          TORCH_CHECK(p.default_value().has_value(), "fastddp: ", name, " needs ", p.name());
          call.args.push_back(*p.default_value());
          continue;
        }
        c10::IValue iv = torch::jit::toIValue(value, p.type());
        if (iv.isTensor() && views_storage(iv.toTensor(), buffer)) {
          call.views.push_back(view_of(call.args.size(), iv.toTensor(), buffer));
        }
        call.args.push_back(std::move(iv));
      }
      out.push_back(std::move(call));
    }
    return out;
  }

  static Collective collective_of(const py::tuple& t, const at::Tensor& buffer) {
    Collective c;
    auto kind = t[0].cast<std::string>();
    if (kind == "allreduce") {
      c.kind = Kind::kAllReduce;
    } else if (kind == "alltoall") {
      c.kind = Kind::kAllToAll;
    } else if (kind == "allgather") {
      c.kind = Kind::kAllGather;
    } else {
      TORCH_CHECK(false, "fastddp: unknown collective ", kind);
    }
    c.weak_group = c10::weak_intrusive_ptr<c10d::ProcessGroup>(
        t[1].cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
    c.out = t[2].cast<at::Tensor>();
    c.in = t[3].is_none() ? c.out : t[3].cast<at::Tensor>();
    if (!t[4].is_none()) {
      c.out_splits = t[4].cast<std::vector<int64_t>>();
    }
    if (!t[5].is_none()) {
      c.in_splits = t[5].cast<std::vector<int64_t>>();
    }
    if (!t[6].is_none()) {
      c.python_group = held(py::module_::import("weakref").attr("ref")(t[6]));
    }
    if (views_storage(c.out, buffer)) {
      c.views.push_back(view_of(0, c.out, buffer));
    }
    if (views_storage(c.in, buffer)) {
      c.views.push_back(view_of(1, c.in, buffer));
    }
    return c;
  }

  void check() {
    std::lock_guard<std::mutex> lock(mu_);
    TORCH_CHECK(
        failure_.empty(),
        "fastddp: an earlier reduction failed on this rank (",
        failure_,
        "); the ranks' collectives no longer match, so this CompressState refuses further "
        "work. Fix the cause and restart the job (a checkpointed state_dict() can be loaded "
        "into a new state)");
  }

  // Run `fn`; on failure, fail every unfinished job, then rethrow. The next stages of the jobs
  // of `earlier` (pending before the bucket `fn` starts) are issued first, as Python's
  // pipeline issues them: the other ranks issue them too, whatever failed here alone.
  template <typename Fn>
  void guarded(Fn&& fn, std::vector<std::shared_ptr<Job>>* earlier = nullptr) {
    try {
      fn();
    } catch (const std::exception& e) {
      if (earlier != nullptr) {
        try {
          step_newest_first(*earlier);
        } catch (const std::exception&) {
          // the first failure is the one to report
        }
        earlier->clear();
      }
      fail(std::current_exception());
      throw;
    }
  }

  // The next stage of each of `jobs`, the newest (last submitted) first, as the Python
  // pipeline orders them: a young job's quick collective is issued before this thread waits
  // for an older job's slow one. The order depends only on the submissions, alike on every
  // rank.
  void step_newest_first(std::vector<std::shared_ptr<Job>> jobs) {
    std::stable_sort(jobs.begin(), jobs.end(), [](const auto& a, const auto& b) {
      return a->order > b->order;
    });
    for (const auto& job : jobs) {
      step(job);
    }
  }

  // On the thread that calls the hook.
  void fail(const std::exception_ptr& error) {
    std::vector<std::shared_ptr<Job>> jobs(pending_.begin(), pending_.end());
    jobs.insert(jobs.end(), completing_.begin(), completing_.end());
    pending_.clear();
    completing_.clear();
    refuse(error, std::move(jobs));
  }

  // Record the first failure and fail `jobs` and each plan's latest job, touching nothing
  // but what mu_ guards: on any thread.
  void refuse(const std::exception_ptr& error, std::vector<std::shared_ptr<Job>> jobs = {}) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failure_.empty()) {
        failure_ = describe(error);
      }
      // Each plan's latest: the job that was being stepped, and those set aside to step after
      // it, are in neither list. Nothing may wait for them forever (remove(), flush()).
      for (auto& [key, plan] : plans_) {
        if (plan->job) {
          jobs.push_back(plan->job);
        }
      }
    }
    for (auto& job : jobs) {
      if (job->result && !job->result->completed()) {
        job->result->setErrorIfNeeded(std::make_exception_ptr(
            std::runtime_error("fastddp: reduction abandoned: " + describe(error))));
      }
    }
  }

  // Run `job`'s next stage: its calls, then its collective; complete it after the last.
  void step(const std::shared_ptr<Job>& job) {
    const Stage& stage = job->plan->stages[job->stage];
    if (job->stage == 0) {
      for (const auto& call : stage.calls) {
        call.run(job->bucket, job->same_buffer);
      }
      job->work = stage.collective.issue(job->bucket, job->same_buffer);
    } else {
      // A later stage reads the previous collective's output; on CUDA it runs on a side
      // stream that waits for that collective, so the compute stream never stalls.
      c10::OptionalStreamGuard guard;
      if (job->bucket.is_cuda()) {
        guard.reset_stream(side_stream(job->bucket.device()));
      }
      if (defect_ != kNoWaitBeforeLaterStage) {
        wait_work(job->work);
      }
      for (const auto& call : stage.calls) {
        call.run(job->bucket, job->same_buffer);
      }
      job->work = stage.collective.issue(job->bucket, job->same_buffer);
    }
    ++job->stage;
    if (job->stage < job->plan->stages.size()) {
      pending_.push_back(job);
      return;
    }
    complete_after(job);
  }

  // Decode into the bucket once the last collective's output can be read, then complete.
  void complete_after(const std::shared_ptr<Job>& job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      prune();
      in_flight_.push_back(job->result);
    }
    if (job->plan->on_caller && defect_ != kDecodeAtOnce) {
      completing_.push_back(job);
      return;
    }
    auto work = job->work;
    auto fut = work->getFuture();
    if (defect_ == kDecodeAtOnce) {
      for (const auto& call : job->plan->finish) {
        call.run(job->bucket, job->same_buffer);
      }
      job->result->markCompleted(job->value);
      return;
    }
    fut->addCallback([self = shared_from_this(), job, work](Future& done) {
      try {
        if (done.hasError()) {
          std::rethrow_exception(done.exception_ptr());
        }
        // The callback's streams wait for the future's CUDA events, which is all NCCL needs.
        if (job->plan->wait_in_callback) {
          work->wait();
        }
        for (const auto& call : job->plan->finish) {
          call.run(job->bucket, job->same_buffer);
        }
        std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> storages;
        if (job->bucket.is_cuda()) {
          storages.push_back(job->bucket.storage().getWeakStorageImpl());
        }
        job->result->markCompleted(job->value, std::move(storages));
      } catch (const std::exception&) {
        auto error = std::current_exception();
        {
          std::lock_guard<std::mutex> lock(self->mu_);
          if (self->failure_.empty()) {
            self->failure_ = describe(error);
          }
        }
        job->result->setErrorIfNeeded(error);
      }
    });
  }

  // Decode a job whose last collective was issued on this thread, once it is done.
  void complete(const std::shared_ptr<Job>& job) {
    try {
      wait_work(job->work);  // rethrows a failed collective
      for (const auto& call : job->plan->finish) {
        call.run(job->bucket, job->same_buffer);
      }
    } catch (const std::exception&) {
      job->result->setErrorIfNeeded(std::current_exception());
      throw;
    }
    job->result->markCompleted(job->value);
  }

  // Complete the jobs whose collectives are done, in order.
  void poll() {
    while (!completing_.empty() && completing_.front()->work->isCompleted()) {
      auto job = completing_.front();
      completing_.pop_front();
      complete(job);
    }
  }

  // Issue every pending stage and complete every job waiting on this thread.
  void finish_all() {
    issue_pending();
    while (!completing_.empty()) {
      auto job = completing_.front();
      completing_.pop_front();
      complete(job);
    }
  }

  void issue_pending() {
    while (!pending_.empty()) {
      std::vector<std::shared_ptr<Job>> jobs(pending_.begin(), pending_.end());
      pending_.clear();
      step_newest_first(std::move(jobs));
    }
  }

  // If the bucket DDP marks last never reaches the hook, nothing else would issue the stages
  // left: do it at the end of this backward pass (before DDP's own end-of-backward callback,
  // which DDP queues only after the last bucket).
  void finish_by_end_of_backward() {
    const int task = torch::autograd::get_current_graph_task_id();
    if (task == -1) {
      finish_all();  // not in a backward pass: nothing would come back for them
      return;
    }
    if (task == graph_task_) {
      return;
    }
    graph_task_ = task;
    torch::autograd::Engine::get_default_engine().queue_callback([self = shared_from_this()] {
      self->graph_task_ = -1;
      bool failed;
      {
        std::lock_guard<std::mutex> lock(self->mu_);
        failed = !self->failure_.empty();
      }
      if (!failed) {
        self->guarded([&] { self->finish_all(); });
      }
    });
  }

  c10::Stream side_stream(c10::Device device) {
    if (given_side_ && given_side_->device() == device) {
      return *given_side_;
    }
    if (!side_ || side_->device() != device) {
      c10::impl::VirtualGuardImpl impl(device.type());
      side_ = impl.getStreamFromGlobalPool(device);
    }
    return *side_;
  }

  void prune() {  // with mu_ held
    std::vector<c10::intrusive_ptr<Future>> left;
    for (auto& r : in_flight_) {
      if (!r->completed()) {
        left.push_back(r);
      }
    }
    in_flight_.swap(left);
  }

  std::mutex mu_;  // plans_, in_flight_ and failure_: completion callbacks run on other threads
  std::unordered_map<c10::TensorImpl*, std::shared_ptr<Plan>> plans_;
  std::deque<std::shared_ptr<Job>> pending_;  // jobs with stages left (stepped by `order`)
  std::deque<std::shared_ptr<Job>> completing_;  // on_caller jobs whose last collective runs
  std::vector<c10::intrusive_ptr<Future>> in_flight_;
  std::string failure_;
  int64_t submitted_ = 0;
  int graph_task_ = -1;
  std::optional<c10::Stream> side_;
  std::optional<c10::Stream> given_side_;  // the Python pipeline's (use_side_stream)
  int defect_ = 0;
};

// The hook fastddp.register_comm_hook registers for a fixed mode: the runner's plans without
// the GIL, and Python's compress_hook for any bucket it declines.
class NativeHook final : public c10d::CommHookInterface {
 public:
  NativeHook(std::shared_ptr<Runner> runner, py::object state, py::object hook)
      : runner_(std::move(runner)), python_(std::move(state), std::move(hook)) {}

  c10::intrusive_ptr<Future> runHook(c10d::GradBucket& bucket) override {
    auto result = runner_->run(bucket, /*python=*/false);
    if (result) {
      return result;
    }
    return python_.runHook(bucket);  // takes the GIL itself
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return hook_result(result);
  }

 private:
  std::shared_ptr<Runner> runner_;
  c10d::PythonCommHook python_;
};

}  // namespace

// Add the native runner's names to the _C module (from add_ddp_hooks, switch_hook.cpp).
void define_native_hook(py::module_& m) {
  py::class_<Runner, std::shared_ptr<Runner>>(m, "NativeRunner")
      .def(py::init<>())
      .def("add", &Runner::add, py::arg("id"), py::arg("buffer"), py::arg("stages"),
           py::arg("finish"), py::arg("wait_in_callback"), py::arg("on_caller"),
           py::arg("previous") = py::none())
      .def("remove", &Runner::remove, py::arg("buffer"))
      .def("take_runs", &Runner::take_runs)
      .def("fail", &Runner::fail_with, py::arg("why"), py::arg("in_callback") = false)
      .def("flush", &Runner::flush, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("busy", &Runner::busy)
      .def("use_side_stream", &Runner::use_side_stream, py::arg("stream"))
      .def("_plant_defect", &Runner::plant_defect, py::arg("defect"))
      .def("__len__", &Runner::size)
      .def(
          "run",
          [](Runner& self, const py::object& bucket) -> py::object {
            // Anything but a GradBucket (compiled DDP passes pairs) is left to Python.
            if (!py::isinstance<c10d::GradBucket>(bucket)) {
              return py::none();
            }
            auto& grad_bucket = bucket.cast<c10d::GradBucket&>();
            c10::intrusive_ptr<Future> result;
            {
              py::gil_scoped_release no_gil;
              result = self.run(grad_bucket, /*python=*/true);
            }
            if (!result) {
              return py::none();
            }
            return torch::jit::toPyObject(c10::IValue(std::move(result)));
          },
          py::arg("bucket"));
  m.def(
      "register_native_hook",
      [](const std::shared_ptr<c10d::Reducer>& reducer, std::shared_ptr<Runner> runner,
         py::object state, py::object hook) {
        reducer->register_comm_hook(
            std::make_unique<NativeHook>(std::move(runner), std::move(state), std::move(hook)));
      },
      py::arg("reducer"), py::arg("runner"), py::arg("state"), py::arg("hook"));
}

}  // namespace fastddp::ddp
