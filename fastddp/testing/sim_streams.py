"""Notional CUDA streams for the simulated NCCL backend (:mod:`fastddp.testing.nccl_sim`).

On CPU tensors every op runs when the host calls it, so no stream's work is ever late for
another stream's reader. This module hides what a stream wrote until the reader is ordered
after it, as a CUDA stream's kernels may not have run yet:

- the *compute* stream is the host: what it writes is visible at once;
- a :class:`SideStream` records the tensors its ops write (from the ops' schemas, by a
  dispatch mode) while it runs. While any other stream runs, those tensors are *poisoned*
  (every byte ``0xFF``: NaN in every float format, -1 in every int one) and their contents
  set aside; a stream sees them again once it is ordered after the writer;
- :meth:`SimRuntime.side` (the pipeline's later stages) runs on the runtime's side stream,
  and a completion callback (:meth:`SimRuntime.then`) at once, as torch runs it when the
  future is complete, but on a stream of its own (on CUDA, one from torch's pool that waits
  for the collective);
- the compute stream is ordered after a side stream by :meth:`SimRuntime.synchronize`, after
  a callback's stream by :meth:`SimRuntime.wait_result` on the result whose value it wrote,
  and after a stream's writes up to a collective by a wait for that collective (NCCL's stream
  waited for the issuing stream's work). A wait on a side stream (or in a callback) makes the
  collective's output, and what the issuer wrote before it, real for that stream only.

A hidden tensor written by another stream before it is ordered after the writer raises
:class:`SimRace` when the writer's contents come back; one read that early reads poison,
which the tests see in their results.

A tensor freed while a side stream's write to it is still hidden from the compute stream is
an *early free* (:func:`early_frees`): on CUDA the caching allocator hands its block to the
next tensor made on the stream that made it, while the writer's kernels may still run, unless
the writer's stream held it (:meth:`SimRuntime.hold`, ``record_stream`` on CUDA; a callback's
stream holds its collective's output, as torch's futures do).

What this cannot see: a side stream reads the host's latest values (so a side stream not
ordered after the compute stream's writes, or after a collective the compute stream waited
for, goes unnoticed); reads are not recorded, only writes (a buffer overwritten while a
stream may still read it is caught only through the values that come out, and one freed
while a stream may still read it not at all); a reader ordered after part of a stream's work
between two collectives is treated as ordered after all of it; the wait DDP (or any other
reader of a hook's future) makes on a result, from C++: a callback's writes land only at
:meth:`SimRuntime.wait_result`, so fastddp must wait for every result it hands out before
its own reads and before DDP's (the pipeline's ``flush()``, at the last bucket, does).
"""

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastddp.hooks import runtime as runtimes
from fastddp.testing.sim_lifetimes import Life, early_frees, track

__all__ = ["SideStream", "SimRace", "SimRuntime", "current", "early_frees", "internal"]


class SimRace(RuntimeError):
    """A buffer was used by one stream before it was ordered after another that uses it."""


def poison(t: torch.Tensor) -> None:
    """Fill ``t`` with bytes ``0xFF`` (NaN in every float format, -1 in every int format)."""
    if t.is_contiguous():
        t.view(torch.uint8).fill_(0xFF)
    else:
        t.fill_(float("nan") if t.is_floating_point() else -1)


def poisoned(t: torch.Tensor) -> bool:
    """Whether ``t`` holds only what :func:`poison` wrote."""
    if t.is_contiguous():
        return bool((t.view(torch.uint8) == 0xFF).all())
    return bool(t.isnan().all()) if t.is_floating_point() else bool((t == -1).all())


class _State(threading.local):
    def __init__(self) -> None:
        self.stream = None  # the side stream running now; None: the compute stream
        self.internal = 0  # > 0 while the simulator itself copies or poisons


_state = _State()


def current():
    """The side stream running now, or None for the compute stream."""
    return _state.stream


