"""Typed wrappers over ``torch.ops.fastddp``, each with a fake kernel for ``torch.compile``."""

from typing import Optional

import torch

from fastddp import _extension
from fastddp._ops_support import check_ints, named, one_device

__all__ = [
    "compress",
    "decompress",
    "dequantize_int8",
    "dequantize_packed",
    "quantize_int8",
    "quantize_packed",
    "requantize",
    "sum_chunks",
    "unpack_int8",
    "unpack_packed",
    "widen_sum",
]

_extension.load()

# The packed codes' ops and requantize, in a module of their own (loaded after the extension).
from fastddp._ops_packed import dequantize_packed, quantize_packed, requantize, unpack_packed  # noqa: E402

_WIRE_DTYPES = (torch.float16, torch.bfloat16)


def _check_pair(op: str, bucket: torch.Tensor, wire: torch.Tensor) -> None:
    # The plainest of csrc/include/fastddp/checks.h's checks (dtypes, device, lengths), so
    # that tracing rejects them; the kernels check the rest (layout, block sizes, overlap)
    # when the compiled code runs, with their full messages.
    torch._check(bucket.dtype == torch.float32, lambda: f"fastddp.{op}: bucket must be float32")
    torch._check(wire.dtype in _WIRE_DTYPES, lambda: f"fastddp.{op}: wire must be fp16/bf16")
    torch._check(bucket.device == wire.device, lambda: f"fastddp.{op}: devices differ")
    torch._check(bucket.numel() == wire.numel(), lambda: f"fastddp.{op}: lengths differ")


def _rounding_op(name: str, doc: str):
    """The wrapper of compress or sum_chunks, whose schemas take the same arguments."""
    op = getattr(torch.ops.fastddp, name).default

    def wrapper(
        src: torch.Tensor,
        dst: torch.Tensor,
        scale: float = 1.0,
        found_nonfinite: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
        seed: int = -1,
    ) -> None:
        check_ints(name, seed=seed)
        op(src, dst, scale, found_nonfinite, residual, seed)

    return named(wrapper, name, doc)


def _dequantizing_op(name: str, doc: str):
    """The wrapper of dequantize_int8 or unpack_int8, whose schemas take the same arguments."""
    op = getattr(torch.ops.fastddp, name).default

    def wrapper(
        src: torch.Tensor,
        scales: torch.Tensor,
        dst: torch.Tensor,
        block_size: int,
        scale: float = 1.0,
    ) -> None:
        check_ints(name, block_size=block_size)
        op(src, scales, dst, block_size, scale)

    return named(wrapper, name, doc)


compress = _rounding_op(
    "compress",
    """Write ``(src * scale)`` rounded to ``dst.dtype`` (fp16/bf16) into ``dst``, in one pass.

    Args:
        src: contiguous float32 tensor.
        dst: contiguous float16 or bfloat16 tensor with ``src.numel()`` elements, same device.
        scale: factor applied in fp32 before rounding (to nearest even).
        found_nonfinite: optional one-element int32 tensor, set to 1 if any value written to
            ``dst`` is inf or NaN (for fp16, an overflow), else 0.
        residual: optional float32 tensor like ``src`` (error feedback): the value rounded is
            ``src * scale + residual``, and ``residual`` becomes what the rounding dropped
            (left unchanged where the result is inf or NaN).
        seed: ``>= 0`` rounds stochastically with random numbers drawn from this seed and the
            element index (the same on every device); ``-1`` rounds to nearest even.
    """,
)


@torch.library.register_fake("fastddp::compress")
def _compress_fake(src, dst, scale, found_nonfinite=None, residual=None, seed=-1):
    _check_pair("compress", src, dst)
    one_device("compress", src, dst, found_nonfinite, residual)
    return None


