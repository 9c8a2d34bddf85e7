"""Per-bucket slots: the persistent buffers, residuals and counters of one DDP bucket.

A slot is allocated when a bucket is first seen and reused on every later step, so that the
hook never allocates per step; DDP's bucket rebuild after its first iteration (or a changed
bucket) retires the old slot and allocates a new one. Slots belong to one bucket *of one
model*: two models sharing a state never share buffers.
"""

from typing import Optional

import torch

from fastddp.hooks.codecs import Codec

__all__ = ["Slot", "allocate"]


class Slot:
    """Buffers, residuals and counters of one bucket (see the module docstring)."""

    __slots__ = (
        "index",
        "numel",
        "device",
        "world",
        "params",
        "signature",
        "path",
        "codec",
        "shard",
        "row",
        "wire",
        "recv",
        "out",
        "scratch",
        "flag",
        "nonfinite",
        "residual",
        "shard_residual",
        "node_shard",
        "node_recv",
        "node_sum",
        "gathered",
        "calls",
        "payload_bytes",
        "wire_bytes",
        "cross_node_bytes",
        "job",
    )

    def __init__(self, index: int, numel: int, device: torch.device, world: int) -> None:
        self.index = index
        self.numel = numel
        self.device = device
        self.world = world
        # (key, numel) of each parameter in the bucket, in buffer order: lets residuals follow
        # their parameters into another bucket layout or a restarted job.
        self.params: Optional[tuple] = None
        self.signature: tuple = ()  # what identifies the bucket cheaply on every call
        self.path = ""
        self.codec: Optional[Codec] = None
        self.shard = 0
        self.row = 0
        self.wire: Optional[torch.Tensor] = None
        self.recv: Optional[torch.Tensor] = None
        self.out: Optional[torch.Tensor] = None
        self.scratch: dict[str, torch.Tensor] = {}
        self.flag: Optional[torch.Tensor] = None
        self.nonfinite: Optional[torch.Tensor] = None  # events, counted on the bucket's device
        self.residual: Optional[torch.Tensor] = None
        self.shard_residual: Optional[torch.Tensor] = None
        # Two-level path: residuals taken over from another layout wait in ``residual`` to be
        # added to the next bucket before it is sent (see residuals.py).
        self.node_shard = 0  # elements of the bucket each rank of a node reduces across nodes
        self.node_recv: Optional[torch.Tensor] = None  # [L, node_shard] fp32, from the node
        self.node_sum: Optional[torch.Tensor] = None  # [node_shard] fp32, their sum
        self.gathered: Optional[torch.Tensor] = None  # [L, inner wire] every rank's result
        self.calls = 0
        self.payload_bytes = 0
        self.wire_bytes = 0
        self.cross_node_bytes = 0
        self.job = None  # the latest reduction of this bucket (pipeline.Job)

    def nonfinite_events(self) -> int:
        return 0 if self.nonfinite is None else int(self.nonfinite.item())


def allocate(
    slot: Slot,
    path: str,
    codec: Codec,
    error_feedback: bool,
    events: int = 0,
    nodes: int = 1,
    per_node: int = 1,
) -> None:
    """Give ``slot`` the buffers its path needs (zeros where padding must stay zero).

    A two-level path (``hierarchical-*``, ``nodes`` x ``per_node`` ranks) reduces a node shard
    of ``node_shard`` elements across nodes with the inner path's buffers (``wire``, ``recv``,
    ``out``), sized for the cross-node group.
    """
    on = dict(device=slot.device)
    slot.path, slot.codec = path, codec
    inner, n, world = path, slot.numel, slot.world
    if path.startswith("hierarchical-"):
        inner, world = path.removeprefix("hierarchical-"), nodes
        # Node shards split evenly into the inner path's aligned shards.
        unit = codec.align() * (nodes if inner == "alltoall" else 1)
        slot.node_shard = n = -(-slot.numel // (per_node * unit)) * unit
        slot.node_recv = torch.empty(per_node, n, **on)
        slot.node_sum = torch.zeros(n, **on)  # zeros past the bucket's end stay zero
    if inner == "allreduce":
        slot.shard, slot.row = 0, n
        slot.wire = torch.empty(1, n, dtype=codec.wire_dtype, **on)
    elif inner == "alltoall":
        align = codec.align()
        slot.shard = -(-n // (world * align)) * align
        slot.row = codec.row_elems(slot.shard)
        # Rows past the bucket's end stay zero: every stage maps zeros to zeros.
        slot.wire = torch.zeros(world, slot.row, dtype=codec.wire_dtype, **on)
        slot.recv = torch.empty(world, slot.row, dtype=codec.wire_dtype, **on)
        slot.out = torch.empty(slot.row, dtype=codec.wire_dtype, **on)
        slot.scratch = codec.scratch(slot.shard, slot.device)
    if slot.node_shard:
        wire = slot.wire.numel()
        slot.gathered = torch.empty(per_node, wire, dtype=codec.wire_dtype, **on)
    slot.flag = torch.zeros(1, dtype=torch.int32, **on)
    slot.nonfinite = torch.tensor([events], dtype=torch.int64, **on)
    if error_feedback and path != "passthrough":
        # Two-level: one residual per element of the padded bucket, non-zero in this rank's
        # node shard only (residuals.py moves them there).
        slot.residual = torch.zeros(max(slot.numel, per_node * slot.node_shard), **on)
        if slot.shard > 0:
            slot.shard_residual = torch.zeros(slot.shard, **on)
