"""The candidates of ``dtype="auto"``: their names, checked, and the fixed states that run them.

A candidate is ``"none"`` (PyTorch's fp32 all-reduce hook) or a preset of
:data:`fastddp.PRESETS`, optionally with its path after a colon (``"int8-ef:flat"``), each run by
a fixed :class:`~fastddp.CompressState` of its own. A plan assigns one candidate to every bucket,
or one per bucket (a *mixed* plan).
"""

from typing import Any, Optional, Union

import torch

from fastddp.hooks import native, settings
from fastddp.hooks.hook import _verify
from fastddp.hooks.presets import PRESETS
from fastddp.hooks.state import CompressState
from fastddp.hooks.topology import UnevenNodes

__all__ = ["DEFAULT_ALLOW", "MIXED", "NONE", "Assignment", "checked_allow", "checked_fixed"]

NONE = "none"
MIXED = "mixed"  # the label of a plan with a mode per bucket
DEFAULT_ALLOW = (NONE, "bf16", "bf16-acc", "int8-ef")
Assignment = Union[str, tuple[str, ...]]  # one mode for every bucket, or a mode per bucket

_PATHS = ("flat", "hierarchical")  # the paths a candidate may name: "int8-ef:flat"
# Settings of a fixed mode, which dtype="auto" takes only at their defaults.
# (With their defaults, which alone auto takes: a value equal to one but of another type, such
# as block_size=0 or delay=0.0, is a setting given.)
_FIXED_ONLY = {
    "accumulate_dtype": None, "error_feedback": False, "stochastic_rounding": False,
    "block_size": None, "delay": 0,
}  # fmt: skip


def checked_allow(allow) -> tuple[str, ...]:
    """``allow`` as a tuple of candidate names (:data:`DEFAULT_ALLOW` for ``None``), or raise."""
    if allow is None:
        return DEFAULT_ALLOW
    # In order: the first is the trial's reference and ties go to the earlier name, so a set,
    # whose order differs from process to process, would make ranks disagree.
    if not isinstance(allow, (list, tuple)):
        raise TypeError(
            f"CompressState: allow must be a list of mode names, in order of preference, got "
            f"{allow!r}; for example allow=['none', 'bf16', 'int8-ef']"
        )
    names = tuple(allow)
    bad = [n for n in names if not _known(n)]
    if bad or not names or len(set(names)) != len(names):
        why = f"unknown {bad}" if bad else "empty" if not names else "repeated names"
        raise ValueError(
            f"CompressState: allow is {why}; name each candidate once, from "
            f"{', '.join((NONE, *PRESETS))}, a preset with a path ('int8-ef:flat', "
            f"'int8-ef:hierarchical') included"
        )
    return names


def checked_fixed(fixed: dict[str, Any]) -> None:
    """Refuse the settings of a fixed mode given to ``dtype="auto"`` other than at defaults."""
    for name in fixed:
        if name not in _FIXED_ONLY:
            raise TypeError(f"CompressState() got an unexpected keyword argument {name!r}")
    given = [
        k for k, v in fixed.items() if type(v) is not type(_FIXED_ONLY[k]) or v != _FIXED_ONLY[k]
    ]
    if given:
        raise ValueError(
            f"CompressState: with dtype='auto' the modes come from allow; {', '.join(given)} "
            "belongs to a fixed mode (allow=['bf16-acc', 'int8-ef', ...] names presets)"
        )


def _known(name) -> bool:
    if not isinstance(name, str):
        return False
    preset, colon, path = name.partition(":")  # ("int8-ef:" names no path: not int8-ef again)
    return name == NONE or (preset in PRESETS and (path in _PATHS if colon else True))


