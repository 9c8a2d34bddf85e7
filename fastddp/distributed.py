"""Rank setup: find out who this process is, pick device and backend, init and tear down."""

import atexit
import contextlib
import dataclasses
import gc
import os
import sys
from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from fastddp import joining
from fastddp._init_args import (
    DEFAULT_TIMEOUT,
    check_again,
    checked_arguments,
    checked_peer_timeout,
    uses_nccl,
)
from fastddp.cluster import ClusterError, process_settings, srun_task
from fastddp.gpu_choice import cuda_index, gpu_identity
from fastddp.rank_notes import check_ranks, said_while_joining
from fastddp.watchdog import PeerWatchdog, peer_timeout_from_env

__all__ = [
    "DistEnv",
    "distributed_session",
    "init_distributed",
    "is_main_process",
    "shutdown_distributed",
]

_env: Optional["DistEnv"] = None
_watchdog: Optional[PeerWatchdog] = None
_excepthook = None  # the one before _on_uncaught
# Joins made by this process: each takes store keys of its own (see joining.store_for).
_joins = 0
_first: dict = {}  # the arguments _env was made with


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """Who this process is in the job, and where each value came from."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    device: torch.device
    backend: str
    master_addr: str
    master_port: int
    launcher: str  # torchrun, env, slurm, mpi or single
    sources: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(
    backend: Optional[str] = None,
    timeout: Optional[timedelta] = None,
    environ: Optional[Mapping[str, str]] = None,
    peer_timeout: Optional[float] = None,
) -> DistEnv:
    r"""Initialise ``torch.distributed`` from whatever started this process; return who it is.

    Works under ``torchrun`` / ``python -m fastddp.launch``, with hand-set ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, under ``srun`` with one
    task per GPU, under ``mpirun`` (with ``MASTER_ADDR`` exported), and alone (world size 1).
    Picks ``cuda:LOCAL_RANK`` and NCCL when CUDA is available (``cuda:0`` where a rank sees one
    GPU, as under ``srun --gpus-per-task=1``), else CPU and Gloo. Calling it
    again returns the same description (arguments given again must be the first call's).
    Before init, all ranks raise the same error if one cannot start (no GPU for its local rank)
    or two share a GPU, or they picked different backends; after init, they compare nodes and
    fastddp settings, and all raise if they disagree.

    Args:
        backend (str, optional): ``"nccl"``, ``"gloo"``, ... ; ``None`` picks as above.
        timeout (timedelta, optional): how long any collective may wait before failing with an
            error instead of hanging (default 10 minutes).
        environ (Mapping, optional): variables to read instead of ``os.environ``.
        peer_timeout (float, optional): seconds after which a rank that stopped answering
            (stopped, hung outside Python, dead without closing its sockets) is named and this
            rank exits with status 3 (:mod:`fastddp.watchdog`). ``None`` reads
            ``FASTDDP_PEER_TIMEOUT`` (default 300 for up to 64 ranks, else off); 0 is off.

    Returns:
        DistEnv: rank, local_rank, world_size, local_world_size, node_rank, num_nodes,
        device, backend, master address/port, the launcher and where each value came from.

    Example::

        >>> env = fastddp.init_distributed()
        >>> ids = [env.device] if env.device.type == "cuda" else None
        >>> model = DDP(model.to(env.device), device_ids=ids)
        >>> ...
        >>> fastddp.shutdown_distributed()
    """
    global _env, _joins, _first
    backend = checked_arguments(backend, timeout)
    if _env is not None and dist.is_initialized():
        check_again(_first, backend, timeout, peer_timeout)
        return _env
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    if dist.is_initialized():
        raise ClusterError(
            "fastddp.init_distributed: torch.distributed was initialised elsewhere; call "
            "init_distributed() instead of init_process_group(), or not at all"
        )
    env = os.environ if environ is None else environ
    try:
        launcher, settings = process_settings(env)
    except ClusterError as error:
        _tell_the_others(env, str(error), backend, timeout)
        raise
    rank = settings["rank"].value
    world = settings["world_size"].value
    local_rank = settings["local_rank"].value
    if not 0 <= rank < world:
        raise ClusterError(
            f"fastddp.init_distributed: rank {rank} is outside world size {world} "
            f"({settings['rank'].source}); ranks run from 0 to WORLD_SIZE - 1: give each "
            "process its own rank and all the same world size"
        )
    use_cuda = torch.cuda.is_available() if backend is None else uses_nccl(backend)
    # Problems of this rank's node alone: raised on every rank (joining.agree), not here.
    problem = None
    try:  # (FASTDDP_PEER_TIMEOUT may be set on one node only)
        peer_timeout = _peer_timeout(env, peer_timeout, world)
    except ClusterError as error:
        peer_timeout, problem = 0.0, str(error)
    if problem is None and use_cuda and not torch.cuda.is_available():
        problem = (
            "backend='nccl' needs a GPU, and torch sees none; pass backend='gloo' for the CPU, "
            "or leave backend=None to choose by the device"
        )
    index = gpu = None
    if problem is None and use_cuda:
        index, problem = cuda_index(local_rank, torch.cuda.device_count())
    if index is not None:
        gpu, problem = gpu_identity(index)
    backend = backend or ("nccl" if use_cuda else "gloo")
    if launcher == "single":
        if problem is not None:
            raise ClusterError("fastddp.init_distributed: " + problem)
        # One process meets nobody: an in-memory store, where a TCP one would listen on a port
        # taken free moments before (and then maybe taken by another process's connection).
        addr, port = "127.0.0.1", 0
        settings["master_addr"] = settings["master_port"] = None
        kwargs = {"store": dist.HashStore()}
        attempt = ""
    else:
        addr, port = settings["master_addr"].value, int(settings["master_port"].value)
        if not 0 < port < 65536:
            raise ClusterError(
                f"fastddp.init_distributed: MASTER_PORT={port} is not a TCP port; give one "
                f"from 1 to 65535 ({settings['master_port'].source})"
            )
        with said_while_joining(launcher, env, settings, addr, port):
            store, attempt, hint = joining.store_for(
                launcher, env, addr, port, rank, world, timeout, _joins
            )
            _joins += 1
            joining.agree(store, rank, world, backend, problem, hint, gpu, launcher)
        kwargs = {"store": store}
    if use_cuda:
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    try:
        known = settings.get("node_rank")
        local_world, node_rank, num_nodes = check_ranks(None if known is None else known.value, env)
        _start_watchdog(attempt, peer_timeout, rank, world, addr, int(port), launcher, env)
    except BaseException:
        dist.destroy_process_group()
        raise
    sources = {k: s.source for k, s in settings.items() if s is not None}
    sources.setdefault("node_rank", "host names of all ranks")
    sources["local_world_size"] = "ranks on the same node"
    watched = world > 1 and launcher != "single"  # (as _start_watchdog decides)
    _first = dict(backend=backend, timeout=timeout, peer_timeout=peer_timeout if watched else None)
    _env = DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        device=device,
        backend=backend,
        master_addr=addr,
        master_port=int(port),
        launcher=launcher,
        sources=sources,
    )
    return _env


def _peer_timeout(env, peer_timeout, world) -> float:
    if peer_timeout is None:
        return peer_timeout_from_env(env, world)
    return checked_peer_timeout(peer_timeout)


def _start_watchdog(attempt, peer_timeout, rank, world, addr, port, launcher, env) -> None:
    global _watchdog
    if peer_timeout == 0 or world == 1 or launcher == "single":
        return
    agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    watchdog = PeerWatchdog(
        addr, port, rank, world, peer_timeout, attempt, alive=dist.is_initialized,
        # (torchrun's agent serves it, where its workers share its store)
        store_in_rank0=not (launcher == "torchrun" and agent_store),
    )  # fmt: skip
    _watchdog = watchdog.start()
    # A rank that ends without shutdown_distributed() (after destroy_process_group(), or with
    # its group alive) says it finished, or a rank still at work names it lost; one that ends
    # with an uncaught exception says so first (sys.excepthook runs before atexit).
    atexit.register(watchdog.stop)
    global _excepthook
    if _excepthook is None:
        _excepthook = sys.excepthook
        sys.excepthook = _on_uncaught


def _on_uncaught(kind, value, traceback) -> None:
    _report(value)
    (_excepthook or sys.__excepthook__)(kind, value, traceback)


def _report(error: BaseException) -> None:
    """Tell the other ranks' watchdogs that this rank ends with ``error`` (a ``SystemExit``
    of status 0 or None is a finish)."""
    if _watchdog is None or isinstance(error, SystemExit) and error.code in (None, 0):
        return
    first = (str(error).splitlines() or [""])[0]
    name = type(error).__name__
    with contextlib.suppress(Exception):  # (the store may be gone)
        _watchdog.stop(failure=f"{name}: {first}"[:200] if first else name)


def _tell_the_others(env, problem: str, backend: Optional[str], timeout: timedelta) -> None:
    """This rank's variables are refused (``problem``): where it can still find the job's
    store, say so there, so that the others raise it too rather than wait for this rank."""
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return  # nothing to find the others by
    if not (0 <= rank < world and world > 1 and 0 < port < 65536) or env.get("TORCHELASTIC_RUN_ID"):
        return  # (a launcher's workers: it reports the failure itself)
    global _joins
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with contextlib.suppress(Exception):  # this rank raises its own error all the same
        store, _, _ = joining.store_for("env", env, addr, port, rank, world, timeout, _joins)
        _joins += 1
        joining.agree(store, rank, world, backend, problem)


def shutdown_distributed() -> None:
    """Destroy the process group made by :func:`init_distributed` (a no-op if there is none).

    .. warning::
        Free DDP models first (let them go out of scope, or ``del`` them): with PyTorch 2.13,
        a DDP model that outlives its process group can abort the process at exit
        ("terminate called without an active exception").
    """
    global _env, _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        atexit.unregister(_watchdog.stop)
        _watchdog = None
    if _env is not None and dist.is_initialized():
        gc.collect()  # DDP models caught in reference cycles release the group now
        dist.destroy_process_group()
    _env = None


def exit_after_shutdown(code: int = 0) -> None:
    """Flush output and end the process now, skipping interpreter finalisation.

    With torch 2.13, a Gloo process can abort during finalisation even after a clean
    ``destroy_process_group()`` ("terminate called without an active exception"), turning a
    good run into a failed one. fastddp's own workers call this once they are done.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def distributed_session(**kwargs) -> Iterator[DistEnv]:
    """``with fastddp.distributed_session() as env:`` — :func:`init_distributed`, then teardown.

    A session inside another (or after :func:`init_distributed`) uses the group already made
    (arguments given again must be the first call's) and leaves it to whoever made it.
    """
    made = not (_env is not None and dist.is_initialized())
    env = init_distributed(**kwargs)
    try:
        yield env
    except BaseException as error:
        if made:  # the group goes now: the others must hear why, not that this rank finished
            _report(error)
        raise
    finally:
        if made:
            shutdown_distributed()


def is_main_process() -> bool:
    """True on global rank 0, and in a process that is not part of a distributed job.

    Before :func:`init_distributed`, the rank a launcher gave the process decides (``RANK``,
    else ``SLURM_PROCID`` of an ``srun`` step, else mpirun's), so that work meant for rank 0
    alone runs once before the group exists too.
    """
    if dist.is_initialized():
        return dist.get_rank() == 0
    env = os.environ
    names = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
    if srun_task(env):  # a task of srun, not the batch script or mpirun's rank under Slurm
        names.insert(1, "SLURM_PROCID")
    for name in names:
        if env.get(name, "").strip().isdigit():
            return int(env[name]) == 0
    return True
