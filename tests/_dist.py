"""Run a function on several real processes joined by a Gloo process group.

The ranks are pooled (:class:`fastddp.testing.pool.RankPool`): one pool per world size, started
at its first use and kept for the session; each call gets a fresh group and fastddp's state as
a rank starts with it. Tests whose ranks must be processes of their own (CUDA initialised in
them) are marked ``cuda`` and get a pool for their call alone (see ``conftest.py``).
"""

import atexit
from datetime import timedelta

from fastddp.testing import slack
from fastddp.testing.pool import RankError, RankPool, stop_fork_server

__all__ = ["PG_TIMEOUT", "RankError", "close_pools", "pool", "run_ranks"]

# Every collective gives up after this long, so a broken test fails instead of hanging: a hang
# guard, scaled to the machine like the calls' limits.
PG_TIMEOUT = timedelta(seconds=slack.guard(60))

_pools: dict[int, RankPool] = {}
# Set by conftest.py for the duration of a test whose ranks must not be shared.
own_processes = False


def pool(world_size: int) -> RankPool:
    """The session's pool of ``world_size`` ranks."""
    if world_size not in _pools:
        _pools[world_size] = RankPool(world_size, timeout=PG_TIMEOUT)
    return _pools[world_size]


def run_ranks(fn, world_size, *args, timeout=180.0, nodes=None):
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return their results.

    A rank that raises fails the call with that rank's traceback (:class:`RankError`), one that
    hangs past ``timeout`` seconds (a hang guard, scaled by :func:`slack.guard`) with
    ``TimeoutError``; the pool's ranks are then replaced.
    ``fn`` must be a module-level function (it is pickled by name). ``nodes``, per rank, sets
    ``FASTDDP_NODE_ID`` for the call, to make several "nodes" of one machine.
    """
    env = None if nodes is None else [{"FASTDDP_NODE_ID": f"node-{n}"} for n in nodes]
    timeout = slack.guard(timeout)
    if own_processes:
        with RankPool(world_size, timeout=PG_TIMEOUT) as own:
            return own.run(fn, *args, timeout=timeout, env=env)
    return pool(world_size).run(fn, *args, timeout=timeout, env=env)


@atexit.register
def close_pools():
    for p in _pools.values():
        p.close()
    _pools.clear()
    stop_fork_server()  # the ranks' parent
