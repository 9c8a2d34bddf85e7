"""Lightning: a DDP strategy that registers fastddp's hook on CPU and GPU alike.

Lightning's ``DDPStrategy(ddp_comm_hook=...)`` registers the hook only when the device is CUDA
and otherwise skips it without a word. ``FastDDPStrategy`` registers
:func:`fastddp.compress_hook` whatever the device::

    from fastddp.integrations.lightning import FastDDPStrategy

    state = fastddp.CompressState(accumulate_dtype=torch.float32)
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy=FastDDPStrategy(state))
    trainer.fit(module)
    state.stats()  # this process's hook calls
"""

from typing import Any, Optional

from torch.nn.parallel import DistributedDataParallel

try:
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastddp.integrations.lightning needs Lightning: pip install lightning"
    ) from e

from fastddp.hooks import CompressState, compress_hook
from fastddp.hooks.register import checked

__all__ = ["FastDDPStrategy"]


class FastDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with :func:`fastddp.compress_hook` registered on every device.

    Args:
        state (CompressState, optional): the hook's state (a bf16 one if ``None``). Each
            process gets its own copy (Lightning starts processes by re-running the script or
            by pickling the strategy), so read ``stats()`` inside the processes.
        **kwargs: passed to ``DDPStrategy`` (``process_group_backend``, ``timeout``, DDP
            arguments such as ``bucket_cap_mb``...), except ``ddp_comm_hook``/``ddp_comm_state``
            /``ddp_comm_wrapper``.
    """

    strategy_name = "fastddp"

    def __init__(self, state: Optional[CompressState] = None, **kwargs: Any) -> None:
        taken = sorted({"ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper"} & set(kwargs))
        if taken:
            raise ValueError(
                f"FastDDPStrategy registers fastddp.compress_hook itself; drop {', '.join(taken)} "
                "(give settings through state=fastddp.CompressState(...))"
            )
        if state is not None and not isinstance(state, CompressState):
            got = type(state).__name__
            raise TypeError(f"FastDDPStrategy: state must be a fastddp.CompressState, got {got}")
        super().__init__(**kwargs)
        self.compress_state = state if state is not None else CompressState()

    def _register_ddp_hooks(self) -> None:
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(
                f"FastDDPStrategy: expected the model wrapped in DistributedDataParallel, got "
                f"{type(self.model).__name__}"
            )
        state = checked(self.model, self.compress_state, "FastDDPStrategy")
        self.model.register_comm_hook(state, compress_hook)
