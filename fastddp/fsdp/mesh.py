"""``node_mesh()``: the 2-D device mesh of a job, nodes by ranks per node, for hybrid sharding."""

from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fastddp.cluster import NODE_ENV
from fastddp.hooks.topology import Topology, node_hash

__all__ = ["MESH_DIMS", "node_mesh"]

MESH_DIMS = ("replicate", "shard")


def node_mesh(device_type: Optional[str] = None) -> DeviceMesh:
    """Return a 2-D :class:`~torch.distributed.device_mesh.DeviceMesh` of nodes × ranks per node.

    Dimension ``"shard"`` holds the ranks of this rank's node (shard the model over it with
    ``fully_shard(module, mesh=mesh["shard"])``) and ``"replicate"`` the ranks with this local
    position on every node (hand it to :func:`fastddp.fsdp.hybrid`). Nodes are found as the
    hooks find them: every rank sends its node identity (host name and network namespace, or
    ``FASTDDP_NODE_ID``) to every other, so rank numbering is never assumed; nodes are ordered
    by their lowest rank. Call it on every rank, after ``init_process_group``.

    Args:
        device_type (str, optional): the mesh's device type (default ``"cuda"`` when the
            default group's backend is NCCL, else ``"cpu"``).

    Raises:
        ValueError: on every rank, when the nodes hold different numbers of ranks.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "fastddp.fsdp.node_mesh: torch.distributed is not initialised; call "
            "init_process_group (or fastddp.init_distributed) first"
        )
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    # (DeviceMesh took "gpu" or "CPU" as it was, a mesh of a device type that does not exist)
    try:
        known = isinstance(device_type, str) and torch.device(device_type).type == device_type
    except RuntimeError:  # torch's list of every device type it knows
        known = False
    if not known:
        raise ValueError(
            f"fastddp.fsdp.node_mesh: device_type must be a torch device type such as 'cuda' "
            f"or 'cpu', got {device_type!r}"
        )
    device = (
        torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else None
    )
    world = dist.get_world_size()
    mine = torch.tensor([node_hash()], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    topo = Topology([int(t.item()) for t in everyone], dist.get_rank())
    sizes = sorted({len(ranks) for ranks in topo.nodes})
    if len(sizes) > 1:
        shape = ", ".join(f"node {j}: ranks {ranks}" for j, ranks in enumerate(topo.nodes))
        raise ValueError(
            f"fastddp.fsdp.node_mesh: the nodes hold different numbers of ranks ({shape}); a "
            "2-D mesh needs the same number on every node: launch as many ranks on each node "
            f"(--nproc-per-node), or set {NODE_ENV} to group ranks into equal nodes"
        )
    return DeviceMesh(device_type, torch.tensor(topo.nodes), mesh_dim_names=MESH_DIMS)
