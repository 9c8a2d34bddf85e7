"""What a rank says of the others: while it waits for them to join, and what the ranks
compare after init (fastddp's settings and their nodes).

After init, every rank all-gathers one row and runs the same checks on the same rows, so that
a clash raises the same :class:`~fastddp.cluster.ClusterError` on every rank instead of a hang.
"""

import contextlib
import socket
from collections.abc import Mapping
from typing import Optional

import torch
import torch.distributed as dist

from fastddp import joining
from fastddp._version import __version__
from fastddp.cluster import NODE_ENV, ClusterError, Setting

__all__ = ["check_ranks", "said_while_joining"]


# FASTDDP_* variables that differ between nodes by design, or that only the launcher reads.
_PER_NODE = (NODE_ENV, "FASTDDP_PREFLIGHT_TIMEOUT", "FASTDDP_CLUSTER")


def said_while_joining(
    launcher: str, env: Mapping[str, str], settings: Mapping[str, Setting], addr: str, port: int
) -> contextlib.AbstractContextManager:
    """Around joining the others: one line on stderr if that takes longer than
    :data:`fastddp.joining.WAIT_SAY_S`, fit to what started the process.

    A rank that never comes leaves the others waiting in silence until their timeout
    (10 minutes by default). torchrun's agent reports its own waits: nothing is said there.
    """
    rank, world = settings["rank"].value, settings["world_size"].value
    if launcher == "torchrun":
        return contextlib.nullcontext()
    if launcher == "env":
        return joining.said_while_waiting(rank, world, addr, port)
    after_s = joining.WAIT_SAY_S
    head = (
        f"fastddp.init_distributed: rank {rank} has waited {after_s:g} s for the other "
        f"{world - 1} rank(s) at {addr}:{port}"
    )
    by = f"{settings['rank'].source}={rank}, {settings['world_size'].source}={world}"
    if launcher == "slurm":
        step = f"{env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')}"
        text = (
            f"{head} (srun step {step}: {by}); each task of the step is one rank, and every "
            "one must call init_distributed. In an interactive `srun --pty` shell a plain "
            "`python train.py` runs as one task of the shell's step, whose other tasks never "
            "come: start it with `srun python train.py` from the allocation's shell (salloc, "
            "sbatch) instead, or in this shell run `python -m fastddp.launch --cluster none "
            "--nproc-per-node N train.py` (N ranks), or `env -u SLURM_STEP_ID python train.py` "
            "(one process alone)"
        )
    else:
        text = (
            f"{head} (mpirun: {by}); every rank of the mpirun must call init_distributed, "
            "with the same MASTER_ADDR and MASTER_PORT exported to all (mpirun -x MASTER_ADDR "
            "-x MASTER_PORT ...). In a shell started by mpirun a plain `python train.py` runs "
            "as one of its ranks, whose others never come: start it with `mpirun ... python "
            "train.py` instead, or in this shell run `python -m fastddp.launch --cluster none "
            "--nproc-per-node N train.py` (N ranks)"
        )
    return joining.said_after(after_s, text)


def _settings_fingerprint(env: Mapping[str, str]) -> dict:
    """What must be equal on every rank: fastddp's and torch's versions, FASTDDP_* switches."""
    switches = {k: v for k, v in env.items() if k.startswith("FASTDDP_") and k not in _PER_NODE}
    return {"fastddp": __version__, "torch": torch.__version__, "env": switches}


def check_ranks(node_rank: Optional[int], env: Mapping[str, str]) -> tuple[int, int, int]:
    """All-gather nodes and settings; raise the same error on every rank if they clash.

    (Two ranks on one GPU are refused before init, by the GPUs' UUIDs:
    :func:`fastddp.joining.agree`.)

    Returns ``(local_world_size, node_rank, num_nodes)``. Nodes are the launcher's node ranks
    where known (two network namespaces may share one host name), else ``FASTDDP_NODE_ID``
    of ``env`` (as for the hooks' topology), else host names.
    """
    host = socket.gethostname()
    mine = {
        "host": host,
        "node": f"node {node_rank}" if node_rank is not None else env.get(NODE_ENV, host),
        "settings": _settings_fingerprint(env),
        "given": env.get(NODE_ENV) or None,
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
