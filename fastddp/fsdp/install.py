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
        names = {id(p): n for n, p in module.named_parameters()}
        for name, m in sharded:
            _check_gathered_dtypes(names, name, m)
    except (TypeError, ValueError) as error:
        problem = error
    agree_install("quantize_all_gather", sharded, problem)  # (raised on every rank)
    comm.modules = sharded
    for _, m in sharded:
        m.set_custom_all_gather(comm)
        setattr(m, _GATHERING, comm)
    return comm


_GATHERING = "_fastddp_all_gather"


def _check_gathered_dtypes(names: dict[int, str], name: str, module) -> None:
    """Refuse a module whose parameter group FSDP2 would all-gather as bytes: its parameters
    of two dtypes (as the mixed-precision policy leaves them), or a tensor subclass that
    gathers its own way. The comm would see only uint8 at the first forward. ``names``: the
    model's parameter names by id."""
    group = module._get_fsdp_state()._fsdp_param_group
    if group is None:  # no parameters of its own
        return
    cast = group.mp_policy.param_dtype
    found: dict[torch.dtype, list[str]] = {}
    for fsdp_param in group.fsdp_params:
        param = fsdp_param.sharded_param
        label = names.get(id(param), "?")
        if hasattr(getattr(fsdp_param, "_sharded_local_tensor", None), "fsdp_pre_all_gather"):
            raise TypeError(
                f"quantize_all_gather: parameter {label} of module {name or 'the root'} is a "
                f"tensor subclass ({type(fsdp_param._sharded_local_tensor).__name__}) that "
                "FSDP2 all-gathers its own way, as bytes; quantize only modules of plain "
                "floating parameters"
            )
        dtype = cast if cast is not None and param.dtype.is_floating_point else param.dtype
        found.setdefault(dtype, []).append(label)
    if len(found) > 1 or not found.keys() <= set(_GATHERED):
        kinds = "; ".join(
            f"{dtype}: {', '.join(labels[:3])}{' ...' if len(labels) > 3 else ''}"
            for dtype, labels in found.items()
        )
        why = (
            "parameters of more than one dtype, which FSDP2 all-gathers together as bytes"
            if len(found) > 1
            else "parameters that are not float32, bfloat16 or float16"
        )
        raise TypeError(
            f"quantize_all_gather: module {name or 'the root'} has {why} ({kinds}). Give its "
            "fully_shard a MixedPrecisionPolicy(param_dtype=...) that casts them to one, "
            "fully_shard the parameters of each dtype apart, or leave this model's "
            "all-gather unquantized"
        )


_GATHERED = (torch.float32, torch.bfloat16, torch.float16)
