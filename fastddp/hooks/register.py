"""``register_comm_hook``: :func:`compress_hook` on a DDP model, with a fixed mode's planned
buckets run in C++ without the GIL (``csrc/ddp/native_hook.cpp``) and ``dtype="auto"``'s fp32
plans run in C++ (``csrc/ddp/switch_hook.cpp``)."""

from typing import Optional

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastddp import _extension
from fastddp.hooks.auto import AutoState
from fastddp.hooks.hook import compress_hook
from fastddp.hooks.state import CompressState
from fastddp.hooks.switch import Switch

__all__ = ["register_comm_hook"]


def register_comm_hook(
    model: DistributedDataParallel, state: Optional[CompressState] = None
) -> Optional[CompressState]:
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
        state (CompressState, optional): the state; ``None`` is bf16 on the default group.

    Returns:
        ``state``.

    Example::

        >>> state = fastddp.CompressState(dtype="auto")
        >>> fastddp.register_comm_hook(ddp_model, state)
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(
            f"fastddp.register_comm_hook: model must be a DistributedDataParallel, got "
            f"{type(model).__name__}; wrap it first: DistributedDataParallel(model)"
        )
    if state is not None and not isinstance(state, CompressState):
        raise TypeError(
            f"fastddp.register_comm_hook: state must be a fastddp.CompressState or None, got "
            f"{type(state).__name__}"
        )
    runner = getattr(state, "_runner", None)
    if not isinstance(state, AutoState) and runner is None:
        model.register_comm_hook(state, compress_hook)  # nothing to run natively
        return state
    if isinstance(state, AutoState) and state._switch is not None:
        raise RuntimeError(
            "fastddp.register_comm_hook: this CompressState(dtype='auto') is registered on "
            "another model already; give each model a state of its own"
        )
    # What DDP's own register_comm_hook does around the reducer's registration.
    model._check_comm_hook(compress_hook)
    model.logger._set_comm_hook_name(compress_hook.__qualname__)
    model._comm_hooks.append((compress_hook, state))
    if runner is not None:
        _extension.load().register_native_hook(model.reducer, runner, state, compress_hook)
        return state
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    control = _extension.load().register_switch_hook(model.reducer, group, state, compress_hook)
    state._switch = Switch(control)
    return state
