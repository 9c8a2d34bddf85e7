"""The counters of :class:`~fastddp.CompressState` and what ``stats()`` reports."""

from typing import Any

from fastddp.codecs import Codec
from fastddp.hooks.slots import Slot
from fastddp.hooks.topology import Topology, ring_bytes

__all__ = ["COUNTERS", "count", "report"]

# A state's own counters (each slot keeps its own too: slots.SLOT_COUNTERS).
COUNTERS = (
    "calls",
    "passthrough_calls",
    "allocations",
    "payload_bytes",
    "wire_bytes",
    "fp32_wire_bytes",
    "cross_node_bytes",
    "fp32_ring_cross_node_bytes",
)


def count(
    counters: dict[str, int], slot: Slot, codec: Codec, topo: Topology, times: int = 1
) -> None:
    """Add ``times`` reductions of ``slot``'s bucket to its counters and the state's
    ``counters``."""
    n = slot.numel
    payload = times * codec.payload_bytes(n)
    sent = times * slot.path.sent_bytes(slot, topo)
    cross = times * slot.path.cross_bytes(slot, topo)
    slot.payload_bytes += payload
    slot.wire_bytes += sent
    slot.cross_node_bytes += cross
    counters["payload_bytes"] += payload
    counters["wire_bytes"] += sent
    counters["fp32_wire_bytes"] += times * ring_bytes(n, topo.world, 4)
    counters["cross_node_bytes"] += cross
    counters["fp32_ring_cross_node_bytes"] += times * topo.ring_cross_bytes(n, 4)


def report(state: Any) -> dict[str, Any]:
    """``state.stats()``: settings, counters and per-bucket figures (see its docstring)."""
    buckets = {
        key: {"numel": slot.numel, "path": slot.path.name, **slot.counts()}
        for key, slot in state._table.by_index()
    }
    retired = state._table.retired()
    topo = state._topology
    return {
        **state.settings(),
        "path": state.path,
        "topology_used": state._resolved,
        "nodes": None if topo is None else topo.nodes,
        **state._counters,
        "nonfinite_events": sum(
            b["nonfinite_events"] for b in [*buckets.values(), *retired.values()]
        ),
        # Without error feedback the parked sizes only check a load; nothing is owed.
        "parked_residuals": len(state._residuals) if state.error_feedback else 0,
        "buckets": buckets,
        "retired_buckets": retired,
    }
