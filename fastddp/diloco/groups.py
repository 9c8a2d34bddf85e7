"""The two groups of DiLoCo: the node's ranks (DDP every step) and, per local rank, the ranks of
equal local rank on every node (the outer round's slice across nodes).

Both come from the two-level reduction's :class:`~fastddp.hooks.topology.Topology`: nodes are
told apart by host name and network namespace, or ``FASTDDP_NODE_ID``, and the groups are made
once per process and layout, so that :func:`node_group` (called to build the DDP model) and
:class:`~fastddp.DiLoCo` get the same group objects.
"""

from typing import Optional

import torch.distributed as dist

from fastddp.hooks.topology import Topology, node_hash

__all__ = ["node_group"]


def node_group(group: Optional[dist.ProcessGroup] = None) -> dist.ProcessGroup:
    r"""Return the process group of this rank's node, for the DDP model that DiLoCo wraps.

    A collective over ``group``: every rank calls it. Nodes are told apart by host name and
    network namespace, or by ``FASTDDP_NODE_ID`` where those are wrong.

    Args:
        group (ProcessGroup, optional): the ranks that train together; ``None`` is every rank.

    Raises:
        ValueError: the nodes have different numbers of ranks (on every rank).

    Example::

        >>> model = DDP(model, process_group=fastddp.DiLoCo.node_group())
        >>> diloco = fastddp.DiLoCo(model, sync_every=100)
    """
    hashes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(hashes, node_hash(), group=group)
    topo = Topology(hashes, dist.get_rank(group))
    if not topo.even:
        raise ValueError(
            "fastddp.DiLoCo.node_group: every node needs the same number of ranks, but the "
            f"group has {topo.describe()}. Launch the same number of ranks per node"
        )
    topo.make_groups(group, hierarchical=True)  # "intra" and "cross", as DiLoCo makes them
    return topo.groups["intra"]
