"""Reduction paths: which collectives move a bucket, and which codec step runs between them.

A path runs in *stages*. Stage ``i`` does local work and issues collective ``i``, returning its
``Work``; :meth:`Path.finish` runs once the last collective is done. When a stage runs, and how
completion is awaited, is the pipeline's business (``pipeline.py``); what is encoded and how
rows are summed is the codec's (``codecs.py``). Every path writes its result into the bucket.
"""

from abc import ABC, abstractmethod
from typing import Any

import torch.distributed as dist

from fastddp.hooks.buffers import Slot

__all__ = ["Path", "AllReducePath", "AllToAllPath", "PassthroughPath", "path_named"]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Path(ABC):
    """The protocol of a reduction path (see the module docstring)."""

    name: str
    stages: int

    @abstractmethod
    def sent_bytes(self, slot: Slot, world: int) -> int:
        """Bytes this rank sends for one reduction of ``slot``'s bucket."""

    @abstractmethod
    def stage(self, job: Any, i: int) -> dist.Work:
        """Do stage ``i``'s local work and issue its collective."""

    @abstractmethod
    def finish(self, job: Any) -> None:
        """Write the result into the bucket, once the last collective is done."""


def _encode(job: Any) -> None:
    # The first stage of both compressing paths: the bucket, scaled, into the wire rows.
    slot = job.slot
    slot.codec.encode(job.bucket, slot.wire, job.scale, slot.flag, slot.residual, job.seeds[0])
    slot.nonfinite.add_(slot.flag)


class AllReducePath(Path):
    """Encode, all-reduce the payload (the collective sums in the wire dtype), decode."""

    name = "allreduce"
    stages = 1

    def sent_bytes(self, slot: Slot, world: int) -> int:
        ring_share = -(-slot.numel // world)  # what each rank forwards per ring phase
        return 2 * (world - 1) * ring_share * slot.codec.wire_dtype.itemsize

    def stage(self, job, i):
        _encode(job)
        return dist.all_reduce(job.slot.wire.view(-1), group=job.group, async_op=True)

    def finish(self, job):
        job.slot.codec.decode(job.slot.wire, job.bucket)


class AllToAllPath(Path):
    """A reduce-scatter summed in fp32, then an all-gather of the re-encoded shards.

    Stage 0 encodes the bucket as one row per rank and exchanges rows (all-to-all: each rank
    receives every rank's row of its shard). Stage 1 sums the received rows in fp32, encodes the
    sum once, and all-gathers the shards back into the wire buffer. Each rank sends what a ring
    all-reduce sends, but the sum is rounded once instead of at every hop.
    """

    name = "alltoall"
    stages = 2

    def sent_bytes(self, slot: Slot, world: int) -> int:
        # A row out to every other rank in the all-to-all, then our row to each in the gather.
        return 2 * (world - 1) * slot.row * slot.codec.wire_dtype.itemsize

    def stage(self, job, i):
        slot = job.slot
        if i == 0:
            _encode(job)
            return dist.all_to_all_single(
                slot.recv.view(-1), slot.wire.view(-1), group=job.group, async_op=True
            )
        slot.codec.reduce(
            slot.recv, slot.out, slot.flag, slot.shard_residual, job.seeds[1], slot.scratch
        )  # fmt: skip
        slot.nonfinite.add_(slot.flag)
        # The wire buffer is free again once the all-to-all is done: gather into it.
        return _all_gather_single(slot.wire.view(-1), slot.out, group=job.group, async_op=True)

    def finish(self, job):
        job.slot.codec.decode(job.slot.wire, job.bucket)


class PassthroughPath(Path):
    """A bucket that is already fp16/bf16: averaged as it is, nothing to encode."""

    name = "passthrough"
    stages = 1

    def sent_bytes(self, slot: Slot, world: int) -> int:
        return 0

    def stage(self, job, i):
        if job.average:
            job.bucket.div_(job.world)
        return dist.all_reduce(job.bucket, group=job.group, async_op=True)

    def finish(self, job):
        pass


_PATHS = {p.name: p for p in (AllReducePath(), AllToAllPath(), PassthroughPath())}


def path_named(name: str) -> Path:
    return _PATHS[name]
