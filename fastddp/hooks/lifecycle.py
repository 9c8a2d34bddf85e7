"""A bucket's slot over its life: made at the bucket's first reduction, retired when DDP
rebuilds its buckets, its residuals read out for a checkpoint or a move.

The hook asks for a bucket's slot here once per call (:func:`slot_for`); the state holds the
table of slots and the settings, and never calls into this module itself.
"""

from typing import Any, Optional

import torch.distributed as dist

from fastddp.hooks.slots import Slot

__all__ = ["residuals_of", "retire", "seed", "slot_for"]


def slot_for(state, key, signature, index, buffer, parameters, params, world) -> Slot:
    """The slot of the bucket ``key``: the one in ``state``'s table while it still fits,
    else a new one (buffers, path and residuals), retiring the slots it replaces."""
    table = state._table
    slot = table.reusable(key, signature, index)
    if slot is not None:
        return slot
    if parameters:
        params = table.keys_of(parameters)
        key, signature = table.identify(index, buffer, parameters, None)
    rank = dist.get_rank(state.process_group)
    # Retire every slot holding one of these parameters (DDP rebuilt its buckets), and the
    # slot of this key: their residuals wait, by parameter, for the new slot.
    for old_key in table.holders(key, params):
        retire(state, old_key, rank)
    slot = Slot(index, buffer.numel(), buffer.device, world)
    slot.params, slot.signature = params, signature
    events = slot.resume(table.take(index))
    slot.path = state._path()
    slot.path.allocate(slot, state.codec, state._topology)
    slot.give_buffers(state.codec, state.error_feedback, events, state._topology.per_node)
    state._counters["allocations"] += 1
    table.add(key, slot)
    if state.error_feedback:
        two_level = state._topology if slot.node_shard else None
        state._residuals.take(slot, rank, state.process_group, two_level)
    return slot


def retire(state, key, rank: int) -> None:
    """Drop the slot of ``key`` from ``state``'s table; its residuals wait, by parameter, for
    the slots that take its parameters."""
    slot = state._table.slots.get(key)
    if slot is None:
        return
    if state._native is not None:
        state._native.sync(state)
        state._native.drop(slot, state)
    state._pipeline.settle(slot.job)
    state._table.remove(key)
    slot.job = None  # the job points back at the slot: let the buffers go now, not at GC
    slot.free_buffers()  # first: the residuals are copied out next
    parts = residuals_of(state, slot, rank)
    slot.residual = slot.shard_residual = None
    state._residuals.park(
        slot.params,
        parts["residual"],
        parts["shard_residual"],
        parts["shard_offset"],
        with_shards=parts["shard_residual"] is not None,
        copy=True,
    )


def residuals_of(state, slot: Slot, rank: Optional[int]) -> dict[str, Any]:
    """A slot's residuals as saved and parked, the shard's at its offset in the bucket."""
    shard = slot.shard_residual
    offset = 0
    if shard is not None and slot.node_shard:
        topo = state._topology
        offset = topo.local_rank * slot.node_shard + topo.cross_rank * slot.shard
    elif shard is not None and rank is not None:
        offset = rank * shard.numel()
    residual = None if slot.residual is None else slot.residual[: slot.numel]
    return {"residual": residual, "shard_residual": shard, "shard_offset": offset}


def seed(state, rank: int, index: int, stage: int) -> int:
    """The stochastic-rounding seed of a bucket call's stage; -1 without stochastic rounding."""
    if not state.stochastic_rounding:
        return -1
    # Hashes of int tuples are the same in every process; each rank, bucket call and stage
    # draws its own numbers, reproducibly (and again after a restart: the count is saved).
    calls = state._counters["calls"]
    return hash((state.seed, rank, index, calls, stage)) & ((1 << 63) - 1)
