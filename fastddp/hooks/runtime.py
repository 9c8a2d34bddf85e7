"""The device runtime: how the pipeline orders work around collectives on one kind of device.

The pipeline (``pipeline.py``) decides *when* each stage of a reduction runs; a runtime decides
*how* the stage that reads a collective's output waits for it, how a job's completion follows
its last collective, and how host reads see the device's work. Three implementations:

- :class:`CpuRuntime` (Gloo, CPU tensors): nothing runs asynchronously but the collective, so
  waiting means blocking the calling thread on ``Work.wait()``, and completion is polled.
- :class:`CudaRuntime` (NCCL, or Gloo with CUDA tensors): later stages run on a side stream
  that waits for the collective's CUDA events, so the compute stream never stalls; completion
  is a ``then`` callback of the collective's own future, whose stream waits for those events
  (NCCL completes its futures when the work is *enqueued*, so nothing else is safe); host reads
  first make the current stream wait for the side streams.
- a simulated-NCCL runtime for tests (:mod:`fastddp.testing.nccl_sim`), registered for its
  backend with :func:`register`: NCCL's completion order on CPU tensors.
"""

import contextlib
import threading
from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp import _extension

__all__ = ["CpuRuntime", "CudaRuntime", "Runtime", "own_stream", "register", "runtime_for"]

_OWN_STREAMS: dict[tuple[int, Any], Any] = {}
_MAKING = threading.Lock()


def own_stream(device: torch.device, purpose: Any, high_priority: bool) -> "torch.cuda.Stream":
    """fastddp's own stream on ``device`` for ``purpose``, made once a process.

    Not one of torch's stream pools: torch hands their streams out in turn, and each ``then``
    callback takes the next of the low-priority pool, so a decode could land on a stream that
    also waits for a slow collective, and wait behind it.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _OWN_STREAMS.get((index, purpose))
    if stream is not None:
        return stream
    module = _extension.load()
    if not hasattr(module, "new_stream"):
        raise RuntimeError(
            "fastddp was built without CUDA, so it cannot reduce CUDA tensors; rebuild it "
            f"where nvcc is found (or with FORCE_CUDA=1): {_extension.REBUILD}"
        )
    with _MAKING:
        stream = _OWN_STREAMS.get((index, purpose))
        if stream is None:
            # torch's device guard, which makes no context on a device this process never used
            with torch.cuda.device(index):
                handle = module.new_stream(index, high_priority)
            stream = torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))
            _OWN_STREAMS[(index, purpose)] = stream
    return stream


class Runtime:
    """Primitives that order a pipeline's work on one device (see the module docstring).

    The pipeline decides which wait goes where; a runtime only says what a wait means here.
    ``asynchronous``: a job completes in a callback on its last collective's future
    (:meth:`then`); otherwise the pipeline waits on the calling thread once :meth:`ready`.
    """

    asynchronous = False
    # Whether the native runner (native.py) may run buckets of this runtime: its C++ waits
    # (Work::wait before reading a collective's output, completion in a callback of its
    # future) order work here as this runtime does.
    native = False
    # Whether a completion callback must call ``Work.wait()`` before it reads the output.
    waits_in_then = False

    def side(self) -> AbstractContextManager:
        """Where a later stage runs: off the compute stream, where there is one."""
        return contextlib.nullcontext()

    def wait(self, work: dist.Work) -> None:
        """Make what runs next here (the current stream on CUDA) wait for ``work``."""
        work.wait()

    def then(self, work: dist.Work, callback: Callable[[torch.futures.Future], None]) -> None:
        """Call ``callback(future)`` where ``work``'s output can be read (asynchronous only)."""
        raise TypeError(f"{type(self).__name__} completes jobs by waiting, not by callbacks")

    def ready(self, work: dist.Work) -> bool:
        """Whether ``work`` has finished (polled by synchronous runtimes)."""
        return work.is_completed()

    def wait_result(self, result: torch.futures.Future) -> None:
        """Make what runs next wait for a job's completion (its decode)."""
        result.wait()

    def synchronize(self) -> None:
        """Order the current stream after the side stream, before the host reads results."""

    def hold(self, tensors) -> None:
        """Keep ``tensors``' memory from reuse until the work queued so far on the current
        stream is done, should they be freed before (on CUDA the caching allocator hands a
        freed block out again at once, on the stream that made it)."""


class CpuRuntime(Runtime):
    """Gloo on CPU tensors: the calling thread waits; there is no other stream."""

    native = True


class CudaRuntime(Runtime):
    """CUDA tensors: a side stream per device for later stages, completion by ``then``.

    The side stream is fastddp's own (:func:`own_stream`), at the device's highest priority
    (the collectives wait for what it queues), one for each thread that issues stages:
    pipelines of one thread issue in one order on every rank, but two threads (the backward's
    hooks and DiLoCo's outer reduction) may interleave differently on each rank, and on one
    stream their waits could form a cycle across ranks.
    """

    asynchronous = True
    native = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._side: Optional[torch.cuda.Stream] = None

    def side_stream(self) -> "torch.cuda.Stream":
        if self._side is None:
            purpose = ("side", threading.get_ident())
            self._side = own_stream(self.device, purpose, high_priority=True)
        return self._side

    def side(self):
        return torch.cuda.stream(self.side_stream())

    def then(self, work, callback):
        # torch runs the callback with its stream waiting for the future's CUDA events.
        work.get_future().then(callback)

    def synchronize(self):
        if self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def hold(self, tensors):
        stream = torch.cuda.current_stream(self.device)
        for t in tensors:
            t.record_stream(stream)


_BY_BACKEND: dict[str, Callable[[torch.device], Runtime]] = {}


def register(backend: str, make: Callable[[torch.device], Runtime]) -> None:
    """Use ``make(device)`` as the runtime of CPU tensors on process groups of ``backend``."""
    _BY_BACKEND[backend] = make


def runtime_for(device: torch.device, group: Any) -> Runtime:
    """The runtime for tensors on ``device`` reduced over ``group``."""
    if device.type == "cuda":
        return CudaRuntime(device)
    make = _BY_BACKEND.get(dist.get_backend(group))
    return make(device) if make is not None else CpuRuntime()
