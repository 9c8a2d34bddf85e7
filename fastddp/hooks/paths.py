"""Reduction paths: which collectives move a bucket, and which codec step runs between them.

A path runs in *stages*. Stage ``i`` does local work and issues collective ``i``, returning its
``Work``; :meth:`Path.finish` runs once the last collective is done. Each is written once, as
data: the op calls of the local work and the collective to issue (:meth:`Path.stage_calls`,
:meth:`Path.finish_calls`), which the Python pipeline runs and the native runner (``native.py``)
replays without Python. A path also allocates the buffers its stages use (:meth:`Path.allocate`)
and says which stages draw stochastic-rounding seeds. When a stage runs, and how completion is
awaited, is the pipeline's business (``pipeline.py``); what is encoded and how rows are summed
is the codec's (:mod:`fastddp.codecs`). Every path writes its result into the bucket. The
two-level path and the choice among paths are in ``two_level.py``.
"""

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import Call, Codec, run_calls
from fastddp.hooks.slots import Slot
from fastddp.hooks.topology import Topology, ring_bytes

__all__ = [
    "PASSTHROUGH",
    "Path",
    "AllReducePath",
    "AllToAllPath",
    "PassthroughPath",
    "Collective",
    "encode",
    "issue",
]

#: A collective: ``(kind, group, out, in, out_splits, in_splits)``; kind is ``"allreduce"``
#: (in place on ``out``), ``"alltoall"`` or ``"allgather"``.
Collective = tuple[str, Any, torch.Tensor, Optional[torch.Tensor], Optional[list], Optional[list]]

_add_ = torch.ops.aten.add_.Tensor
_or_ = torch.ops.aten.bitwise_or_.Tensor
_div_ = torch.ops.aten.div_.Scalar

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def issue(collective: Collective) -> dist.Work:
    """Issue ``collective`` asynchronously."""
    kind, group, out, inp, out_splits, in_splits = collective
    if kind == "allreduce":
        return dist.all_reduce(out, group=group, async_op=True)
    if kind == "alltoall":
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)
    return _all_gather_single(out, inp, group=group, async_op=True)


class Path(ABC):
    """The protocol of a reduction path (see the module docstring)."""

    name: str
    stages: int
    # The process group of each stage, by role: "group" (the state's), "intra" (this node's
    # ranks), "cross" (this local rank on every node).
    roles: tuple[str, ...]
    # The stages whose rounding draws a seed, in the order the job's ``seeds`` hold them.
    seed_stages: tuple[int, ...] = ()

    def allocate(self, slot: Slot, codec: Codec, topo: Topology) -> None:
        """Give ``slot`` the buffers its stages use (zeros where padding must stay zero)."""
        self.buffers(slot, codec, slot.numel, slot.world)

    def buffers(self, slot: Slot, codec: Codec, n: int, world: int) -> None:  # noqa: B027
        """Give ``slot`` the wire buffers for ``n`` elements over ``world`` ranks (the
        passthrough path has none)."""

    def unit(self, codec: Codec, world: int) -> int:
        """Lengths this path pads to a multiple of, over ``world`` ranks."""
        return codec.align()

    def group_bytes(self, slot: Slot, ranks: int) -> int:
        """Bytes one rank sends in this path's collectives over a group of ``ranks`` ranks."""
        return 0

    @abstractmethod
    def sent_bytes(self, slot: Slot, topo: Topology) -> int:
        """Bytes this rank sends for one reduction of ``slot``'s bucket."""

    @abstractmethod
    def cross_bytes(self, slot: Slot, topo: Topology) -> int:
        """Of :meth:`sent_bytes`, the bytes that leave this rank's node."""

    @abstractmethod
    def stage_bytes(self, job: Any, i: int) -> int:
        """Bytes this rank sends in stage ``i``'s collective (``dtype="auto"`` times the levels
        of the network with them)."""

    def stage(self, job: Any, i: int) -> Collective:
        """Do stage ``i``'s local work (a later stage: on the side stream, which holds the
        slot's buffers) and return its collective, for :func:`issue`."""
        if i > 0:
            job.slot.hold(job.runtime)
        calls, collective = self.stage_calls(job, i)
        run_calls(calls)
        return collective

    def finish(self, job: Any) -> None:
        """Write the result into the bucket, once the last collective is done."""
        run_calls(self.finish_calls(job))

    @abstractmethod
    def stage_calls(self, job: Any, i: int) -> tuple[list[Call], Collective]:
        """Stage ``i``'s local work (op calls) and its collective."""

    @abstractmethod
    def finish_calls(self, job: Any) -> list[Call]:
        """The calls that write the result into the bucket."""


def encode(job: Any, src: torch.Tensor, residual: Optional[torch.Tensor], last: bool) -> list[Call]:
    # The first step of every compressing path: ``src``, scaled, into the wire rows. The
    # event is counted here when this is the reduction's ``last`` encode, else by gather().
    slot = job.slot
    calls = slot.codec.encode_calls(
        src, slot.wire, slot.per_row, job.scale, slot.flag, residual, job.seeds[0]
    )
    return [*calls, (_add_, (slot.nonfinite, slot.flag), {})] if last else calls


