"""Joining a job: the store ranks meet through, and a check that every rank can start.

Some problems are one rank's or one node's alone: a local rank without its GPU (more tasks
than GPUs on a node), a node whose driver shows no GPU (so it would pick Gloo where the
others pick NCCL). A rank that raises there leaves the others waiting in
``init_process_group`` until its timeout. So every rank first posts what it would start with
to the store, waits for all, and all raise the same error if any rank cannot start.
"""

import contextlib
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from fastddp.cluster import ClusterError
from fastddp.launch.store import MARKER as ROUND_STORE_MARKER

__all__ = ["agree", "said_after", "said_while_waiting", "store_for"]

_KEY = "fastddp/join/"
# How long rank 0, whose process serves the store, stays for the others to read a failure.
_LINGER = timedelta(seconds=30)
_GO = "go"  # the verdict of a roll every rank came to
# How long a rank started by hand waits for the others before it says so.
WAIT_SAY_S = 20.0
# The stores this process joined through, by (address, port, world size, rank).
_JOINED: dict[tuple, dist.Store] = {}


@contextlib.contextmanager
def said_while_waiting(
    rank: int, world: int, addr: str, port: int, after_s: Optional[float] = None
) -> Iterator[None]:
    """Print one line if the body (joining the others) takes longer than ``after_s``.

    For ranks started by hand: one that was never started, or given another ``MASTER_PORT``,
    would leave the others waiting in silence until their timeout (10 minutes by default).
    """
    after_s = WAIT_SAY_S if after_s is None else after_s
    with said_after(
        after_s,
        f"fastddp.init_distributed: rank {rank} has waited {after_s:g} s for the other "
        f"{world - 1} rank(s) at {addr}:{port}; start every rank with the same "
        "WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and RANK 0 to WORLD_SIZE-1)",
    ):
        yield


