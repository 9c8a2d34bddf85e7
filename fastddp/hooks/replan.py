"""When ``dtype="auto"`` plans again: the planned step held against the steps since.

Every ``check_every`` steps the median period is held against the planned figure (the slowest
rank's, as in the trial; on CUDA the plan's first judged figure, see :meth:`Checks.judge`); off
by more than ``margin`` at two checks in a row (a link that
degrades, or recovers), the trial runs again. At a new plan the residuals of every bucket a
candidate no longer reduces are owed to their parameters (``owed.py``).

A check runs on the first bucket of a step, on the autograd thread: reading an all-reduced
figure there at once would make the host wait for every kernel queued before it (on a GPU, a
bubble every ``check_every`` steps). So the slowest median is all-reduced in the background
and read at the next check, long done by then: a drift is judged one check late, alike on
every rank.
"""

import logging
import statistics
from typing import Optional

import torch
import torch.distributed as dist

from fastddp.hooks.runtime import own_stream

__all__ = ["Checks"]

logger = logging.getLogger("fastddp")


class _Slowest:
    """The slowest rank's median period, all-reduced without a host wait."""

    def __init__(self, recent: list[float], group, device: torch.device) -> None:
        # (a fill: a tensor from a Python list waits for a host-to-device copy)
        now = torch.full((1,), statistics.median(recent), dtype=torch.float64, device=device)
        self._work = dist.all_reduce(now, op=dist.ReduceOp.MAX, group=group, async_op=True)
        self._event, self._host = None, now
        if now.is_cuda:
            # A stream of its own waits for the reduction (on NCCL a stream wait, which the
            # compute stream would make for the slowest rank), then copies it to the host.
            stream = own_stream(now.device, "replan", high_priority=False)
            now.record_stream(stream)
            with torch.cuda.stream(stream):
                self._work.wait()
                self._host = torch.empty(1, dtype=torch.float64, pin_memory=True)
                self._host.copy_(now, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)

    def seconds(self) -> float:
        if self._event is None:
            self._work.wait()
        elif not self._event.query():  # (recorded a check ago: done, but for a slow device)
            self._event.synchronize()
        return self._host.tolist()[0]


class Checks:
    """The checks of one plan: the reduction in flight and the checks off in a row."""

    __slots__ = ("strikes", "_pending", "_reference")

    def __init__(self) -> None:
        self.strikes = 0
        self._pending: Optional[_Slowest] = None
        self._reference: Optional[float] = None  # seconds the later checks are held against

    def check(
        self, recent: list[float], planned_ms: float, margin: float, group, device
    ) -> Optional[float]:
        """Start the reduction of ``recent``'s median, and judge the previous check's: return
        its slowest median over the planned step (None at a plan's first check), counting
        :attr:`strikes`, the checks in a row off by more than ``margin`` (two: plan again)."""
        previous, self._pending = self._pending, _Slowest(recent, group, device)
        if previous is None:
            return None
        return self.judge(previous.seconds(), planned_ms, margin, device.type == "cuda")

    def judge(self, seconds: float, planned_ms: float, margin: float, settled: bool) -> float:
        """:meth:`check`'s verdict on the slowest median ``seconds``. ``settled``: the trial's
        steps waited for the device at each clock reading (CUDA, ``trial.settle``) and the
        plan's do not, so the plan's first figure is what the later ones are held against,
        rather than the trial's: a host that overlaps the kernels makes them differ."""
        if settled and self._reference is None:
            self._reference = seconds
        planned = planned_ms / 1e3 if self._reference is None else self._reference
        ratio = seconds / planned
        self.strikes = self.strikes + 1 if abs(ratio - 1) > margin else 0
        if self.strikes >= 2:
            logger.info(
                "fastddp auto: the step takes %.2fx the planned %.1f ms; trying every mode again",
                ratio,
                planned * 1e3,
            )
        return ratio
