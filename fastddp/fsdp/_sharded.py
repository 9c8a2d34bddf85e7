"""The modules of a model that FSDP2 sharded, where fastddp's comms are installed."""

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["sharded_modules"]


def sharded_modules(
    model: torch.nn.Module, where: str, how: str = "torch.distributed.fsdp.fully_shard"
) -> list[tuple[str, FSDPModule]]:
    """``model``'s ``fully_shard``-ed modules with their names, in ``named_modules()`` order (the
    same on every rank); raise if it is not a module or none is sharded."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{where}: expected an nn.Module, got {type(model).__name__}")
    sharded = [(n, m) for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(
            f"{where}: no module in this model is sharded by FSDP2; call {how} on its layers "
            "and on the model first"
        )
    return sharded
