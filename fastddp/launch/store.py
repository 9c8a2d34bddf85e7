"""The workers' stores: fresh for every rendezvous round, and on loopback for one node.

:func:`restart_store` decides how the workers' store survives restarts and membership
changes; :func:`install` gives a launch a new store per round (:class:`RoundStoreHandler`
says why this mechanism); :func:`loopback_stores` keeps a single-node launch's store servers
on 127.0.0.1.
"""

import argparse
import contextlib
import dataclasses
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from fastddp.launch import failures

__all__ = [
    "MARKER",
    "RoundStoreError",
    "RoundStoreHandler",
    "StorePlan",
    "install",
    "loopback_stores",
    "restart_store",
]

# Set in every store made here: a worker that finds it knows the store holds only its attempt.
MARKER = "fastddp/round_store"
_PREFIX = "fastddp-"
_SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_LAUNCH: dict = {}  # what install() knows of the launch and the handler does not


# ------------------------------------------------------------------------ the plan for restarts


@dataclasses.dataclass
class StorePlan:
    """How the workers of every rendezvous round get a store without the last round's keys.

    ``fresh``: a new store per rendezvous round (:func:`install`); ``environment``: variables
    to set for torch's own handler; ``say``: the lines for the launch summary.
    """

    fresh: bool = False
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    say: list[str] = dataclasses.field(default_factory=list)


def restart_store(args: argparse.Namespace, environ=os.environ) -> StorePlan:
    """Decide how the workers' store survives restarts and membership changes.

    Every round gets a fresh store, served by node 0's launcher, on every rendezvous backend,
    also in a job without ``--max-restarts``: each node decides alone, and nodes that decided
    differently (say, different ``--max-restarts``) would wait for each other's store. A user's
    own ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` wins on the c10d rendezvous (the only one that
    reads it): ``1`` makes rank 0's worker serve a store per attempt, ``0`` keeps torch's shared
    store, whose restarts can read the previous attempt's keys.
    """
    c10d = args.rdzv_backend == "c10d"
    if c10d and _SHARE_VAR in environ:
        value = environ[_SHARE_VAR]
        line = f"restarts: {_SHARE_VAR}={value} is yours, so torch's own workers' store is kept"
        if value != "1":
            line += (
                "; warning: a restarted attempt can read the previous attempt's addresses "
                f"and fail to connect (unset {_SHARE_VAR} to get a fresh store per round)"
            )
        return StorePlan(say=[line])
    plan = StorePlan(fresh=True)
    if c10d:
        # torch's c10d handler must not share its own store: a node that joins a later round
        # would wait for an address that the surviving nodes never publish again.
        plan.environment[_SHARE_VAR] = "1"
    plan.say.append(
        f"restarts: a fresh workers' store for every rendezvous round, served by node 0's "
        f"launcher ({args.rdzv_backend} rendezvous), so that no attempt reads the keys of the "
        "one before"
    )
    return plan


# -------------------------------------------------------------------- a fresh store per round


class RoundStoreError(RuntimeError):
    """A restarted round could not get its workers' store; the message names the cause."""


