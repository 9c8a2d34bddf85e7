"""``CompressState(dtype="auto")``: the mode that makes the step shortest, chosen by measuring.

Each allowed mode is a candidate: ``"none"`` (PyTorch's fp32 all-reduce hook) or a preset of
:data:`fastddp.PRESETS`, each a fixed :class:`~fastddp.CompressState` of its own. The plan is
made by trial, on the job itself: after one warm-up step, each candidate reduces every bucket
for :data:`TRIAL_STEPS` steps, and the step period (from one backward's first bucket to the
next's: forward, backward, waiting and optimizer, all of it) of all but the first of those
steps is its figure. The slowest rank's figures (one all-reduce) decide, identically on every
rank: the fastest candidate, or the first in ``allow`` order within :data:`PREFER` of it, so that
a mode compresses only when that pays measurably. With the default four candidates the plan is
made at step 17.

Then every :data:`CHECK_EVERY` steps the median period is held against the planned figure
(again the slowest rank's); off by more than :data:`MARGIN` at two checks in a row (a link
that degrades, or recovers), the trial runs again. A candidate left behind owes its
error-feedback residuals: the next buckets holding those parameters add them before they are
reduced, so nothing error feedback kept is lost.
"""

import logging
import statistics
import time
import zlib
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.utils.weak import WeakIdKeyDictionary

from fastddp.hooks.hook import compress_hook
from fastddp.hooks.presets import PRESETS
from fastddp.hooks.state import CompressState

__all__ = ["AutoState", "DEFAULT_ALLOW", "NONE"]

NONE = "none"
DEFAULT_ALLOW = (NONE, "bf16", "bf16-acc", "int8-ef")
TRIAL_STEPS = 4  # steps per candidate in a trial; the first is not measured
CHECK_EVERY = 10  # steps between checks of the planned step time
MARGIN = 0.25  # relative change of the step time that, at two checks in a row, re-plans
PREFER = 0.02  # a candidate earlier in ``allow`` within this of the fastest is chosen

logger = logging.getLogger("fastddp")
# Settings of a fixed mode, which dtype="auto" takes only at their defaults.
_FIXED_ONLY = ("accumulate_dtype", "error_feedback", "stochastic_rounding", "block_size", "delay")


def _checked_allow(allow) -> tuple[str, ...]:
    choices = (NONE, *PRESETS)
    if allow is None:
        return DEFAULT_ALLOW
    if isinstance(allow, str) or not hasattr(allow, "__iter__"):
        raise TypeError(
            f"CompressState: allow must be a list of mode names, got {allow!r}; for example "
            "allow=['none', 'bf16', 'int8-ef']"
        )
    names = tuple(allow)
    bad = [n for n in names if n not in choices]
    if bad or not names or len(set(names)) != len(names):
        why = f"unknown {bad}" if bad else "empty" if not names else "repeated names"
        raise ValueError(
            f"CompressState: allow is {why}; name each candidate once, from {', '.join(choices)}"
        )
    return names


