"""Which ranks share a node, and the process groups of the two-level path.

Every rank sends a node identity in the settings all-gather of its first reduction
(``handshake.py``), so every rank derives the same :class:`Topology` from the same rows.
A node is identified by its host name and network namespace (ranks in one namespace reach each
other without the node's network), or by ``FASTDDP_NODE_ID`` where that is wrong (containers
with their own namespaces on one host, say). Rank numbering is never assumed.

The two-level path needs an *intra-node* group (the ranks of this node) and a *cross-node*
group (the ranks of every node with this rank's local rank). For a state over every rank, every
rank creates every such group (each node's, then each local rank's), in that order, and keeps
its own: with NCCL and a bound device (``init_process_group(device_id=...)``), torch makes a new
group by splitting the default communicator, which every rank must join, in the same order, or
the job hangs; torch's TorchComms path refuses groups made by their members alone. A state
over a subgroup cannot ask ranks outside it to take part, so its groups are made by their
members only (``use_local_synchronization``), which Gloo and an unbound NCCL allow; with a
bound NCCL device that is refused with an error. Groups are kept per process by their layout,
so that states over the same ranks share them instead of creating more.
"""

import hashlib
import os
import socket
import warnings
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from fastddp.cluster import NODE_ENV

__all__ = ["TOPOLOGIES", "Topology", "UnevenNodes", "node_hash", "resolve", "ring_bytes"]

TOPOLOGIES = ("auto", "flat", "hierarchical")
_GROUPS: dict[tuple, dict[tuple, dist.ProcessGroup]] = {}


