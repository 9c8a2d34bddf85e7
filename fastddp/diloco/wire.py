"""The slow link: a slice's average across nodes, now or in the background.

:class:`CrossAverage` averages one slice over the ranks of equal local rank on every node: with
a preset, through :func:`fastddp.all_reduce` and a :class:`~fastddp.CompressState` that keeps
the codec's error-feedback residuals between rounds; with ``None``, in fp32 by
``torch.distributed.all_reduce``. A group of one node sends nothing.

:class:`Background` runs such an average on a thread of its own, so that the next inner steps
train while the slow link carries it (``overlap=True``). That thread issues collectives only on
the cross-node group, and the training thread none there while it runs, so the order of each
group's collectives is the same on every rank. On CUDA the thread works on a stream of its own,
which waits for the slice to be written, and the training stream waits for its result.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp.hooks import CompressState, checkpoint
from fastddp.hooks.runtime import own_stream
from fastddp.hooks.topology import ring_bytes
from fastddp.reduce import all_reduce

__all__ = ["Background", "CrossAverage"]


class CrossAverage:
    """Average a slice across nodes, in place, with the settings of one preset (or fp32)."""

    __slots__ = ("group", "nodes", "state", "_fp32_bytes", "_compress")

    def __init__(self, compress: Optional[str], group: dist.ProcessGroup, nodes: int) -> None:
        self.group, self.nodes, self._fp32_bytes = group, nodes, 0
        self._compress = compress
        self.state: Optional[CompressState] = None
        if compress is not None and nodes > 1:
            self.state = self._new_state()

    def _new_state(self) -> CompressState:
        # One rank per node in this group: nothing to split in two levels.
        return CompressState.from_preset(self._compress, self.group, topology="flat")

    @property
    def block(self) -> int:
        """Elements per scale of the codec (1 for fp32 and 16-bit ones)."""
        return (self.state.block_size or 1) if self.state is not None else 1

    def __call__(self, flat: torch.Tensor) -> None:
        if self.nodes == 1:
            return  # the node's own pseudo-gradient is the average
        if self.state is not None:
            all_reduce(flat, state=self.state)
            return
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.nodes)
        self._fp32_bytes += ring_bytes(flat.numel(), self.nodes, 4)

    def sent(self) -> int:
        """Bytes this rank sent to other nodes so far."""
        if self.state is None:
            return self._fp32_bytes
        return int(self.state.stats()["cross_node_bytes"])

    def state_dict(self) -> dict[str, Any]:
        """The compressing state's, or (fp32 across nodes) the bytes sent so far."""
        if self.state is None:
            return {"fp32_bytes": self._fp32_bytes}
        return self.state.state_dict()

    def load_problem(self, saved: Any) -> Optional[str]:
        """Why ``saved`` would not load into this rank's part (None if it would): tried on a
        fresh state of the same settings, so that a refusal loads nothing, and residuals saved
        by another node's rank are named here rather than at the next round's handshake, where
        only this rank's group would raise."""
        if saved is None:
            return None
        if self.state is None:
            fine = isinstance(saved, dict) and isinstance(saved.get("fp32_bytes", 0), int)
            return None if fine else "its compress entry is not what fp32 across nodes saves"
        try:
            trial = self._new_state()
            checkpoint.load(trial, saved)
        except Exception as error:  # (a damaged dict raises whatever its contents make)
            return f"its compress entry does not load ({type(error).__name__}: {error})"
        mine = (dist.get_rank(self.group), dist.get_world_size(self.group))
        theirs = trial._loaded_from
        if theirs is not None and theirs[:2] != mine:
            return (
                f"its compress residuals were saved by rank {theirs[0]} of the {theirs[1]} ranks "
                f"of its cross-node group, and this rank is rank {mine[0]} there (another "
                "node's file?)"
            )
        return None

    def load_state_dict(self, saved: Optional[dict[str, Any]]) -> None:
        if saved is None:  # saved by an older fastddp, fp32 across nodes
            return
        if self.state is None:
            self._fp32_bytes = int(saved.get("fp32_bytes", 0))
        else:
            self.state.load_state_dict(saved)


class Background:
    """One job at a time on a thread of its own; :meth:`wait` hands its end to the caller."""

    __slots__ = ("_pool", "_job", "_stream")

    def __init__(self, device: torch.device) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        self._job: Optional[Future] = None
        # (fastddp's own stream: on one of torch's pools a DDP decode could queue behind this
        # stream's slow outer reduction)
        self._stream = own_stream(device, "diloco", False) if device.type == "cuda" else None

    @property
    def busy(self) -> bool:
        return self._job is not None

    def start(self, fn: Callable[[], None], uses: tuple = ()) -> None:
        """Run ``fn`` on the thread, after the work queued so far on the device's current stream;
        ``uses``: tensors of this stream that ``fn``'s work reads or writes."""
        assert self._job is None, "wait() for the job in flight first"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastddp-diloco")
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()  # (the model's device, which need not be the current)
            ready.record(torch.cuda.current_stream(self._stream.device))
            for t in uses:  # (dropped before the job ends, their memory must wait for it)
                t.record_stream(self._stream)
        self._job = self._pool.submit(self._run, fn, ready)

    def _run(self, fn: Callable[[], None], ready: Any) -> Any:
        if self._stream is None:
            fn()
            return None
        # A new thread starts on device 0 and its default stream: name both.
        with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            fn()
            done = torch.cuda.Event()
            done.record()
        return done

    def wait(self) -> None:
        """Wait for the job in flight, if any (re-raising its error); order the device's current
        stream after it."""
        job, self._job = self._job, None
        if job is None:
            return
        done = job.result()
        if done is not None:
            torch.cuda.current_stream(self._stream.device).wait_event(done)

    def close(self) -> None:
        """Wait for the job in flight and let the thread go."""
        try:
            self.wait()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
