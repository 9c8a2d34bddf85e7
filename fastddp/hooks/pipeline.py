"""The pipeline: when each stage of a reduction runs, and how its result future completes.

Rules, in one place:

- Collectives are issued only from the thread that calls the hook, in call order, so every
  rank issues them in the same order.
- A path's first stage runs in the call that submits the bucket. Later stages of bucket k run
  at the next submission, right after bucket k + 1's first stage (so that bucket k's all-to-all
  overlaps the backward pass until bucket k + 1 is ready, and bucket k + 1's is on the wire
  while this thread waits for bucket k's); everything still pending runs when a bucket with
  ``is_last`` arrives, when :meth:`Pipeline.flush` is called, or at the end of the backward
  pass that submitted it.
- With ``delay=1`` (``submit(..., defer=True)``) nothing is finished at ``is_last`` or at the
  end of the backward pass: later submissions step the jobs, and a bucket's previous job is
  settled when that bucket comes back, a step later (``delay.py``).
- Pending jobs take their next stage newest first: a young job's next collective (behind a
  quick one, an intra-node exchange say) is issued before this thread waits for an older job's
  slower one, so the slow link never idles while this thread waits. The order depends only on
  the order of submissions, so it is the same on every rank.
- Pending stages run even when the new bucket fails on this rank alone (out of memory, say), so
  that this rank still issues every collective the other ranks issue.
- Completion (decoding into the bucket, then the result future) follows the last collective,
  in the way the job's device runtime (``runtime.py``) orders it: on CUDA, a ``then``
  callback of that collective's own future, whose stream waits for the collective's CUDA
  events (NCCL completes futures when work is enqueued, so nothing else is safe); on CPU, the
  calling thread, once ``Work.wait()`` returns. With CPU tensors no fastddp callback runs on a
  Gloo thread, so none can be left for one to run at interpreter exit (Gloo with CUDA tensors
  runs the ``then`` callback on its own thread).
- :meth:`Pipeline.flush` leaves the current stream ordered after everything queued, the
  decodes in callbacks included (their results' events): host reads see finished values.
- After a failure every later call raises the same error: the ranks' collectives no longer
  match, and carrying on would hang or mix payloads.
"""

import contextlib
import time
import warnings
from collections import deque
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.autograd import Variable

from fastddp.hooks.job import Job
from fastddp.hooks.paths import issue
from fastddp.hooks.runtime import Runtime, runtime_for

__all__ = ["Pipeline", "PipelineFailed"]


class PipelineFailed(RuntimeError):
    """A reduction failed earlier on this rank; the state cannot be used further."""


