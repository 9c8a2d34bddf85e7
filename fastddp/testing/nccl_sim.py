"""A process group with NCCL's completion order, over Gloo, on CPU tensors (tests only).

NCCL returns from a collective call once the work is *enqueued*: its ``Work``'s future is
complete at once, and the output holds the result only after the reader's stream has waited for
the collective's events. Code that is right on Gloo (whose futures complete after the
collective) can race there. This backend makes such races visible on a machine without a GPU:

- every collective's future is complete when it returns, as NCCL's;
- its outputs are *poisoned* (every byte ``0xFF``: NaN in every float format) until the
  consumer waits for it: ``Work.wait()`` (a stream wait on NCCL), or a callback hung on the
  future through the runtime (whose stream waits for the future's events on NCCL);
- the real result is computed by Gloo on a background thread, one per group, in issue order,
  from the inputs as they were when the collective was enqueued (NCCL's stream reads them in
  stream order), and copied into the outputs at the wait;
- an input written, or an output touched, between the call and the wait is a race on NCCL:
  the wait raises :class:`SimRace` naming the collective.

The pipeline's runtime for this backend (:class:`~fastddp.testing.sim_streams.SimRuntime`)
behaves as the CUDA one, with notional streams (:mod:`fastddp.testing.sim_streams`): later
stages run on a side stream, whose writes the compute stream does not see until it is ordered
after them; a collective waited for on the side stream is real there only; completion is a
callback on the collective's future, run at once on a stream of its own, whose writes a reader
sees once ordered after it; host reads must be ordered after the side stream (``dirty``).

Use :func:`install` in every rank, then ``dist.new_group(backend=BACKEND)`` (or
``init_process_group(BACKEND)``).
"""

import atexit
import queue
import threading
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, Work

from fastddp.hooks import runtime as runtimes
from fastddp.testing.sim_streams import SimRace, SimRuntime, current, internal, poison, poisoned

__all__ = ["BACKEND", "SimRace", "SimNccl", "SimRuntime", "install"]

BACKEND = "fastddp_nccl_sim"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bit for bit where both are contiguous: poison read into an input is NaN, never equal.
    if a.is_contiguous() and b.is_contiguous() and a.dim() > 0:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _Collective:
    """One collective in flight: enqueued inputs, private results, and its outputs."""

    def __init__(self, name: str, inputs: list, outputs: list, run: Callable) -> None:
        self.name = name
        self.outputs = outputs
        # NCCL's stream reads the inputs in stream order: as they are now.
        self.snapshots = [t.clone() for t in inputs]
        # Inputs that are also outputs (in place) are checked through their poison instead.
        self.inputs = [t for t in inputs if not any(_shares(t, o) for o in outputs)]
        self.results = [torch.empty_like(o) for o in outputs]
        self.run = run
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.copied = False
        # The stream it was issued from, and that stream's clock: NCCL's stream waits for that
        # stream's work so far, and whoever waits for the collective then waits for it too.
        self.stream = current()
        self.tick = self.stream.clock if self.stream is not None else 0
        self.landed_on = None  # the side stream that waited for it, where one did
        for t in outputs:
            poison(t)


def _order(stream, other, upto=None, tensors=()) -> None:
    """Order ``stream`` (None: the compute stream) after ``other``'s writes up to its clock
    ``upto`` (all if None), and after its writes of ``tensors``."""
    if stream is None:
        other.land(upto, tensors)
    else:
        stream.adopt(other, upto, tensors)


class SimWork(Work):
    """NCCL-like work: its future is complete at once; :meth:`wait` makes the output real."""

    def __init__(self, coll: _Collective, pg: "SimNccl") -> None:
        super().__init__()
        self._coll = coll
        self._pg = pg
        self._future = torch.futures.Future()
        self._future.set_result(coll.outputs)

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # On NCCL a stream wait: the output is real for the stream that waits (current()).
        self._pg._land(self._coll, current())
        return True

    def is_completed(self) -> bool:
        # NCCL's answers whether the device finished; the output is then in memory.
        if not self._coll.done.is_set():
            return False
        self._pg._land(self._coll, current())
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future


