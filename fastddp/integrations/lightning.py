"""Lightning: a DDP strategy that registers fastddp's hook on CPU and GPU alike.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when the device is CUDA
and otherwise skips it without a word. ``FastDDPStrategy`` registers
:func:`fastddp.compress_hook` whatever the device::

    from fastddp.integrations.lightning import FastDDPStrategy

    state = fastddp.CompressState(accumulate_dtype=torch.float32)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=FastDDPStrategy(state))
    trainer.fit(module)
    state.stats()  # this process's hook calls

Lightning writes a checkpoint from rank 0 alone, and the hook's error-feedback residuals (and a
pending ``delay=1`` gradient) are each rank's own: ``FastDDPStrategy`` writes each rank's
``state.state_dict()`` in a folder beside the checkpoint, as
``fastddp-hook-state/<checkpoint's name>.rank<R>``, and a resumed fit loads it into the same
rank (regrouped by :meth:`CompressState.reshard` when the number of ranks changed), so that a
resume ends where an uninterrupted run would. Each save's files and checkpoint carry one save id,
and a resume refuses, on every rank, files of another save.
"""

import os
import uuid
import warnings
from typing import Any, Optional

import torch.distributed
from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastddp.integrations.lightning needs Lightning: pip install lightning"
    ) from e

from fastddp.hooks import CompressState, compress_hook
from fastddp.hooks.register import check_type, checked

__all__ = ["FastDDPStrategy"]


class FastDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with :func:`fastddp.compress_hook` registered on every device.

    Args:
        state (CompressState, optional): the hook's state (a bf16 one if ``None``). Each
            process gets its own copy (Lightning starts processes by re-running the script or
            by pickling the strategy), so read ``stats()`` inside the processes.
        resume_hook_state (bool): whether a resumed ``fit`` loads the hook's state saved
            beside the checkpoint (default); ``False`` starts the hook afresh (error-feedback
            residuals zero), as for a fit resumed under other compression settings, which
            the saved state does not fit.
        **kwargs: passed to ``DDPStrategy`` (``process_group_backend``, ``timeout``, DDP
            arguments such as ``bucket_cap_mb``...), except ``ddp_comm_hook``/``ddp_comm_state``
            /``ddp_comm_wrapper``.
    """

    strategy_name = "fastddp"

    def __init__(
        self,
        state: Optional[CompressState] = None,
        *,
        resume_hook_state: bool = True,
        **kwargs: Any,
    ) -> None:
        if not isinstance(resume_hook_state, bool):
            got = repr(resume_hook_state)
            raise TypeError(f"FastDDPStrategy: resume_hook_state must be True or False, got {got}")
        settings = sorted(_STATE_SETTINGS & set(kwargs))  # (DDP would refuse them, later)
        if settings:
            raise TypeError(
                f"FastDDPStrategy: {', '.join(settings)} are the hook's settings; give them to "
                "its state: FastDDPStrategy(fastddp.CompressState(...)), or "
                "fastddp.CompressState.from_preset(name)"
            )
        taken = sorted({"ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"} & set(kwargs))
        if taken:
            raise ValueError(
                f"FastDDPStrategy registers fastddp.compress_hook itself; drop {', '.join(taken)} "
                "(give settings through state=fastddp.CompressState(...))"
            )
        check_type(state, "FastDDPStrategy")
        super().__init__(**kwargs)
        self.compress_state = state if state is not None else CompressState()
        self.resume_hook_state = resume_hook_state

    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(
                f"FastDDPStrategy: expected the model wrapped in DistributedDataParallel, got "
                f"{type(self.model).__name__}"
            )
        # In Python, as model.register_comm_hook does (no native runner, no C++ switch):
        # Lightning wraps the module in a new DDP for each fit/test, while the old one lives.
        state = checked(self.model, self.compress_state, "FastDDPStrategy")
        self.model.register_comm_hook(state, compress_hook)

    # -- checkpoints: the hook's state, one file per rank ------------------------------------

    @staticmethod
    def _beside(filepath: Any, rank: int) -> str:
        path = str(filepath)
        return os.path.join(os.path.dirname(path), _DIR, f"{os.path.basename(path)}.rank{rank}")

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        if not torch.distributed.is_initialized():
            # ddp_spawn's main process after fit: its copy of the state never ran (each spawned
            # process had its own), and no other rank would write a file beside the checkpoint.
            warnings.warn(
                "FastDDPStrategy: this process has no process group (ddp_spawn's main process "
                "after fit?), so the checkpoint holds no hook state, and a fit resumed from it "
                "starts the hook afresh; save during fit (a ModelCheckpoint) to keep it",
                stacklevel=2,
            )
            super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            return
        # On every rank (Lightning calls it there): the state dict finishes pending reductions,
        # a collective with delay=1. Rank 0's id ties this save's files to its checkpoint: two
        # saves at one step (a fit re-run from an earlier checkpoint) pass the step check of
        # the first reduction, and a file of either may be left beside the other's checkpoint.
        save = self.broadcast(uuid.uuid4().hex)
        state = {**self.compress_state.state_dict(), _ID: save}
        self.checkpoint_io.save_checkpoint(state, self._beside(filepath, self.global_rank))
        checkpoint[_KEY] = {"world_size": self.world_size, "save": save}
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)  # (any version's)
        saved = checkpoint.get(_KEY) if isinstance(checkpoint, dict) else None
        trainer = getattr(self.lightning_module, "_trainer", None)  # (the property raises)
        fitting = trainer is None or trainer.state.fn == "fit"
        if saved is None or not fitting or not self.resume_hook_state:
            # Written without FastDDPStrategy, or resume_hook_state=False: the hook starts
            # afresh. Or validate/test/predict, which run no hook: the checkpoint alone will do.
            return checkpoint
        # ModelCheckpoint(save_last="link") makes last.ckpt a link to a checkpoint saved under
        # its own name, without calling save_checkpoint: the files are beside that one.
        target = str(checkpoint_path)
        if os.path.islink(target):
            target = os.path.realpath(target)
        paths = [self._beside(target, r) for r in range(saved["world_size"])]
        missing = [p for p in paths if not get_filesystem(p).exists(p)]
        if missing:  # written in the earlier layout, beside the checkpoint?
            older = [f"{target}.fastddp-rank{r}" for r in range(saved["world_size"])]
            if all(get_filesystem(p).exists(p) for p in older):
                paths, missing = older, []
        if missing:  # (every rank sees the same files, and raises alike)
            raise FileNotFoundError(
                f"FastDDPStrategy: {checkpoint_path} was saved by {saved['world_size']} ranks, "
                f"each with its hook state beside it, but {len(missing)} of those files are "
                f"missing ({missing[0]}...): copy them with the checkpoint"
            )
        if saved["world_size"] == self.world_size:
            state = self.checkpoint_io.load_checkpoint(paths[self.global_rank])
            read = {self.global_rank: state.pop(_ID, None)}
        else:
            states = [self.checkpoint_io.load_checkpoint(p) for p in paths]
            read = {r: s.pop(_ID, None) for r, s in enumerate(states)}
        # A rank reads its own file (all of them to reshard): sharing what they read, the
        # ranks decide alike, and raise alike.
        _same_save(checkpoint_path, paths, _gathered((saved.get("save"), read)))
        if saved["world_size"] != self.world_size:
            state = CompressState.reshard(states, self.world_size)[self.global_rank]
        self.compress_state.load_state_dict(state)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoint_io.remove_checkpoint(self._beside(filepath, self.global_rank))
        super().remove_checkpoint(filepath)


def _gathered(mine: Any) -> list[Any]:
    """Every rank's ``mine``, in rank order; a collective where there is a process group."""
    if not torch.distributed.is_initialized():
        return [mine]
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    return everyone


