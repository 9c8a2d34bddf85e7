"""Typed wrappers over ``torch.ops.fastddp``, each with a fake kernel for ``torch.compile``."""

from typing import Optional

import torch

from fastddp import _extension

_extension.load()

_WIRE_DTYPES = (torch.float16, torch.bfloat16)


def compress(
    src: torch.Tensor,
    dst: torch.Tensor,
    scale: float = 1.0,
    found_nonfinite: Optional[torch.Tensor] = None,
) -> None:
    """Write ``(src * scale)`` rounded to ``dst.dtype`` (fp16/bf16) into ``dst``, in one pass.

    Args:
        src: contiguous float32 tensor.
        dst: contiguous float16 or bfloat16 tensor with ``src.numel()`` elements, same device.
        scale: factor applied in fp32 before rounding (to nearest even).
        found_nonfinite: optional one-element int32 tensor, set to 1 if any value written to
            ``dst`` is inf or NaN (for fp16, an overflow), else 0.
    """
    torch.ops.fastddp.compress.default(src, dst, scale, found_nonfinite)


def decompress(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0) -> None:
    """Write ``float(src) * scale`` into the float32 tensor ``dst``, in one pass.

    Args:
        src: contiguous float16 or bfloat16 tensor.
        dst: contiguous float32 tensor with ``src.numel()`` elements, same device.
        scale: factor applied in fp32 after widening.
    """
    torch.ops.fastddp.decompress.default(src, dst, scale)


def _check_pair(op: str, bucket: torch.Tensor, wire: torch.Tensor) -> None:
    # Mirrors csrc/include/fastddp/checks.h so that tracing rejects what the kernels reject.
    torch._check(bucket.dtype == torch.float32, lambda: f"fastddp.{op}: bucket must be float32")
    torch._check(wire.dtype in _WIRE_DTYPES, lambda: f"fastddp.{op}: wire must be fp16/bf16")
    torch._check(bucket.device == wire.device, lambda: f"fastddp.{op}: devices differ")
    torch._check(bucket.numel() == wire.numel(), lambda: f"fastddp.{op}: lengths differ")


@torch.library.register_fake("fastddp::compress")
def _compress_fake(src, dst, scale, found_nonfinite=None):
    _check_pair("compress", src, dst)
    return None


@torch.library.register_fake("fastddp::decompress")
def _decompress_fake(src, dst, scale):
    _check_pair("decompress", dst, src)
    return None
