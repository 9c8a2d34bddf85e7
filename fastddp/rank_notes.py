"""What the ranks compare after init: fastddp's settings and their nodes.

Every rank all-gathers one row and runs the same checks on the same rows, so that a clash
raises the same :class:`~fastddp.cluster.ClusterError` on every rank instead of a hang.
"""

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist

from fastddp._version import __version__
from fastddp.cluster import NODE_ENV, ClusterError

__all__ = ["check_ranks"]


# FASTDDP_* variables that differ between nodes by design, or that only the launcher reads.
_PER_NODE = (NODE_ENV, "FASTDDP_PREFLIGHT_TIMEOUT", "FASTDDP_CLUSTER")


def _settings_fingerprint() -> dict:
    """What must be equal on every rank: fastddp's and torch's versions, FASTDDP_* switches."""
    switches = {
        k: v for k, v in os.environ.items() if k.startswith("FASTDDP_") and k not in _PER_NODE
    }
    return {"fastddp": __version__, "torch": torch.__version__, "env": switches}


def check_ranks(node_rank: Optional[int]) -> tuple[int, int, int]:
    """All-gather nodes and settings; raise the same error on every rank if they clash.

    (Two ranks on one GPU are refused before init, by the GPUs' UUIDs:
    :func:`fastddp.joining.agree`.)

    Returns ``(local_world_size, node_rank, num_nodes)``. Nodes are the launcher's node ranks
    where known (two network namespaces may share one host name), else ``FASTDDP_NODE_ID``
    (as for the hooks' topology), else host names.
    """
    host = socket.gethostname()
    mine = {
        "host": host,
        "node": f"node {node_rank}" if node_rank is not None else os.environ.get(NODE_ENV, host),
        "settings": _settings_fingerprint(),
        "given": os.environ.get(NODE_ENV) or None,
        "node_rank": node_rank,
    }
    world = dist.get_world_size()
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    problems = []
    for rank, info in enumerate(everyone):
        if info["settings"] != everyone[0]["settings"]:
            problems.append(
                f"rank {rank} runs with different fastddp settings than rank 0: rank {rank} "
                f"{info['settings']}, rank 0 {everyone[0]['settings']}; start every rank with the "
                "same fastddp/torch versions and FASTDDP_* variables"
            )
    problems += _merged_nodes(everyone)
    if problems:
        raise ClusterError("fastddp.init_distributed: " + "; ".join(problems))
    nodes = list(dict.fromkeys(info["node"] for info in everyone))  # in rank order
    local = sum(1 for info in everyone if info["node"] == mine["node"])
    index = node_rank if node_rank is not None else nodes.index(mine["node"])
    return local, index, len(nodes)


def _merged_nodes(everyone: list[dict]) -> list[str]:
    """A node id of ``FASTDDP_NODE_ID`` given to ranks the launcher put on different nodes:
    the hooks would take them for one node and send their intra-node stage between nodes."""
    launcher_nodes: dict[str, set] = {}
    for info in everyone:
        if info["given"] is not None and info["node_rank"] is not None:
            launcher_nodes.setdefault(info["given"], set()).add(info["node_rank"])
    return [
        f"{NODE_ENV}={given!r} names ranks on the launcher's nodes {sorted(nodes)} as one node, "
        "so the two-level reductions would send their inside-a-node stage between nodes; unset "
        f"{NODE_ENV}, or give each node an id of its own"
        for given, nodes in launcher_nodes.items()
        if len(nodes) > 1
    ]