def _same_save(checkpoint_path: Any, paths: list, seen: list) -> None:
    """Raise if a file is of another save than the checkpoint (as rank 0, its writer, read it).

    ``seen``: each rank's ``(checkpoint's save id, {rank: save id of rank's file})``, for the
    files it read.
    Checkpoints and files saved before save ids have none (``None``) and load as they did:
    nothing tells their saves apart, and the first reduction still refuses files saved at
    different steps. A file without an id beside a checkpoint with one (or the reverse) is of
    another save.
    """
    save = seen[0][0]
    files = {r: s for _, read in seen for r, s in read.items()}
    other = [f"  {paths[r]}: {_named(s)}" for r, s in sorted(files.items()) if s != save]
    other += [
        f"  {checkpoint_path} as rank {r} read it: {_named(s)}"
        for r, (s, _) in enumerate(seen)
        if s != save
    ]
    if other:
        raise ValueError(
            f"FastDDPStrategy: {checkpoint_path} is of {_named(save)}, but hook state files "
            "beside it are of another (a save cut short, a file left by an earlier save, or "
            "copied from another checkpoint), and their residuals do not go with it:\n"
            + "\n".join(other)
            + "\ncopy the files of the checkpoint's own save with it, or resume with "
            "FastDDPStrategy(resume_hook_state=False) to start the hook afresh"
        )


def _named(save: Optional[str]) -> str:
    return f"save {save}" if save is not None else "a save without an id (by an older fastddp)"


_KEY = "fastddp"
_ID = "fastddp_save"  # in each rank's file, beside the state dict's own keys
# Not beside the checkpoint itself: Lightning numbers its next HPC checkpoint (and finds the
# one to resume) by the digits of every name in the folder that holds "ckpt_", and
# "hpc_ckpt_1.ckpt.fastddp-rank0" read as version 10.
_DIR = "fastddp-hook-state"
_STATE_SETTINGS = {"dtype", "preset", "allow", "accumulate_dtype", "error_feedback", "block_size",
                   "stochastic_rounding", "seed", "topology", "delay"}  # fmt: skip

# Trainer(strategy="fastddp"), once this module is imported: bf16 on every device.
StrategyRegistry.register(
    FastDDPStrategy.strategy_name,
    FastDDPStrategy,
    description="DDP with fastddp.compress_hook (bf16) on every device",
    override=True,
)
