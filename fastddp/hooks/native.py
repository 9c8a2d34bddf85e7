"""The native runner: a fixed mode's steady state, run by the extension without Python.

Once :func:`~fastddp.compress_hook` has set a DDP bucket up in Python (its slot, buffers,
residuals and groups), it hands the extension the bucket's *plan*: the op calls and the
collective of each stage of its path, and the calls that decode the result, bound to the
slot's persistent tensors (the very calls the Python path runs, from ``Path.stage_calls``).
From the next step on, the bucket is reduced by ``csrc/ddp/native_hook.cpp`` alone, in the
Python pipeline's order, with the same bits; Python runs only what has no plan: a new or
rebuilt bucket (whose buffer differs), and whatever the runner declines. Settings whose every
call differs are not planned: stochastic rounding (a seed per call), ``delay=1`` and
``dtype="auto"``.

Python reads the runner's work back at its own points (``stats()``, ``state_dict()``,
``flush()``, and before a slot is retired): :meth:`Native.sync` first finishes every reduction
started there and adds its runs to the counters.
"""

import os
from typing import Any, Optional

import torch.distributed as dist

from fastddp import _extension
from fastddp.codecs import Call
from fastddp.hooks import stats
from fastddp.hooks.paths import Collective

__all__ = ["Native", "plannable", "turn_off"]

# Tests plant a defect in every new runner here (1: a later stage reads the previous
# collective's output without waiting; 2: the decode runs when the last collective is issued),
# to prove that the simulated NCCL catches it.
_PLANTED_DEFECT = 0


def plannable(state: Any) -> bool:
    """Whether ``state``'s buckets can run natively (their calls are the same every step;
    ``FASTDDP_NATIVE=0`` turns the runner off)."""
    if os.environ.get("FASTDDP_NATIVE", "1") == "0":
        return False
    return not state.stochastic_rounding and not state.delay


def _calls(calls: list[Call]) -> list[tuple]:
    # As the extension binds them: the op's schema name and overload, then the arguments.
    return [(op._schema.name, op._schema.overload_name, args, kwargs) for op, args, kwargs in calls]


def _collective(collective: Collective) -> tuple:
    kind, group, *rest = collective
    group = group if group is not None else dist.group.WORLD
    # A process group written in Python (a subclass) is also handed over as itself.
    python = group if type(group) is not dist.ProcessGroup else None
    return (kind, group, *rest, python)


class Native:
    """A state's native runner and the slots it holds plans of."""

    __slots__ = ("runner", "slots", "_ids")

    def __init__(self) -> None:
        self.runner = _extension.load().NativeRunner()
        if _PLANTED_DEFECT:
            self.runner._plant_defect(_PLANTED_DEFECT)
        self.slots: dict[int, Any] = {}  # plan id -> slot
        self._ids = 0

    def plan(self, job: Any, make_job: Any, state: Any) -> None:
        """Hand the runner the plan of ``job``'s bucket, unless it has it already
        (``make_job(seeds)`` makes a job of the same bucket, to read the calls from)."""
        path, slot = job.path, job.slot
        if slot.plan is not None:
            if slot.plan[1] is job.bucket:
                return
            # The same parameters in another buffer (DDP's Join gives a joined rank fresh
            # zeros): plan that one, counting the old plan's runs into ``state``.
            self.drop(slot, state)
        template = make_job((-1,) * len(path.seed_stages))
        stages = []
        for i in range(path.stages):
            calls, collective = path.stage_calls(template, i)
            stages.append((_calls(calls), _collective(collective)))
        self._ids += 1
        finish = _calls(path.finish_calls(template))
        runtime = job.runtime
        on_caller = not runtime.asynchronous  # as the pipeline completes its jobs
        side = getattr(runtime, "side_stream", None)
        if side is not None:  # later stages on the pipeline's side stream
            self.runner.use_side_stream(side())
        # The runner's first run of it waits for this job's decode, as the pipeline's would.
        self.runner.add(
            self._ids, job.bucket, stages, finish, runtime.waits_in_then, on_caller, job.result
        )
        self.slots[self._ids] = slot
        slot.plan = (self._ids, job.bucket)

    def drop(self, slot: Any, state: Any) -> None:
        """Forget ``slot``'s plan; its runs not yet counted (since :meth:`sync`) are counted
        into ``state``."""
        if slot.plan is None:
            return
        plan_id, buffer = slot.plan
        self._count(state, slot, self.runner.remove(buffer))
        self.slots.pop(plan_id, None)
        slot.plan = None

    @staticmethod
    def _count(state: Any, slot: Any, runs: int) -> None:
        if runs:
            slot.calls += runs
            state._counters["calls"] += runs
            stats.count(state._counters, slot, state.codec, state._topology, runs)

    def clear(self, state: Any) -> None:
        """Forget every plan (after :meth:`sync`): the slots they were bound to are dropped."""
        for slot in list(self.slots.values()):
            self.drop(slot, state)

    def sync(self, state: Any) -> None:
        """Finish every reduction the runner started and count them into ``state``."""
        self.runner.flush()
        for plan_id, runs in self.runner.take_runs():
            self._count(state, self.slots[plan_id], runs)


def turn_off(state: Any) -> None:
    """Run every bucket of ``state`` (not yet used) on the Python path, after a load too."""
    state._native = state._runner = state._pipeline.on_fail = None
    state._python_only = True


def make(state: Any) -> Optional[Native]:
    """A runner for ``state``, or None where its buckets cannot be planned (or must not be:
    :func:`turn_off`)."""
    if getattr(state, "_python_only", False):
        return None
    return Native() if plannable(state) else None
