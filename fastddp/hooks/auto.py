"""``CompressState(dtype="auto")``: the plan that makes the step shortest, chosen by measuring.

Each allowed mode is a candidate (``candidates.py``): ``"none"`` (PyTorch's fp32 all-reduce hook)
or a preset of :data:`fastddp.PRESETS`, each a fixed :class:`~fastddp.CompressState` of its own.
:class:`AutoState` runs every step under a plan (one candidate for all buckets, or one per
bucket) and makes the plan on the job itself: the candidates take turns (``trial.py``); the
fastest, or a mode per bucket that a model of the backward pass proposes and turns confirm, is
chosen (``choice.py``, over ``planner.py``, ``measured.py`` and ``links.py``); the step is held
against the plan, and a trial runs again when it drifts (``replan.py``); residuals of buckets a
candidate left are repaid (``owed.py``); with :func:`fastddp.register_comm_hook` the steps of
``"none"`` run in C++ (``switch.py``). With the default four candidates the plan is made by step
16 (at step 8 where one candidate is left after the first round), 22 after a run-off, and 6
steps later when a mixed plan was tried. The constants below are the figures those modules
decide by, read at each decision (:func:`_rules`): a change to them applies from the next one.
"""

import time
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fastddp.hooks import candidates, checkpoint, choice, links, replan, trial
from fastddp.hooks.auto_plan import PlanSteps
from fastddp.hooks.candidates import DEFAULT_ALLOW, MIXED, NONE, Assignment
from fastddp.hooks.hook import compress_hook
from fastddp.hooks.measured import StepRecord
from fastddp.hooks.owed import Owed
from fastddp.hooks.presets import named_preset
from fastddp.hooks.state import CompressState
from fastddp.hooks.switch import Switch
from fastddp.hooks.trial import Rules, Trial

__all__ = ["AutoState", "DEFAULT_ALLOW", "MIXED", "NONE"]

TRIAL_ROUNDS = 4  # steps per candidate in a trial, taken in turns; the first is not measured
VERIFY_ROUNDS = 3  # turns of a proposed mixed plan and the uniform choice
CHECK_EVERY = 10  # steps between checks of the planned step time
MARGIN = 0.25  # relative change of the step time that, at two checks in a row, re-plans
PREFER = 0.02  # a candidate earlier in ``allow`` within this of the fastest is chosen
# "none" is ranked as if this much faster: compression must beat the exact fp32 by more than a
# trial's noise, which picks the winner among modes that close (never slower than no compression).
PLAIN_EDGE = 0.05
MIX_GAIN = 0.05  # a mixed plan is tried if the model makes the step shorter by this much
# After measured round r (1, 2), a candidate this much slower than the fastest is out: a step of
# a shared machine can take twice another's, so one measured step must show more than that.
ELIMINATE = (2.5, 1.5)
# Two candidates left within RUNOFF of each other after the measured rounds take RUNOFF_ROUNDS
# more turns, and all their steps decide: one step varies by about 7 % on a shared machine.
RUNOFF = 0.10
RUNOFF_ROUNDS = 3


def _rules() -> Rules:
    """The constants above, as they are now."""
    return Rules(
        TRIAL_ROUNDS, VERIFY_ROUNDS, CHECK_EVERY, MARGIN, PREFER, PLAIN_EDGE, MIX_GAIN,
        ELIMINATE, RUNOFF, RUNOFF_ROUNDS,
    )  # fmt: skip