def make(allow: tuple[str, ...], process_group, topology: str, seed: int) -> dict:
    """The fixed state of each candidate but ``"none"``: a preset, with the path after a colon
    if one is named."""
    # Checked as a candidate's state checks them, for an allow of "none" alone too.
    settings.checked(torch.bfloat16, process_group, None, False, False, None, seed, topology)
    states = {}
    for name in allow:
        if name != NONE:
            preset, _, path = name.partition(":")
            states[name] = CompressState.from_preset(
                preset, process_group, topology=path or topology, seed=seed
            )
            # The trial times each collective as the pipeline issues it (links.py), and plans
            # hand buckets from one candidate to another: candidates stay on the Python path.
            native.turn_off(states[name])
    return states


def verify(
    states: dict[str, CompressState], device: torch.device, plan: Any, using: Assignment
) -> None:
    """At the first step, check on every rank that each candidate naming the two-level path
    that will run can take it on this group's nodes: every one in a fresh trial; in a run
    resumed with a ``plan``, those it uses (``using``; its ``allow`` cannot change, and the
    others raise only if a re-plan's trial reaches them).

    Raises the same ``ValueError`` on every rank, naming the candidate, if one cannot (nodes
    with different numbers of ranks), rather than when a bucket reaches it.
    """
    runs = set(states) if plan is None else {using} if isinstance(using, str) else set(using)
    for name, state in states.items():
        if not name.endswith(":hierarchical") or name not in runs or state._verified:
            continue
        try:
            _verify(state, device)
        except UnevenNodes as e:
            fix = (
                f"Leave {name!r} out of allow"
                if plan is None
                else "The plan loaded uses it: resume on the nodes the plan was made on, or "
                "load a state dict without its 'plan' (a fresh trial then chooses)"
            )
            raise ValueError(
                f"fastddp: dtype='auto' cannot run its candidate {name!r}: the two-level path "
                f"needs the same number of ranks on every node, but the group has "
                f"{e.topo.describe()}. {fix}, or launch the same number of ranks per node"
            ) from None


def keys_of(
    states: dict[str, CompressState], parameters: list[torch.Tensor], check: bool = False
) -> tuple:
    """The ``(key, numel)`` of ``parameters``, named alike by every candidate; with ``check``
    (the first step), raise unless every candidate's loaded residuals for them fit them: those
    of a candidate the plan does not run too, on every rank alike, not when a trial reaches it.
    """
    # Every candidate names parameters alike (by first sight here), so that residuals saved
    # by one plan find their parameters in a job resumed under another. The tables grow
    # together, so the others need the parameters only when the first did not know them (the
    # hook's own cost, every bucket of every step).
    tables = [candidate._table for candidate in states.values()]
    if not tables:
        return ()
    before = len(tables[0].param_keys)
    keys = tables[0].keys_of(parameters)
    if len(tables[0].param_keys) != before:
        for table in tables[1:]:
            table.keys_of(parameters)
    if check:
        for candidate in states.values():
            candidate._residuals.check_sizes(keys)
    return keys


def label(using: Assignment) -> str:
    """The candidate of a uniform plan, or :data:`MIXED`."""
    return using if isinstance(using, str) else MIXED


def spelled(using: Assignment, plan: dict) -> str:
    """The candidate of a uniform plan, or ``"mixed: "`` and each bucket's; and the step time
    ``plan`` expects, which a later check holds the steps against."""
    modes = using if isinstance(using, str) else "mixed: " + ", ".join(using)
    ms = plan.get("planned_ms")
    return f"{modes}, {ms if ms is None else format(ms, '.6g')} ms a step"


def mode_of(using: Assignment, index: int, plan: Optional[dict]) -> str:
    """The candidate that reduces bucket ``index`` under ``using`` (``plan``: the plan made)."""
    if isinstance(using, str):
        return using
    # A bucket the plan does not know (DDP laid its buckets out again): the uniform choice.
    return using[index] if index < len(using) else plan["uniform"]


def summary(using: Assignment, allow: tuple[str, ...]) -> str:
    """The mode in use, or the modes of a mixed plan with their numbers of buckets."""
    if isinstance(using, str):
        return using
    counts = {m: using.count(m) for m in allow if m in using}
    return "mixed (" + ", ".join(f"{m} x{c}" for m, c in counts.items()) + ")"