def decompress(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``float(src) * scale`` into the float32 tensor ``dst``, in one pass.

    Args:
        src: contiguous float16 or bfloat16 tensor.
        dst: contiguous float32 tensor with ``src.numel()`` elements, same device.
        scale: factor applied in fp32 after widening.
    """
    torch.ops.fastddp.decompress.default(src, dst, scale)


@torch.library.register_fake("fastddp::decompress")
def _decompress_fake(src, dst, scale):
    _check_pair("decompress", dst, src)
    one_device("decompress", src, dst)
    return None


sum_chunks = _rounding_op(
    "sum_chunks",
    """Sum the rows of ``src`` in fp32, times ``scale``, and round once into ``dst``.

    The reduce step of a reduce-scatter whose payload is 16-bit: one rounding in all, however
    many rows (ranks) there are.

    Args:
        src: contiguous float16 or bfloat16 tensor of shape ``[chunks, m]``.
        dst: contiguous tensor of ``m`` elements, of ``src``'s dtype and device.
        scale, found_nonfinite, residual, seed: as for :func:`compress`, applied to the sum.
    """,
)


@torch.library.register_fake("fastddp::sum_chunks")
def _sum_chunks_fake(src, dst, scale, found_nonfinite=None, residual=None, seed=-1):
    torch._check(src.dim() == 2, lambda: "fastddp.sum_chunks: src must be [chunks, m]")
    torch._check(src.dtype == dst.dtype, lambda: "fastddp.sum_chunks: dtypes differ")
    torch._check(dst.numel() == src.shape[1], lambda: "fastddp.sum_chunks: lengths differ")
    one_device("sum_chunks", src, dst, found_nonfinite, residual)
    return None


def widen_sum(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0) -> None:
    """Sum the rows of the 16-bit ``src`` in fp32, times ``scale``, into the fp32 ``dst``.

    The reduce step of a reduce-scatter whose result stays in fp32: nothing is rounded to the
    wire format after the sum. Rows are added in order, so every device gives the same bits.

    Args:
        src: contiguous float16 or bfloat16 tensor of shape ``[chunks, m]``.
        dst: contiguous float32 tensor of ``m`` elements, same device.
        scale: factor applied to the sum in fp32.
    """
    torch.ops.fastddp.widen_sum.default(src, dst, scale)


@torch.library.register_fake("fastddp::widen_sum")
def _widen_sum_fake(src, dst, scale):
    torch._check(src.dim() == 2, lambda: "fastddp.widen_sum: src must be [chunks, m]")
    torch._check(src.dtype in _WIRE_DTYPES, lambda: "fastddp.widen_sum: src must be fp16/bf16")
    torch._check(dst.dtype == torch.float32, lambda: "fastddp.widen_sum: dst must be float32")
    torch._check(dst.numel() == src.shape[1], lambda: "fastddp.widen_sum: lengths differ")
    one_device("widen_sum", src, dst)
    return None


def quantize_int8(
    src: torch.Tensor,
    dst: torch.Tensor,
    scales: torch.Tensor,
    block_size: int,
    scale: float = 1.0,
    found_nonfinite: Optional[torch.Tensor] = None,
    residual: Optional[torch.Tensor] = None,
    seed: int = -1,
) -> None:
    """Quantise ``src * scale`` to int8 with one absmax scale per block, in one pass.

    For each block of ``block_size`` elements (the last may be shorter), ``scales[b]`` becomes
    ``absmax / 127`` (the float below it where 127 times it would overflow, at absmax near
    the largest float) and ``dst = round(v * (127 / absmax))``, to nearest even. A block holding
    inf or NaN gets a NaN scale and zeros, so that it dequantises to NaN; a block too small for
    ``127 / absmax`` to be finite (below about 3.7e-37) quantises to zeros.

    Args:
        src: contiguous float32 tensor of ``n`` elements.
        dst: contiguous int8 tensor of ``n`` elements, same device; or ``[R, m]`` rows holding
            ``src`` end to end (``n <= R * m``, ``m`` a multiple of ``block_size`` when
            ``R > 1``), each row contiguous but rows possibly apart, e.g. one row per rank
            in a byte buffer that also holds the scales.
        scales: contiguous float32 tensor of ``ceil(n / block_size)`` elements; for a 2-D
            ``dst``, ``[R, m / block_size]`` with contiguous rows.
        block_size: elements per scale, at least 1.
        scale, found_nonfinite, residual, seed: as for :func:`compress`.
    """
    check_ints("quantize_int8", block_size=block_size, seed=seed)
    torch.ops.fastddp.quantize_int8.default(
        src, dst, scales, block_size, scale, found_nonfinite, residual, seed
    )


@torch.library.register_fake("fastddp::quantize_int8")
def _quantize_int8_fake(
    src, dst, scales, block_size, scale, found_nonfinite=None, residual=None, seed=-1
):
    torch._check(dst.dtype == torch.int8, lambda: "fastddp.quantize_int8: dst must be int8")
    if dst.dim() == 1:
        torch._check(src.numel() == dst.numel(), lambda: "fastddp.quantize_int8: lengths differ")
    else:
        torch._check(src.numel() <= dst.numel(), lambda: "fastddp.quantize_int8: too long")
    one_device("quantize_int8", src, dst, scales, found_nonfinite, residual)
    return None


dequantize_int8 = _dequantizing_op(
    "dequantize_int8",
    """Dequantise the rows of ``src`` and sum them in fp32 into ``dst``, times ``scale``.

    Args:
        src: int8 tensor of shape ``[chunks, m]`` whose rows are contiguous (they may lie
            apart).
        scales: float32 ``[chunks, ceil(m / block_size)]`` with contiguous rows (or a
            contiguous tensor of that many elements).
        dst: contiguous float32 tensor of ``m`` elements, same device.
        block_size: elements per scale.
        scale: factor applied to the sum.
    """,
)


@torch.library.register_fake("fastddp::dequantize_int8")
def _dequantize_int8_fake(src, scales, dst, block_size, scale):
    torch._check(
        src.dim() == 2 and src.shape[0] >= 1,
        lambda: "fastddp.dequantize_int8: src must be [chunks, m] with at least one row",
    )
    torch._check(dst.numel() == src.shape[1], lambda: "fastddp.dequantize_int8: lengths differ")
    one_device("dequantize_int8", src, scales, dst)
    return None


unpack_int8 = _dequantizing_op(
    "unpack_int8",
    """Dequantise int8 rows laid out as :func:`quantize_int8` writes them into ``dst``, no sum.

    The inverse of :func:`quantize_int8`: ``dst[i] = src[i] * scales[i // block_size] * scale``
    with ``src`` and ``scales`` 1-D, or 2-D rows holding ``dst``'s elements end to end.

    Args:
        src: int8, 1-D with ``dst.numel()`` elements or ``[R, m]`` (contiguous rows).
        scales: float32 scales in the matching layout.
        dst: contiguous float32 tensor, same device.
        block_size: elements per scale.
        scale: factor applied in fp32.
    """,
)


@torch.library.register_fake("fastddp::unpack_int8")
def _unpack_int8_fake(src, scales, dst, block_size, scale):
    torch._check(src.dtype == torch.int8, lambda: "fastddp.unpack_int8: src must be int8")
    torch._check(dst.numel() <= src.numel(), lambda: "fastddp.unpack_int8: too long")
    one_device("unpack_int8", src, scales, dst)
    return None
