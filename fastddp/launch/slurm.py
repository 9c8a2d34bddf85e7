"""What a launch under Slurm or mpirun is told before it starts: a refusal, or warnings.

A launch of fewer nodes than srun (or mpirun) started launchers on is refused: each node past
them would run a job of its own, or wait for a rendezvous that never takes it. The warnings are for
launches that may be meant: a batch script may mean to run one node's launcher, and a
rendezvous may gather the nodes of several steps. But each, when it is a mistake, waits until
the rendezvous' timeout without a word, so the launcher says so before it starts.
"""

from collections.abc import Mapping
from typing import Optional

from fastddp.cluster import ClusterError, Setting
from fastddp.launch.options import node_span
from fastddp.slurm_env import tasks_per_node

__all__ = ["check"]


def _count(text: str) -> Optional[int]:
    return int(text) if text.isascii() and text.isdecimal() else None


def check(
    env: Mapping[str, str],
    kind: str,
    nnodes: str,
    slurm_nodes: Optional[Setting],
    standalone: bool = False,
    detected: bool = False,
) -> list[str]:
    """The lines to print for a launch under Slurm or mpirun (``kind``; none for others).

    Args:
        env: the environment.
        kind: the cluster kind detected or given (``"slurm"``, ``"mpi"``, ...).
        nnodes: ``--nnodes`` as the launch will take it (given, or from Slurm).
        slurm_nodes: the node count Slurm (or mpirun) gives (its variable's text and name),
            if any.
        standalone: ``--standalone`` was given: one node, whatever Slurm says.
        detected: ``nnodes`` is Slurm's count, not given on the command line (or by a
            ``PET_NNODES``).

    Raises:
        ClusterError: srun or mpirun started launchers on more nodes than ``nnodes`` admits;
            or, ``detected``, Slurm's node count would be waited for by a launcher of the
            batch script, not srun's.
    """
    span = node_span(nnodes)
    if span is None or kind not in ("slurm", "mpi"):
        return []
    fewest, most = span
    if kind == "mpi":
        # One launcher a node (several are refused unless the command line says all): each
        # of mpirun's processes is a node to torch, counted in the detected node count.
        size = _count(str(slurm_nodes.value)) if slurm_nodes else None
        if size is None or most >= size:
            return []
        started = f"mpirun started {size} launchers ({slurm_nodes.source}={size})"
        ask = f"start {most} (mpirun -np {most} --npernode 1)"
        return _too_few(nnodes, most, started, size, "MPI", ask, standalone)
    out = []
    # Only the step's count: a step may run on fewer nodes than the job has (srun -N1).
    step = _count(env.get("SLURM_STEP_NUM_NODES", "")) if "SLURM_STEP_ID" in env else None
    if step is not None and most < step:
        started = f"srun started launchers on {step} nodes (SLURM_STEP_NUM_NODES={step})"
        ask = f"ask srun for {most} (srun -N {most})"
        out += _too_few(nnodes, most, started, step, "Slurm", ask, standalone)
    if "SLURM_STEP_ID" not in env and most > 1 and detected:
        # torchrun would run this node alone; a job of the allocation's nodes would wait for
        # launchers that never start, until the rendezvous' timeout.
        raise ClusterError(
            f"SLURM_STEP_ID is not set, so this launcher is not an srun task: in a batch "
            f"script it runs on the first node only, and the job of {nnodes} nodes that "
            f"{slurm_nodes.source if slurm_nodes else 'Slurm'} gives would wait for launchers "
            "the other nodes never start. Start one launcher per node: srun "
            "--ntasks-per-node=1 python -m fastddp.launch ...; or give --nnodes 1 to train on "
            "this node alone"
        )
    if "SLURM_STEP_ID" not in env and most > 1:
        out.append(
            "warning: SLURM_STEP_ID is not set, so this launcher is not an srun task: in a "
            "batch script it runs on the first node only, and the job's other nodes start "
            "nothing. Start one launcher per node: srun --ntasks-per-node=1 python -m "
            "fastddp.launch ..."
        )
    count = _count(str(slurm_nodes.value)) if slurm_nodes else None
    # Several launchers a node, where the command line says every setting (each a node of its
    # own to torch): the step's tasks are its launchers.
    per_node = tasks_per_node(env) if "SLURM_STEP_ID" in env else None
    tasks = sum(per_node[1]) if per_node else 0
    if count is not None and fewest > max(count, tasks):
        out.append(
            f"warning: --nnodes {nnodes} needs {fewest} nodes, but Slurm starts launchers on "
            f"{count} ({slurm_nodes.source}={count}): unless another step's launchers join "
            "this rendezvous, it waits for nodes that never start, until its timeout. Give "
            f"--nnodes {count} (or leave it out: Slurm's count is the default), or ask Slurm "
            f"for {fewest} nodes (srun -N {fewest})"
        )
    return out


def _too_few(
    nnodes: str, most: int, started: str, count: int, who: str, ask: str, standalone: bool
) -> list[str]:
    """``--standalone``'s line; else the refusal of ``--nnodes`` admitting ``most`` nodes
    where ``count`` launchers were ``started``."""
    if standalone:
        return [f"--standalone: {started}, and each runs a one-node job of its own"]
    fate = (
        "each would run a job of its own"
        if most == 1
        else f"those past {most} would wait for a rendezvous that never takes them"
    )
    shell = ""
    if who == "Slurm":
        shell = " (also in an interactive srun shell, which runs one launcher)"
    raise ClusterError(
        f"--nnodes {nnodes} admits at most {most} node(s), but {started}: {fate}. Give "
        f"--nnodes {count} (or leave it out: {who}'s count is the default), {ask}, or pass "
        f"--standalone for a one-node job on each node{shell}, or --cluster none to read no "
        f"{who} variables"
    )