class AutoState(PlanSteps, CompressState):
    """:class:`~fastddp.CompressState` with ``dtype="auto"`` (see the module docstring).

    Args:
        process_group (ProcessGroup, optional): the group; ``None`` is the default group.
        allow (list of str, optional): the candidates, most accurate first: ``"none"`` and
            names of :data:`fastddp.PRESETS` (default ``["none", "bf16", "bf16-acc",
            "int8-ef"]``; int4 and int2 only when listed). A preset may name its path:
            ``"int8-ef:flat"`` and ``"int8-ef:hierarchical"`` are two candidates, so that the
            plan chooses the path per bucket too.
        topology (str): as for a fixed mode, given to every candidate that names no path.
        seed (int): as for a fixed mode.
    """

    __slots__ = (
        "allow", "_states", "_using", "_step", "_trial", "_record", "_recent",
        "_checks", "_plan", "_proposal", "_owed", "_checked", "_steps_in", "_held", "_switch",
        "_stamp", "_nodes",
    )  # fmt: skip

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
            why = f"dtype must be a torch.dtype or 'auto', got {dtype!r}{named_preset(dtype)}"
            raise ValueError(f"CompressState: {why}")
        candidates.checked_fixed(fixed)
        self.allow = candidates.checked_allow(allow)
        self.dtype, self.process_group, self.delay = "auto", process_group, 0
        self.topology, self.seed = topology, seed
        self._states = candidates.make(self.allow, process_group, topology, seed)
        self._using: Assignment = self.allow[0]
        self._plan: Optional[dict[str, Any]] = None
        self._owed = Owed()  # residuals of buckets a candidate left (owed.py)
        self._checked, self._load_problem = False, None
        self._steps_in = dict.fromkeys((*self.allow, MIXED), 0)  # steps each plan reduced
        self._switch: Optional[Switch] = None  # where fastddp.register_comm_hook set it
        self._stamp = None  # the extension's completion stamp, where levels are timed
        self._nodes = 1
        self._restart()

    def _restart(self) -> None:
        """Forget measurements: the next step starts a trial (or runs a loaded plan)."""
        self._step = -1
        self._trial = Trial(self.allow)
        self._record: Optional[StepRecord] = None
        self._recent: list[float] = []
        self._checks = replan.Checks()
        self._proposal: Optional[tuple[str, ...]] = None
        self._held: dict[str, set[int]] = {}  # parameter keys each mode reduced a step ago
        if self._switch is not None:
            self._switch.stop()

    # -- the hook -------------------------------------------------------------------------

    def _reduce_bucket(self, bucket: dist.GradBucket) -> torch.futures.Future:
        # A step starts at bucket 0: DDP reduces its buckets in index order, and so does the
        # replay of DDP's Join for a rank out of inputs, outside autograd (no graph task to
        # tell its steps apart). As the C++ hook (switch_hook.cpp) counts them.
        if bucket.index() == 0:
            self._begin_step(bucket.buffer().device)
        keys = candidates.keys_of(self._states, bucket.parameters(), check=self._step == 0)
        if len(self._owed):
            self._owed.repay(bucket, dist.get_world_size(self.process_group))
        mode = candidates.mode_of(self._using, bucket.index(), self._plan)
        state = self._states.get(mode)
        record = self._record
        waited = 0.0 if state is None else state._pipeline.waited
        began = time.perf_counter()
        if state is None:
            future = allreduce_hook(self.process_group, bucket)
        else:
            future = compress_hook(state, bucket)
        if bucket.is_last() and not isinstance(self._using, str):
            # Under a mode per bucket the bucket DDP marks last reaches one candidate only: the
            # others' pending stages would wait for the end of the backward pass, which a rank
            # out of inputs under DDP's Join (its hook run outside autograd, then each future
            # waited on) never reaches. Finish them here, on every rank alike.
            for other in self._states.values():
                if other is not state:
                    other.flush()
        record.began.append(began)
        record.held.setdefault(mode, set()).update(k for k, _ in keys)
        if record.kind is not None:  # a measured step: what the per-bucket model needs
            record.left.append(time.perf_counter())
            record.numel.append(bucket.buffer().numel())
            record.waited.append(0.0 if state is None else state._pipeline.waited - waited)
            future.add_done_callback(record.finished)
        return future

    def _begin_step(self, device: torch.device) -> None:
        trialing = self._plan is None or self._plan["trial"]
        if trialing and self._switch is None:  # (the C++ hook settles before it stamps)
            trial.settle(device)
        now, last, native = time.perf_counter(), self._record, []
        periods = [now - last.began[0]] if last is not None and last.began else []
        if self._switch is not None:  # the steps run in C++ since the last one here count too
            periods = self._switch.periods()  # the last step's, then each C++ step's
            native = self._switch.records()
            self._count_native()
        self._step += 1
        if not self._checked:  # every rank must run the same trial: raise on every rank alike
            self._checked, cpp = True, self._switch is not None  # the turns' order depends on cpp
            plan = None if self._plan is None else candidates.spelled(self._using, self._plan)
            trial.agree(
                self.allow, _rules(), cpp, self.process_group, device, plan, self.topology,
                self._load_problem, tuple(self._states.values()),
            )  # fmt: skip
            candidates.verify(self._states, device, self._plan, self._using)  # fails now
            self._stamp = links.stamper(device, self.process_group)
        if last is not None:
            self._owed.settle_moves(self._states, self._held, last.held, self.process_group)
            self._held = last.held
        label, kind = candidates.label(self._using), None
        if trialing:
            self._trial.add(([] if last is None else [last]) + native, periods)
            label, kind = self._next_turn(device)
        elif periods:
            self._recent += periods
            if len(self._recent) >= CHECK_EVERY:
                self._check_plan(device)
            label = candidates.label(self._using)
        self._record = StepRecord(label, kind)
        on_issue = self._on_issue if kind == "trial" and self._stamp is not None else None
        for state in self._states.values():
            state._pipeline.on_issue = on_issue
        self._steps_in[label] += 1
        self._hand_over()

    def _on_issue(self, job, stage: int, began: float) -> None:
        # A collective of a measured trial step (the extension stamps its completion); a 16-bit
        # bucket, passed through alike under every candidate, has nothing to time.
        if job.topo is None:
            return
        self._nodes = len(job.topo.nodes)
        self._record.collectives.append(links.issued(job, stage, began, self._stamp))

    def _count_native(self) -> None:
        native = 0 if self._switch is None else self._switch.count()
        if native:  # (only ever steps of "none": trial turns, or under a plan of "none")
            self._step += native
            self._steps_in[NONE] += native

    def _hand_over(self) -> None:
        # Steps of "none" run in C++ where nothing is owed, as alike on every rank as the
        # trial and the checks: a measured turn of "none", or the steps up to the next check.
        if self._switch is not None:
            trialing, turn = self._plan is None or self._plan["trial"], self._step + 1
            to_check = CHECK_EVERY - len(self._recent) if self._using == NONE else None
            self._switch.hand_over(trialing, self._trial.turn(turn), to_check, len(self._owed))

    def _rules_now(self) -> Rules:
        return _rules()

    # -- what CompressState offers ----------------------------------------------------------

    @property
    def path(self) -> str:
        return "auto"

    @property
    def trial_steps(self) -> int:
        """Steps before the first plan at most (``trial.steps``)."""
        return trial.steps(self.allow, _rules())

    def settings(self) -> dict[str, Any]:
        return {"dtype": "auto", "allow": list(self.allow), "topology": self.topology}

    def __repr__(self) -> str:
        mode = candidates.label(self._using)
        return f"CompressState(dtype=auto, allow={list(self.allow)}, mode={mode})"

    def flush(self) -> None:
        for state in self._states.values():
            state.flush()

    def discard_feedback(self) -> None:
        """:meth:`CompressState.discard_feedback` of every candidate, and what they owe."""
        self.flush()
        for state in self._states.values():
            state._drop_residuals()
        self._owed = Owed()

    def stats(self) -> dict[str, Any]:
        """Settings, ``mode`` (the candidate now in use, or ``"mixed"``), ``steps_in`` (steps
        per candidate and mixed plan), ``plan`` and each candidate's ``stats()`` once checked.

        ``plan`` is the plan with the figures it was made from (its keys:
        :func:`fastddp.hooks.choice.make`). ``native_steps`` counts the steps run in C++
        (:func:`fastddp.register_comm_hook`).
        """
        self._count_native()
        native_now = self._switch is not None and self._switch.native_now
        return {
            **self.settings(),
            "mode": NONE if native_now else candidates.label(self._using),
            "step": self._step,
            "steps_in": dict(self._steps_in),
            "native_steps": 0 if self._switch is None else self._switch.seen,
            "plan": choice.plain(self._plan),
            "candidates": {n: s.stats() for n, s in self._states.items() if s._verified},
        }

    def state_dict(self) -> dict[str, Any]:
        """The plan and every candidate's state dict; a resumed job keeps the plan."""
        self.flush()
        done = self._plan is not None and not self._plan["trial"]
        return {
            "settings": self.settings(),
            "plan": choice.plain(self._plan) if done else None,
            "candidates": {n: s.state_dict() for n, s in self._states.items()},
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        def forget() -> None:
            self._owed, self._checked = Owed(), False  # the loaded plan is agreed on again
            if self._switch is not None:  # the C++ hook's steps so far: counted, not measured
                self._count_native()
                self._switch.periods()  # (taken, and dropped with the trial they belong to)
                self._switch.records()
            self._restart()

        def load() -> None:
            plan, using = choice.load(self._states, self.allow, self.settings(), state_dict)
            forget()
            self._plan, self._using = plan, using

        checkpoint.deferred(self, load, forget)  # (what fails on one rank, every rank raises)

    def __getstate__(self) -> dict:  # the settings (no topology from older fastddp), the state
        kept = {"allow": self.allow, "topology": self.topology, "seed": self.seed}
        return {**kept, "state_dict": self.state_dict()}

    def __setstate__(self, saved: dict) -> None:
        AutoState.__init__(self, **{k: v for k, v in saved.items() if k != "state_dict"})
        self.load_state_dict(saved["state_dict"])


# dtype="auto" makes this class (CompressState.__new__): state.py, below this module, cannot.
CompressState._named = AutoState
