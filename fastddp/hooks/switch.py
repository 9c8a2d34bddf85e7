"""Steps of ``dtype="auto"`` handed to the C++ hook (``csrc/ddp/switch_hook.cpp``).

Registered with :func:`fastddp.register_comm_hook`, ``"none"`` runs in a hook in C++: PyTorch's
fp32 all-reduce without Python. Its measured trial turns are handed over by the step before and
recorded there (so a later round runs it last), and a plan of ``"none"`` hands over the steps
between two checks; the C++ hook stamps when each step starts (in a trial, on CUDA, once the
device's queued work is done), and the checks read those stamps.
"""

import weakref
from typing import Any, Optional

from fastddp.hooks.candidates import NONE
from fastddp.hooks.measured import StepRecord

__all__ = ["Switch"]


class Switch:
    """The C++ hook's control (``control``), and what this side knows of the steps it ran.

    ``model``: the DDP model whose reducer holds the hook (kept weakly: once it is gone, the
    state may be registered on another model).
    """

    __slots__ = ("control", "seen", "handed", "_model", "_base")

    def __init__(self, control: Any, model: Any) -> None:
        self.control = control
        self._model = weakref.ref(model)
        self.seen = 0  # steps it ran, as last counted here (on every model it moved to)
        self._base = 0  # steps run by the hooks of models before this one
        self.handed: list[tuple[str, Optional[str]]] = []  # trial turns handed to it

    def move(self, control: Any, model: Any) -> None:
        """Go on with the hook of another model, this one's being gone (counted first)."""
        control.settling = self.control.settling  # (mid-trial: the stamps go on waiting)
        self.control, self._model = control, weakref.ref(model)
        self._base, self.handed = self.seen, []

    @property
    def in_use(self) -> bool:
        """Whether the model it was registered on still exists."""
        return self._model() is not None

    @property
    def native_now(self) -> bool:
        """Whether the step now running runs in C++."""
        return self.control.native_now

    def count(self) -> int:
        """The steps it ran since the last count (all steps of ``"none"``)."""
        new = self._base + self.control.native_total - self.seen
        self.seen += new
        return new

    def periods(self) -> list[float]:
        """The period of the last step run in Python, then of each step run in C++ since."""
        return self.control.take_periods()

    def records(self) -> list[StepRecord]:
        """The measured trial turns it ran since the last step in Python, as records."""
        records = []
        for (began, left, numel, done), (label, kind) in zip(
            self.control.take_records(), self.handed
        ):
            record = StepRecord(label, kind)
            record.began, record.left, record.numel = began, left, numel
            record.waited, record.done = [0.0] * len(numel), done
            records.append(record)
        self.handed = []
        return records

    def hand_over(self, trialing: bool, turn, to_check: Optional[int], owed: int) -> None:
        """After a step run in Python. In a trial (``trialing``), the C++ hook waits for the
        device before it stamps a step (as ``trial.settle``), and takes the next step if its
        ``turn`` is a measured turn of ``"none"`` (recorded there as here, so that ``"none"`` is
        measured as it will run). Under a plan of ``"none"``, it takes the steps up to the next
        check, ``to_check`` steps away (``None`` under another plan), whose last step runs in
        Python to make the check. Nothing while residuals are ``owed`` (repaid in Python)."""
        self.control.settling = trialing
        if owed:
            return
        if trialing:
            if turn is not None and turn[0] == NONE and turn[1] is not None:
                self.handed = [turn]
                self.control.run_native(1, measure=True)
        elif to_check is not None and to_check > 1:
            self.control.run_native(to_check - 1)

    def stop(self) -> None:
        """Take back every step handed over and not yet run (and wait for the device no more
        before a stamp, until told again)."""
        self.handed = []
        self.control.run_native(0)
        self.control.settling = False
