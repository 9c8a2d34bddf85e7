"""A pool of processes, one per rank of this machine, that run functions one call after another,
each call in a fresh Gloo process group, and bring back what each rank returned.

A :class:`RankPool` runs each call under a key prefix of its own on one TCP store held by the
caller. Between calls a rank puts back what a call may have changed: the environment (each call
gets the caller's), the working directory, torch's seed, default dtype and threads, the warning
filters, and the attributes of fastddp's modules and classes (a hook's default state, a method
patched to plant a defect). A rank that raises, dies or outlives the call's timeout fails that
call; every rank of the pool is then replaced before the next call.
"""

import multiprocessing.forkserver
import os
import pickle
import signal
import time
from collections.abc import Sequence
from datetime import timedelta
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable, Optional

import torch.distributed as dist
import torch.multiprocessing as mp

from fastddp.testing import slack
from fastddp.testing._rank import serve

__all__ = ["RankError", "RankPool", "pid_running", "stop_fork_server"]

# How long a pool's processes may take to start (import torch, connect to the store).
START_TIMEOUT = 120.0
# What the ranks' fork server imports once, so that a rank starts with it: torch, fastddp and
# the rank's loop (2.3 CPU s a rank when each imported them), and the compiler stack that
# DistributedDataParallel's constructor imports (torch 2.13 asks torch._dynamo for its mode:
# another second a rank).
PRELOAD = ["fastddp.testing._rank", "torch._dynamo"]
# After one rank fails, how long the others get to report before they are stopped: they are
# usually blocked in a collective with the failed rank, which only the group's timeout ends.
GRACE = 3.0


class RankError(RuntimeError):
    """A call failed on some rank: it raised, died or did not finish in time."""


