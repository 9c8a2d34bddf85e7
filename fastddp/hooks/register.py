"""``register_comm_hook``: :func:`compress_hook` on a DDP model, with a fixed mode's planned
buckets run in C++ without the GIL (``csrc/ddp/native_hook.cpp``) and ``dtype="auto"``'s fp32
plans run in C++ (``csrc/ddp/switch_hook.cpp``)."""

from typing import Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastddp import _extension
from fastddp.hooks import hook
from fastddp.hooks.auto import AutoState
from fastddp.hooks.hook import compress_hook
from fastddp.hooks.presets import named_preset
from fastddp.hooks.state import CompressState
from fastddp.hooks.switch import Switch

__all__ = ["check_type", "checked", "register", "register_comm_hook"]


def register_comm_hook(
    model: DistributedDataParallel, state: Optional[CompressState] = None
) -> CompressState:
    r"""Register :func:`fastddp.compress_hook` with ``state`` on ``model``.

    For a fixed mode the hook is registered through fastddp's extension: the buckets whose
    plan the state's native runner holds (every bucket from its second step on, see
    ``native.py``) are reduced in C++ without taking Python's lock, and the others by
    :func:`compress_hook`, as ``model.register_comm_hook(state, fastddp.compress_hook)`` would.
    For ``CompressState(dtype="auto")`` the hook is registered through fastddp's extension too, so
    that while the plan is fp32 throughout (``"none"``) the steps run DDP's fp32 all-reduce in
    C++, as DDP with no hook does, without taking Python's lock per bucket: one step in
    :data:`~fastddp.hooks.auto.CHECK_EVERY` still runs in Python, to check the plan. Over a
    fast link a Python comm hook, PyTorch's ``allreduce_hook`` included, costs a few percent of
    a step. Gradients are the same, bit for bit, either way.

    Args:
        model (DistributedDataParallel): the wrapped model; one hook per model, as for DDP.
        state (CompressState, optional): the state, on the ranks the model's DDP reduces over
            (its ``process_group``); ``None`` is bf16 on the default group.

    Returns:
        ``state``; for ``None``, the default state that :func:`compress_hook` uses for
        ``None`` (shared by every model registered without one), for its ``stats()``.

    Example::

        >>> state = fastddp.CompressState(dtype="auto")
        >>> fastddp.register_comm_hook(ddp_model, state)
    """
    return register(model, state, "fastddp.register_comm_hook")


def register(
    model: DistributedDataParallel, state: Optional[CompressState], where: str
) -> CompressState:
    """:func:`register_comm_hook`, its errors starting with ``where`` (the frameworks' helpers
    register through it too)."""
    if not isinstance(model, DistributedDataParallel):
        fix = "wrap it first: DistributedDataParallel(model)"
        if isinstance(getattr(model, "_orig_mod", None), DistributedDataParallel):
            fix = "register on the DDP model before torch.compile, or pass model._orig_mod"
        raise TypeError(
            f"{where}: model must be a DistributedDataParallel, got {type(model).__name__}; {fix}"
        )
    check_type(state, where)
    state = checked(model, state, where)
    runner = getattr(state, "_runner", None)
    if not isinstance(state, AutoState) and runner is None:
        model.register_comm_hook(state, compress_hook)  # nothing to run natively
        return state
    moving = isinstance(state, AutoState) and state._switch is not None
    if moving and state._switch._model() is model:
        raise RuntimeError(
            f"{where}: this CompressState(dtype='auto') is already registered on this model; "
            "DDP takes one comm hook (register it once)"
        )
    if moving and state._switch.in_use:
        raise RuntimeError(
            f"{where}: this CompressState(dtype='auto') is registered on another model, which "
            "still exists; give each model a state of its own (or delete the old model first, "
            "to move the state to a new one)"
        )
    # What DDP's own register_comm_hook does around the reducer's registration.
    model._check_comm_hook(compress_hook)
    model.logger._set_comm_hook_name(compress_hook.__qualname__)
    if runner is not None:
        _extension.load().register_native_hook(model.reducer, runner, state, compress_hook)
    else:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        control = _extension.load().register_switch_hook(model.reducer, group, state, compress_hook)
        if moving:
            # The old model is gone: its hook's steps count, and the state (its plan and
            # residuals) goes on with this model's hook.
            state._count_native()
            state._switch.move(control, model)
            state._moved()
        else:
            state._switch = Switch(control, model)
    # Once the reducer took it (a second registration raises there, and is not kept).
    model._comm_hooks.append((compress_hook, state))
    return state


def check_type(state, where: str) -> None:
    """Refuse a ``state`` that is neither a :class:`CompressState` nor None (a preset's name is
    answered with ``from_preset``); for the frameworks' helpers too."""
    if state is not None and not isinstance(state, CompressState):
        raise TypeError(
            f"{where}: state must be a fastddp.CompressState or None, got "
            f"{type(state).__name__}{named_preset(state, 'fastddp.CompressState.from_preset')}"
        )


def checked(
    model: DistributedDataParallel, state: Optional[CompressState], where: str
) -> CompressState:
    """``state`` (the default one for None) once it fits ``model``: the same ranks, and no
    ``delay=1`` with ``find_unused_parameters``. For every registration, the frameworks' too."""
    _check_group(model, state, where)
    if state is None:
        state = hook._default_state or hook._new_default_state()
    if getattr(state, "_layout", None) is not None:  # (the hook would refuse it in backward)
        raise ValueError(
            f"{where}: this state was given to fastddp.all_reduce, and its buffers and "
            "residuals belong to those tensors; register a CompressState of its own"
        )
    if getattr(state, "delay", 0) and model.find_unused_parameters:
        raise ValueError(
            f"{where}: delay=1 hands each step's reduced gradient over on the next step, and "
            "DDP writes no gradient to a parameter unused in that step, so it would lose "
            "them; with find_unused_parameters=True use delay=0"
        )
    return state


def _ranks(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"ranks {ranks[0]}-{ranks[-1]}"
    shown = ", ".join(map(str, ranks[:8])) + (", ..." if len(ranks) > 8 else "")
    return f"ranks [{shown}]"


def _check_group(model: DistributedDataParallel, state: Optional[CompressState], where: str):
    """Refuses a state whose group is not the ranks the model's DDP reduces over: its hook
    would average the gradients of other ranks (DDP inside a node under DiLoCo, a data-parallel
    subgroup beside tensor or pipeline parallelism), or hang where the buckets differ."""
    ours = None if state is None else state.process_group
    theirs = model.process_group
    if ours is theirs or (ours is None and theirs is dist.group.WORLD):
        return
    got = dist.get_process_group_ranks(dist.group.WORLD if ours is None else ours)
    want = dist.get_process_group_ranks(theirs)
    if got == want:
        return
    named = "the default group" if ours is None else "its process group"
    fix = (
        "fastddp.CompressState(process_group=model.process_group)"
        if state is None
        else "CompressState(..., process_group=model.process_group)"
    )
    raise ValueError(
        f"{where}: the model's DDP reduces over {_ranks(want)}, but the state reduces over "
        f"{named} ({_ranks(got)}): its hook would average other ranks' gradients. Build the "
        f"state on the model's group: {fix}"
    )
