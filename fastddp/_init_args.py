"""The arguments of :func:`fastddp.init_distributed`, checked before anything else runs."""

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

__all__ = ["checked_arguments"]


def checked_arguments(backend: Optional[str], timeout: timedelta) -> Optional[str]:
    """Return ``backend`` as torch names it (lower case), or raise on a bad argument."""
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"fastddp.init_distributed: timeout must be a datetime.timedelta, got "
            f"{type(timeout).__name__} (timedelta(minutes=10), say)"
        )
    if timeout <= timedelta(0):  # (torch's own error came from C++, after the group's store)
        raise ValueError(f"fastddp.init_distributed: timeout must be positive, got {timeout}")
    # torch's names are lower case: "NCCL" passed this module's checks of "nccl" and failed in
    # torch, and a typo failed an assert deep in it.
    if backend is None or (isinstance(backend, str) and ":" in backend):  # "cpu:gloo,cuda:nccl"
        return backend
    if not isinstance(backend, str) or backend.lower() not in dist.Backend.backend_list:
        raise ValueError(
            f"fastddp.init_distributed: unknown backend {backend!r}; use 'nccl' (GPUs) or "
            "'gloo' (CPU), or leave it None to choose by the device"
        )
    return backend.lower()
