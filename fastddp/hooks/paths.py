"""Reduction paths: which collectives move a bucket, and which codec step runs between them.

A path runs in *stages*. Stage ``i`` does local work and issues collective ``i``, returning its
``Work``; :meth:`Path.finish` runs once the last collective is done. Each is written once, as
data: the op calls of the local work and the collective to issue (:meth:`Path.stage_calls`,
:meth:`Path.finish_calls`), which the Python pipeline runs and the native runner (``native.py``)
replays without Python. A path also allocates the buffers its stages use (:meth:`Path.allocate`)
and says which stages draw stochastic-rounding seeds. When a stage runs, and how completion is
awaited, is the pipeline's business (``pipeline.py``); what is encoded and how rows are summed
is the codec's (:mod:`fastddp.codecs`). Every path writes its result into the bucket.
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
    "HierarchicalPath",
    "PassthroughPath",
    "Collective",
    "issue",
    "path_for",
]

#: A collective: ``(kind, group, out, in, out_splits, in_splits)``; kind is ``"allreduce"``
#: (in place on ``out``), ``"alltoall"`` or ``"allgather"``.
Collective = tuple[str, Any, torch.Tensor, Optional[torch.Tensor], Optional[list], Optional[list]]

_add_ = torch.ops.aten.add_.Tensor
_div_ = torch.ops.aten.div_.Scalar
_sum_rows = torch.ops.aten.sum.IntList_out

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

    def stage(self, job: Any, i: int) -> dist.Work:
        """Do stage ``i``'s local work and issue its collective."""
        calls, collective = self.stage_calls(job, i)
        run_calls(calls)
        return issue(collective)

    def finish(self, job: Any) -> None:
        """Write the result into the bucket, once the last collective is done."""
        run_calls(self.finish_calls(job))

    @abstractmethod
    def stage_calls(self, job: Any, i: int) -> tuple[list[Call], Collective]:
        """Stage ``i``'s local work (op calls) and its collective."""

    @abstractmethod
    def finish_calls(self, job: Any) -> list[Call]:
        """The calls that write the result into the bucket."""


def _encode(job: Any, src: torch.Tensor, residual: Optional[torch.Tensor]) -> list[Call]:
    # The first step of every compressing path: ``src``, scaled, into the wire rows.
    slot = job.slot
    calls = slot.codec.encode_calls(
        src, slot.wire, slot.per_row, job.scale, slot.flag, residual, job.seeds[0]
    )
    return [*calls, (_add_, (slot.nonfinite, slot.flag), {})]


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
        return _encode(job, job.bucket, job.slot.residual), self.first(job, job.groups[0])

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
        slot.scratch = codec.scratch(slot.shard, slot.device)

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
            return _encode(job, job.bucket, job.slot.residual), self.first(job, job.groups[0])
        return self.gather(job, job.groups[1])

    def finish_calls(self, job):
        return job.slot.codec.decode_calls(job.slot.wire, job.slot.per_row, job.bucket)

    @staticmethod
    def gather(job: Any, group) -> tuple[list[Call], Collective]:
        slot = job.slot
        calls = slot.codec.reduce_calls(
            slot.recv, slot.out, slot.shard, 1.0, slot.flag, slot.shard_residual, job.seeds[1],
            slot.scratch,
        )  # fmt: skip
        calls.append((_add_, (slot.nonfinite, slot.flag), {}))
        # The wire buffer is free again once the all-to-all is done: gather into it.
        return calls, ("allgather", group, slot.wire.view(-1), slot.out, None, None)


