"""Warnings for a launch under Slurm that would wait for nodes rather than fail.

Neither case is an error: a batch script may mean to run one node's launcher, and a
rendezvous may gather the nodes of several steps. But each, when it is a mistake, waits until
the rendezvous' timeout without a word, so the launcher says so before it starts.
"""

from collections.abc import Mapping
from typing import Optional

from fastddp.cluster import Setting
from fastddp.launch.options import node_span

__all__ = ["warnings"]


def warnings(env: Mapping[str, str], nnodes: str, slurm_nodes: Optional[Setting]) -> list[str]:
    """The lines to print for a launch under Slurm.

    Args:
        env: the environment.
        nnodes: ``--nnodes`` as the launch will take it (given, or from Slurm).
        slurm_nodes: the node count Slurm gives (its variable's text and name), if any.
    """
    span = node_span(nnodes)
    if span is None:
        return []
    fewest, most = span
    out = []
    if "SLURM_STEP_ID" not in env and most > 1:
        out.append(
            "warning: SLURM_STEP_ID is not set, so this launcher is not an srun task: in a "
            "batch script it runs on the first node only, and the job's other nodes start "
            "nothing. Start one launcher per node: srun --ntasks-per-node=1 python -m "
            "fastddp.launch ..."
        )
    count = str(slurm_nodes.value) if slurm_nodes else ""
    if count.isascii() and count.isdecimal() and fewest > int(count):
        out.append(
            f"warning: --nnodes {nnodes} needs {fewest} nodes, but Slurm starts launchers on "
            f"{count} ({slurm_nodes.source}={count}): unless another step's launchers join "
            "this rendezvous, it waits for nodes that never start, until its timeout. Give "
            f"--nnodes {count} (or leave it out: Slurm's count is the default), or ask Slurm "
            f"for {fewest} nodes (srun -N {fewest})"
        )
    return out
