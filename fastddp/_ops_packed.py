"""The ops of the packed int4 and int2 codes, and requantize (int8, int4 and int2), each with a
fake kernel for ``torch.compile``; :mod:`fastddp.ops` exports them with the others."""

from typing import Optional

import torch

from fastddp import _extension
from fastddp._ops_support import check_ints, one_device

__all__ = ["dequantize_packed", "quantize_packed", "requantize", "unpack_packed"]

_extension.load()


def quantize_packed(src, dst, scales, bits: int, block_size: int, scale: float = 1.0,
                    found_nonfinite=None, residual=None, seed: int = -1) -> None:  # fmt: skip
    """:func:`quantize_int8` for ``bits`` = 4 or 2: codes in ``[-7, 7]`` or ``[-1, 1]``
    (``scales[b] = absmax / 7`` or ``absmax``), packed ``8 / bits`` to a byte of the uint8
    ``dst``, code ``j`` of a byte in bits ``[j * bits, (j + 1) * bits)``, two's complement.

    ``dst`` is 1-D with ``ceil(n * bits / 8)`` bytes, or ``[R, m]`` rows of ``m * 8 / bits``
    codes; ``block_size`` is a multiple of ``8 / bits``, so that a block holds whole bytes.
    """
    check_ints("quantize_packed", bits=bits, block_size=block_size, seed=seed)
    torch.ops.fastddp.quantize_packed.default(
        src, dst, scales, bits, block_size, scale, found_nonfinite, residual, seed
    )


@torch.library.register_fake("fastddp::quantize_packed")
def _quantize_packed_fake(
    src, dst, scales, bits, block_size, scale, found_nonfinite=None, residual=None, seed=-1
):
    torch._check(dst.dtype == torch.uint8, lambda: "fastddp.quantize_packed: dst must be uint8")
    torch._check(bits in (4, 2), lambda: "fastddp.quantize_packed: bits must be 4 or 2")
    one_device("quantize_packed", src, dst, scales, found_nonfinite, residual)
    return None


def dequantize_packed(src, scales, dst, bits: int, block_size: int, scale: float = 1.0) -> None:
    """:func:`dequantize_int8` for the packed codes of :func:`quantize_packed`: ``src`` is
    ``[chunks, ceil(m * bits / 8)]`` bytes, ``dst`` the ``m`` fp32 sums."""
    check_ints("dequantize_packed", bits=bits, block_size=block_size)
    torch.ops.fastddp.dequantize_packed.default(src, scales, dst, bits, block_size, scale)


def unpack_packed(src, scales, dst, bits: int, block_size: int, scale: float = 1.0) -> None:
    """:func:`unpack_int8` for the packed codes of :func:`quantize_packed`."""
    check_ints("unpack_packed", bits=bits, block_size=block_size)
    torch.ops.fastddp.unpack_packed.default(src, scales, dst, bits, block_size, scale)


@torch.library.register_fake("fastddp::dequantize_packed")
def _dequantize_packed_fake(src, scales, dst, bits, block_size, scale):
    torch._check(
        src.dim() == 2 and src.shape[0] >= 1,
        lambda: "fastddp.dequantize_packed: src must be [chunks, bytes] with at least one row",
    )
    one_device("dequantize_packed", src, scales, dst)
    return None


@torch.library.register_fake("fastddp::unpack_packed")
def _unpack_packed_fake(src, scales, dst, bits, block_size, scale):
    torch._check(src.dtype == torch.uint8, lambda: "fastddp.unpack_packed: src must be uint8")
    one_device("unpack_packed", src, scales, dst)
    return None


def requantize(
    src: torch.Tensor,
    src_scales: torch.Tensor,
    dst: torch.Tensor,
    dst_scales: torch.Tensor,
    bits: int,
    block_size: int,
    scale: float = 1.0,
    found_nonfinite: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    seed: int = -1,
) -> None:
    """Sum rows of codes in fp32 and quantise the sum once, in one pass.

    The bits of :func:`~fastddp.ops.dequantize_int8` (or :func:`dequantize_packed`) of ``src``
    into fp32, times ``scale``, then :func:`~fastddp.ops.quantize_int8` (or
    :func:`quantize_packed`) of that sum with scale 1, without the fp32 sum in memory: the
    reduce step of a reduce-scatter whose payload is codes.

    Args:
        src: ``[chunks, bytes]`` rows of codes of ``bits`` bits (int8 for 8, packed uint8 for 4
            and 2), rows contiguous but possibly apart; a row holds ``m = bytes * 8 / bits``
            codes.
        src_scales: float32 ``[chunks, ceil(m / block_size)]`` with contiguous rows.
        dst: one row of ``m`` codes of ``src``'s dtype: 1-D or ``[1, bytes]``.
        dst_scales: float32, ``ceil(m / block_size)`` of them.
        bits: 8, 4 or 2.
        block_size: elements per scale, in ``src`` and in ``dst``.
        scale: factor applied to the sum in fp32.
        found_nonfinite, residual, seed: as for :func:`~fastddp.ops.compress`, applied to the
            sum; ``residual`` has ``m`` elements.
    """
    check_ints("requantize", bits=bits, block_size=block_size, seed=seed)
    torch.ops.fastddp.requantize.default(
        src, src_scales, dst, dst_scales, bits, block_size, scale, found_nonfinite, residual, seed
    )


@torch.library.register_fake("fastddp::requantize")
def _requantize_fake(
    src, src_scales, dst, dst_scales, bits, block_size, scale, found_nonfinite=None,
    residual=None, seed=-1,
):  # fmt: skip
    torch._check(
        src.dim() == 2 and src.shape[0] >= 1,
        lambda: "fastddp.requantize: src must be [chunks, bytes] with at least one row",
    )
    torch._check(src.dtype == dst.dtype, lambda: "fastddp.requantize: src and dst dtypes differ")
    torch._check(bits in (8, 4, 2), lambda: "fastddp.requantize: bits must be 8, 4 or 2")
    one_device("requantize", src, src_scales, dst, dst_scales, found_nonfinite, residual)
    return None
