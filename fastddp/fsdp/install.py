"""Where fastddp's comms go onto FSDP2's modules: :func:`compress_reduce_scatter` and
:func:`quantize_all_gather`.

Each installs one comm on every ``fully_shard``-ed module of a model. Its arguments are
checked on every rank of the modules' shard group alike (one all-gather of a flag): a rank
that refused its own would otherwise leave the others waiting for it in FSDP2's next
collective. The comms' settings are compared at their first call.
"""

from typing import Optional

import torch
from torch.distributed import ReduceOp

from fastddp.fsdp._agree import agree_install
from fastddp.fsdp._sharded import sharded_modules
from fastddp.fsdp.all_gather import QuantizedAllGather
from fastddp.fsdp.reduce_scatter import CompressedReduceScatter, ReduceScatter

__all__ = ["compress_reduce_scatter", "quantize_all_gather"]


class _GroupDoor(ReduceScatter):
    """One module's way into a shared :class:`CompressedReduceScatter`: it names the module's
    parameter group for the call, so that error feedback finds the group's residual."""

    def __init__(self, comm: CompressedReduceScatter, key: int) -> None:
        self.comm, self.key = comm, key

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=ReduceOp.SUM, async_op=False):
        self.comm.group_key = self.key
        try:
            return self.comm(output_tensor, input_tensor, group, op, async_op)
        finally:
            self.comm.group_key = None


def compress_reduce_scatter(
    module: torch.nn.Module,
    dtype: torch.dtype = torch.bfloat16,
    *,
    block_size: Optional[int] = None,
    error_feedback: bool = False,
) -> CompressedReduceScatter:
    """Give every ``fully_shard``-ed module in ``module`` one :class:`CompressedReduceScatter`.

    Call it after ``fully_shard`` and before the first backward. Returns the comm, whose
    :meth:`~CompressedReduceScatter.stats` count what it did; with ``error_feedback``, save it
    with the model (``dcp.save({..., "fastddp": comm})``) to resume exactly.
    """
    comm, problem, sharded = None, None, []
    try:  # (every refusal goes through agree_install, which names it on the other ranks)
        sharded = sharded_modules(module, "compress_reduce_scatter")
        if any(hasattr(m, INSTALLED) for _, m in sharded):
            # A second comm would take over silently, and the first's stats() stop counting.
            raise ValueError(
                "compress_reduce_scatter: this model's modules reduce-scatter through a fastddp "
                "comm already (an earlier call, or fastddp.fsdp.hybrid's); keep the comm it "
                "returned"
            )
        comm = CompressedReduceScatter(dtype, block_size=block_size, error_feedback=error_feedback)
    except (TypeError, ValueError) as error:  # (sharded kept: the modules' groups agree)
        problem = error
    agree_install("compress_reduce_scatter", sharded, problem)  # (raised on every rank)
    comm.modules = sharded  # (their groups check the settings at the first call)
    for index, (name, m) in enumerate(sharded):  # the same order on every rank
        m.set_custom_reduce_scatter(_GroupDoor(comm, index))
        comm.group_names[index] = name
        setattr(m, INSTALLED, comm)
    return comm


INSTALLED = "_fastddp_reduce_scatter"


def quantize_all_gather(
    module: torch.nn.Module, *, block_size: Optional[int] = None
) -> QuantizedAllGather:
    """Give every ``fully_shard``-ed module in ``module`` one :class:`QuantizedAllGather`.

    Call it after ``fully_shard`` and before the first forward; it works with plain sharding
    and with :func:`fastddp.fsdp.hybrid` (whose all-gathers stay inside the node). Returns the
    comm, whose :meth:`~QuantizedAllGather.stats` count what it sent.
    """
    comm, problem, sharded = None, None, []
    try:
        sharded = sharded_modules(module, "quantize_all_gather")
        if any(hasattr(m, _GATHERING) for _, m in sharded):
            # As for the reduce-scatter: the first comm's stats() would stop counting.
            raise ValueError(
                "quantize_all_gather: this model's modules all-gather through a fastddp comm "
                "already (an earlier call); keep the comm it returned"
            )
        comm = QuantizedAllGather(block_size)
    except (TypeError, ValueError) as error:
        problem = error
    agree_install("quantize_all_gather", sharded, problem)  # (raised on every rank)
    comm.modules = sharded
    for _, m in sharded:
        m.set_custom_all_gather(comm)
        setattr(m, _GATHERING, comm)
    return comm


_GATHERING = "_fastddp_all_gather"