class SimNccl(dist.ProcessGroup):
    """The simulated-NCCL group over a Gloo backend (see the module docstring)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("sim-gloo", store), rank, size, timeout)
        self._timeout = timeout
        self._queue: queue.Queue[Optional[_Collective]] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="nccl-sim")
        self._thread.start()
        # A thread still inside Gloo at interpreter exit aborts the process.
        atexit.register(self.shutdown)
        self.collectives = 0  # issued, for tests

    def getBackendName(self) -> str:
        return BACKEND

    def _serve(self) -> None:
        while True:
            coll = self._queue.get()
            if coll is None:
                return
            try:
                coll.run(coll.snapshots, coll.results).wait()
            except BaseException as e:  # handed to the waiter
                coll.error = e
            coll.done.set()
            del coll  # (held while the next wait blocks, it would keep its streams' tensors)

    def _issue(self, name: str, inputs: list, outputs: list, run: Callable) -> SimWork:
        with internal():
            coll = _Collective(name, inputs, outputs, run)
        self.collectives += 1
        self._queue.put(coll)
        return SimWork(coll, self)

    def _land(self, coll: _Collective, stream) -> None:
        """Make ``coll``'s output real for ``stream`` (a side stream; None: the compute one)."""
        if coll.stream is not None and coll.stream is not stream:
            _order(stream, coll.stream, upto=coll.tick)  # the issuer's work before the issue
        if coll.landed_on is not None and coll.landed_on is not stream:
            _order(stream, coll.landed_on, tensors=coll.outputs)  # another stream waited first
        if coll.copied:
            return
        if not coll.done.wait(self._timeout.total_seconds()):
            raise RuntimeError(f"nccl-sim: {coll.name} did not finish within the group timeout")
        if coll.error is not None:
            raise coll.error
        for t, snap in zip(coll.inputs, coll.snapshots):
            if not _same(t, snap):
                raise SimRace(
                    f"nccl-sim: an input of {coll.name} was written before the collective was "
                    "waited for (on NCCL its stream may still be reading it)"
                )
        for t in coll.outputs:
            if not poisoned(t):
                raise SimRace(
                    f"nccl-sim: an output of {coll.name} was written before the collective was "
                    "waited for (on NCCL its stream may still be writing it)"
                )
        with internal():
            for t, r in zip(coll.outputs, coll.results):
                t.copy_(r)
        coll.copied = True
        if stream is not None:
            # Real for this side stream only: the compute stream waits on its own.
            for t in coll.outputs:
                stream.wrote(t, coll.name)
            coll.landed_on = stream

    # -- the collectives fastddp and DDP issue ------------------------------------------------

    def allreduce(self, tensors, opts=None):
        opts = opts or dist.AllreduceOptions()

        def run(ins, outs):
            for o, i in zip(outs, ins):
                o.copy_(i)
            return self._gloo.allreduce(outs, opts)

        return self._issue("all_reduce", tensors, tensors, run)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        opts = opts or dist.AllToAllOptions()
        outs, ins = list(output_split_sizes or []), list(input_split_sizes or [])

        def run(i, o):
            return self._gloo.alltoall_base(o[0], i[0], outs, ins, opts)

        return self._issue("all_to_all_single", [input], [output], run)

    def all_gather_single(self, output, input, opts=None):
        opts = opts or AllgatherOptions()
        return self._issue(
            "all_gather_single",
            [input],
            [output],
            lambda i, o: self._gloo._allgather_base(o[0], i[0], opts),
        )

    def reduce_scatter_single(self, output, input, opts=None):
        opts = opts or dist.ReduceScatterOptions()
        return self._issue(
            "reduce_scatter_single",
            [input],
            [output],
            lambda i, o: self._gloo._reduce_scatter_base(o[0], i[0], opts),
        )

    # The names torch 2.11's collectives call (its all_to_all_single, all_gather_into_tensor and
    # reduce_scatter_tensor); later releases call the ones above.
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts)

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts)

    def allgather(self, output_lists, inputs, opts=None):
        opts = opts or AllgatherOptions()
        flat = list(output_lists[0])
        n = len(flat)

        def run(i, o):
            return self._gloo.allgather([o], i, opts)

        return self._issue("all_gather", inputs, flat, run) if n else None

    def broadcast(self, tensors, opts=None):
        opts = opts or dist.BroadcastOptions()

        def run(ins, outs):
            for o, i in zip(outs, ins):
                o.copy_(i)
            return self._gloo.broadcast(outs, opts)

        return self._issue("broadcast", tensors, tensors, run)

    def barrier(self, opts=None):
        return self._gloo.barrier(opts or dist.BarrierOptions())

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=self._timeout.total_seconds())


def _create(store, rank: int, size: int, timeout: timedelta) -> SimNccl:
    return SimNccl(store, rank, size, timeout)


def install() -> None:
    """Register the backend and its pipeline runtime (once per process)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
    runtimes.register(BACKEND, SimRuntime)
