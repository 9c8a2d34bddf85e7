"""A quantized parameter all-gather for FSDP2: int8 with block scales on the wire.

FSDP2 all-gathers each parameter group's shards before forward and again before backward (the
``param_dtype`` of its ``MixedPrecisionPolicy``, or the parameters' own) and lets a module
replace that collective (``set_custom_all_gather``). :class:`QuantizedAllGather` sends each
rank's shard as int8 with one fp32 absmax scale per block and decodes every rank's row, its own
included, so every rank computes with the same unsharded weights. Only the copies that
forward and backward use are rounded: the sharded parameters the optimizer updates, fp32 master
weights included, are never touched.
"""

from collections.abc import Sequence
from typing import Optional

import torch
import torch.distributed as dist

from fastddp.codecs import codec_for
from fastddp.fsdp._agree import agree, codec_row, describe, outer_group
from fastddp.fsdp._buffers import Buffers

try:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather
except ImportError as error:  # pragma: no cover - depends on the installed torch
    raise ImportError(
        f"fastddp.fsdp needs FSDP2's custom all-gather (torch >= 2.9): {error}"
    ) from error

__all__ = ["QuantizedAllGather"]

# torch 2.13 renamed all_gather_into_tensor (now deprecated); older releases have only that.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WHERE = "QuantizedAllGather"
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class QuantizedAllGather(AllGather):
    """FSDP2's parameter all-gather, sent as int8 with one fp32 scale per ``block_size``.

    A row carries ``n`` int8 codes and ``ceil(n / block_size)`` scales: 1.03 bytes per
    parameter at the default block of 128, against 2 for bf16 parameters and 4 for fp32. The
    call is synchronous: it returns once the unsharded parameters are written.

    Args:
        block_size (int): elements per scale (default 128).
    """

    def __init__(self, block_size: Optional[int] = None) -> None:
        self.codec = codec_for(torch.int8, block_size, _WHERE)
        self.block_size = self.codec.block_size
        self._buffers = Buffers()
        self._agreed = False
        self.modules: list = []  # (name, module) it is installed on (quantize_all_gather's)
        self._counters = dict.fromkeys(("calls", "elements", "wire_bytes", "bf16_wire_bytes"), 0)

    def __repr__(self) -> str:
        return f"QuantizedAllGather(block_size={self.block_size})"

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def stats(self) -> dict[str, int]:
        """``calls``; ``elements`` gathered (the whole unsharded size); ``wire_bytes``: what
        this rank sent; ``bf16_wire_bytes``: what it would send with bf16 parameters."""
        return dict(self._counters)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Optional[dist.Work]:
        world = dist.get_world_size(group)
        n = input_tensor.numel()
        # FSDP2 hands the same dtypes and sizes to every rank: these raise on all of them.
        if input_tensor.dtype not in _PARAM_DTYPES or output_tensor.dtype != input_tensor.dtype:
            raise TypeError(
                f"{_WHERE}: parameters must be float32, bfloat16 or float16 (the param_dtype), "
                f"got {input_tensor.dtype} in and {output_tensor.dtype} out (FSDP2 all-gathers "
                "a module's parameters as bytes where they are of several dtypes, or tensor "
                "subclasses; quantize only modules of plain floating parameters of one dtype)"
            )
        if output_tensor.numel() != n * world:
            raise ValueError(
                f"{_WHERE}: output has {output_tensor.numel()} elements, but gathering {n} from "
                f"{world} ranks needs {n * world}"
            )
        if not self._agreed:  # every rank's comm must have the same block size
            self._agreed = True
            row, outer = codec_row(self.codec), outer_group(self.modules)
            agree(_WHERE, input_tensor.device, group, row, describe, outer=outer)
        if n == 0:
            return None
        codec = self.codec
        row = codec.row_elems(n)
        device = input_tensor.device
        src = input_tensor.reshape(-1)
        if src.dtype != torch.float32:
            src = self._buffers.get("stage", n, torch.float32, device).copy_(src)
        send = self._buffers.get("send", row, codec.wire_dtype, device)
        codec.encode(src, send.view(1, row), n)
        recv = self._buffers.get("recv", world * row, codec.wire_dtype, device)
        all_gather_single(recv, send, group=group)
        dst = output_tensor.view(-1)
        wide = (
            dst
            if dst.dtype == torch.float32
            else self._buffers.get("wide", world * n, torch.float32, device)
        )
        codec.decode(recv.view(world, row), n, wide)
        if wide is not dst:
            dst.copy_(wide)
        self._counters["calls"] += 1
        self._counters["elements"] += n * world
        self._counters["wire_bytes"] += (world - 1) * codec.payload_bytes(n)
        self._counters["bf16_wire_bytes"] += (world - 1) * n * 2
        return None
