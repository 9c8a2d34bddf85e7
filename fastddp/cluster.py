"""Read cluster environments (Slurm, MPI, plain variables) into launcher and rank settings.

Everything here is a pure function of an environment mapping, so the tables can be tested
without a cluster. :mod:`fastddp.launch` turns the launcher settings into torchrun defaults;
:func:`fastddp.init_distributed` uses the per-process ones.
"""

import warnings
from collections.abc import Mapping
from typing import NamedTuple, Optional

from fastddp import nodelist as nodelist_
from fastddp import slurm_env
from fastddp.slurm_env import slurm_port, srun_task

__all__ = [
    "ClusterError",
    "Setting",
    "VariableError",
    "expand_nodelist",
    "launcher_settings",
    "process_settings",
    "slurm_port",
    "srun_task",
    "unread",
]

DEFAULT_PORT = 29500
# Names this process's node where host names do not (containers); it may differ between nodes.
NODE_ENV = "FASTDDP_NODE_ID"


class ClusterError(RuntimeError):
    """The environment describes a launch that cannot work; the message says how to fix it."""


class VariableError(ClusterError):
    """A cluster variable's value cannot be read (a malformed node list, a count that is not a
    number)."""


class Setting(NamedTuple):
    value: object
    source: str  # the variable(s) it came from, e.g. "SLURM_NODEID"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm host list such as ``node[01-04,07],gpu5`` into host names, in order
    (:func:`fastddp.nodelist.expand`); a malformed one raises :class:`VariableError`."""
    try:
        return nodelist_.expand(nodelist)
    except ValueError as e:
        raise VariableError(str(e)) from None


def _slurm_port(env: Mapping[str, str]) -> Setting:
    port = slurm_port(env.get("SLURM_JOB_ID", "0"), env.get("SLURM_STEP_ID", "0"))
    return Setting(port, "SLURM_JOB_ID and SLURM_STEP_ID")


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name)
    if raw is None:
        raise VariableError(f"{name} is not set; export it, or start under what sets it")
    try:
        return int(raw)
    except ValueError:
        # Kubernetes gives every pod MASTER_PORT=tcp://IP:PORT for a service named "master".
        hint = "; pass --master-port" if raw.startswith("tcp://") else ""
        raise VariableError(f"{name}={raw!r} is not an integer{hint}") from None


def _read(env: Mapping[str, str], name: str, key: str, given, parse) -> Setting:
    """``key``'s setting from the variable ``name``: ``parse()``d, unless ``key`` is set elsewhere
    (``given``): then the variable is not read, and its text is kept only to be reported."""
    return Setting(env[name] if key in given else parse(), name)


def _first(env: Mapping[str, str], *names: str) -> Optional[str]:
    for name in names:
        if env.get(name):
            return name
    return None


# A rank's index among its node's ranks, and their number: Open MPI's, MPICH's and Intel MPI's
# (Hydra), HPE Cray PALS', MVAPICH2's.
_MPI_LOCAL_RANK = (
    "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"
)  # fmt: skip
_MPI_LOCAL_SIZE = (
    "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"
)  # fmt: skip


def detect_kind(env: Mapping[str, str]) -> str:
    """Name the environment: ``mpi``, ``slurm``, ``env`` or ``none``."""
    # srun sets PMI_SIZE too (--mpi=pmi2); Intel MPI's or MPICH's mpirun inside an allocation
    # starts its daemons with srun, and its ranks inherit a daemon's SLURM_PROCID.
    if _first(env, "OMPI_COMM_WORLD_SIZE") or (_first(env, "PMI_SIZE") and not srun_task(env)):
        return "mpi"
    if _first(env, "SLURM_JOB_ID"):
        return "slurm"
    if _xtuner(env) or _first(env, "MASTER_ADDR", "MASTER_PORT"):
        return "env"
    return "none"


def _xtuner(env: Mapping[str, str]) -> bool:
    # XTuner's variables. Its ADDR and PORT are read only beside one of these: alone, names
    # that common (a web server's PORT) say nothing of a training job.
    return bool(_first(env, "NNODES", "NODE_RANK", "NPROC_PER_NODE"))


def unread(env: Mapping[str, str], kind: str) -> list[str]:
    """XTuner's variables set in ``env`` (``NAME=value``) that ``kind`` does not read: all under
    ``slurm`` and ``mpi``, whose own variables describe the launch, none elsewhere."""
    if kind not in ("slurm", "mpi") or not _xtuner(env):
        return []
    return [f"{n}={env[n]}" for n in ("NNODES", "NODE_RANK", "NPROC_PER_NODE", "ADDR", "PORT")
            if env.get(n)]  # fmt: skip


def _master_overlay(env: Mapping[str, str], out: dict, given=frozenset(), xtuner=False) -> None:
    # Explicit variables beat what a cluster implies: XTuner's ADDR/PORT (where its other
    # variables are read too), then MASTER_*.
    xtuner = xtuner and _xtuner(env)
    name = _first(env, *(["ADDR"] if xtuner else []), "MASTER_ADDR")
    if name:
        out["master_addr"] = Setting(env[name], name)
    name = _first(env, *(["PORT"] if xtuner else []), "MASTER_PORT")
    if name:  # a port set elsewhere (``given``) wins: this one is not read, nor checked
        out["master_port"] = _read(env, name, "master_port", given, lambda: _int(env, name))


# What detection decides. Where all of them are set elsewhere (--standalone, the command line)
# the environment decides nothing, and several launchers a node are the user's choice.
_DETECTED = frozenset({"nnodes", "node_rank", "master_addr", "master_port"})


def launcher_settings(
    env: Mapping[str, str], kind: str = "auto", gpus_on_node: int = 0, given=frozenset()
) -> tuple[str, dict[str, Setting]]:
    """Settings for one launcher per node, keyed by torchrun's option names.

    Args:
        env: the environment, e.g. ``os.environ``.
        kind: ``auto`` (detect), ``slurm``, ``mpi``, ``env`` or ``none``.
        gpus_on_node: GPUs visible here; under Slurm it sets ``nproc_per_node`` when Slurm
            does not say.
        given: settings known from elsewhere (the command line, ``PET_*``): not required
            here (mpirun's master address), and their variables are not read (a malformed
            one is no error); each is returned with the variable's text.

    Returns:
        ``(kind, settings)``, where settings maps ``nnodes``, ``node_rank``, ``master_addr``,
        ``master_port`` and ``nproc_per_node`` (those known) to :class:`Setting`.

    Raises:
        ClusterError: the environment asks for something that cannot work, such as ``srun``
            starting several launchers per node (unless ``given`` holds all that detection
            decides: nnodes, node rank and master).
    """
    if kind == "auto":
        kind = detect_kind(env)
    out: dict[str, Setting] = {}
    if kind == "slurm":
        if not env.get("SLURM_JOB_ID"):
            raise ClusterError("--cluster slurm, but SLURM_JOB_ID is not set: not in a Slurm job")
        why = slurm_env.several_tasks(env)
        if why and not given >= _DETECTED:
            raise ClusterError(why)
        name = _first(env, *slurm_env.NODE_COUNTS)
        if name:
            out["nnodes"] = _read(env, name, "nnodes", given, lambda: str(_int(env, name)))
        if env.get(node := "SLURM_NODEID"):
            out["node_rank"] = _read(env, node, "node_rank", given, lambda: _int(env, node))
        nodes = _first(env, *slurm_env.NODE_LISTS)
        if nodes:
            try:
                out["master_addr"] = Setting(
                    expand_nodelist(env[nodes])[0], f"first host of {nodes}"
                )
            except VariableError:
                if "master_addr" not in given:
                    raise
                out["master_addr"] = Setting(env[nodes], nodes)  # not read: no error
        out["master_port"] = _slurm_port(env)
        gpus = "SLURM_GPUS_ON_NODE"
        if "nproc_per_node" in given and env.get(gpus):
            out["nproc_per_node"] = Setting(env[gpus], gpus)
        elif env.get(gpus) and _int(env, gpus) > 0:  # 0: a job without GPUs says nothing here
            out["nproc_per_node"] = Setting(str(_int(env, gpus)), gpus)
        elif gpus_on_node > 0:
            out["nproc_per_node"] = Setting(str(gpus_on_node), "GPUs visible on this node")
    elif kind == "mpi":
        size = _first(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
        rank = _first(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
        if size is None or rank is None:
            raise ClusterError("--cluster mpi, but no OMPI_COMM_WORLD_* or PMI_* variables are set")
        local = _first(env, *_MPI_LOCAL_SIZE)
        if local and _int(env, local) > 1 and not given >= _DETECTED:
            raise ClusterError(
                f"mpirun started {env[local]} processes per node ({local}), so each node would "
                "run several launchers. Start one per node (mpirun --npernode 1 / -ppn 1), or "
                "run the training script directly under mpirun with fastddp.init_distributed(); "
                "or pass --cluster none to read no MPI variables"
            )
        out["nnodes"] = _read(env, size, "nnodes", given, lambda: str(_int(env, size)))
        out["node_rank"] = _read(env, rank, "node_rank", given, lambda: _int(env, rank))
        if not (env.get("MASTER_ADDR") or {"master_addr", "rdzv_endpoint"} & given):
            raise ClusterError(
                "mpirun does not say which host is the master: export MASTER_ADDR to all "
                "nodes (mpirun -x MASTER_ADDR=<first host> ...), pass --master-addr (or a "
                "c10d --rdzv-endpoint), or pass --cluster none to read no MPI variables"
            )
    elif kind == "env":
        for var, key in (("NNODES", "nnodes"), ("NPROC_PER_NODE", "nproc_per_node")):
            if env.get(var):
                out[key] = _read(env, var, key, given, lambda var=var: str(_int(env, var)))
        if env.get("NODE_RANK"):
            out["node_rank"] = _read(
                env, "NODE_RANK", "node_rank", given, lambda: _int(env, "NODE_RANK")
            )
    elif kind != "none":
        raise ClusterError(f"unknown cluster kind {kind!r}; use auto, none, slurm, mpi or env")
    if kind != "none":
        _master_overlay(env, out, given, xtuner=kind == "env")
    return kind, out


def process_settings(env: Mapping[str, str]) -> tuple[str, dict[str, Setting]]:
    """Settings of one training process: rank, world_size, local_rank, master address/port.

    Understands torchrun and ``fastddp.launch`` workers, hand-set ``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``, ``srun`` with one task per GPU and
    ``mpirun``. With none of them, a single process (world size 1).

    Returns:
        ``(source, settings)``: source is ``torchrun``, ``env``, ``slurm``, ``mpi`` or
        ``single``; settings maps ``rank``, ``world_size``, ``local_rank``, ``master_addr``
        and ``master_port`` (and ``local_world_size``/``node_rank`` when known).
    """
    out: dict[str, Setting] = {}
    if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
        source = "torchrun" if env.get("TORCHELASTIC_RUN_ID") else "env"
        out["rank"] = Setting(_int(env, "RANK"), "RANK")
        out["world_size"] = Setting(_int(env, "WORLD_SIZE"), "WORLD_SIZE")
        if env.get("LOCAL_RANK") is None:
            raise ClusterError(
                "RANK and WORLD_SIZE are set but LOCAL_RANK is not; set LOCAL_RANK to this "
                "process's index on its node (0 on a single node with one process per GPU "
                "means LOCAL_RANK=RANK)"
            )
        out["local_rank"] = Setting(_int(env, "LOCAL_RANK"), "LOCAL_RANK")
        if env.get("LOCAL_WORLD_SIZE"):
            out["local_world_size"] = Setting(_int(env, "LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE")
        name = _first(env, "GROUP_RANK", "NODE_RANK")
        if name:
            out["node_rank"] = Setting(_int(env, name), name)
        if not env.get("MASTER_ADDR") or not env.get("MASTER_PORT"):
            raise ClusterError(
                "RANK and WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are not; export both "
                "(the address and a free port of rank 0's host) on every process"
            )
        _master_overlay({k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT")}, out)
        return source, out
    if srun_task(env):
        out["rank"] = Setting(_int(env, "SLURM_PROCID"), "SLURM_PROCID")
        out["world_size"] = Setting(_int(env, tasks := slurm_env.step_tasks(env)), tasks)
        out["local_rank"] = Setting(_int(env, "SLURM_LOCALID"), "SLURM_LOCALID")
        if env.get("SLURM_NODEID"):
            out["node_rank"] = Setting(_int(env, "SLURM_NODEID"), "SLURM_NODEID")
        counts = slurm_env.tasks_per_node(env)
        if counts is not None:  # this node's count (a step's nodes may run different numbers)
            name, per_node = counts
            node = out["node_rank"].value if "node_rank" in out else 0
            out["local_world_size"] = Setting(per_node[min(node, len(per_node) - 1)], name)
        name = _first(env, *slurm_env.NODE_LISTS)
        if name:
            out["master_addr"] = Setting(expand_nodelist(env[name])[0], f"first host of {name}")
        out["master_port"] = _slurm_port(env)
        _master_overlay(env, out)
        _warn_unread(env, "slurm")
        if "master_addr" not in out:
            raise ClusterError(
                "srun task without SLURM_JOB_NODELIST or MASTER_ADDR: export MASTER_ADDR "
                "(rank 0's host) to every task"
            )
        return "slurm", out
    rank = _first(env, "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    size = _first(env, "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    if rank and size:
        out["rank"] = Setting(_int(env, rank), rank)
        out["world_size"] = Setting(_int(env, size), size)
        local = _first(env, *_MPI_LOCAL_RANK)
        out["local_rank"] = Setting(_int(env, local) if local else 0, local or "default 0")
        local_size = _first(env, *_MPI_LOCAL_SIZE)
        if local_size:
            out["local_world_size"] = Setting(_int(env, local_size), local_size)
        _master_overlay(env, out)
        _warn_unread(env, "mpi")
        if "master_addr" not in out:
            raise ClusterError(
                "started by mpirun, but MASTER_ADDR is not set: export it to every rank "
                "(mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port> ...)"
            )
        out.setdefault("master_port", Setting(DEFAULT_PORT, "default"))
        if local is None and out["world_size"].value > 1:
            warnings.warn(
                f"fastddp: started by mpirun ({rank}, {size}), but no variable names this "
                f"rank's index on its node ({', '.join(_MPI_LOCAL_RANK)}): taking 0, as for "
                "one rank per node; with several, export LOCAL_RANK, RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT to each rank",
                stacklevel=3,
            )
        return "mpi", out
    # One of the two alone is a job set up by hand with a variable left out: each process
    # would train alone as rank 0 of 1, without a word.
    for given, missing in (("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "RANK")):
        if env.get(given) is not None and env.get(missing) is None:
            raise ClusterError(
                f"{given} is set but {missing} is not; export RANK, WORLD_SIZE, LOCAL_RANK, "
                f"MASTER_ADDR and MASTER_PORT on every process (or unset {given} for a "
                "single process)"
            )
    tasks = env.get("SLURM_NTASKS", "")
    if env.get("SLURM_JOB_ID") and tasks.isdigit() and int(tasks) > 1:  # a batch script's
        warnings.warn(
            f"fastddp: this Slurm job has SLURM_NTASKS={tasks}, but this process is no srun "
            "task (SLURM_STEP_ID is not set), so it runs alone, as rank 0 of 1; start the "
            f"script with srun to run {tasks} ranks",
            stacklevel=3,
        )
    return "single", {
        "rank": Setting(0, "single process"),
        "world_size": Setting(1, "single process"),
        "local_rank": Setting(0, "single process"),
    }


def _warn_unread(env: Mapping[str, str], kind: str) -> None:
    # A rank reads only the master of XTuner's variables (ADDR, PORT).
    if names := [n for n in unread(env, kind) if n.startswith(("ADDR=", "PORT="))]:
        warnings.warn(
            f"fastddp: {', '.join(names)}: XTuner's variables are not read under {kind}, whose "
            "own variables and MASTER_ADDR/MASTER_PORT name the master",
            stacklevel=4,
        )