@contextlib.contextmanager
def internal():
    """The simulator's own copies and poisonings: no stream's writes."""
    _state.internal += 1
    try:
        yield
    finally:
        _state.internal -= 1


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _span(t: torch.Tensor) -> tuple:
    """The storage and the byte range of ``t``."""
    size = t.element_size()
    first = t.storage_offset() * size
    extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
    return t.untyped_storage().data_ptr(), first, first + extent * size


def _overlap(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class _Write:
    __slots__ = ("tensor", "tick", "value", "_life")

    def __init__(self, tensor: torch.Tensor, tick: int, held: set, by: str) -> None:
        self.tensor = tensor
        self.tick = tick  # the writing stream's clock at the write
        self.value = None  # the real contents while hidden (None while a stream that sees it runs)
        self._life = Life(tensor, held, by)
        track(tensor, self._life)

    @property
    def gone(self) -> bool:
        """Landed for the compute stream, or written over by its stream."""
        return not self._life.hidden

    @gone.setter
    def gone(self, value: bool) -> None:
        if value:
            self._life.seen()


class SideStream:
    """One notional stream off the compute stream: the writes it sees that the compute stream
    may not see yet (its own, and those of streams it was ordered after)."""

    def __init__(self) -> None:
        self.clock = 0
        self._writes: dict[tuple, _Write] = {}
        self.held: set[int] = set()  # pointers of the storages this stream holds

    def hold(self, tensors) -> None:
        """Hold ``tensors``' storages: freeing them waits for this stream's work."""
        self.held.update(t.untyped_storage().data_ptr() for t in tensors)

    def wrote(self, t: torch.Tensor, by: str) -> None:
        """Record that ``t`` was written on this stream (while it runs), by ``by``."""
        self.clock += 1
        span = _span(t)
        for w in self._live():
            # Written over (in part): streams that saw it must not put its old contents back.
            if _overlap(span, _span(w.tensor)):
                w.gone = True
        self._writes[_key(t)] = _Write(t, self.clock, self.held, by)

    def writes_to(self, storages: set) -> bool:
        """Whether a write this stream sees, still hidden, lies in one of ``storages``."""
        return any(w.tensor.untyped_storage().data_ptr() in storages for w in self._live())

    def resume(self) -> None:
        """This stream runs again: it sees its writes."""
        writes = self._live()
        self._release(writes, ())
        for w in writes:
            w.value = None

    def hide(self) -> None:
        """The compute stream runs: hide this stream's writes from it."""
        with internal():
            stashes: dict[int, torch.UntypedStorage] = {}
            for w in self._live():
                # One copy per storage, viewed as each write views it: views may overlap.
                storage = w.tensor.untyped_storage()
                stash = stashes.get(storage.data_ptr())
                if stash is None:
                    stash = stashes[storage.data_ptr()] = storage.clone()
                t = w.tensor
                w.value = t.new_empty(0).set_(stash, t.storage_offset(), t.shape, t.stride())
            for w in self._live():
                poison(w.tensor)

    def land(self, upto=None, tensors=()) -> None:
        """The compute stream is now ordered after this stream's writes up to clock ``upto``
        (all of them if None), and after its writes of ``tensors``."""
        landing = self._select(upto, tensors)
        for w in landing:
            w.gone = True
        self._release(landing, self._live())

    def adopt(self, other: "SideStream", upto=None, tensors=()) -> None:
        """This stream (running) is now ordered after ``other``'s writes up to its clock
        ``upto`` (all of them if None), and after its writes of ``tensors``: it sees them, and
        a reader ordered after this stream will too."""
        seen = self._select_in(other, upto, tensors)
        self._release(seen, other._live())
        for w in seen:
            w.value = None
            self._writes.setdefault(_key(w.tensor), w)

    def _live(self) -> list:
        self._writes = {k: w for k, w in self._writes.items() if not w.gone}
        return list(self._writes.values())

    def _select(self, upto, tensors) -> list:
        return self._select_in(self, upto, tensors)

    @staticmethod
    def _select_in(stream: "SideStream", upto, tensors) -> list:
        keys = {_key(t) for t in tensors}
        return [
            w
            for key, w in stream._writes.items()
            if not w.gone
            and w.value is not None
            and (upto is None or w.tick <= upto or key in keys)
        ]

    @staticmethod
    def _release(writes: list, others) -> None:
        # Check them all first: a restored view may cover bytes of another.
        for w in writes:
            if not poisoned(w.tensor):
                raise SimRace(
                    f"nccl-sim: a tensor of shape {tuple(w.tensor.shape)} written on a side "
                    "stream was written elsewhere before the compute stream was ordered after "
                    "the side stream (on CUDA the two writes may land in either order)"
                )
        with internal():
            for w in writes:
                w.tensor.copy_(w.value)
            # Bytes that writes still hidden share with the restored ones stay hidden.
            storages = {w.tensor.untyped_storage().data_ptr() for w in writes}
            released = {id(w) for w in writes}
            for w in others:
                hidden = w.value is not None and not w.gone and id(w) not in released
                if hidden and w.tensor.untyped_storage().data_ptr() in storages:
                    poison(w.tensor)


class _Recorder(TorchDispatchMode):
    """Records the tensors that ops write, from their schemas, as writes of ``stream``."""

    def __init__(self, stream: SideStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A collective's outputs are its own (poisoned until waited for), not the stream's.
        if not _state.internal and func.namespace != "c10d":
            for i, arg in enumerate(func._schema.arguments):
                if arg.alias_info is None or not arg.alias_info.is_write:
                    continue
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else [value]:
                    if isinstance(t, torch.Tensor):
                        self.stream.wrote(t, func.name())
        return func(*args, **kwargs)


@contextlib.contextmanager
def running(stream: SideStream):
    """Run the body on ``stream``: it sees its own writes, and the compute stream sees none
    of them afterwards until it is ordered after them."""
    outer = _state.stream
    stream.resume()
    _state.stream = stream
    try:
        with _Recorder(stream):
            yield
    finally:
        _state.stream = outer
        stream.hide()


class SimRuntime(runtimes.Runtime):
    """The pipeline's runtime for the simulated NCCL: the primitives of the CUDA one.

    Later stages run on a :class:`SideStream`, completion callbacks each on a stream of their
    own (see the module docstring). ``dirty`` says that a later stage ran on the side stream
    since the last :meth:`synchronize`: a host read then would race on a GPU.
    """

    asynchronous = True
    native = True  # the native runner waits on the work before reading, as NCCL needs
    waits_in_then = True  # as then() below does

    def __init__(self, device: torch.device) -> None:
        self.dirty = False
        self.stream = SideStream()
        self.pools: list[SideStream] = []  # completion callbacks' streams, not yet landed

    @contextlib.contextmanager
    def side(self):
        with running(self.stream):
            yield
        self.dirty = True

    def then(self, work, callback):
        # NCCL's future is complete, so torch runs the callback now, on a stream from its pool
        # that waits for the collective's events; a reader sees what it wrote once ordered
        # after that stream.
        pool = SideStream()
        with running(pool):
            work.wait()
            # torch records the future's value (the collective's output) on this stream.
            pool.hold(t for t in work.get_future().value() if isinstance(t, torch.Tensor))
            callback(work.get_future())
        self.pools.append(pool)

    def hold(self, tensors):
        stream = current()
        if stream is not None:  # (the compute stream's writes are done when the host goes on)
            stream.hold(tensors)

    def wait_result(self, result):
        result.wait()
        value = result.value()
        values = value if isinstance(value, (list, tuple)) else [value]
        # The result's events are the ones of the stream that wrote its value.
        storages = {t.untyped_storage().data_ptr() for t in values if isinstance(t, torch.Tensor)}
        for pool in [p for p in self.pools if p.writes_to(storages)]:
            pool.land()
            self.pools.remove(pool)

    def synchronize(self):
        # As CUDA's: the side stream only. The callbacks' streams land at wait_result.
        self.stream.land()
        self.dirty = False
