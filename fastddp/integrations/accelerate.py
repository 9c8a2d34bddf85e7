"""Hugging Face Accelerate: register fastddp's hook on a prepared model.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` accepts only its own list of
PyTorch hooks. Register fastddp's after ``prepare()``, before the first backward and before
``accelerator.load_state`` (which loads the hook's state only where it is registered)::

    accelerator = Accelerator()  # Accelerator(cpu=True) on a machine without GPUs
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = fastddp.integrations.accelerate.register_comm_hook(accelerator, model)

``accelerator.save_state(dir)`` then writes each process's hook state (error-feedback
residuals, a pending ``delay=1`` gradient: each rank's own) into ``dir`` as
``fastddp_hook_state_model<M>_rank<R>.pt``, ``M`` counting the models given
``register_comm_hook`` in order, and ``accelerator.load_state(dir)`` loads it into the same
model and rank (regrouped by :meth:`CompressState.reshard` on another number of processes).
The files of one save carry one save id, and ``load_state`` refuses, on every process, files of
different saves.
"""

import glob
import os
import uuid
import weakref
from typing import Optional

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from fastddp.hooks import CompressState
from fastddp.hooks.register import check_type, register

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
    where = "fastddp.integrations.accelerate.register_comm_hook"
    check_type(state, where)  # (before a single process returns: wrong there too)
    if accelerator.num_processes == 1:
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1:  # each rank would train alone
            raise ValueError(
                f"{where}: Accelerate sees one process, but WORLD_SIZE={launched}: its ranks "
                "would train apart. On a machine without GPUs create Accelerator(cpu=True), "
                "and launch with accelerate launch or torchrun"
            )
        return None
    # With Accelerator(dynamo_backend=...), prepare() returns torch.compile(DDP(model)): the
    # hook goes on the DDP inside, as before the compiled model's first step.
    ddp = getattr(model, "_orig_mod", model)
    if not isinstance(ddp, DistributedDataParallel) and _sharded(ddp):
        raise TypeError(
            f"{where}: the model is sharded by FSDP, which takes no DDP comm hook; use "
            "fastddp.fsdp (compress_reduce_scatter) on it, or DDP in Accelerate's config"
        )
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(
            f"{where}: pass the model returned by accelerator.prepare() (a "
            f"DistributedDataParallel), got {type(model).__name__}"
        )
    state = register(ddp, state if state is not None else CompressState(), where)
    _keep_with_checkpoints(accelerator, state)
    return state


def _keep_with_checkpoints(accelerator, state: CompressState) -> None:
    """Save and load ``state`` with ``accelerator.save_state``/``load_state``, which call their
    pre-hooks on every process (where the Accelerate version has them)."""
    if not hasattr(accelerator, "register_save_state_pre_hook"):
        return
    rank, world = accelerator.process_index, accelerator.num_processes
    # Each model registered on this accelerator gets files of its own, named by the order of
    # registration (as Accelerate names its models by the order of prepare()): a GAN's two
    # models must not load each other's residuals.
    index = _registered.get(accelerator, 0)
    _registered[accelerator] = index + 1

    def name(r: int) -> str:
        return f"{_PREFIX}model{index}_rank{r}.pt"

    def save(models, weights, output_dir) -> None:
        # On every process: the state dict finishes pending reductions (delay=1: a collective).
        saved = {"world_size": world, "state": state.state_dict()}
        # Process 0's id ties the files of this save together: two saves at one step (a run
        # re-run from an earlier checkpoint) pass the step check of the first reduction.
        save = [uuid.uuid4().hex]
        if world > 1:
            dist.broadcast_object_list(save, src=0)
        saved["save"] = save[0]
        torch.save(saved, os.path.join(output_dir, name(rank)))

    def load(models, input_dir) -> None:
        ours = sorted(glob.glob(os.path.join(glob.escape(input_dir), name("*"))))
        if not ours:
            if glob.glob(os.path.join(glob.escape(input_dir), f"{_PREFIX}*")):
                raise FileNotFoundError(
                    f"{input_dir} holds fastddp's hook state, but none for model {index} (the "
                    f"{_ordinal(index)} model given register_comm_hook): it was saved with "
                    "fewer models hooked; register the same models, in the same order"
                )
            return  # saved without fastddp's hook: it starts afresh
        saved = torch.load(ours[0])["world_size"]
        paths = [os.path.join(input_dir, name(r)) for r in range(saved)]
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:  # (every process sees the same files, and raises alike)
            raise FileNotFoundError(
                f"{input_dir} was saved by {saved} processes, each with fastddp's hook state, "
                f"but {len(missing)} of those files are missing ({missing[0]}...): copy them "
                "with the checkpoint"
            )
        if saved == world:
            mine = torch.load(paths[rank])
            saves = _gathered(mine.get("save"), world)  # (each process reads its own)
        else:
            files = [torch.load(p) for p in paths]
            saves = [f.get("save") for f in files]
        # Files saved before save ids have none (None) and load as they did: nothing tells
        # their saves apart, and the first reduction still refuses files of different steps.
        if len(set(saves)) > 1:  # (every process has every id, and raises alike)
            listed = "\n".join(f"  {p}: {_named(s)}" for p, s in zip(paths, saves))
            raise ValueError(
                f"{input_dir} holds fastddp's hook state of different saves (a save cut short, "
                f"a file left by an earlier one, or copied from another checkpoint), whose "
                f"residuals do not go together:\n{listed}\ncopy the files of one "
                f"accelerator.save_state together, or remove every {_PREFIX}* file there to "
                "start the hook afresh"
            )
        if saved == world:
            loaded = mine["state"]
        else:
            loaded = CompressState.reshard([f["state"] for f in files], world)[rank]
        state.load_state_dict(loaded)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def _gathered(mine, world: int) -> list:
    """Every process's ``mine``, in rank order; a collective with several processes."""
    if world == 1:
        return [mine]
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _named(save) -> str:
    return f"save {save}" if save is not None else "a save without an id (by an older fastddp)"


def _sharded(model) -> bool:
    # FSDP1's wrapper, or a module fully_shard (FSDP2) made an FSDPModule.
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(model, (FSDPModule, FullyShardedDataParallel))


def _ordinal(index: int) -> str:
    return {0: "first", 1: "second", 2: "third"}.get(index, f"{index + 1}th")


_PREFIX = "fastddp_hook_state_"
_registered: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # accelerator -> models
