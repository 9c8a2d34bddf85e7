"""What Slurm's variables say of a job step: its port, whether a process is an srun task, and
its tasks on each node. Pure functions of an environment mapping (:mod:`fastddp.cluster`
reads them into launcher and rank settings)."""

import re
from collections.abc import Mapping
from typing import Optional

__all__ = ["slurm_port", "srun_task", "tasks_per_node"]


def slurm_port(job_id: str, step_id: str = "0") -> int:
    """A port from the Slurm job and step ids: the same on every node of a step, rarely shared
    by two jobs or by two steps of one job run at once. In 20000-29999, below Linux's
    ephemeral range (32768-60999)."""
    job, step = (int(re.sub(r"\D", "", i or "") or "0") for i in (job_id, step_id))
    return 20000 + (job + 1009 * step) % 10000


def srun_task(env: Mapping[str, str]) -> bool:
    """Whether this process is a task of ``srun``, and not a rank of an mpirun that started
    its daemons with ``srun`` (inside an allocation), whose ranks inherit a daemon's
    ``SLURM_PROCID`` and ``SLURM_NTASKS``. Open MPI's variables are set by its mpirun alone;
    ``PMI_SIZE`` by srun too (``--mpi=pmi2``), so there mpirun shows in a world size other
    than ``SLURM_NTASKS``."""
    if env.get("SLURM_PROCID") is None or env.get("SLURM_STEP_ID") is None:
        return False
    if env.get("OMPI_COMM_WORLD_SIZE"):
        return False
    return not env.get("PMI_SIZE") or env["PMI_SIZE"] == env.get("SLURM_NTASKS")


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
