"""Loopback-only stores for single-node launches.

torchrun's agent hosts its c10d stores (the rendezvous store and the workers' store) with
``TCPStore``, whose server listens on every interface, even for ``--standalone``, where only
this machine's processes ever connect. The stores have no authentication, so anyone who can
reach the port can read and write the job's keys. :func:`loopback_stores` makes every store
server created inside it listen on 127.0.0.1 only, by handing ``TCPStore`` a socket already
bound there (its ``master_listen_fd`` argument).
"""

import contextlib
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

__all__ = ["loopback_stores"]


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
    """Within this block, store servers made by torch's launcher listen on loopback only."""
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
