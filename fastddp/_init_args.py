"""The arguments of :func:`fastddp.init_distributed`, checked before anything else runs."""

import math
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from fastddp.cluster import ClusterError
from fastddp.watchdog import MIN_PEER_TIMEOUT_S

__all__ = [
    "DEFAULT_TIMEOUT",
    "checked_arguments",
    "checked_peer_timeout",
    "check_again",
    "uses_nccl",
]

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
    pairs = _pairs(backend) if isinstance(backend, str) else [(None, None)]
    if any(not _device_type(d) or n is None or n.lower() not in dist.Backend.backend_list
           for d, n in pairs):  # fmt: skip
        raise ValueError(
            f"fastddp.init_distributed: unknown backend {backend!r}; use 'nccl' (GPUs) or "
            "'gloo' (CPU), or 'cpu:gloo,cuda:nccl', or leave it None to choose by the device"
        )
    return backend.lower()


def _pairs(backend: str) -> list[tuple[str, str]]:
    """(device, backend) of each part of "cpu:gloo,cuda:nccl"; a plain name is ("cpu", name)."""
    if ":" not in backend:
        return [("cpu", backend)]
    return [tuple(p.partition(":")[::2]) for p in backend.split(",")]


def _device_type(name: Optional[str]) -> bool:
    try:  # (torch's own list; "gpu" or " cuda" failed in torch after the rendezvous)
        return isinstance(name, str) and torch.device(name).type == name
    except RuntimeError:
        return False


def uses_nccl(backend: str) -> bool:
    """Whether the (checked) backend puts CUDA tensors on NCCL: "nccl", or "cuda:nccl" among
    a device's pairs, so that the ranks take a GPU each."""
    return backend == "nccl" or ("cuda", "nccl") in _pairs(backend)


def checked_peer_timeout(peer_timeout) -> float:
    """``peer_timeout`` (given) as the watchdog takes it, or raise."""
    number = isinstance(peer_timeout, (int, float)) and not isinstance(peer_timeout, bool)
    if not number or not 0 <= peer_timeout < math.inf:
        raise ClusterError(
            "peer_timeout must be a number of seconds, 0 (off) or positive and finite, got "
            f"{peer_timeout!r}"
        )
    if 0 < peer_timeout < MIN_PEER_TIMEOUT_S:
        raise ClusterError(
            f"peer_timeout={peer_timeout!r} is shorter than {MIN_PEER_TIMEOUT_S:g} s, the least "
            "the watchdog takes; use 0 to turn it off"
        )
    return peer_timeout


def check_again(first: dict, backend, timeout, peer_timeout) -> None:
    """Refuse a later call's arguments that differ from those the group was made with (the
    ``first`` call's, resolved), which it would otherwise ignore."""
    if peer_timeout is not None:
        checked_peer_timeout(peer_timeout)
    given = {"backend": backend, "timeout": timeout, "peer_timeout": peer_timeout}
    for name, value in given.items():
        # (first["peer_timeout"] is None where no watchdog runs: one process)
        if value is not None and first[name] is not None and value != first[name]:
            raise ClusterError(
                f"fastddp.init_distributed: already initialised with {name}={first[name]!r}, "
                f"not {value!r}; call fastddp.shutdown_distributed() first to change it"
            )
