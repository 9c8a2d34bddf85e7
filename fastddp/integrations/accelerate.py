"""Hugging Face Accelerate: register fastddp's hook on a prepared model.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only its own list of
PyTorch hooks. Register fastddp's after ``prepare()``, before the first backward::

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = fastddp.integrations.accelerate.register_comm_hook(accelerator, model)
"""

from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from fastddp.hooks import CompressState, compress_hook
from fastddp.hooks.register import checked

__all__ = ["register_comm_hook"]


def register_comm_hook(
    accelerator, model: torch.nn.Module, state: Optional[CompressState] = None
) -> Optional[CompressState]:
    """Register :func:`fastddp.compress_hook` on ``model`` as returned by ``prepare()``.

    Args:
        accelerator: the ``accelerate.Accelerator`` that prepared ``model``.
        model: the prepared model: a ``DistributedDataParallel`` when there are several
            processes; with one process there is nothing to reduce and nothing is registered.
        state (CompressState, optional): the hook's state; a bf16 one if ``None``.

    Returns:
        The state in use (for ``stats()``), or ``None`` with a single process.
    """
    if accelerator.num_processes == 1:
        return None
    where = "fastddp.integrations.accelerate.register_comm_hook"
    # With Accelerator(dynamo_backend=...), prepare() returns torch.compile(DDP(model)): the
    # hook goes on the DDP inside, as before the compiled model's first step.
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"{where}: pass the model returned by accelerator.prepare() (a "
            f"DistributedDataParallel), got {type(model).__name__}"
        )
    state = checked(ddp, state if state is not None else CompressState(), where)
    ddp.register_comm_hook(state, compress_hook)
    return state
