"""The first call's check across ranks: the same settings everywhere, and every load sound.

FSDP2 hands every rank the same tensors, but each rank builds its comm itself: a comm of other
settings on one rank (another wire dtype, block size or error feedback) would combine payloads
it cannot read, or wait in a collective the others never enter. One all-gather at a comm's
first call carries each rank's settings and whether its ``load_state_dict`` failed, and every
rank raises the same error.
"""

from typing import Callable, Optional

import torch
import torch.distributed as dist

from fastddp.codecs import CODECS, Codec
from fastddp.hooks.handshake import PROTOCOL

__all__ = ["agree", "codec_row", "describe"]


def agree(
    where: str,
    device: torch.device,
    group: Optional[dist.ProcessGroup],
    settings: tuple[int, ...],
    describe: Callable[[tuple[int, ...]], str],
    problem: Optional[str] = None,
) -> None:
    """Raise on every rank of ``group`` (the default group when None) if the ranks' ``settings``
    differ (each shown by ``describe``), or a rank has a load ``problem``. A collective: one
    all-gather of a few int64s on ``device``."""
    mine = torch.tensor([*settings, int(problem is not None)], dtype=torch.int64, device=device)
    size = dist.get_world_size(group)
    rows = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(rows, mine, group=group)
    rows = [tuple(row.tolist()) for row in rows]

    def rank(r: int) -> int:  # named by their rank in the job, as each rank's own error says
        return r if group is None else dist.get_global_rank(group, r)

    if len({row[:-1] for row in rows}) > 1:
        lines = [f"  rank {rank(r)}: {describe(row[:-1])}" for r, row in enumerate(rows)]
        raise ValueError(
            f"{where}: ranks disagree on the settings, so their payloads cannot be combined:\n"
            + "\n".join(lines)
            + "\nGive every rank the same arguments."
        )
    failed = [rank(r) for r, row in enumerate(rows) if row[-1]]
    if failed:
        why = problem if problem is not None else "each of them raises the reason"
        raise ValueError(
            f"{where}: load_state_dict failed on rank(s) {failed} of {dist.get_world_size()} "
            f"({why}); load into every rank the state that same rank saved, in a job of the "
            "same size"
        )


def codec_row(codec: Codec, error_feedback: bool = False) -> tuple[int, ...]:
    """A comm's settings as :func:`agree` compares them (with the payloads' protocol)."""
    return (PROTOCOL, codec.code, codec.block_size or 0, int(error_feedback))


def describe(row: tuple[int, ...]) -> str:
    """A :func:`codec_row` in words."""
    protocol, code, block, feedback = row
    names = {entry.code: str(dtype) for dtype, entry in CODECS.items()}
    version = f", fastddp protocol {protocol}" if protocol != PROTOCOL else ""
    block_size = f", block_size={block}" if block else ""
    return f"dtype={names.get(code, '?')}{block_size}, error_feedback={bool(feedback)}{version}"