@contextlib.contextmanager
def said_after(after_s: float, text: str) -> Iterator[None]:
    """Print ``text`` to stderr once if the body takes longer than ``after_s`` seconds."""

    def say() -> None:
        print(text, file=sys.stderr, flush=True)

    timer = threading.Timer(after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def store_for(
    launcher: str,
    env,
    addr: str,
    port: int,
    rank: int,
    world: int,
    timeout: timedelta,
    join: int = 0,
) -> tuple[dist.Store, str, Optional[str]]:
    """The store of this launch attempt, the attempt's name (for the peer watchdog), and what
    :func:`agree` should add where a rank never comes or a RANK is taken (or None).

    ``join`` counts this process's earlier joins (a session after
    :func:`~fastddp.shutdown_distributed`): from the second on, the keys get a prefix of their
    own, as the first join's are still in the store, and torch names the new group as it
    named the old one.
    """
    store, attempt, hint = _store_for(launcher, env, addr, port, rank, world, timeout)
    if join == 0:
        return store, attempt, hint
    return dist.PrefixStore(f"fastddp/join-{join}/", store), f"{attempt}/join-{join}", hint


def _apart_hint(env, world: int) -> Optional[str]:
    """Under plain torchrun on several nodes: why ranks that were all started may never meet,
    or meet the keys of an earlier round."""
    local = env.get("LOCAL_WORLD_SIZE") or ""
    if local.isdigit() and int(local) >= world:
        return None  # one node: every rank counts the same restarts
    return (
        f"under torchrun, this node's workers have restarted "
        f"{env.get('TORCHELASTIC_RESTART_COUNT', 0)} time(s); torchrun keeps one store across "
        "restarts and counts a restart only on a node whose workers failed, so ranks of nodes "
        "that counted differently wait apart, or meet an earlier round's keys; "
        "python -m fastddp.launch gives every round a store of its own"
    )


def _store_for(launcher, env, addr, port, rank, world, timeout):
    attempt = f"{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    if launcher == "torchrun" and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun's agent already serves the store on MASTER_PORT: every rank is a client.
        client = _client(addr, port, timeout)
        if client.check([ROUND_STORE_MARKER]):
            # fastddp.launch serves a fresh store per round: it holds this attempt's keys only,
            # and the restart count may differ between nodes (a node started again counts
            # from 0), so no prefix.
            return client, env.get("TORCHELASTIC_RUN_ID", ""), None
        # Plain torchrun keeps one store across restarts (--max-restarts) and torch's env://
        # adds no per-attempt prefix, so a restarted rank could read the previous attempt's
        # Gloo addresses and connect to a dead process. A prefix per attempt avoids it on
        # one node (the restart count is per node).
        prefixed = dist.PrefixStore(f"fastddp/attempt/{attempt}/", client)
        return prefixed, attempt, _apart_hint(env, world)
    # As torch's env:// and tcp:// make it: rank 0 serves, for this attempt alone. A later
    # join of this process keeps the first join's store (its keys under a prefix): a new one
    # would make rank 0 close its server and open another, and a rank that connected to the
    # old one in between would wait on a closed store.
    # No world size for torch's own count of workers: rank 0 would wait in it for as many as
    # its own WORLD_SIZE, so ranks given different ones would never reach agree(), which says
    # so (and waits for the others with the same timeout).
    key = (addr, port, world, rank)
    if key not in _JOINED:
        try:
            _JOINED[key] = (
                dist.TCPStore(
                    addr, port, None, True, timeout, wait_for_workers=False, multi_tenant=True
                )
                if rank == 0
                else _client(addr, port, timeout)
            )
        except dist.DistNetworkError as e:
            if rank != 0 or "EADDRINUSE" not in str(e):
                raise
            raise ClusterError(
                f"fastddp.init_distributed: rank 0 serves the job's store at MASTER_PORT={port}, "
                "and that port is taken on this host: another job uses it, or another process "
                "was given RANK=0 as well; give each process its own RANK, and each job its own "
                "MASTER_PORT"
            ) from None
    else:
        _JOINED[key].set_timeout(timeout)  # this join's, for its waits and its group's
    return _JOINED[key], attempt, None


def _client(addr: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A client of the store at ``addr:port``, within ``timeout`` (and a few seconds) or a
    :class:`ClusterError`: torch's client waits for good on a server that accepts and never
    answers (rank 0's process stopped while serving it, or another program on the port)."""
    made: list = []

    def connect() -> None:
        try:
            made.append(dist.TCPStore(addr, port, None, False, timeout, wait_for_workers=False))
        except Exception as e:  # (its own timeout, a refusal: raised below as torch's)
            made.append(e)

    thread = threading.Thread(target=connect, name="fastddp-store-client", daemon=True)
    thread.start()
    thread.join(timeout.total_seconds() + 5.0)
    if not made:
        raise ClusterError(
            f"fastddp.init_distributed: the job's store at {addr}:{port} took this rank's "
            f"connection but did not answer within the timeout ({timeout}): the process that "
            "serves it (rank 0's where the ranks were started by hand, by srun or by mpirun) "
            "is stopped or hung, or another program holds MASTER_PORT"
        )
    if isinstance(made[0], Exception):
        raise made[0]
    return made[0]


def agree(
    store: dist.Store,
    rank: int,
    world: int,
    backend: str,
    problem: Optional[str],
    hint: Optional[str] = None,
    gpu: Optional[tuple[str, str]] = None,
    launcher: str = "env",
) -> None:
    """Post this rank's backend and ``problem`` (None: it can start); wait for every rank.

    Raises the same :class:`ClusterError` on every rank if any rank has a problem, the ranks
    chose different backends or were given different ``WORLD_SIZE``, or two ranks' ``gpu``
    (``(uuid, where)``, :func:`fastddp.gpu_choice.gpu_identity`) have one UUID; and a
    :class:`ClusterError` naming the ranks that never came (``hint``: :func:`store_for`'s; the
    advice ``launcher``'s) if the store's timeout runs out first. Every rank calls it once.
    """
    if store.add(f"{_KEY}rank/{rank}", 1) > 1:
        # Posted nothing but this: the job whose store this is goes on without this rank, and
        # its ranks name the RANK given twice if they time out waiting for another.
        with contextlib.suppress(Exception):
            store.append(f"{_KEY}twice", f"{rank} ")
        raise ClusterError(
            f"fastddp.init_distributed: another process joined the store at MASTER_ADDR:"
            f"MASTER_PORT as RANK {rank} already: two processes were given the same RANK, or "
            "another job uses that port; give each process its own RANK, and each job its own "
            "port" + (f"; {hint}" if hint else "")
        )
    store.append(f"{_KEY}came", f"{rank} ")  # read in one request by a rank that gives up
    if gpu is not None:
        problem = _gpu_taken(store, rank, gpu, problem)
    if store.add(f"{_KEY}backend/{backend}", 1) == 1:
        store.append(f"{_KEY}backends", backend + "\n")
    if store.add(f"{_KEY}world/{world}", 1) == 1:
        store.append(f"{_KEY}worlds", f"{world}\n")
    if problem is not None:
        store.append(f"{_KEY}ranks", f"{rank} ")
        store.compare_set(f"{_KEY}first", "", f"rank {rank}: {problem}")
    # The verdict is the value of "all", set once (compare_set): "go" by the rank whose arrival
    # completes the roll, or the reason of a rank that gave up waiting first; every rank acts
    # on the one value, so none starts while another gives up.
    start = time.monotonic()
    try:
        # Each rank posts its WORLD_SIZE before it arrives, so the worlds read after arriving
        # hold those of all who arrived. Where they differ, the smallest is as many as are sure
        # to come (counted up to its own WORLD_SIZE, a rank could wait for ranks that do not
        # exist).
        arrived = store.add(f"{_KEY}arrived", 1)
        if arrived >= min(map(int, store.get(f"{_KEY}worlds").decode().split())):
            store.compare_set(f"{_KEY}all", "", _GO)
        store.wait([f"{_KEY}all"])
        verdict = store.get(f"{_KEY}all")
    except dist.DistError as e:  # the timeout ran out, or the store's server went away
        verdict = _gave_up(store, rank, world, time.monotonic() - start, e, hint, launcher)
    if verdict != _GO.encode():
        _told(store, rank)
        raise ClusterError(verdict.decode())
    backends = store.get(f"{_KEY}backends").decode().split()
    worlds = store.get(f"{_KEY}worlds").decode().split()
    bad = store.get(f"{_KEY}ranks").decode().split() if store.check([f"{_KEY}ranks"]) else []
    if not bad and len(backends) == 1 and len(worlds) == 1:
        return
    lines = []
    if len(worlds) > 1:
        counts = ", ".join(
            f"{store.add(f'{_KEY}world/{w}', 0)} rank(s) WORLD_SIZE={w}" for w in sorted(worlds)
        )
        lines.append(
            f"the ranks were started with different WORLD_SIZE ({counts}); give all the same"
        )
    if bad:
        shown = ", ".join(sorted(bad, key=int)[:16]) + (", ..." if len(bad) > 16 else "")
        lines.append(
            f"{len(bad)} of {world} rank(s) cannot start ({shown}); "
            + store.get(f"{_KEY}first").decode()
        )
    if len(backends) > 1:
        counts = ", ".join(
            f"{store.add(f'{_KEY}backend/{b}', 0)} rank(s) {b}" for b in sorted(backends)
        )
        lines.append(
            f"the ranks chose different backends ({counts}): a node where torch sees no GPU "
            "picks gloo; check CUDA_VISIBLE_DEVICES and the driver on every node, or pass the "
            "same backend= on every rank"
        )
    _told(store, rank)
    raise ClusterError("fastddp.init_distributed: " + "; ".join(lines))


def _gpu_taken(
    store: dist.Store, rank: int, gpu: tuple[str, str], problem: Optional[str]
) -> Optional[str]:
    """``problem``, and that another rank holds this rank's GPU where one does: the first to
    post a UUID holds it, and the second's problem stops every rank."""
    uuid, where = gpu
    mine = f"{rank}\t{where}"
    holder = store.compare_set(f"{_KEY}gpu/{uuid}", "", mine).decode()
    if holder == mine:
        return problem
    other, other_where = holder.split("\t", 1)
    clash = (
        f"ranks {other} ({other_where}) and {rank} ({where}) use the same GPU ({uuid}); give "
        "each rank a GPU of its own: at most one process per GPU on each node, and each task "
        "its own CUDA_VISIBLE_DEVICES where it sees one GPU"
    )
    return clash if problem is None else f"{problem}; {clash}"


# What a rank that gave up advises. Under srun and mpirun the launcher set every rank's
# variables: there the advice is about its tasks.
_TASKS = "every task of the {} must reach init_distributed: look in the output of those that "
_ADVICE = {k: _TASKS.format(v) + "never came for an error or an exit before it"
           for k, v in (("slurm", "srun step"), ("mpi", "mpirun job"))}  # fmt: skip


def _gave_up(store: dist.Store, rank: int, world: int, waited: float, error: Exception,
             hint: Optional[str], launcher: str = "env") -> bytes:  # fmt: skip
    """The verdict of a rank whose wait in :func:`agree` failed: ``_GO`` where the roll was
    completed meanwhile, else its reason (which ranks never came), posted as the verdict for
    every rank that came, where the store is still there."""
    missing: list[str] = []
    twice: list[str] = []
    with contextlib.suppress(Exception):  # (the store may be gone): say what is known
        if store.check([f"{_KEY}all"]):  # another rank gave up first, or the roll completed
            return store.get(f"{_KEY}all")
        # Two requests whatever the world size: thousands of ranks giving up together would
        # make millions of one rank's checks.
        came = set(store.get(f"{_KEY}came").decode().split())
        missing = [str(r) for r in range(world) if str(r) not in came]
        if store.check([f"{_KEY}twice"]):
            twice = sorted(set(store.get(f"{_KEY}twice").decode().split()), key=int)
    gone = isinstance(error, dist.DistNetworkError)
    who = "not every rank came"
    if gone:
        who = "the store went away (the process that served it ended?)"
    elif missing:
        shown = ", ".join(missing[:16]) + (", ..." if len(missing) > 16 else "")
        who = f"{len(missing)} of {world} rank(s) never came ({shown})"
    if twice and not gone:
        who += f", and RANK {', '.join(twice)} was given to two processes (the second raised)"
    if missing and hint:
        who += f"; {hint}"
    advice = _ADVICE.get(launcher) or (
        "start every rank with the same WORLD_SIZE, MASTER_ADDR and MASTER_PORT (and RANK 0 to "
        "WORLD_SIZE-1)"
    )
    message = (
        f"fastddp.init_distributed: rank {rank} waited {waited:.0f} s for the others, and {who}; "
        f"{advice}, or give init_distributed a longer timeout"
    )
    try:
        return store.compare_set(f"{_KEY}all", "", message)
    except Exception:  # the store is gone: this rank says so alone
        return message.encode()


def _told(store: dist.Store, rank: int) -> None:
    """Count this rank as told why the ranks stop; rank 0, whose process serves the store
    where the ranks were started by hand, stays until every rank that came is told (or a
    while): its exit would take the store away from them, and they would fail in torch's
    terms."""
    with contextlib.suppress(Exception):  # a store gone, or a rank gone: raise anyway
        # (every rank that arrived, of whatever WORLD_SIZE, is told)
        if store.add(f"{_KEY}told", 1) >= store.add(f"{_KEY}arrived", 0):
            store.set(f"{_KEY}told-all", "1")
        if rank == 0:
            store.wait([f"{_KEY}told-all"], _LINGER)
