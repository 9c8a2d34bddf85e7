"""The two-level path (full precision inside each node, the codec across nodes), and the
choice of a compressing state's path among it and the flat paths of ``paths.py``."""

import torch

from fastddp.hooks.paths import AllReducePath, AllToAllPath, Collective, Path, encode
from fastddp.hooks.slots import Slot
from fastddp.hooks.topology import Topology

__all__ = ["HierarchicalPath", "path_for"]

_SUM_ROWS = torch.ops.aten.sum.IntList_out


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
        nodes, per_node = len(topo.nodes), topo.per_node
        on = dict(dtype=torch.float32, device=slot.device)  # (whatever the default dtype)
        unit = self.inner.unit(codec, nodes)
        slot.node_shard = n = -(-slot.numel // (per_node * unit)) * unit
        slot.node_recv = torch.empty(per_node, n, **on)
        slot.node_sum = torch.zeros(n, **on)  # zeros past the bucket's end stay zero
        self.inner.buffers(slot, codec, n, nodes)
        wire = slot.wire.numel()
        slot.gathered = torch.empty(per_node, wire, dtype=codec.wire_dtype, device=slot.device)

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
            total = (_SUM_ROWS, (rows, [0]), {"out": slot.node_sum[:mine]})
            lo = topo.local_rank * slot.node_shard
            residual = slot.residual
            if residual is not None:
                residual = residual[lo : lo + slot.node_shard]
            last = self.inner.stages == 1  # else the inner path's gather counts the event
            return [total, *encode(job, slot.node_sum, residual, last)], self.inner.first(
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


_FLAT = {False: AllReducePath(), True: AllToAllPath()}
_TWO_LEVEL = {fp32: HierarchicalPath(inner) for fp32, inner in _FLAT.items()}


def path_for(sum_in_fp32: bool, hierarchical: bool) -> Path:
    """The path of a compressing state: summed in fp32 (all-to-all) or by the collective
    (all-reduce), flat or in two levels."""
    return (_TWO_LEVEL if hierarchical else _FLAT)[sum_in_fp32]