class RoundStoreHandler(RendezvousHandler):
    """torch's handler for one backend, with a new workers' store for every round.

    The workers of a torchrun job meet through a ``TCPStore`` (``MASTER_ADDR``/
    ``MASTER_PORT``): Gloo publishes each rank's address there, NCCL its unique id. torch 2.13
    serves that store from node 0's agent and keeps the same one for the whole job: the static
    rendezvous always, the c10d rendezvous unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``.
    Workers add no prefix per attempt (``torch.distributed.rendezvous._create_c10d_store``), so
    after ``--max-restarts`` brings a failed attempt back, a restarted rank can read a key the
    previous attempt left and connect to a dead process: Gloo's ``connectFullMesh`` fails with
    "Connection refused" (8 of 12 restarts on one node, measured), NCCL's bootstrap likewise
    (pytorch/pytorch#135712, #167288). Three ways out were weighed against torch's source:

    - ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` fixes the c10d rendezvous only (the static one
      ignores it), and moves the store into rank 0's worker on a port chosen by probing, so
      the store dies with that worker and listens on every interface, even for
      ``--standalone``.
    - A prefix per attempt needs a number every node agrees on. ``TORCHELASTIC_RESTART_COUNT``
      is per agent: a node started again after it was lost counts from 0 while the others do
      not.
    - **A fresh store per round, served by the agent** (this class): node 0's agent starts a
      new ``TCPStore`` server on a port the kernel assigns, every time the rendezvous
      completes, and publishes its port under that round's keys; every agent hands it to its
      workers. Each attempt sees only its own keys, the store outlives the workers (the reason
      torch moved it into the agent), a restart of a lost node works, and
      :func:`loopback_stores` still keeps a standalone job's stores on 127.0.0.1.

    Args:
        inner (RendezvousHandler): torch's handler for the backend.
        timeout (timedelta): how long a node waits for node 0 to publish the round's store.
    """

    def __init__(self, inner: RendezvousHandler, timeout: timedelta, roll_call=None) -> None:
        self._inner = inner
        self._backend = _PREFIX + inner.get_backend()
        self._timeout = timeout
        self._server: Optional[dist.TCPStore] = None
        self._roll_call = roll_call  # for the first round only (roster.py)
        self._joined = (-1, 0)  # the round this node's workers run, and its nodes

    def next_rendezvous(self) -> RendezvousInfo:
        roll_call, self._roll_call = self._roll_call, None
        if roll_call is None:
            info = self._inner.next_rendezvous()
        else:
            roll_call.start()
            try:
                if self._inner.get_backend() != "static":  # (static: node 0 serves it in there)
                    roll_call.checked_in()
                info = self._inner.next_rendezvous()
                problem = roll_call.confirm(info.world_size)
            finally:
                roll_call.stop()
            if problem is not None:
                raise RoundStoreError(problem)
            roll_call.hand_over()
            failures.keep(self._inner)
        self._server = None  # the previous round's workers are gone: close their store
        store, rank = info.store, info.rank
        # The c10d rendezvous gives a store per round; the static one the same store for the
        # whole job. Counting arrivals numbers the rounds alike on every node, since every
        # node (a restarted one too) joins each round once.
        try:
            arrivals = store.add(failures.ARRIVALS, 1)
        except RuntimeError as e:
            raise RoundStoreError(
                f"the rendezvous store is unreachable ({e}): node 0's launcher has exited, so "
                "this node cannot start its workers again"
            ) from None
        round_ = (arrivals - 1) // info.world_size
        self._joined = (round_, info.world_size)
        key = f"fastddp/round_store/{round_}"
        if rank == 0:
            addr = info.bootstrap_store_info.master_addr
            self._server = dist.TCPStore(
                addr, 0, is_master=True, wait_for_workers=False, multi_tenant=True
            )
            self._server.set(MARKER, str(round_))
            store.set(key, f"{addr} {self._server.port}")
        try:
            store.wait([key], self._timeout)
            addr, port = store.get(key).decode().split()
        except RuntimeError as e:
            restarted = (
                "node 0 did not restart its workers: its launcher exited, or it has fewer "
                "--max-restarts than this node"
            )
            first = (
                "node 0 was not started by fastddp.launch, or it was started with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE set and this node without"
            )
            # (The c10d rendezvous gives a store per round, whose count starts at 0: any round.)
            per_round = self._inner.get_backend() != "static"
            why = restarted if round_ else f"{restarted}; or {first}" if per_round else first
            raise RoundStoreError(
                f"node 0 did not publish the workers' store for round {round_} within "
                f"{self._timeout.total_seconds():.0f} s ({e}): {why}"
            ) from None
        return RendezvousInfo(store, rank, info.world_size, RendezvousStoreInfo(addr, int(port)))

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers are clients of the store served above

    def get_backend(self) -> str:
        return self._backend  # torch's registry checks that it is the name it was asked for

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        round_, world = self._joined
        arrived = failures.arrived()
        if self._inner.get_backend() == "static" and round_ >= 0 and arrived >= 0:
            # torch's static handler says 0, always: a node whose workers failed and restarted
            # then waits for a round the others never join, while theirs wait for its ranks.
            # Counted as nodes waiting, torch's agents restart their workers to meet it.
            waiting = max(waiting, arrived - (round_ + 1) * world)
        return waiting

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        # The workers' store stays until the process exits: after a failure here the other
        # nodes' workers then wait for the note that stops them (failures.py), rather than
        # fail on a closed store first.
        return self._inner.shutdown()

    def __getattr__(self, name: str):
        return getattr(self._inner, name)  # anything else a torch version asks of its handler