class Pipeline:
    """Runs jobs' stages and completes their futures by the rules in the module docstring."""

    __slots__ = (
        "_pending",
        "_earlier",
        "_completing",
        "_in_flight",
        "_failure",
        "_graph_task",
        "_runtimes",
        "_submitted",
        "waited",
        "on_issue",
        "on_fail",
    )

    def __init__(self) -> None:
        self._pending: deque[Job] = deque()  # jobs with stages left, oldest first
        self._earlier: list[Job] = []  # pending jobs set aside while a new bucket starts
        self._completing: deque[Job] = deque()  # CPU jobs whose last collective is in flight
        # Asynchronous jobs whose decode no reader here has waited for yet, in submission order
        # (a dict: settle() takes one out per bucket): flush() waits for them.
        self._in_flight: dict[Job, None] = {}
        self._failure: Optional[BaseException] = None
        self._graph_task = -1
        self._runtimes: dict[tuple, Runtime] = {}
        self._submitted = 0
        self.waited = 0.0  # seconds this thread blocked on collectives (``dtype="auto"`` reads it)
        # Called as on_issue(job, stage, began) once a stage's collective is issued, with the
        # time just before it was (``dtype="auto"`` times the collectives of its measured steps).
        self.on_issue: Optional[Callable[[Job, int, float], None]] = None
        # Called as on_fail(message, in_callback) at the first failure: the state's native
        # runner, whose collectives and these are one sequence, refuses further work too.
        # in_callback: from a completion callback, maybe on a backend's thread.
        self.on_fail: Optional[Callable[[str, bool], None]] = None

    def check(self) -> None:
        """Raise if an earlier reduction failed."""
        if self._failure is not None:
            raise PipelineFailed(
                "fastddp: an earlier reduction failed on this rank "
                f"({type(self._failure).__name__}: {self._failure}); the ranks' collectives no "
                "longer match, so this CompressState refuses further work. Fix the cause and "
                "restart the job (a checkpointed state_dict() can be loaded into a new state)"
            )

    def guarded(self, fn: Callable[[], None]) -> None:
        """Run ``fn``; on failure, fail every unfinished job and the pipeline, then re-raise."""
        try:
            fn()
        except BaseException as e:
            self._fail(e)
            raise

    def submit(
        self, start: Callable[[], Optional[Job]], is_last: bool, defer: bool = False
    ) -> None:
        """Start a new bucket with ``start`` (which returns its job, or None if there is nothing
        to send), then run the next stage of every job that was pending before it; finish
        everything if ``is_last``. ``defer`` (``delay=1``): leave jobs pending past the end of
        the backward pass; later submissions and :meth:`settle` run them."""
        self._earlier = list(self._pending)
        self._pending.clear()
        try:
            job = start()
            if job is not None:
                job.runtime, job.deferred = self._runtime_of(job), defer
                self._submitted += 1
                job.order = self._submitted
                self._step(job)
        except BaseException as e:
            with contextlib.suppress(BaseException):
                self._run_earlier()  # issue them anyway: the other ranks do
            self._fail(e)
            raise
        self.guarded(self._run_earlier)
        self.guarded(self._poll)
        if defer:
            return
        if is_last:
            self.flush()
        elif self._pending or self._completing:
            self._finish_by_end_of_backward()

    def _run_earlier(self) -> None:
        earlier, self._earlier = self._earlier, []
        for job in sorted(earlier, key=lambda j: -j.order):
            self._step(job)

    def flush(self) -> None:
        """Run every pending stage and wait for every reduction to complete."""
        # Guarded wherever it is called from (the end of the backward pass, state.flush()):
        # a collective or decode failing here fails the state, as in a step.
        self.guarded(self._flush)

    def _flush(self) -> None:
        while self._pending:
            self._earlier = list(self._pending)
            self._pending.clear()
            self._run_earlier()
        while self._completing:
            self._complete(self._completing.popleft())
        # On CUDA each decode ran in a callback, on a stream of torch's pool: the side
        # stream's wait below does not cover it, its result's events do.
        in_flight, self._in_flight = self._in_flight, {}
        for job in in_flight:
            job.runtime.wait_result(job.result)
        self.synchronize()

    def drain(self, jobs) -> None:
        """Before this pipeline is dropped: finish ``jobs`` (reductions still in flight, as
        delay=1 leaves them) and every pending stage, and order the current stream after all
        of it. On CUDA the buffers they use may otherwise go back to the allocator while a
        collective or a decode still writes them. Nothing after a failure."""
        if self._failure is not None:
            return

        def finish() -> None:
            for job in jobs:
                self.settle(job)
            self.flush()

        self.guarded(finish)  # a collective failing here fails the state, as in a step

    def synchronize(self) -> None:
        """Order the current stream after all queued work (before reading results on the host)."""
        for runtime in self._runtimes.values():
            runtime.synchronize()

    def is_pending(self, job: Optional[Job]) -> bool:
        """Whether stages of ``job`` have yet to run."""
        return job is not None and (job in self._pending or job in self._earlier)

    def settle(self, job: Optional[Job]) -> None:
        """Make ``job`` (a slot's previous reduction) finished before its buffers are reused.

        Pending jobs step as in :meth:`flush` (every rank alike), until ``job`` has no stage
        left; jobs completed before it (in order) and it are completed, later ones are left.
        """
        if job is None:
            return
        if job in self._earlier:
            self._run_earlier()  # before this bucket's own first stage, on every rank alike
        while job in self._pending:
            self._earlier = list(self._pending)
            self._pending.clear()
            self._run_earlier()
        while job in self._completing:
            self._complete(self._completing.popleft())
        job.runtime.wait_result(job.result)  # on CUDA: the current stream waits for its decode
        self._in_flight.pop(job, None)

    # -- internals ------------------------------------------------------------------------

    def _runtime_of(self, job: Job) -> Runtime:
        group = job.groups[0]
        key = (job.bucket.device, dist.get_backend(group))
        runtime = self._runtimes.get(key)
        if runtime is None:
            runtime = self._runtimes[key] = runtime_for(job.bucket.device, group)
        return runtime

    def _step(self, job: Job) -> None:
        runtime = job.runtime
        if job.stage > 0:
            # A later stage reads what the previous collective wrote. On CUDA it runs on a
            # side stream that waits for that collective, so the compute stream never stalls.
            with runtime.side():
                self._wait(runtime, job.work)
                self._issue(job)
        else:
            self._issue(job)
        job.stage += 1
        if not job.started_all:
            self._pending.append(job)
        elif runtime.asynchronous:
            runtime.then(job.work, lambda fut, job=job: self._complete_async(job, fut))
            self._in_flight[job] = None
        else:
            self._completing.append(job)

    def _issue(self, job: Job) -> None:
        collective, on_issue = job.path.stage(job, job.stage), self.on_issue
        # Timed from before issue(): a small collective may complete before it returns.
        began = 0.0 if on_issue is None else time.perf_counter()
        job.work = issue(collective)
        if on_issue is not None:
            on_issue(job, job.stage, began)

    def _wait(self, runtime: Runtime, work: dist.Work) -> None:
        began = time.perf_counter()
        try:
            runtime.wait(work)
        finally:
            self.waited += time.perf_counter() - began

    def _complete_async(self, job: Job, fut: torch.futures.Future) -> None:
        # Runs once the collective's output can be read (on CUDA, with the current stream
        # waiting on its events; for NCCL at once, on the calling thread).
        try:
            fut.value()  # re-raises a failed collective
            job.path.finish(job)
            if job.deferred:  # the bucket is the state's, which may be dropped meanwhile
                job.runtime.hold((job.bucket,))
            job.result.set_result(job.bucket)
        except Exception as e:
            job.result.set_exception(e)
            # The runner is told now: it takes the next planned bucket without asking here.
            # (This may run on a backend's thread: the job lists, the calling thread's, are
            # left to it; its next call refuses.)
            self._record(e, in_callback=True)

    def _poll(self) -> None:
        while self._completing and self._completing[0].runtime.ready(self._completing[0].work):
            self._complete(self._completing.popleft())

    def _complete(self, job: Job) -> None:
        try:
            self._wait(job.runtime, job.work)  # re-raises a failed collective
            job.path.finish(job)
        except Exception as e:
            job.result.set_exception(e)
            self._fail(e)
            raise
        job.result.set_result(job.bucket)

    def _record(self, error: BaseException, in_callback: bool = False) -> None:
        if self._failure is None and self.on_fail is not None:
            self.on_fail(f"{type(error).__name__}: {error}", in_callback)
        self._failure = self._failure or error

    def _fail(self, error: BaseException) -> None:
        self._record(error)
        for job in (*self._pending, *self._earlier, *self._completing):
            if not job.result.done():
                job.result.set_exception(RuntimeError(f"fastddp: reduction abandoned: {error}"))
        self._pending.clear()
        self._earlier.clear()
        self._completing.clear()
        self._in_flight.clear()

    def _finish_by_end_of_backward(self) -> None:
        # DDP waits for every bucket's future at the end of backward. If the bucket marked
        # is_last never reaches this hook (a user hook may send it elsewhere), nothing else would
        # run the pending stages: queue a flush at the end of this backward pass. It runs before
        # DDP's own end-of-backward callback, which DDP queues only after the last bucket.
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._graph_task:
            return
        if torch._C._current_autograd_node() is None:
            # Called from a callback at the end of the backward pass: DDP's first iteration
            # with static_graph=True reduces every bucket there (each named bucket 0, none
            # marked last), then waits for their futures, before any callback queued now.
            self.flush()
            return
        self._graph_task = task
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._graph_task = -1
        if self._failure is None:
            self.flush()


def warn_stale() -> None:
    warnings.warn(
        "fastddp: a bucket was reduced again while its previous reduction still had pending "
        "stages (the last bucket of the previous step never reached compress_hook with "
        "is_last); finished it now. Call state.flush() after a step whose last bucket bypasses "
        "the hook",
        stacklevel=4,
    )
