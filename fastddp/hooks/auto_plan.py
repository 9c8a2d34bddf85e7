"""The trial and the plan of ``dtype="auto"``: :class:`PlanSteps`, the part of
:class:`~fastddp.hooks.auto.AutoState` that, at the start of a step, takes the trial's next
turn, ends a measured round (another round, or a plan), confirms or drops a proposed mixed
plan, checks the step against the plan and starts a trial again when it drifts, or when the
state moved to another model mid-trial. Its figures come from ``auto.py``'s constants
(``_rules_now``), read at each decision.
"""

from typing import Optional

import torch

from fastddp.hooks import candidates, choice, replan
from fastddp.hooks.candidates import MIXED

__all__ = ["PlanSteps"]


class PlanSteps:
    """Methods of :class:`~fastddp.hooks.auto.AutoState` over its trial and plan. They read
    the figures they decide by from its ``_rules_now()`` (``auto.py``'s constants, which this
    module cannot import: ``auto.py`` imports it)."""

    __slots__ = ()

    def _next_turn(self, device: torch.device) -> tuple[str, Optional[str]]:
        if self._step - self._trial.start == len(self._trial.turns):
            (self._next_round if self._proposal is None else self._conclude)(device)
        if self._plan is not None and not self._plan["trial"]:
            return candidates.label(self._using), None
        label, kind = self._trial.turn(self._step)
        # (In a trial each candidate's residuals stay in its buckets until it runs again.)
        self._using = self._proposal if label == MIXED else label
        return label, kind

    def _next_round(self, device: torch.device) -> None:
        """After a measured round: another round of the candidates that can still win, or the
        uniform choice and a mode per bucket proposed from the trial."""
        rules, group = self._rules_now(), self.process_group
        measured_s = self._trial.slowest(group, device)
        alive = self._trial.next_round(measured_s, rules, none_last=self._switch is not None)
        if alive is None:
            return
        plans = 1 if self._plan is None else self._plan["plans"] + 1
        made = {"made_at_step": self._step, "plans": plans, "nodes": self._nodes}
        self._plan, self._proposal = choice.make(
            self._trial, alive, self._states, group, device, rules, **made
        )
        if self._proposal is None:
            self._adopt(self._plan["uniform"])
        else:
            self._trial.verify(self._plan["uniform"], rules.verify_rounds)

    def _conclude(self, device: torch.device) -> None:
        keep = choice.confirmed(
            self._plan, self._trial, self.process_group, device, self._rules_now()
        )
        self._adopt(MIXED if keep else self._plan["uniform"])

    def _adopt(self, label: str) -> None:
        choice.settle(self._plan, label)
        self._using = self._proposal if label == MIXED else label
        self._owed.settle_plan(self._states, self._using, self.process_group)
        self._proposal = None
        self._recent, self._checks = [], replan.Checks()
        self._plan["summary"] = candidates.summary(self._using, self.allow)
        choice.log(self._plan, self._step)

    def _check_plan(self, device: torch.device) -> None:
        group, planned_ms = self.process_group, self._plan["planned_ms"]
        ratio = self._checks.check(
            self._recent, planned_ms, self._rules_now().margin, group, device
        )
        self._recent = []
        if ratio is None:
            return
        self._plan["last_check_ratio"] = ratio
        if self._checks.strikes >= 2:
            self._plan["trial"] = True
            step = self._step
            self._restart()
            self._step = self._trial.start = step
            self._using = self._trial.turns[0][0]

    def _moved(self) -> None:
        """After a move to another model's C++ hook (``register.py``): mid-trial, the turns the
        old hook measured went with it, and the new model lays its buckets out again, so the
        trial starts again at the next step, with its warm-up (as a re-plan's does)."""
        if self._plan is not None and not self._plan["trial"]:
            return
        step = self._step
        self._restart()
        self._step, self._trial.start = step, step + 1
