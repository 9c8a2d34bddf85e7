"""Codecs: how fp32 values are written onto the wire, summed in fp32, and read back.

One table, :data:`CODECS`, keyed by wire dtype, serves the DDP hook, FSDP2's reduce-scatter and
:func:`fastddp.all_reduce`. A codec works on *rows*: a wire buffer seen as ``[P, row]``, one row
per destination rank (``P = 1`` when the collective sums the payload itself). Row ``r`` holds
``shard`` values, elements ``[r * shard, (r + 1) * shard)`` of the source, plus whatever side
data the codec needs, so that one collective moves each row with its side data:

- ``float16`` / ``bfloat16``: the 16-bit values, nothing else;
- ``int8``: ``[int8 values | one fp32 absmax scale per block]``, each part and the row padded
  to a multiple of 16 bytes (so that the rows of a gathered buffer start 16-byte aligned);
- ``int4`` / ``int2``: the same with the codes packed two or four to a byte (a uint8 wire).

Each step is written once, as the list of op calls it makes (``encode_calls`` and the like):
the Python path runs the calls, and the DDP hook's native runner (``csrc/ddp/native_hook.cpp``)
binds the same calls once per bucket and replays them without Python. A codec is one class
here, an entry in :data:`CODECS` and kernels in :mod:`fastddp.ops`; its users never look inside.
"""

import math
import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Optional

import torch

from fastddp import ops  # noqa: F401  (loads the extension, which defines torch.ops.fastddp)

__all__ = [
    "CODECS",
    "Blocks",
    "Call",
    "Codec",
    "HalfCodec",
    "Int8Codec",
    "PackedCodec",
    "checked_block_size",
    "codec_for",
    "run_calls",
]

#: One op call: the op (an ``OpOverload``), its positional and its keyword arguments.
Call = tuple[Any, tuple, dict]

_OPS = torch.ops.fastddp
_AMAX = torch.ops.aten.amax.out


def run_calls(calls: list[Call]) -> None:
    """Make the op calls ``calls``, in order."""
    for op, args, kwargs in calls:
        op(*args, **kwargs)


# Hook shards start at multiples of this many elements: 16-byte aligned for every wire dtype.
_ALIGN = 16


def _round16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


@dataclass(frozen=True)
class Blocks:
    """The block sizes a block-scaled codec accepts (elements per scale)."""

    default: int
    low: int
    high: int
    power_of_two: bool = False  # packed codecs: a block holds whole bytes


class Codec(ABC):
    """The protocol every codec follows (see the module docstring).

    ``scale`` multiplies the values in fp32 before they are rounded; ``flag`` (an int32 tensor)
    is set where a non-finite value was met; ``residual`` (fp32, optional) is added before
    rounding and receives what the rounding dropped (error feedback); ``seed`` >= 0 asks for
    stochastic rounding.
    """

    name: str  # the wire dtype's name, as saved in state dicts
    code: int  # identifies the codec in the cross-rank settings check
    wire_dtype: torch.dtype  # element type of wire buffers
    sums_on_wire: bool  # whether a collective may sum payloads in the wire dtype
    plain: bool  # whether a row is the values alone (a tensor of the wire dtype is a row)
    block_size: Optional[int] = None

    def align(self) -> int:
        """Hook shard lengths are multiples of this many elements."""
        return _ALIGN

    def row_elems(self, shard: int) -> int:
        """Wire elements in one row carrying ``shard`` values."""
        return shard

    def payload_bytes(self, n: int) -> int:
        """Bytes that carry ``n`` values (with their side data)."""
        return self.row_elems(n) * self.wire_dtype.itemsize

    def encode(self, src, rows, shard, scale=1.0, flag=None, residual=None, seed=-1) -> None:
        """Write ``src * scale`` (+ ``residual``) into ``rows``, end to end."""
        run_calls(self.encode_calls(src, rows, shard, scale, flag, residual, seed))

    def sum_into(self, rows, shard, dst, scale=1.0) -> None:
        """Sum the rows in fp32, times ``scale``, into the fp32 ``dst`` of ``shard`` values."""
        run_calls(self.sum_calls(rows, shard, dst, scale))

    def reduce(self, rows, out, shard, scale=1.0, flag=None, residual=None, seed=-1) -> None:
        """Sum the rows in fp32, times ``scale``, and encode the sum, rounded once, into the
        row ``out``."""
        run_calls(self.reduce_calls(rows, out, shard, scale, flag, residual, seed))

    def decode(self, rows, shard, dst) -> None:
        """Read ``dst.numel()`` values back from ``rows``, end to end, into the fp32 ``dst``."""
        run_calls(self.decode_calls(rows, shard, dst))

    @abstractmethod
    def encode_calls(self, src, rows, shard, scale, flag, residual, seed) -> list[Call]:
        """The calls of :meth:`encode`."""

    @abstractmethod
    def sum_calls(self, rows, shard, dst, scale) -> list[Call]:
        """The calls of :meth:`sum_into`."""

    @abstractmethod
    def reduce_calls(self, rows, out, shard, scale, flag, residual, seed) -> list[Call]:
        """The calls of :meth:`reduce`."""

    @abstractmethod
    def decode_calls(self, rows, shard, dst) -> list[Call]:
        """The calls of :meth:`decode`."""


