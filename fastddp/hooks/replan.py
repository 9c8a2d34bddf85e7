"""When ``dtype="auto"`` plans again: the planned step held against the steps since.

Every ``check_every`` steps the median period is held against the planned figure (the slowest
rank's, as in the trial); off by more than ``margin`` at two checks in a row (a link that
degrades, or recovers), the trial runs again. At a new plan the residuals of every bucket a
candidate no longer reduces are owed to their parameters (``owed.py``).
"""

import logging
import statistics

import torch
import torch.distributed as dist

__all__ = ["check"]

logger = logging.getLogger("fastddp")


def check(
    recent: list[float], planned_ms: float, strikes: int, margin: float, group, device
) -> tuple[float, int]:
    """The slowest rank's median of the ``recent`` periods over the planned step, and the
    checks in a row off by more than ``margin``, this one included (two: plan again)."""
    now = torch.tensor([statistics.median(recent)], dtype=torch.float64, device=device)
    dist.all_reduce(now, op=dist.ReduceOp.MAX, group=group)
    planned = planned_ms / 1e3
    ratio = now.item() / planned
    strikes = strikes + 1 if abs(ratio - 1) > margin else 0
    if strikes >= 2:
        logger.info(
            "fastddp auto: the step takes %.2fx the planned %.1f ms; trying every mode again",
            ratio,
            planned * 1e3,
        )
    return ratio, strikes
