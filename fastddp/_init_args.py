"""The arguments of :func:`fastddp.init_distributed`, checked before anything else runs."""

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from fastddp.cluster import ClusterError

__all__ = ["DEFAULT_TIMEOUT", "checked_arguments", "check_again"]

DEFAULT_TIMEOUT = timedelta(minutes=10)


def checked_arguments(backend: Optional[str], timeout: Optional[timedelta]) -> Optional[str]:
    """Return ``backend`` as torch names it (lower case), or raise on a bad argument."""
    if timeout is not None and not isinstance(timeout, timedelta):
        raise TypeError(
            f"fastddp.init_distributed: timeout must be a datetime.timedelta, got "
            f"{type(timeout).__name__} (timedelta(minutes=10), say)"
        )
    if timeout is not None and timeout <= timedelta(0):  # (torch's error came after the store)
        raise ValueError(f"fastddp.init_distributed: timeout must be positive, got {timeout}")
    if backend is None:
        return backend
    # torch's names are lower case: "NCCL" passed this module's checks of "nccl" and failed in
    # torch, and a typo failed an assert deep in it, in a device's part too ("cpu:glooo").
    names = [None]
    if isinstance(backend, str):
        names = [p.partition(":")[2] for p in backend.split(",")] if ":" in backend else [backend]
    if any(n is None or n.lower() not in dist.Backend.backend_list for n in names):
        raise ValueError(
            f"fastddp.init_distributed: unknown backend {backend!r}; use 'nccl' (GPUs) or "
            "'gloo' (CPU), or 'cpu:gloo,cuda:nccl', or leave it None to choose by the device"
        )
    return backend.lower()


def check_again(first: dict, backend, timeout, peer_timeout) -> None:
    """Refuse a later call's arguments that differ from those the group was made with (the
    ``first`` call's, resolved), which it would otherwise ignore."""
    given = {"backend": backend, "timeout": timeout, "peer_timeout": peer_timeout}
    for name, value in given.items():
        if value is not None and value != first[name]:
            raise ClusterError(
                f"fastddp.init_distributed: already initialised with {name}={first[name]!r}, "
                f"not {value!r}; call fastddp.shutdown_distributed() first to change it"
            )