class HalfCodec(Codec):
    """fp16 or bf16: a row is the 16-bit values, nothing else."""

    sums_on_wire = True
    plain = True

    def __init__(self, dtype: torch.dtype) -> None:
        self.wire_dtype = dtype
        self.name = str(dtype).removeprefix("torch.")
        self.code = CODECS[dtype].code

    def encode_calls(self, src, rows, shard, scale, flag, residual, seed):
        dst = rows.view(-1)[: src.numel()]
        return [(_OPS.compress.default, (src, dst, scale, flag, residual, seed), {})]

    def sum_calls(self, rows, shard, dst, scale):
        return [(_OPS.widen_sum.default, (rows.view(-1, shard), dst, scale), {})]

    def reduce_calls(self, rows, out, shard, scale, flag, residual, seed):
        src = rows.view(-1, shard)
        return [(_OPS.sum_chunks.default, (src, out.view(-1), scale, flag, residual, seed), {})]

    def decode_calls(self, rows, shard, dst):
        return [(_OPS.decompress.default, (rows.view(-1)[: dst.numel()], dst, 1.0), {})]


class Int8Codec(Codec):
    """int8 with one fp32 absmax scale per block of each row; always summed in fp32."""

    name = "int8"
    code = 3
    wire_dtype = torch.int8
    _bits = 8  # bits per code, as requantize takes them
    sums_on_wire = False  # int8 values of different scales cannot be added as they are
    plain = False

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size

    def align(self) -> int:
        return math.lcm(self.block_size, _ALIGN)

    def _bytes(self, shard: int) -> int:
        """Bytes of the codes of ``shard`` values."""
        return shard

    def row_elems(self, shard: int) -> int:
        # The codes, then the scales, each from a multiple of 16 bytes, and the row too: the
        # rows of a gathered payload then start 16-byte aligned, as the GPU kernels' 16-byte
        # accesses to a group of codes need.
        return _round16(_round16(self._bytes(shard)) + 4 * -(-shard // self.block_size))

    def _split(self, rows: torch.Tensor, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Views of the values and the scales of every row; rows stay where they are.
        rows = rows.view(-1, rows.shape[-1])
        nbytes = self._bytes(shard)
        at = _round16(nbytes)
        scales = rows[:, at : at + 4 * -(-shard // self.block_size)].view(torch.float32)
        return rows[:, :nbytes], scales

    def _quantize(self, src, values, scales, scale, flag, residual, seed) -> Call:
        args = (src, values, scales, self.block_size, scale, flag, residual, seed)
        return (_OPS.quantize_int8.default, args, {})

    def _unpack(self, values, scales, dst) -> Call:
        return (_OPS.unpack_int8.default, (values, scales, dst, self.block_size, 1.0), {})

    def _pieces(self, values, scales, flat, shard):
        # None where one call covers the rows (of whole blocks, or one); else, as a block may
        # not straddle rows, (slice of flat, codes, scales, row) of each row holding part of it.
        if shard % self.block_size == 0 or values.shape[0] == 1:
            return None
        ns = [min(shard, flat.numel() - r * shard) for r in range(values.shape[0])]
        return [
            (slice(r * shard, r * shard + n), values[r, : self._bytes(n)],
             scales[r, : -(-n // self.block_size)], r)
            for r, n in enumerate(ns) if n > 0
        ]  # fmt: skip

    def encode_calls(self, src, rows, shard, scale, flag, residual, seed):
        values, scales = self._split(rows, shard)
        pieces = self._pieces(values, scales, src, shard)
        if pieces is None:
            return [self._quantize(src, values, scales, scale, flag, residual, seed)]
        calls, (marks, tail) = [], self._row_flags(flag, values.shape[0])
        for at, q, sc, r in pieces:
            extra = None if residual is None else residual[at]
            calls.append(self._quantize(src[at], q, sc, scale, marks[r], extra, seed))
        return calls + tail

    @staticmethod
    def _row_flags(flag, rows):
        # An op sets its flag to what that call met, so a flag shared by the rows' calls would
        # say what the last one met: each gets its own, and the flag the largest of them.
        if flag is None:
            return [None] * rows, []
        marks = torch.zeros(rows, dtype=flag.dtype, device=flag.device)
        return list(marks.split(1)), [(_AMAX, (marks, [0], True), {"out": flag.view(1)})]

    def sum_calls(self, rows, shard, dst, scale):
        values, scales = self._split(rows, shard)
        return [(_OPS.dequantize_int8.default, (values, scales, dst, self.block_size, scale), {})]

    def reduce_calls(self, rows, out, shard, scale, flag, residual, seed):
        if self._bytes(shard) * 8 != shard * self._bits:  # requantize takes whole bytes
            total = torch.empty(shard, dtype=torch.float32, device=rows.device)
            return [
                *self.sum_calls(rows, shard, total, scale),
                *self.encode_calls(total, out.view(1, -1), shard, 1.0, flag, residual, seed),
            ]
        # One pass: the rows' codes summed in fp32 and quantised again, the sum never stored.
        values, scales = self._split(rows, shard)
        out_values, out_scales = self._split(out.view(1, -1), shard)
        args = (values, scales, out_values, out_scales, self._bits, self.block_size, scale, flag,
                residual, seed)  # fmt: skip
        return [(_OPS.requantize.default, args, {})]

    def decode_calls(self, rows, shard, dst):
        values, scales = self._split(rows, shard)
        pieces = self._pieces(values, scales, dst, shard)
        if pieces is None:
            return [self._unpack(values, scales, dst)]
        return [self._unpack(q, sc, dst[at]) for at, q, sc, _ in pieces]


class PackedCodec(Int8Codec):
    """int4 or int2: codes in ``[-7, 7]`` or ``[-1, 1]`` packed ``8 / bits`` to a byte, one fp32
    absmax scale per block of each row; always summed in fp32."""

    wire_dtype = torch.uint8

    def __init__(self, bits: int, block_size: int) -> None:
        super().__init__(block_size)
        self.bits = self._bits = bits
        self.name = f"int{bits}"
        self.code = CODECS[torch.int4 if bits == 4 else torch.int2].code

    def _bytes(self, shard: int) -> int:
        return -(-shard * self.bits // 8)

    def _quantize(self, src, values, scales, scale, flag, residual, seed) -> Call:
        args = (src, values, scales, self.bits, self.block_size, scale, flag, residual, seed)
        return (_OPS.quantize_packed.default, args, {})

    def _unpack(self, values, scales, dst) -> Call:
        args = (values, scales, dst, self.bits, self.block_size, 1.0)
        return (_OPS.unpack_packed.default, args, {})

    def sum_calls(self, rows, shard, dst, scale):
        values, scales = self._split(rows, shard)
        args = (values, scales, dst, self.bits, self.block_size, scale)
        return [(_OPS.dequantize_packed.default, args, {})]


@dataclass(frozen=True)
class _Entry:
    code: int  # sent in the cross-rank settings check; never reuse one
    bits: int  # bits per value on the wire, side data aside
    blocks: Optional[Blocks]  # block sizes of a block-scaled codec; None: no blocks
    error_feedback: bool  # whether it needs error feedback to train as well as fp32
    make: Callable[..., Codec]  # (dtype) for a codec without blocks, else (block_size)
    feedback_required: bool = False  # refused without it: rounding drops most of a gradient


# The codecs, by wire dtype.
CODECS: dict[torch.dtype, _Entry] = {
    torch.float16: _Entry(1, 16, None, False, HalfCodec),
    torch.bfloat16: _Entry(2, 16, None, False, HalfCodec),
    torch.int8: _Entry(3, 8, Blocks(default=128, low=1, high=1 << 20), True, Int8Codec),
    torch.int4: _Entry(4, 4, Blocks(128, 32, 256, True), True, partial(PackedCodec, 4)),
    torch.int2: _Entry(5, 2, Blocks(128, 32, 256, True), True, partial(PackedCodec, 2), True),
}


def _names(dtypes) -> str:
    *rest, last = [str(d) for d in dtypes]
    return ", ".join(rest) + " or " + last if rest else last


def checked_block_size(where: str, dtype: torch.dtype, block_size) -> Optional[int]:
    """Return the block size for wire ``dtype`` (its default when ``None``), or ``None`` for a
    codec without blocks; anything else raises an error that starts with ``where``."""
    if not isinstance(dtype, torch.dtype) or dtype not in CODECS:
        raise ValueError(f"{where}: dtype must be {_names(CODECS)}, got {dtype!r}")
    blocks = CODECS[dtype].blocks
    if blocks is None:
        if block_size is not None:
            scaled = _names(d for d, e in CODECS.items() if e.blocks)
            raise ValueError(
                f"{where}: block_size applies to dtype={scaled} only ({dtype} values need no "
                f"scales); leave it out, or use dtype={scaled}"
            )
        return None
    block_size = blocks.default if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):  # (numpy's)
        raise TypeError(f"{where}: block_size must be an int, got {block_size!r}")
    if not blocks.low <= block_size <= blocks.high:
        raise ValueError(
            f"{where}: block_size must be between {blocks.low} and {blocks.high}, got {block_size}"
        )
    if blocks.power_of_two and block_size & (block_size - 1):
        raise ValueError(
            f"{where}: block_size must be a power of two for dtype={dtype}, got {block_size}"
        )
    return int(block_size)


def codec_for(
    dtype: torch.dtype, block_size: Optional[int] = None, where: str = "fastddp"
) -> Codec:
    """Return the codec of wire ``dtype``; ``block_size`` as for :func:`checked_block_size`."""
    block_size = checked_block_size(where, dtype, block_size)
    make = CODECS[dtype].make
    return make(block_size) if block_size is not None else make(dtype)
