"""Run a function on ranks of this machine, joined by a Gloo process group, and bring back what
each rank returned.

One mechanism for the tests, the benchmark scripts, ``python -m fastddp.bench`` and the demo:
:func:`spawn_ranks` runs one call on processes of its own (a :class:`RankPool` used once); the
tests keep pools for the session (``tests/_dist.py``).

Within :func:`pooled`, :func:`spawn_ranks` runs its calls on pools given to it instead: the
test suite runs the benchmarks' command lines in its own process on its pooled ranks, as a
rank process costs 3 CPU-s to start and a benchmark's smoke run a fraction of that.
"""

import contextlib
import io
import sys
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from fastddp.testing.pool import RankError, RankPool

__all__ = ["RankError", "RankPool", "pooled", "spawn_ranks"]


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
    returns, so whatever ``fn`` built (a DDP model holds the group) is freed before. A
    :class:`RankPool` used for one call.

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
    if _pool_of is not None:
        replies = _pool_of(world_size).run(_pooled_call, threads, fn, *args)
        for _, out, err in replies:  # what each rank printed, here as from processes of its own
            sys.stdout.write(out)
            sys.stderr.write(err)
        return [result for result, _, _ in replies]
    with RankPool(world_size, threads=threads, timeout=timeout, restore=False) as pool:
        return pool.run(fn, *args)


# Set by pooled(): the pool of each world size that spawn_ranks uses instead of its own.
_pool_of: Optional[Callable[[int], RankPool]] = None


@contextlib.contextmanager
def pooled(pool_of: Callable[[int], RankPool]):
    """Within this block, :func:`spawn_ranks` calls ``pool_of(world_size).run`` instead of
    starting processes of its own, and prints here what each rank printed; the pool's group
    timeout then applies."""
    global _pool_of
    previous, _pool_of = _pool_of, pool_of
    try:
        yield
    finally:
        _pool_of = previous


def _pooled_call(rank: int, world_size: int, threads: int, fn, *args):
    """``fn``'s result and what it printed, on a pooled rank set up as spawn_ranks' own."""
    torch.set_num_threads(threads)  # the pool puts its own back after the call
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = fn(rank, world_size, *args)
    except BaseException:
        sys.stderr.write(err.getvalue())  # shown with the rank's traceback
        raise
    return result, out.getvalue(), err.getvalue()
