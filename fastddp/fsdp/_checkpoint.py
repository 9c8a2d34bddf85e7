"""Per-rank state in a ``torch.distributed.checkpoint`` (DCP) ``Stateful``.

Error-feedback residuals are each rank's own. DCP keeps one copy of a value saved under the
same key on every rank (it takes them for replicas), so each rank's state is saved as one
serialised value under a key naming its rank and the world size; a job of another size finds
no key of its own and gets :func:`unpack`'s error.
"""

import io
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fastddp.fsdp._agree import agree, describe

__all__ = ["LoadCheck", "pack", "unpack"]


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
        same_size = [k for k in saved if k.endswith(f"_of_{dist.get_world_size()}")]
        if len(saved) == 1 and same_size:  # one rank's own file, given to another rank
            raise ValueError(
                f"{where}: this is rank {dist.get_rank()}, and the state loaded here is "
                f"{saved[0].split('_of_')[0].replace('rank', 'rank ')}'s ({saved[0]}): load "
                "into every rank the state that same rank saved"
            )
        raise ValueError(
            f"{where}: the checkpoint holds no state for {key} (it holds "
            f"{saved[:4]}{'...' if len(saved) > 4 else ''}): it was saved by a job of another "
            "size. Error-feedback residuals belong to the shards they were saved with; resume "
            "on the same number of ranks, or leave this comm out of the state you load (its "
            "residuals then start from zero)"
        )
    return torch.load(io.BytesIO(blob), weights_only=True)


class LoadCheck:
    """What went wrong loading this rank's state, raised on every rank at the first reduction.

    Each rank loads its own state (DCP's merged checkpoint, or a file per rank), so a problem
    may be found on some ranks only, as when one rank is given another's file. Raised there
    alone, it would leave the others waiting in the first reduction's collective until the
    process group's timeout. So a load before the first reduction keeps its error, and the
    first reduction agrees, over the group that reduction runs on, whether any rank has one:
    every rank of it then raises, naming the ranks. (Not over the default group: under
    pipeline parallelism, stages reach their first reduction at different times, one waiting
    for the other's backward.) A load after the first reduction cannot be agreed on without a
    collective of its own and raises where it fails, as before.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.agreed = False
        self.problem: Optional[str] = None

    def load(self, state_dict: dict[str, bytes], restore: Callable[[Any], None]) -> None:
        """Unpack this rank's state from ``state_dict`` and ``restore`` it, or keep the error."""
        try:
            restore(unpack(state_dict, self.where))
        except Exception as error:  # whatever the load found, every rank must hear of it
            if self.agreed:
                raise
            self.problem = f"{type(error).__name__}: {error}"
        else:
            self.problem = None

    def agree(
        self,
        device: torch.device,
        group: Optional[dist.ProcessGroup] = None,
        settings: tuple[int, ...] = (),
        outer: Optional[dist.ProcessGroup] = None,
    ) -> None:
        """At the first reduction, :func:`fastddp.fsdp._agree.agree`: raise on every rank of
        ``group`` (the default one when None) if a load failed on any, or the ``settings`` (a
        :func:`~fastddp.fsdp._agree.codec_row`, if any) differ; and on every rank of
        ``outer`` if that happened in another shard group."""
        if self.agreed:
            return
        # Agreed only once it passed: where it raised (on every rank), that reduction did not
        # run, and a load after it is still one to agree on.
        agree(self.where, device, group, settings, describe, self.problem, outer)
        self.agreed = True
