"""Per-rank state in a ``torch.distributed.checkpoint`` (DCP) ``Stateful``.

Error-feedback residuals are each rank's own. DCP keeps one copy of a value saved under the
same key on every rank (it takes them for replicas), so each rank's state is saved as one
serialised value under a key naming its rank and the world size; a job of another size finds
no key of its own and gets :func:`unpack`'s error.
"""

import io
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["pack", "unpack"]


def _key() -> str:
    return f"rank{dist.get_rank()}_of_{dist.get_world_size()}"


def pack(state: Any) -> dict[str, bytes]:
    """``state`` (tensors on the CPU, plain Python values) under this rank's key."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return {_key(): buffer.getvalue()}


def unpack(state_dict: dict[str, bytes], where: str) -> Any:
    """What :func:`pack` saved on this rank; raise if this rank's key is missing."""
    key = _key()
    blob = state_dict.get(key)
    if not isinstance(blob, bytes) or not blob:
        saved = sorted(k for k in state_dict if isinstance(k, str))
        raise ValueError(
            f"{where}: the checkpoint holds no state for {key} (it holds "
            f"{saved[:4]}{'...' if len(saved) > 4 else ''}): it was saved by a job of another "
            "size. Error-feedback residuals belong to the shards they were saved with; resume "
            "on the same number of ranks, or leave this comm out of the state you load (its "
            "residuals then start from zero)"
        )
    return torch.load(io.BytesIO(blob), weights_only=True)