class HierarchicalPath(Path):
    """Full precision inside each node, the codec across nodes (``hierarchical-<inner>``).

    With L ranks on each of N nodes, local rank l reduces node shard l of the bucket:

    - stage 0: an all-to-all of the fp32 bucket inside the node (a reduce-scatter that moves
      each byte once; Gloo's ``reduce_scatter_tensor`` moves it twice);
    - stage 1: the received pieces summed in fp32, encoded once (scaled, with the residual of
      this rank's node shard), and the inner path's first collective on the cross-node group;
    - the inner path's later stages, on the cross-node group;
    - last: an all-gather of the inner path's wire inside the node (every rank then holds every
      node shard's encoded sum, which loses nothing), and one decode into the bucket.

    Only the inner path's collectives leave the node, with 1/L of the bucket per rank.
    """

    def __init__(self, inner: "AllReducePath | AllToAllPath") -> None:
        self.inner = inner  # a flat compressing path: it issues its first collective itself
        self.name = f"hierarchical-{inner.name}"
        self.stages = inner.stages + 2
        self.roles = ("intra", *("cross",) * inner.stages, "intra")
        self.seed_stages = (1, 2)

    def allocate(self, slot, codec, topo):
        # Node shards split evenly into the inner path's aligned shards; the inner path's
        # buffers (wire, recv, out) are sized for the cross-node group.
        nodes, per_node, on = len(topo.nodes), topo.per_node, dict(device=slot.device)
        unit = self.inner.unit(codec, nodes)
        slot.node_shard = n = -(-slot.numel // (per_node * unit)) * unit
        slot.node_recv = torch.empty(per_node, n, **on)
        slot.node_sum = torch.zeros(n, **on)  # zeros past the bucket's end stay zero
        self.inner.buffers(slot, codec, n, nodes)
        wire = slot.wire.numel()
        slot.gathered = torch.empty(per_node, wire, dtype=codec.wire_dtype, **on)

    def sent_bytes(self, slot, topo):
        return sum(self._bytes_of(slot, topo, i) for i in range(self.stages))

    def cross_bytes(self, slot, topo):
        return self.inner.group_bytes(slot, len(topo.nodes))

    def stage_bytes(self, job, i):
        return self._bytes_of(job.slot, job.topo, i)

    def _bytes_of(self, slot: Slot, topo: Topology, i: int) -> int:
        if i == 0:  # the other local ranks' node shards, in fp32 (the padding is not sent)
            counts = self._counts(slot, topo)
            return 4 * (sum(counts) - counts[topo.local_rank])
        if i == self.stages - 1:  # this rank's wire to every other local rank
            ranks = slot.gathered.shape[0]
            return (ranks - 1) * slot.wire.numel() * slot.codec.wire_dtype.itemsize
        return self.cross_bytes(slot, topo) // self.inner.stages

    def stage_calls(self, job, i):
        slot, topo = job.slot, job.topo
        if i == 0:
            return [], self._scatter(job)
        if i == 1:
            counts = self._counts(slot, topo)
            mine = counts[topo.local_rank]
            rows = slot.node_recv.view(-1)[: mine * len(counts)].view(len(counts), mine)
            total = (_sum_rows, (rows, [0]), {"out": slot.node_sum[:mine]})
            lo = topo.local_rank * slot.node_shard
            residual = slot.residual
            if residual is not None:
                residual = residual[lo : lo + slot.node_shard]
            return [total, *_encode(job, slot.node_sum, residual)], self.inner.first(
                job, job.groups[1]
            )
        if i < self.stages - 1:
            return AllToAllPath.gather(job, job.groups[i])
        gather = ("allgather", job.groups[i], slot.gathered.view(-1), slot.wire.view(-1))
        return [], (*gather, None, None)

    def finish_calls(self, job):
        slot = job.slot
        rows = slot.gathered.view(-1, slot.wire.shape[-1])
        return slot.codec.decode_calls(rows, slot.per_row, job.bucket)

    @staticmethod
    def _counts(slot: Slot, topo: Topology) -> list[int]:
        # Elements of each node shard that lie in the bucket (the padding is never sent).
        s = slot.node_shard
        return [min(s, max(0, slot.numel - k * s)) for k in range(topo.per_node)]

    def _scatter(self, job) -> Collective:
        slot, topo = job.slot, job.topo
        counts = self._counts(slot, topo)
        mine = counts[topo.local_rank]
        out = slot.node_recv.view(-1)[: mine * len(counts)]
        return ("alltoall", job.groups[0], out, job.bucket, [mine] * len(counts), counts)


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
_FLAT = {False: AllReducePath(), True: AllToAllPath()}
_TWO_LEVEL = {fp32: HierarchicalPath(inner) for fp32, inner in _FLAT.items()}


def path_for(sum_in_fp32: bool, hierarchical: bool) -> Path:
    """The path of a compressing state: summed in fp32 (all-to-all) or by the collective
    (all-reduce), flat or in two levels."""
    return (_TWO_LEVEL if hierarchical else _FLAT)[sum_in_fp32]
