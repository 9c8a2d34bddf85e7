"""DiLoCo for the slowest links: DDP inside each node every step, and every ``sync_every``
steps an outer step across nodes on the nodes' averaged progress, sent compressed.

Each module has one job:

- ``checks``: every rank's arguments, settings and model, one verdict on every rank;
- ``groups``: the node's group (for the DDP model) and the cross-node groups, from the
  two-level reduction's topology;
- ``shards``: each local rank's slice of the flat parameters, and the node's all-gather;
- ``start``: the first node's frozen parameters and buffers, sent where they differ;
- ``wire``: a slice's average across nodes (a preset's codec, or fp32), now or on a thread;
- ``core``: :class:`DiLoCo`, its rounds, outer step and state dict.
"""

from fastddp.diloco.core import DiLoCo
from fastddp.diloco.groups import node_group

__all__ = ["DiLoCo", "node_group"]
