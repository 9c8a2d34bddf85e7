"""Lengths that take the CUDA kernels' grid-stride loops through several passes.

``grid_for`` in csrc/cuda/launch.h launches ``min(ceil(work / 256), 8 * sms)`` blocks of
``kThreads = 256`` threads, and every kernel strides over what one grid cannot cover. On an
H100 (132 SMs) one pass is 132 * 8 * 256 = 270,336 threads: that many elements for the scalar
loops, 8 times as many for the vectorised compress/decompress (``kVec = 8`` elements a
thread), and 8 times as many for quantize_int8 with blocks of up to 128 (a warp takes
``kCodeUnroll = 2`` runs of 128 elements a step; unpack takes 4, so 1.5 passes there). Smaller
tests never reach a second pass, where an indexing slip in the stride would hide.
"""

import pytest
import torch

H100_SMS = 132
THREADS_PER_PASS = H100_SMS * 8 * 256  # grid_for's cap of 8 blocks per SM, times kThreads


def grid_stride_length(elements_per_thread: int = 1, passes: int = 3) -> int:
    """The length one grid covers ``passes`` times on an H100, plus an odd tail of 3."""
    return passes * THREADS_PER_PASS * elements_per_thread + 3


# 3 passes of the scalar kernels (and of the vectorised ones on unaligned views).
SCALAR = grid_stride_length()
# 3 passes of 16-byte accesses in compress/decompress, 8 elements each.
VECTORISED = grid_stride_length(8)
# 3 passes of quantize_int8 over 128-element blocks: 32 threads a block, 4 elements a thread,
# 2 blocks a warp at a time.
INT8_BLOCKS_OF_128 = grid_stride_length(2 * 128 // 32)

_CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def devices_and_lengths(lengths, long: int) -> list:
    """``(device, n)`` cases for ``parametrize(..., indirect=["device"])``: every length on
    every device, plus ``long`` on CUDA only (the CPU loops have no grid to pass over)."""
    cases = [pytest.param("cpu", n, id=f"cpu-{n}") for n in lengths]
    cases += [pytest.param("cuda", n, marks=_CUDA, id=f"cuda-{n}") for n in (*lengths, long)]
    return cases
