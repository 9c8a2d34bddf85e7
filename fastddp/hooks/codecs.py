"""Codecs: how a fp32 bucket is written onto the wire, summed in fp32, and read back.

A codec works on *rows*: the wire buffer seen as ``[P, row]``, one row per destination rank
(``P = 1`` when the collective sums the payload itself). Row ``r`` holds elements
``[r * shard, (r + 1) * shard)`` of the bucket, plus whatever side data the codec needs, so
that one collective moves each row with its side data. A new codec is one class here plus its
kernels in ``fastddp.ops``; the paths never look inside a row.
"""

import math
from abc import ABC, abstractmethod
from typing import Optional

import torch

from fastddp import ops

__all__ = ["Codec", "HalfCodec", "Int8Codec", "codec_for"]

# Shards start at multiples of this many elements: 16-byte aligned for every wire dtype.
_ALIGN = 16


class Codec(ABC):
    """The protocol every codec follows (see the module docstring)."""

    name: str
    code: int  # identifies the codec in the cross-rank settings check
    wire_dtype: torch.dtype  # element type of wire buffers
    sums_on_wire: bool  # whether a collective may sum payloads in the wire dtype

    def align(self) -> int:
        """Shard lengths are multiples of this many elements."""
        return _ALIGN

    def row_elems(self, shard: int) -> int:
        """Wire elements in one row carrying ``shard`` bucket elements."""
        return shard

    @abstractmethod
    def payload_bytes(self, n: int) -> int:
        """Bytes that carry ``n`` elements (with their side data)."""

    def scratch(self, shard: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Persistent work buffers for :meth:`reduce`."""
        return {}

    @abstractmethod
    def encode(self, src, rows, scale, flag, residual, seed) -> None:
        """Write ``src * scale`` (+ ``residual``) into ``rows``, end to end."""

    @abstractmethod
    def reduce(self, rows, out, flag, residual, seed, scratch) -> None:
        """Sum the rows in fp32 and encode the sum, rounded once, into the row ``out``."""

    @abstractmethod
    def decode(self, rows, dst) -> None:
        """Read ``dst.numel()`` elements back from ``rows`` into the fp32 ``dst``."""


class HalfCodec(Codec):
    """fp16 or bf16: a row is the 16-bit values, nothing else."""

    sums_on_wire = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.wire_dtype = dtype
        self.name = "float16" if dtype == torch.float16 else "bfloat16"
        self.code = 1 if dtype == torch.float16 else 2

    def payload_bytes(self, n: int) -> int:
        return 2 * n

    def encode(self, src, rows, scale, flag, residual, seed) -> None:
        ops.compress(src, rows.view(-1)[: src.numel()], scale, flag, residual, seed)

    def reduce(self, rows, out, flag, residual, seed, scratch) -> None:
        ops.sum_chunks(rows, out, 1.0, flag, residual, seed)

    def decode(self, rows, dst) -> None:
        ops.decompress(rows.view(-1)[: dst.numel()], dst, 1.0)


class Int8Codec(Codec):
    """int8 with one fp32 absmax scale per block: a row is ``[int8 values | fp32 scales]``."""

    name = "int8"
    code = 3
    wire_dtype = torch.int8
    sums_on_wire = False  # int8 values of different scales cannot be added as they are

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def align(self) -> int:
        return math.lcm(self.block_size, _ALIGN)

    def row_elems(self, shard: int) -> int:
        return shard + 4 * (shard // self.block_size)

    def payload_bytes(self, n: int) -> int:
        return n + 4 * -(-n // self.block_size)

    def scratch(self, shard: int, device: torch.device) -> dict[str, torch.Tensor]:
        return {"sum": torch.empty(shard, device=device)}

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Views of the values and the scales of every row; rows stay where they are.
        rows = rows.view(-1, rows.shape[-1])
        shard = rows.shape[1] * self.block_size // (self.block_size + 4)
        return rows[:, :shard], rows[:, shard:].view(torch.float32)

    def encode(self, src, rows, scale, flag, residual, seed) -> None:
        values, scales = self._split(rows)
        ops.quantize_int8(src, values, scales, self.block_size, scale, flag, residual, seed)

    def reduce(self, rows, out, flag, residual, seed, scratch) -> None:
        values, scales = self._split(rows)
        ops.dequantize_int8(values, scales, scratch["sum"], self.block_size)
        out_values, out_scales = self._split(out)
        ops.quantize_int8(
            scratch["sum"], out_values[0], out_scales[0], self.block_size, 1.0, flag, residual,
            seed,
        )  # fmt: skip

    def decode(self, rows, dst) -> None:
        values, scales = self._split(rows)
        ops.unpack_int8(values, scales, dst, self.block_size)


def codec_for(dtype: torch.dtype, block_size: Optional[int]) -> Codec:
    """The codec of a :class:`~fastddp.CompressState`'s wire ``dtype``."""
    if dtype == torch.int8:
        assert block_size is not None
        return Int8Codec(block_size)
    return HalfCodec(dtype)