class RankPool:
    """Processes for ``world_size`` ranks that run one function after another.

    Each :meth:`run` joins the ranks in a new Gloo group whose collectives give up after
    ``timeout``, calls the function on every rank, and destroys the group. The processes start
    at the first call, forked from a server that has imported :data:`PRELOAD`, each with
    ``threads`` torch threads (several ranks share the cores).

    Args:
        world_size: the number of ranks.
        threads: torch threads per rank.
        timeout: the process groups' timeout.
        restore: put back after each call what a call may have changed (see the module's
            docstring); a pool for one call can skip that (it costs a rank a second at start).

    Example::

        >>> with RankPool(2) as pool:
        ...     pool.run(mean_rank)  # mean_rank: see fastddp.testing.spawn.spawn_ranks
        ...     pool.run(mean_rank, timeout=30.0)
        [0.5, 0.5]
        [0.5, 0.5]
    """

    def __init__(
        self,
        world_size: int,
        *,
        threads: int = 1,
        timeout: timedelta = timedelta(minutes=5),
        restore: bool = True,
    ):
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}")
        self.world_size = world_size
        self.threads = threads
        self.timeout = timeout
        self.restore = restore
        self._store: Optional[dist.TCPStore] = None
        self._procs: list = []
        self._conns: list = []
        self._calls = 0

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (empty before the first call and after a failed one)."""
        return [p.pid for p in self._procs]

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        timeout: Optional[float] = None,
        env: Optional[Sequence[dict[str, str]]] = None,
    ) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        Args:
            fn: a module-level function (it is pickled by name).
            args: picklable arguments, the same on every rank.
            timeout: seconds the call may take, from when the ranks are up; ``None``: no limit
                but the group's.
            env: per rank, variables set on top of this process's environment for the call.

        Returns:
            What each rank's call returned; a result that does not pickle, or unpickle in this
            process, comes back as a string that says so.

        .. warning::
            A rank that raises, dies or hangs raises :class:`RankError` (``TimeoutError`` for a
            hang), with what the first rank to die, or else the first to raise, said; all
            ranks are replaced.
        """
        if env is not None and len(env) != self.world_size:
            raise ValueError(f"env has {len(env)} entries for {self.world_size} ranks")
        payload = pickle.dumps((fn, args))
        self._start()
        self._calls += 1
        done = False
        try:
            for rank, conn in enumerate(self._conns):
                call_env = {**os.environ, **(env[rank] if env else {})}
                conn.send_bytes(pickle.dumps(("run", self._calls, payload, call_env, os.getcwd())))
            results = self._collect(fn, timeout)
            done = True
            return results
        finally:
            if not done:
                self._stop(kill=True)

    def close(self) -> None:
        """Stop the ranks (a later :meth:`run` starts new ones)."""
        self._stop(kill=False)
        self._store = None

    def _start(self) -> None:
        if self._procs and all(_running(p) for p in self._procs):
            return
        self._stop(kill=True)  # a rank that died between calls: start them all again
        if self._store is None:
            self._store = dist.TCPStore(
                "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=self.timeout
            )
        ctx = _context()
        for rank in range(self.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=serve,
                args=(
                    rank,
                    self.world_size,
                    theirs,
                    self._store.port,
                    self.threads,
                    self.timeout,
                    self.restore,
                ),
                name=f"fastddp-rank-{rank}",
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        limit = slack.guard(START_TIMEOUT)  # a hang guard: rank start-ups slow with the machine
        deadline = time.monotonic() + limit
        try:
            for rank, conn in enumerate(self._conns):
                left = deadline - time.monotonic()
                if not conn.poll(max(left, 0.0)):
                    raise RankError(f"rank {rank} did not start within {limit:.0f} s")
                conn.recv_bytes()
        except BaseException:
            self._stop(kill=True)
            raise

    def _collect(self, fn, timeout: Optional[float]) -> list[Any]:
        n = self.world_size
        results: list[Any] = [None] * n
        failures: list[tuple[int, bool, str]] = []  # (rank, died, what), in the order they came
        pending = set(range(n))
        deadline = None if timeout is None else time.monotonic() + timeout
        grace_end = None
        while pending:
            now = time.monotonic()
            ends = [t for t in (deadline, grace_end) if t is not None]
            if ends and now >= min(ends):
                break
            wait = min(ends) - now if ends else None
            handles = {}
            for rank in pending:
                handles[self._conns[rank]] = rank
                handles[self._procs[rank].sentinel] = rank
            for ready in connection.wait(list(handles), wait):
                rank = handles[ready]
                if rank not in pending:
                    continue
                pending.discard(rank)
                kind, value = self._outcome(rank, ready)
                if kind == "ok":
                    results[rank] = _unpickled(value)
                elif kind == "died":
                    failures.append((rank, True, value))
                else:
                    failures.append((rank, False, f"rank {rank} raised:\n{value}"))
            if failures and grace_end is None:
                grace_end = time.monotonic() + GRACE
        if not pending and not failures:
            return results
        name = getattr(fn, "__qualname__", repr(fn))
        if not failures:
            self._dump_stacks(pending)
            raise TimeoutError(
                f"{name}: ranks {sorted(pending)} of {n} did not finish within {timeout:.0f} s "
                "(their Python stacks are on stderr)"
            )
        # A rank that died comes first: the others raise because of it (a collective with it
        # broke), and may say so before its death shows here.
        failures.sort(key=lambda failure: not failure[1])
        first_rank, _, first = failures[0]
        lines = [f"{name} failed on rank {first_rank}; {first}"]
        # The others' failures usually follow from the first: their last line is enough.
        lines += [f"then {_summary(text)}" for _, _, text in failures[1:]]
        if pending:
            lines.append(f"ranks {sorted(pending)} were stopped after rank {first_rank} failed")
        raise RankError("\n".join(lines))

    def _outcome(self, rank: int, ready) -> tuple[str, Any]:
        """What rank's call gave, once its pipe or process is ready: ("ok", result), ("error",
        traceback) or ("died", why)."""
        conn = self._conns[rank]
        try:
            if ready is not conn and not conn.poll():
                raise EOFError
            return pickle.loads(conn.recv_bytes())
        except (EOFError, ConnectionResetError):
            # Its exit status comes from the fork server, which reaps it: a hang guard.
            self._procs[rank].join(slack.guard(10))
            return "died", f"rank {rank} died (exit code {self._procs[rank].exitcode})"

    def _dump_stacks(self, ranks) -> None:
        for rank in ranks:
            if self._procs[rank].is_alive():
                os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(0.5)

    def _stop(self, kill: bool) -> None:
        for proc, conn in zip(self._procs, self._conns):
            if kill:
                proc.kill()
            else:
                try:
                    conn.send_bytes(pickle.dumps(("stop",)))
                except OSError:
                    proc.kill()
        for proc, conn in zip(self._procs, self._conns):
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
            conn.close()
        self._procs, self._conns = [], []


def _context():
    """Ranks are forked from multiprocessing's fork server, which imports :data:`PRELOAD` and
    nothing else: never from the caller, which may hold threads, locks or CUDA."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def stop_fork_server() -> None:
    """Stop multiprocessing's fork server, if it runs, and wait for it. The processes forked
    from it are its children: waited for, they count in this process's children's CPU time
    (which ``tests/streams.py`` reports). A later fork starts a new server."""
    server = getattr(multiprocessing.forkserver, "_forkserver", None)
    if server is not None and hasattr(server, "_stop"):
        server._stop()


def _running(proc) -> bool:
    # A killed process whose threads are still being torn down is not waitable yet, so
    # is_alive() says True; its thread-group leader is already a zombie.
    return proc.is_alive() and pid_running(proc.pid)


def pid_running(pid: int) -> bool:
    """Whether process ``pid`` still runs: not a zombie, and not already reaped (by the fork
    server, for a rank). Without procfs, True."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self/stat").exists()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _summary(failure: str) -> str:
    lines = [line for line in failure.splitlines() if line.strip()]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def _unpickled(data: bytes) -> Any:
    # A result that unpickles only on its rank (a DDP model wants its process group) comes
    # back as a description.
    try:
        return pickle.loads(data)
    except Exception as e:
        return f"<a result that does not unpickle here: {type(e).__name__}: {e}>"
