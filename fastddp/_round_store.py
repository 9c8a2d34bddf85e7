"""A fresh store for the workers of every rendezvous round, so that restarts start clean.

The workers of a torchrun job meet through a ``TCPStore`` (``MASTER_ADDR``/``MASTER_PORT``):
Gloo publishes each rank's address there, NCCL its unique id. torch 2.13 serves that store
from node 0's agent and keeps the same one for the whole job: the static rendezvous always,
the c10d rendezvous unless ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``. Workers add no prefix per
attempt (``torch.distributed.rendezvous._create_c10d_store``), so after ``--max-restarts``
brings a failed attempt back, a restarted rank can read a key the previous attempt left and
connect to a dead process: Gloo's ``connectFullMesh`` fails with "Connection refused" (8 of 12
restarts on one node, measured), NCCL's bootstrap likewise (pytorch/pytorch#135712, #167288).

Three ways out were weighed against torch's source:

- ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` fixes the c10d rendezvous only (the static one
  ignores it), and moves the store into rank 0's worker on a port chosen by probing, so the
  store dies with that worker and listens on every interface, even for ``--standalone``.
- A prefix per attempt needs a number every node agrees on. ``TORCHELASTIC_RESTART_COUNT`` is
  per agent: a node started again after it was lost counts from 0 while the others do not.
- **A fresh store per round, served by the agent** (chosen): node 0's agent starts a new
  ``TCPStore`` server on a port the kernel assigns, every time the rendezvous completes, and
  publishes its port under that round's keys; every agent hands it to its workers. Each
  attempt sees only its own keys, the store outlives the workers (the reason torch moved it
  into the agent), a restart of a lost node works, and :func:`fastddp._loopback.loopback_stores`
  still keeps a standalone job's stores on 127.0.0.1.

It is installed through torch's public rendezvous registry: :func:`install` renames the
launch's backend to ``fastddp-<backend>``, whose handler wraps torch's own handler for
``<backend>`` and changes only the store address given to the workers.
"""

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

__all__ = ["MARKER", "RoundStoreError", "RoundStoreHandler", "install"]

# Set in every store made here: a worker that finds it knows the store holds only its attempt.
MARKER = "fastddp/round_store"
_PREFIX = "fastddp-"
_ARRIVALS = "fastddp/round_store/arrivals"


class RoundStoreError(RuntimeError):
    """A restarted round could not get its workers' store; the message names the cause."""


class RoundStoreHandler(RendezvousHandler):
    """torch's handler for one backend, with a new workers' store for every round.

    Args:
        inner (RendezvousHandler): torch's handler for the backend.
        timeout (timedelta): how long a node waits for node 0 to publish the round's store.
    """

    def __init__(self, inner: RendezvousHandler, timeout: timedelta) -> None:
        self._inner = inner
        self._backend = _PREFIX + inner.get_backend()
        self._timeout = timeout
        self._server: Optional[dist.TCPStore] = None

    def next_rendezvous(self) -> RendezvousInfo:
        info = self._inner.next_rendezvous()
        self._server = None  # the previous round's workers are gone: close their store
        store, rank = info.store, info.rank
        # The c10d rendezvous gives a store per round; the static one the same store for the
        # whole job. Counting arrivals numbers the rounds alike on every node, since every
        # node (a restarted one too) joins each round once.
        try:
            arrivals = store.add(_ARRIVALS, 1)
        except RuntimeError as e:
            raise RoundStoreError(
                f"the rendezvous store is unreachable ({e}): node 0's launcher has exited, so "
                "this node cannot start its workers again"
            ) from None
        round_ = (arrivals - 1) // info.world_size
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
            why = (
                "node 0 did not restart its workers: its launcher exited, or it has fewer "
                "--max-restarts than this node"
                if round_
                else "node 0 was not started by fastddp.launch, or it was started with "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE set and this node without"
            )
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
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._server = None
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
    return RoundStoreHandler(inner, timedelta(seconds=seconds))


def install(config) -> None:
    """Make the launch ``config`` (a ``LaunchConfig``) give its workers a store per round."""
    name = _PREFIX + config.rdzv_backend
    rendezvous_handler_registry.register(name, _create)  # a no-op the second time
    config.rdzv_backend = name
