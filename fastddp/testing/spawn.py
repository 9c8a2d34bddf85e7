"""Spawn ranks on this machine, joined by a Gloo process group, and bring back their results.

What the benchmark scripts, ``python -m fastddp.bench`` and the demo share when no launcher
started them: a file store in a temporary directory, one process per rank, and a clean exit
that skips the interpreter's finalisation (see :func:`fastddp.distributed.exit_after_shutdown`).
"""

import os
import pickle
import tempfile
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastddp.distributed import exit_after_shutdown

__all__ = ["spawn_ranks"]


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    timeout: timedelta = timedelta(minutes=5),
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes; return what
    each rank's call returned, in rank order.

    Each process sets ``threads`` torch threads (several ranks share the cores) and joins a
    Gloo group whose collectives give up after ``timeout``; the group is destroyed when ``fn``
    returns, so whatever ``fn`` built (a DDP model holds the group) is freed before.

    .. warning::
        ``fn`` must be a module-level function (it is pickled by name), and its results
        picklable. A rank that raises fails the call with that rank's traceback.

    Example::

        >>> def mean_rank(rank, world):
        ...     t = torch.tensor([float(rank)])
        ...     dist.all_reduce(t)
        ...     return t.item() / world
        >>> spawn_ranks(mean_rank, 2)
        [0.5, 0.5]
    """
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(
            _entry,
            args=(fn, world_size, init, tmp, args, threads, timeout),
            nprocs=world_size,
            start_method="spawn",
        )
        results = []
        for rank in range(world_size):
            with open(_result_path(tmp, rank), "rb") as f:
                results.append(pickle.load(f))
        return results


def _result_path(tmp: str, rank: int) -> str:
    return os.path.join(tmp, f"result-{rank}.pkl")


def _entry(rank, fn, world_size, init, tmp, args, threads, timeout):
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world_size, timeout=timeout
    )
    try:
        result = fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    with open(_result_path(tmp, rank), "wb") as f:
        pickle.dump(result, f)
    exit_after_shutdown()