class AllReducePath(Path):
    """Encode, all-reduce the payload (the collective sums in the wire dtype), decode."""

    name = "allreduce"
    stages = 1
    roles = ("group",)
    seed_stages = (0,)

    def buffers(self, slot, codec, n, world):
        slot.shard, slot.row = 0, n
        slot.wire = torch.empty(1, n, dtype=codec.wire_dtype, device=slot.device)

    def group_bytes(self, slot, ranks):
        return ring_bytes(slot.wire.numel(), ranks, slot.codec.wire_dtype.itemsize)

    def sent_bytes(self, slot, topo):
        return self.group_bytes(slot, topo.world)

    def cross_bytes(self, slot, topo):
        return topo.ring_cross_bytes(slot.wire.numel(), slot.codec.wire_dtype.itemsize)

    def stage_bytes(self, job, i):
        return self.sent_bytes(job.slot, job.topo)

    def first(self, job, group) -> Collective:
        """The first collective, on the encoded wire buffer."""
        return ("allreduce", group, job.slot.wire.view(-1), None, None, None)

    def stage_calls(self, job, i):
        return encode(job, job.bucket, job.slot.residual, True), self.first(job, job.groups[0])

    def finish_calls(self, job):
        return job.slot.codec.decode_calls(job.slot.wire, job.slot.per_row, job.bucket)


class AllToAllPath(Path):
    """A reduce-scatter summed in fp32, then an all-gather of the re-encoded shards.

    Stage 0 encodes the bucket as one row per rank and exchanges rows (all-to-all: each rank
    receives every rank's row of its shard). Stage 1 sums the received rows in fp32, encodes the
    sum once, and all-gathers the shards back into the wire buffer. Each rank sends what a ring
    all-reduce sends, but the sum is rounded once instead of at every hop.
    """

    name = "alltoall"
    stages = 2
    roles = ("group", "group")
    seed_stages = (1, 2)

    def buffers(self, slot, codec, n, world):
        align, on = codec.align(), dict(dtype=codec.wire_dtype, device=slot.device)
        slot.shard = -(-n // (world * align)) * align
        slot.row = codec.row_elems(slot.shard)
        # Rows past the bucket's end stay zero: every stage maps zeros to zeros.
        slot.wire = torch.zeros(world, slot.row, **on)
        slot.recv = torch.empty(world, slot.row, **on)
        slot.out = torch.empty(slot.row, **on)

    def unit(self, codec, world):
        return codec.align() * world

    def group_bytes(self, slot, ranks):
        # A row out to every other rank in the all-to-all, then our row to each in the gather.
        return 2 * (ranks - 1) * slot.row * slot.codec.wire_dtype.itemsize

    def sent_bytes(self, slot, topo):
        return self.group_bytes(slot, slot.wire.shape[0])

    def cross_bytes(self, slot, topo):
        away = sum(topo.crosses(topo.rank, r) for r in range(topo.world))
        return 2 * away * slot.row * slot.codec.wire_dtype.itemsize

    def stage_bytes(self, job, i):
        return self.sent_bytes(job.slot, job.topo) // 2  # a row to every other rank, twice

    def first(self, job, group) -> Collective:
        slot = job.slot
        return ("alltoall", group, slot.recv.view(-1), slot.wire.view(-1), None, None)

    def stage_calls(self, job, i):
        if i == 0:
            calls = encode(job, job.bucket, job.slot.residual, False)
            return calls, self.first(job, job.groups[0])
        return self.gather(job, job.groups[1])

    def finish_calls(self, job):
        return job.slot.codec.decode_calls(job.slot.wire, job.slot.per_row, job.bucket)

    @staticmethod
    def gather(job: Any, group) -> tuple[list[Call], Collective]:
        slot = job.slot
        calls = slot.codec.reduce_calls(
            slot.recv, slot.out, slot.shard, 1.0, slot.shard_flag, slot.shard_residual, job.seeds[1]
        )
        # One event per reduction, whether this rank's payload or its shard's sum met it.
        calls += [
            (_or_, (slot.flag, slot.shard_flag), {}),
            (_add_, (slot.nonfinite, slot.flag), {}),
        ]
        # The wire buffer is free again once the all-to-all is done: gather into it.
        return calls, ("allgather", group, slot.wire.view(-1), slot.out, None, None)


class PassthroughPath(Path):
    """A bucket that is already fp16/bf16: averaged as it is, nothing to encode."""

    name = "passthrough"
    stages = 1
    roles = ("group",)

    def sent_bytes(self, slot, topo):
        return 0

    def cross_bytes(self, slot, topo):
        return 0

    def stage_bytes(self, job, i):
        return ring_bytes(job.bucket.numel(), job.world, job.bucket.element_size())

    def stage_calls(self, job, i):
        calls = [(_div_, (job.bucket, job.world), {})] if job.average else []
        return calls, ("allreduce", job.groups[0], job.bucket, None, None, None)

    def finish_calls(self, job):
        return []


PASSTHROUGH = PassthroughPath()