def _create(params: RendezvousParameters) -> RendezvousHandler:
    backend = params.backend[len(_PREFIX) :]
    inner = rendezvous_handler_registry.create_handler(
        RendezvousParameters(
            backend,
            params.endpoint,
            params.run_id,
            params.min_nodes,
            params.max_nodes,
            params.local_addr,
            **params.config,
        )
    )
    # The rendezvous's own patience: join_timeout (c10d), timeout (static), else 600 s.
    seconds = params.get_as_int("join_timeout") or params.get_as_int("timeout") or 600
    roll_call = None
    if params.max_nodes > 1:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        from fastddp.launch import cards, roster

        static = backend == "static"
        rank = params.get_as_int("rank") if static else None
        card = cards.this_node(rank, params.min_nodes, params.max_nodes, backend, _LAUNCH)
        endpoint = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
        roll_call = roster.RollCall(endpoint, params.run_id, card, timedelta(seconds=seconds))
    return RoundStoreHandler(inner, timedelta(seconds=seconds), roll_call)


def install(config) -> None:
    """Make the launch ``config`` (a ``LaunchConfig``) give its workers a store per round.

    It goes through torch's public rendezvous registry: the launch's backend is renamed
    ``fastddp-<backend>``, whose handler wraps torch's own handler for ``<backend>`` and
    changes only the store address given to the workers.
    """
    name = _PREFIX + config.rdzv_backend
    rendezvous_handler_registry.register(name, _create)  # a no-op the second time
    # For this node's roll-call card.
    _LAUNCH.update(max_restarts=config.max_restarts, nproc_per_node=config.nproc_per_node)
    config.rdzv_backend = name


# ------------------------------------------------------------------------ stores on loopback


class _LoopbackTCPStore(dist.TCPStore):
    """A ``TCPStore`` whose server, if it is one, listens on 127.0.0.1 only."""

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size=None,
        is_master: bool = False,
        timeout: timedelta = timedelta(seconds=300),
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd=None,
        use_libuv: bool = True,
    ) -> None:
        if is_master and master_listen_fd is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(("127.0.0.1", port))
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            port = sock.getsockname()[1]
            master_listen_fd = sock.detach()  # the store owns it from here
        try:
            super().__init__(
                host_name, port, world_size, is_master, timeout, wait_for_workers,
                multi_tenant, master_listen_fd, use_libuv,
            )  # fmt: skip
        except BaseException:
            if master_listen_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(master_listen_fd)
            raise


@contextlib.contextmanager
def loopback_stores() -> Iterator[None]:
    """Within this block, store servers made by torch's launcher listen on loopback only.

    torchrun's agent hosts its c10d stores (the rendezvous store and the workers' store) with
    ``TCPStore``, whose server listens on every interface, even for ``--standalone``, where
    only this machine's processes ever connect. The stores have no authentication, so anyone
    who can reach the port could read and write the job's keys. Here every store server gets
    a socket already bound to 127.0.0.1 (``TCPStore``'s ``master_listen_fd`` argument).
    """
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

    # The modules that create store servers: torch.distributed (dynamic rendezvous, elastic
    # utils) and two that imported the class by name.
    owners = [dist, c10d_rendezvous_backend, static_tcp_rendezvous]
    saved = [owner.TCPStore for owner in owners]
    for owner in owners:
        owner.TCPStore = _LoopbackTCPStore
    try:
        yield
    finally:
        for owner, original in zip(owners, saved):
            owner.TCPStore = original
