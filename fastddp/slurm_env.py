"""What Slurm's variables say of a job step: its port, whether a process is an srun task, its
counts (the step's, not the allocation's), and its tasks on each node. Pure functions of an
environment mapping (:mod:`fastddp.cluster` reads them into launcher and rank settings)."""

import re
from collections.abc import Mapping
from typing import Optional

__all__ = [
    "NODE_COUNTS",
    "NODE_LISTS",
    "several_tasks",
    "slurm_port",
    "srun_task",
    "step_tasks",
    "tasks_per_node",
]

# The variables of the node count and the node list. A step on some of the job's nodes
# (srun -N1) counts SLURM_NODEID among its own, and srun -E keeps the job's SLURM_NNODES: the
# step's first.
NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
NODE_LISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """A port from the Slurm job and step ids: the same on every node of a step, rarely shared
    by two jobs or by two steps of one job run at once. In 20000-29999, below Linux's
    ephemeral range (32768-60999)."""
    job, step = (int(re.sub(r"\D", "", i or "") or "0") for i in (job_id, step_id))
    return 20000 + (job + 1009 * step) % 10000


def srun_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of ``srun``, and not a rank of an mpirun that started
    its daemons with ``srun`` (inside an allocation), whose ranks inherit a daemon's
    ``SLURM_PROCID`` and step. Open MPI's variables are set by its mpirun alone; ``PMI_SIZE``
    by srun too (``--mpi=pmi2``), so there mpirun shows in a world size other than the
    step's number of tasks (:func:`step_tasks`)."""
    if env.get("SLURM_PROCID") is None or env.get("SLURM_STEP_ID") is None:
        return False
    if env.get("OMPI_COMM_WORLD_SIZE"):
        return False
    return not env.get("PMI_SIZE") or env["PMI_SIZE"] == env.get(step_tasks(env))


def step_tasks(env: Mapping[str, str]) -> str:
    """The variable that holds the step's number of tasks: ``SLURM_STEP_NUM_TASKS`` where set,
    else ``SLURM_NTASKS``. ``srun -E`` (``--preserve-env``) keeps the allocation's
    ``SLURM_NTASKS`` and ``SLURM_NNODES``; only the ``SLURM_STEP_*`` counts are the step's."""
    return "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"


# The step's first: an srun step inherits the job's --ntasks-per-node.
_SLURM_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def tasks_per_node(env: Mapping[str, str]) -> Optional[tuple[str, list[int]]]:
    """The tasks on each node, in node order, and the variable that says so: Slurm writes
    ``2(x3),1`` for 2, 2, 2, 1 (``SLURM_NTASKS_PER_NODE``: one count, for every node)."""
    for name in _SLURM_PER_NODE:
        if env.get(name) and re.match(r"\d+", env[name]):
            counts = []
            for count, times in re.findall(r"(\d+)(?:\(x(\d+)\))?", env[name]):
                counts += [int(count)] * int(times or 1)
            return name, counts
    return None


def several_tasks(env: Mapping[str, str]) -> Optional[str]:
    """Why a launcher per task of this srun step cannot work where the step runs several tasks
    on a node (each would start its own workers), with the fixes; else None."""
    counts = tasks_per_node(env)
    if env.get("SLURM_STEP_ID") is None or counts is None or max(counts[1]) < 2:
        return None
    name, per_node = counts[0], max(counts[1])
    return (
        f"srun started {per_node} tasks per node ({name}={env[name]}), so each node would run "
        f"{per_node} launchers, each starting its own workers. Start one launcher per node "
        "(srun --ntasks-per-node=1 python -m fastddp.launch ...), or run the training script "
        "directly under srun and call fastddp.init_distributed() in it; for one launcher (in "
        "an interactive srun shell), pass --standalone, or --cluster none to read no Slurm "
        "variables"
    )
