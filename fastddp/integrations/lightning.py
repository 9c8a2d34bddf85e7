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
resume ends where an uninterrupted run would.
"""

import os
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
        # a collective with delay=1.
        state = self.compress_state.state_dict()
        self.checkpoint_io.save_checkpoint(state, self._beside(filepath, self.global_rank))
        checkpoint[_KEY] = {"world_size": self.world_size}
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
        else:
            states = [self.checkpoint_io.load_checkpoint(p) for p in paths]
            state = CompressState.reshard(states, self.world_size)[self.global_rank]
        self.compress_state.load_state_dict(state)
        return checkpoint

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoint_io.remove_checkpoint(self._beside(filepath, self.global_rank))
        super().remove_checkpoint(filepath)


_KEY = "fastddp"
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