def ring_bytes(numel: int, world: int, itemsize: int) -> int:
    """What each rank sends in a ring all-reduce: 2(n-1) steps of one n-th of the payload."""
    return 2 * (world - 1) * -(-numel // world) * itemsize


def node_identity() -> str:
    """This process's node: ``FASTDDP_NODE_ID``, else host name and network namespace."""
    given = os.environ.get(NODE_ENV)
    if given:
        return given
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{socket.gethostname()}/netns:{netns}"


def node_hash() -> int:
    """A 63-bit digest of :func:`node_identity`, equal in every process of one node."""
    digest = hashlib.blake2b(node_identity().encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class Topology:
    """Nodes of a process group, from the node hash of every rank (in group rank order).

    Nodes are numbered by their lowest rank; ``nodes[j]`` lists node ``j``'s ranks in order.
    ``groups`` (process group by role) is filled by :meth:`make_groups`.
    """

    __slots__ = ("rank", "world", "node_of", "nodes", "node", "local_rank", "cross_rank", "groups")

    def __init__(self, hashes: list[int], rank: int) -> None:
        order: dict[int, int] = {}
        self.node_of = [order.setdefault(h, len(order)) for h in hashes]
        self.nodes: list[list[int]] = [[] for _ in order]
        for r, j in enumerate(self.node_of):
            self.nodes[j].append(r)
        self.rank, self.world = rank, len(hashes)
        self.node = self.node_of[rank]
        self.local_rank = self.nodes[self.node].index(rank)
        self.cross_rank = self.node
        self.groups: dict[str, Optional[dist.ProcessGroup]] = {}

    @property
    def even(self) -> bool:
        """Whether every node has the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def per_node(self) -> int:
        return len(self.nodes[self.node])

    def describe(self) -> str:
        return ", ".join(f"node {j}: ranks {n}" for j, n in enumerate(self.nodes))

    def crosses(self, src: int, dst: int) -> bool:
        return self.node_of[src] != self.node_of[dst]

    def ring_cross_bytes(self, numel: int, itemsize: int) -> int:
        """Bytes this rank sends across nodes in a ring all-reduce in group rank order."""
        if self.world == 1 or not self.crosses(self.rank, (self.rank + 1) % self.world):
            return 0
        return ring_bytes(numel, self.world, itemsize)

    def make_groups(self, group: Optional[dist.ProcessGroup], hierarchical: bool) -> None:
        """Create (or reuse) the groups a state's paths need; collective over ``group``."""
        self.groups = {"group": group}
        if not hierarchical:
            return
        glob = dist.get_process_group_ranks(group or dist.group.WORLD)
        timeout, backend = _timeout_of(group), dist.get_backend(group)
        intra = [[glob[r] for r in node] for node in self.nodes]
        cross = [[glob[node[k]] for node in self.nodes] for k in range(self.per_node)]
        made = _groups(intra + cross, timeout, backend, everyone=len(glob) == dist.get_world_size())
        self.groups["intra"] = made[tuple(intra[self.node])]
        self.groups["cross"] = made[tuple(cross[self.local_rank])]
        # Shards follow the groups' own rank order (ranks sorted by global rank).
        self.local_rank = dist.get_rank(self.groups["intra"])
        self.cross_rank = dist.get_rank(self.groups["cross"])

    def groups_for(self, roles: tuple[str, ...]) -> tuple:
        """The process group of each stage of a path with these ``roles``."""
        return tuple(self.groups[r] for r in roles)


def _timeout_of(group: Optional[dist.ProcessGroup]) -> Optional[timedelta]:
    # New groups get the state's group's timeout, not the backend default (30 min on Gloo).
    pg = group or dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return pg._get_backend(device).options._timeout
        except Exception:  # no backend for this device, or no options: try the next
            continue
    return None


def _bound_nccl(backend: str) -> bool:
    return (
        "nccl" in backend and dist.distributed_c10d._get_default_group().bound_device_id is not None
    )


def _groups(
    layout: list[list[int]], timeout: Optional[timedelta], backend: str, everyone: bool
) -> dict[tuple, dist.ProcessGroup]:
    """The groups of ``layout`` that hold this rank, by rank tuple; made once per process.

    With ``everyone`` (the state's group is every rank) each rank makes every group of
    ``layout``, in its order; otherwise each group is made by its members only.
    """
    # The state's group's backend: an NCCL group's state gets NCCL subgroups under a Gloo world.
    # And its timeout: a state over a group with a shorter one must not wait on longer ones.
    key = (backend, timeout, tuple(map(tuple, layout)))
    made = _GROUPS.get(key)
    if made is not None:
        try:
            for pg in made.values():
                dist.get_process_group_ranks(pg)
            return made
        except (KeyError, ValueError, RuntimeError):
            pass  # destroyed with an earlier default group: make them again
    me = dist.get_rank()
    if not everyone and _bound_nccl(backend):
        raise ValueError(
            "fastddp: the two-level path of a state over a subgroup needs its node groups made "
            "by their members only, which NCCL refuses once init_process_group(device_id=...) "
            "has bound a device (every rank of the job would have to take part). Use "
            "topology='flat' for this state, or a state over every rank"
        )
    made = {}
    for ranks in layout:
        if everyone:
            pg = dist.new_group(ranks, timeout=timeout, backend=backend)
        elif me in ranks:
            pg = dist.new_group(
                ranks, timeout=timeout, backend=backend, use_local_synchronization=True
            )
        else:
            continue
        if me in ranks:
            made[tuple(ranks)] = pg
    _GROUPS[key] = made
    return made


class UnevenNodes(ValueError):
    """``topology='hierarchical'`` on nodes with different numbers of ranks (``topo``)."""

    def __init__(self, message: str, topo: Topology) -> None:
        super().__init__(message)
        self.topo = topo


def resolve(setting: str, topo: Topology) -> str:
    """``"flat"`` or ``"hierarchical"`` for a state's ``topology`` setting.

    Raises the same :class:`UnevenNodes` on every rank (every rank holds the same ``topo``)
    when ``"hierarchical"`` is asked for on nodes with different numbers of ranks.
    """
    if setting == "flat":
        return "flat"
    if not topo.even:
        if setting == "hierarchical":
            raise UnevenNodes(
                "fastddp: topology='hierarchical' needs the same number of ranks on every node, "
                f"but the group has {topo.describe()}. Launch the same number of ranks per node, "
                "or use topology='flat' (or 'auto', which falls back to flat with a warning)",
                topo,
            )
        warnings.warn(
            f"fastddp: nodes have different numbers of ranks ({topo.describe()}); "
            "topology='auto' reduces flat, as topology='flat' does",
            stacklevel=5,
        )
        return "flat"
    if setting == "hierarchical":
        return "hierarchical"
    return "hierarchical" if len(topo.nodes) > 1 and topo.per_node > 1 else "flat"