class AutoState(CompressState):
    """:class:`~fastddp.CompressState` with ``dtype="auto"`` (see the module docstring).

    Args:
        process_group (ProcessGroup, optional): the group; ``None`` is the default group.
        allow (list of str, optional): the candidates, most accurate first: ``"none"`` and
            names of :data:`fastddp.PRESETS` (default ``["none", "bf16", "bf16-acc",
            "int8-ef"]``; int4 and int2 only when listed).
        topology (str): as for a fixed mode, given to every candidate.
        seed (int): as for a fixed mode.
    """

    __slots__ = (
        "allow",
        "_states",
        "_current",
        "_task",
        "_started",
        "_step",
        "_trial_start",
        "_measured",
        "_recent",
        "_strikes",
        "_plan",
        "_owed",
        "_checked",
        "_steps_in",
    )

    def __init__(
        self,
        dtype: str = "auto",
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        allow=None,
        topology: str = "auto",
        seed: int = 0,
        **fixed: Any,
    ) -> None:
        if dtype != "auto":
            raise ValueError(f"CompressState: dtype must be a torch.dtype or 'auto', got {dtype!r}")
        for name in fixed:
            if name not in _FIXED_ONLY:
                raise TypeError(f"CompressState() got an unexpected keyword argument {name!r}")
        given = [k for k, v in fixed.items() if v not in (None, False, 0)]
        if given:
            raise ValueError(
                f"CompressState: with dtype='auto' the modes come from allow; {', '.join(given)} "
                "belongs to a fixed mode (allow=['bf16-acc', 'int8-ef', ...] names presets)"
            )
        self.allow = _checked_allow(allow)
        self.dtype, self.process_group, self.topology, self.seed = (
            "auto",
            process_group,
            topology,
            seed,
        )
        self.delay = 0
        self._states = {
            name: CompressState.from_preset(name, process_group, topology=topology, seed=seed)
            for name in self.allow
            if name != NONE
        }
        self._current = self.allow[0]
        self._task = None
        self._started: Optional[float] = None
        self._step = -1
        self._trial_start = 0
        self._measured: dict[str, list[float]] = {name: [] for name in self.allow}
        self._recent: list[float] = []
        self._strikes = 0
        self._plan: Optional[dict[str, Any]] = None
        self._owed = WeakIdKeyDictionary()  # parameter -> residual its next reduction adds
        self._checked = False
        self._steps_in = dict.fromkeys(self.allow, 0)  # steps each candidate reduced

    # -- the hook -------------------------------------------------------------------------

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        task = torch._C._current_graph_task_id()
        if task == -1 or task != self._task:  # the first bucket of a backward pass
            self._task = task
            self._begin_step(bucket.buffer().device)
        if len(self._owed):
            self._repay(bucket)
        if self._current == NONE:
            return allreduce_hook(self.process_group, bucket)
        return compress_hook(self._states[self._current], bucket)

    def _begin_step(self, device: torch.device) -> None:
        now = time.perf_counter()
        period = None if self._started is None else now - self._started
        self._started = now
        self._step += 1
        if not self._checked:
            self._check_ranks(device)
        if self._plan is None or self._plan["trial"]:
            self._trial(period, device)
        elif period is not None:
            self._recent.append(period)
            if len(self._recent) >= CHECK_EVERY:
                self._check_plan(device)
        self._steps_in[self._current] += 1

    def _trial(self, period: Optional[float], device: torch.device) -> None:
        k = self._step - self._trial_start  # 0: warm-up, then TRIAL_STEPS per candidate
        if period is not None and k >= 2 and (k - 2) % TRIAL_STEPS != 0:
            self._measured[self._current].append(period)  # the step before this one
        block = (k - 1) // TRIAL_STEPS if k >= 1 else 0
        if block < len(self.allow):
            self._switch(self.allow[block])
        else:
            self._decide(device)

    def _decide(self, device: torch.device) -> None:
        figures = torch.tensor(
            [statistics.median(self._measured[n]) for n in self.allow],
            dtype=torch.float64,
            device=device,
        )
        dist.all_reduce(figures, op=dist.ReduceOp.MAX, group=self.process_group)
        seconds = dict(zip(self.allow, figures.tolist()))
        fastest = min(seconds.values())
        choice = next(n for n in self.allow if seconds[n] <= fastest * (1 + PREFER))
        plans = 1 if self._plan is None else self._plan["plans"] + 1
        self._plan = {
            "mode": choice,
            "trial": False,
            "step_ms": {n: s * 1e3 for n, s in seconds.items()},
            "made_at_step": self._step,
            "plans": plans,
        }
        self._recent, self._strikes = [], 0
        self._switch(choice)
        logger.info(
            "fastddp auto: plan %d at step %d: %s (step ms, slowest rank: %s)",
            plans,
            self._step,
            choice,
            ", ".join(f"{n} {s * 1e3:.1f}" for n, s in seconds.items()),
        )

    def _check_plan(self, device: torch.device) -> None:
        now = torch.tensor([statistics.median(self._recent)], dtype=torch.float64, device=device)
        dist.all_reduce(now, op=dist.ReduceOp.MAX, group=self.process_group)
        self._recent = []
        planned = self._plan["step_ms"][self._plan["mode"]] / 1e3
        ratio = now.item() / planned
        self._plan["last_check_ratio"] = ratio
        self._strikes = self._strikes + 1 if abs(ratio - 1) > MARGIN else 0
        if self._strikes >= 2:
            logger.info(
                "fastddp auto: the step takes %.2fx the planned %.1f ms; trying every mode again",
                ratio,
                planned * 1e3,
            )
            self._plan["trial"] = True
            self._trial_start = self._step
            self._measured = {name: [] for name in self.allow}

    def _check_ranks(self, device: torch.device) -> None:
        # Every rank must run the same trial: a rank with other candidates would issue other
        # collectives. Raise on every rank alike.
        self._checked = True
        mine = zlib.crc32(",".join(self.allow).encode())
        rows = torch.tensor([mine, TRIAL_STEPS, CHECK_EVERY], dtype=torch.int64, device=device)
        everyone = [torch.empty_like(rows) for _ in range(dist.get_world_size(self.process_group))]
        dist.all_gather(everyone, rows, group=self.process_group)
        differ = [r for r, row in enumerate(everyone) if not torch.equal(row, everyone[0])]
        if differ:
            raise ValueError(
                f"fastddp: ranks disagree on CompressState(dtype='auto', allow=...): ranks "
                f"{differ} differ from rank 0 (this rank allows {list(self.allow)}); give every "
                "rank the same allow list (and the same fastddp version)"
            )

    # -- switching candidates ---------------------------------------------------------------

    def _switch(self, name: str) -> None:
        if name == self._current:
            return
        old = self._states.get(self._current)
        if old is not None and old.error_feedback and old._verified:
            self._collect_owed(old)
        self._current = name

    def _collect_owed(self, state: CompressState) -> None:
        """Take ``state``'s residuals out, by parameter, for the next buckets to add."""
        state.flush()
        rank = dist.get_rank(self.process_group)
        tensors = {key: p for p, key in state._table.param_keys.items()}
        for slot in state._table.slots.values():
            if slot.residual is None or not slot.params:
                continue
            parts = state._residuals_of(slot, rank)
            owed = parts["residual"].clone()
            shard = parts["shard_residual"]
            if shard is not None:
                lo = parts["shard_offset"]
                n = max(0, min(shard.numel(), slot.numel - lo))
                owed[lo : lo + n] += shard[:n]
            offset = 0
            for key, numel in slot.params:
                p = tensors.get(key)
                if p is not None:
                    piece = owed[offset : offset + numel]
                    self._owed[p] = self._owed[p] + piece if p in self._owed else piece
                offset += numel
            slot.residual.zero_()
            if slot.shard_residual is not None:
                slot.shard_residual.zero_()

    def _repay(self, bucket: dist.GradBucket) -> None:
        # Residuals are in units of the average; the bucket is divided by the world size.
        world = dist.get_world_size(self.process_group)
        buffer, offset = bucket.buffer(), 0
        for p in bucket.parameters():
            n = p.numel()
            owed = self._owed.pop(p, None)
            if owed is not None:
                buffer[offset : offset + n].add_(owed.to(buffer.device), alpha=world)
            offset += n

    # -- what CompressState offers ----------------------------------------------------------

    @property
    def path(self) -> str:
        return "auto"

    @property
    def trial_steps(self) -> int:
        """Steps before the first plan: a warm-up, then :data:`TRIAL_STEPS` per candidate."""
        return 1 + TRIAL_STEPS * len(self.allow)

    def settings(self) -> dict[str, Any]:
        return {"dtype": "auto", "allow": list(self.allow), "topology": self.topology}

    def __repr__(self) -> str:
        return f"CompressState(dtype=auto, allow={list(self.allow)}, mode={self._current})"

    def flush(self) -> None:
        for state in self._states.values():
            state.flush()

    def stats(self) -> dict[str, Any]:
        """Settings, ``mode`` (the candidate now in use), ``steps_in`` (steps per candidate),
        ``plan`` (the chosen mode, each candidate's measured step in ms on the slowest rank, the
        step it was made at, how many plans so far; one mode for every bucket) and each used
        candidate's own ``stats()``."""
        plan = (
            None if self._plan is None else {**self._plan, "step_ms": dict(self._plan["step_ms"])}
        )
        return {
            **self.settings(),
            "mode": self._current,
            "step": self._step,
            "steps_in": dict(self._steps_in),
            "plan": plan,
            "candidates": {n: s.stats() for n, s in self._states.items() if s._verified},
        }

    def state_dict(self) -> dict[str, Any]:
        """The plan and every candidate's state dict; a resumed job keeps the plan."""
        self.flush()
        return {
            "settings": self.settings(),
            "plan": None if self._plan is None or self._plan["trial"] else dict(self._plan),
            "candidates": {n: s.state_dict() for n, s in self._states.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("settings", {})
        if saved.get("dtype") != "auto" or saved.get("allow") != list(self.allow):
            raise ValueError(
                f"CompressState.load_state_dict: saved settings {saved} do not match this "
                f"state's {self.settings()}; build the state with the settings it was saved with"
            )
        for name, sd in state_dict["candidates"].items():
            self._states[name].load_state_dict(sd)
        plan = state_dict.get("plan")
        self._plan = None if plan is None else {**plan, "trial": False}
        self._current = self.allow[0] if plan is None else plan["mode"]
        self._step, self._trial_start, self._started = -1, 0, None
        self._measured = {name: [] for name in self.allow}
        self._recent, self._strikes = [], 0

    def __getstate__(self) -> dict:
        return {"allow": self.allow, "seed": self.seed, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        AutoState.__init__(self, allow=saved["allow"], seed=saved["seed"])
        self.load_state_dict(saved["state_dict"])
