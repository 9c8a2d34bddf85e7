"""requantize: rows of codes summed in fp32 and quantised once, in one pass.

It must write the bits that dequantize_int8 / dequantize_packed into fp32, then quantize_int8 /
quantize_packed with scale 1, write: that pair is tested against torch references in
test_accum_ops.py and test_packed_ops.py. On CUDA it is checked against the CPU op, bit for bit
(and on the grid emulator in test_emu.py).
"""

import pytest
import torch

from fastddp import codecs, ops

from ._grid import _CUDA
from .test_accum_ops import _grads
from .test_packed_ops import _same_bits

CPU = torch.device("cpu")
MODES = [("plain", None, -1), ("ef", True, -1), ("sr", None, 5), ("ef-sr", True, 5)]


def _rows(bits: int, chunks: int, m: int, block: int, pad: int, seed: int):
    """``chunks`` rows of ``m`` codes (random bytes: every code, -8 and -2 too) ``pad`` bytes
    apart, and their scales (random, a power of two apart), as views of bigger buffers."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.int8 if bits == 8 else torch.uint8
    nbytes, nb = m * bits // 8, -(-m // block)
    low, high = (-128, 128) if bits == 8 else (0, 256)
    wire = torch.randint(low, high, (chunks, nbytes + pad), generator=g, dtype=dtype)
    scales = torch.rand(chunks, nb + 3, generator=g) * 2.0 ** torch.randint(-9, 9, (chunks, 1))
    return wire[:, :nbytes], scales[:, :nb]


def _two_step(q, s, bits, block, scale, residual, seed):
    """(codes, scales, residual, flag) of a dequantize into fp32, then a quantize of the sum."""
    m = q.shape[1] * 8 // bits
    total = torch.empty(m, device=q.device)
    out = torch.empty(q.shape[1], dtype=q.dtype, device=q.device)
    out_scales = torch.empty(s.shape[1], device=q.device)
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    if bits == 8:
        ops.dequantize_int8(q, s, total, block, scale)
        ops.quantize_int8(total, out, out_scales, block, 1.0, flag, residual, seed)
    else:
        ops.dequantize_packed(q, s, total, bits, block, scale)
        ops.quantize_packed(total, out, out_scales, bits, block, 1.0, flag, residual, seed)
    return [out, out_scales, residual, flag]


def _fused(q, s, bits, block, scale, residual, seed, dst_shape=None):
    out = torch.full((q.shape[1],), 93, dtype=q.dtype, device=q.device)
    out_scales = torch.full((s.shape[1],), 93.0, device=q.device)
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    dst = out if dst_shape is None else out.view(dst_shape)
    ops.requantize(q, s, dst, out_scales, bits, block, scale, flag, residual, seed)
    return [out, out_scales, residual, flag]


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("mode", MODES, ids=[m[0] for m in MODES])
@pytest.mark.parametrize(
    "chunks, m, block, pad",
    [(1, 64, 32, 0), (3, 1000, 32, 16), (2, 4096 + 40, 128, 4), (5, 65536 + 8, 256, 16),
     (3, 1000, 8, 0)],
)  # fmt: skip
def test_requantize_writes_the_bits_of_dequantize_then_quantize(bits, mode, chunks, m, block, pad):
    _, feedback, seed = mode
    q, s = _rows(bits, chunks, m, block, pad, seed=chunks * m + bits)
    s[-1, s.shape[1] // 2] = float("inf")  # a block of inf sums: NaN scale, zeros, the flag
    res = _grads(m, seed=3) * 1e-2 if feedback else None
    want = _two_step(q, s, bits, block, 0.5, None if res is None else res.clone(), seed)
    got = _fused(q, s, bits, block, 0.5, None if res is None else res.clone(), seed)
    _same_bits([t for t in got if t is not None], [t for t in want if t is not None])
    assert got[3].item() == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)], indirect=True)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_requantize_matches_the_cpu_op(device, bits):
    # Rows apart, whole steps of the vector kernel and a short last block, a one-row [1, bytes]
    # dst; a NaN scale; and a layout only the scalar kernels take (blocks of 24 elements).
    for chunks, m, block, pad in ((4, 3 * 65536 + 40, 32, 16), (3, 4096, 24, 0)):
        q, s = _rows(bits, chunks, m, block, pad, seed=m + bits)
        s[1, 7] = float("nan")
        res = _grads(m, seed=4) * 1e-2
        for seed in (-1, 9):
            got, want = (
                _fused(q.to(d), s.to(d), bits, block, 0.25, res.to(d, copy=True), seed, (1, -1))
                for d in (device, CPU)
            )
            _same_bits(got, want)


def test_requantize_refuses_bad_input():
    q, s = _rows(8, 3, 256, 32, 0, seed=1)
    out, out_scales = torch.empty(256, dtype=torch.int8), torch.empty(8)

    def call(*args, **kw):
        full = dict(src=q, src_scales=s, dst=out, dst_scales=out_scales, bits=8, block_size=32)
        full.update(kw)
        ops.requantize(*args, **full)

    with pytest.raises(RuntimeError, match="bits must be 8, 4 or 2, got 3"):
        call(bits=3)
    with pytest.raises(RuntimeError, match=r"src must have shape \[chunks, bytes\]"):
        call(src=q[0])
    with pytest.raises(RuntimeError, match="dst must be one row of the 256 codes"):
        call(dst=out[:128])
    with pytest.raises(RuntimeError, match="dst must be one row"):
        call(dst=torch.empty(2, 256, dtype=torch.int8), dst_scales=torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="dst must be int8 for 8-bit codes, got Byte"):
        call(dst=out.view(torch.uint8))
    with pytest.raises(RuntimeError, match="each row of src must be contiguous"):
        call(src=torch.zeros(256, 3, dtype=torch.int8).t())
    with pytest.raises(RuntimeError, match="residual has 100 elements but 256"):
        call(residual=torch.zeros(100))
    with pytest.raises(RuntimeError, match="need 8 scales"):
        call(dst_scales=torch.empty(4))
    with pytest.raises(RuntimeError, match="must not overlap|overlap"):
        call(dst_scales=s[0])
    packed = torch.zeros(3, 128, dtype=torch.uint8)  # 256 int4 codes a row
    with pytest.raises(RuntimeError, match="block_size must be a multiple of 2"):
        call(src=packed, dst=torch.empty(128, dtype=torch.uint8), bits=4, block_size=31)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4, torch.int2])
@pytest.mark.parametrize("shard", [30, 64, 1000])
def test_a_codec_s_reduce_is_its_sum_then_its_encode(dtype, shard):
    # One requantize where a row is whole bytes; int4 and int2 shards whose last byte is part
    # full (30 int4 or int2 codes) are summed into fp32 and quantised, as before requantize.
    codec = codecs.codec_for(dtype, 8 if dtype == torch.int8 else 32)
    rows = torch.zeros(3, codec.row_elems(shard), dtype=codec.wire_dtype)
    codec.encode(_grads(3 * shard, seed=shard), rows, shard)
    outs = []
    for fused in (True, False):
        out = torch.zeros(codec.row_elems(shard), dtype=codec.wire_dtype)
        residual = _grads(shard, seed=1) * 1e-2
        flag = torch.zeros(1, dtype=torch.int32)
        if fused:
            codec.reduce(rows, out, shard, 0.5, flag, residual)
        else:
            total = torch.empty(shard)
            codec.sum_into(rows, shard, total, 0.5)
            codec.encode(total, out.view(1, -1), shard, 1.0, flag, residual)
        outs.append([out, residual, flag])
    _same_bits(*outs)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4, torch.int2])
@pytest.mark.parametrize("short", [0, 7])
def test_a_codec_encodes_and_decodes_rows_of_part_blocks_as_each_row_alone(dtype, short):
    # Rows of 40 values in blocks of 32 (a short last block each), the last row part full: the
    # same bits, residuals and flag as each row encoded and decoded on its own.
    codec, shard, world = codecs.codec_for(dtype, 32), 40, 3
    src = _grads(world * shard - short, seed=short)
    src[shard + 3] = float("inf")
    outs = []
    for whole in (True, False):
        rows = torch.zeros(world, codec.row_elems(shard), dtype=codec.wire_dtype)
        residual, flag = torch.zeros(src.numel()), torch.zeros(1, dtype=torch.int32)
        back = torch.full_like(src, float("nan"))
        if whole:
            codec.encode(src, rows, shard, 0.5, flag, residual)
            codec.decode(rows, shard, back)
        else:
            for r in range(world):
                part = slice(r * shard, min((r + 1) * shard, src.numel()))
                mark = torch.zeros(1, dtype=torch.int32)
                codec.encode(src[part], rows[r : r + 1], shard, 0.5, mark, residual[part])
                codec.decode(rows[r : r + 1], shard, back[part])
                flag = torch.maximum(flag, mark)
        outs.append([rows, residual, flag, back])
    assert outs[0][2].item() != 0 and not outs[0][3].isnan().all()
    _same_bits(*outs)


def test_opcheck_requantize(device):
    for bits in (8, 4, 2):
        q, s = _rows(bits, 2, 320, 32, 0, seed=bits)
        q, s = q.to(device), s.to(device)
        out = torch.empty(q.shape[1], dtype=q.dtype, device=device)
        out_scales = torch.empty(s.shape[1], device=device)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        res = torch.zeros(320, device=device)
        torch.library.opcheck(
            torch.ops.fastddp.requantize.default,
            (q, s, out, out_scales, bits, 32, 0.5, flag, res, 1),
        )


@pytest.mark.parametrize("dtype", [torch.int8, torch.int4, torch.int2])
def test_a_codec_reduces_under_a_float64_default_dtype(dtype):
    # Rows of 33 values, which requantize cannot take in whole bytes at 4 and 2 bits: the sum
    # goes through an fp32 buffer of the codec's own, fp32 whatever torch's default dtype.
    codec, shard = codecs.codec_for(dtype, 32), 33
    rows = torch.zeros(2, codec.row_elems(shard), dtype=codec.wire_dtype)
    codec.encode(_grads(2 * shard, seed=3), rows, shard)
    outs = []
    for default in (torch.float32, torch.float64):
        out = torch.zeros(1, codec.row_elems(shard), dtype=codec.wire_dtype)
        before = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            codec.reduce(rows, out, shard)
        finally:
            torch.set_default_dtype(before)
        outs.append([out])
    _same_bits(*outs)
