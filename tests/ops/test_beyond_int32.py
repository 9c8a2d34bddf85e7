"""The CUDA kernels past 2**31 elements, where a 32-bit index would wrap.

The kernels index in ``int64_t``; only a tensor that long shows a slip. Each op runs once on
the whole tensor, and windows at its start, around element 2**31 and at its end are compared
bit for bit with the same op on the window alone (tested against the CPU elsewhere). About 30
GB of GPU memory: skipped below 48 GB.
"""

import pytest
import torch

from fastddp import ops

N = 2**31 + 2**16 + 37  # odd: the tail past the last 16-byte group too; the windows apart
BLOCK = 128
WINDOW = 64 * BLOCK

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _windows() -> list[slice]:
    """Block-aligned windows: the start, across 2**31, the end (with the short last block)."""
    middle = (2**31 // BLOCK - 32) * BLOCK
    last = (N // BLOCK - 32) * BLOCK
    windows = [slice(0, WINDOW), slice(middle, middle + WINDOW), slice(last, N)]
    assert all(a.stop <= b.start for a, b in zip(windows, windows[1:])), windows
    return windows


@pytest.fixture(scope="module")
def src():
    free, total = torch.cuda.mem_get_info()
    if total < 48 * 2**30:
        pytest.skip(f"needs 48 GB of GPU memory, this GPU has {total / 2**30:.0f}")
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(N, generator=g, device="cuda")
    yield x
    del x
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compress_and_decompress_past_two_to_the_31(src, dtype):
    wire = torch.empty(N, dtype=dtype, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    ops.compress(src, wire, 0.5, flag)
    back = torch.empty_like(src)
    ops.decompress(wire, back, 2.0)
    for w in _windows():
        want = (src[w] * 0.5).to(dtype)
        assert torch.equal(wire[w].view(torch.int16), want.view(torch.int16)), w
        assert torch.equal(back[w], want.float() * 2.0), w
    assert flag.item() == 0
    del wire, back


@pytest.mark.parametrize("bits", [8, 4])
def test_block_codecs_past_two_to_the_31(src, bits):
    blocks = -(-N // BLOCK)
    scales = torch.empty(blocks, device="cuda")
    wide = torch.empty_like(src)
    if bits == 8:
        codes = torch.empty(N, dtype=torch.int8, device="cuda")
        ops.quantize_int8(src, codes, scales, BLOCK)
        ops.dequantize_int8(codes.view(1, -1), scales.view(1, -1), wide, BLOCK)
    else:
        codes = torch.empty(-(-N * bits // 8), dtype=torch.uint8, device="cuda")
        ops.quantize_packed(src, codes, scales, bits, BLOCK)
        ops.dequantize_packed(codes.view(1, -1), scales.view(1, -1), wide, bits, BLOCK)
    for w in _windows():
        part = src[w].contiguous()
        b = slice(w.start // BLOCK, -(-w.stop // BLOCK))
        got_scales = torch.empty(b.stop - b.start, device="cuda")
        got_wide = torch.empty_like(part)
        if bits == 8:
            got = torch.empty(part.numel(), dtype=torch.int8, device="cuda")
            ops.quantize_int8(part, got, got_scales, BLOCK)
            ops.dequantize_int8(got.view(1, -1), got_scales.view(1, -1), got_wide, BLOCK)
            assert torch.equal(codes[w], got), w
        else:
            got = torch.empty(-(-part.numel() * bits // 8), dtype=torch.uint8, device="cuda")
            ops.quantize_packed(part, got, got_scales, bits, BLOCK)
            ops.dequantize_packed(got.view(1, -1), got_scales.view(1, -1), got_wide, bits, BLOCK)
            per_byte = 8 // bits
            assert torch.equal(codes[w.start // per_byte : -(-w.stop // per_byte)], got), w
        assert torch.equal(scales[b], got_scales), w
        assert torch.equal(wide[w], got_wide), w
    del codes, scales, wide
