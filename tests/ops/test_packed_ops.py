"""quantize_packed, dequantize_packed and unpack_packed (int4 and int2) against torch references.

The reference rounds v * (qmax / absmax) to nearest even, or up with probability equal to the
dropped fraction (the same stateless random bits as the kernels), so the codes must match bit for
bit. The CUDA kernels are checked against these CPU ops on the grid emulator (test_emu.py) and,
where a GPU is present, on it: every op on CUDA against the same op on the CPU, bit for bit, at
awkward lengths, a length that takes each grid-stride loop through three passes, views off
alignment, rows apart and non-finite blocks. Those bodies also run CPU against CPU here, so a
fault in a comparison shows without a GPU.
"""

import pytest
import torch

from fastddp import ops

from ._grid import _CUDA, INT8_BLOCKS_OF_128, devices_and_lengths
from .test_accum_ops import _grads, _unit, block_steps, random_bits

BITS = [4, 2]
LENGTHS = [1, 2, 3, 31, 129, 1000, 65537]
CPU = torch.device("cpu")


def _qmax(bits):
    return (1 << (bits - 1)) - 1


def _reference(v, bits, block, seed=-1):
    """(codes, scales) of fp32 ``v``, as the kernels compute them."""
    n, qmax = v.numel(), _qmax(bits)
    padded = torch.nn.functional.pad(v, (0, -n % block)).view(-1, block)
    absmax = padded.abs().amax(1)
    scales = block_steps(absmax, qmax)
    # A division of two tensors, correctly rounded as the kernels' is (a scalar over a tensor
    # is a reciprocal times the scalar in torch).
    inverse = torch.where(absmax > 0, torch.full_like(absmax, qmax) / absmax, 0.0)
    x = (padded * inverse[:, None]).reshape(-1)[:n]
    if seed < 0:
        q = torch.round(x)  # half to even, as rint
    else:
        whole = torch.floor(x)
        q = whole + ((x - whole) > _unit(random_bits(seed, n))).float()
    return q.clamp(-qmax, qmax), scales


def _unpacked(q, bits, n):
    """The signed codes of the packed bytes ``q``, the first ``n``."""
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    codes = (q.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    codes = codes - ((codes & (1 << (bits - 1))) << 1)
    return codes.reshape(-1)[:n].float()


def _quantize(x, bits, block, device, **kw):
    n = x.numel()
    q = torch.full((-(-n * bits // 8),), 0xA5, dtype=torch.uint8, device=device)
    s = torch.empty(-(-n // block), device=device)
    ops.quantize_packed(x, q, s, bits, block, **kw)
    return q, s


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("seed", [-1, 5])
def test_codes_and_scales_match_the_reference(device, bits, n, seed):
    x = _grads(n, seed=bits).to(device)
    for block in (32, 128):
        q, s = _quantize(x, bits, block, device, seed=seed)
        want_q, want_s = _reference(x.cpu(), bits, block, seed)
        assert torch.equal(s.cpu(), want_s)
        assert torch.equal(_unpacked(q.cpu(), bits, n), want_q)
        # The bits past the last code of a short last byte are zeros.
        assert torch.equal(
            _unpacked(q.cpu(), bits, q.numel() * 8 // bits)[n:], torch.zeros(-n % (8 // bits))
        )
        out = torch.empty(n, device=device)
        ops.unpack_packed(q, s, out, bits, block, 0.5)
        assert torch.equal(out.cpu(), want_q * want_s.repeat_interleave(block)[:n] * 0.5)


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_error_is_within_half_a_step(bits):
    x = _grads(10_000)
    q, s = _quantize(x, bits, 64, "cpu")
    out = torch.empty(10_000)
    ops.dequantize_packed(q.view(1, -1), s.view(1, -1), out, bits, 64)
    step = s.repeat_interleave(64)[:10_000]
    assert ((out - x).abs() <= step * 0.5001).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("seed", [-1, 11])
def test_what_was_sent_plus_the_residual_is_the_input(bits, seed):
    x = _grads(50_000, seed=3)
    res = _grads(50_000, seed=4) * 1e-2
    v = x + res  # what is rounded: the gradient plus what earlier steps owe
    q, s = _quantize(x, bits, 128, "cpu", residual=res, seed=seed)
    sent = torch.empty(50_000)
    ops.unpack_packed(q, s, sent, bits, 128)
    assert res.abs().max() > 0
    if seed < 0:
        # To nearest, |v - sent| <= step / 2 and sent is 0 or within a factor 2 of v, so the
        # fp32 residual v - sent is exact (Sterbenz): nothing is lost, to the bit.
        assert torch.equal(sent + res, v)
    else:
        # Rounded up at random, sent may be a whole step from v and the residual is rounded
        # once: off by at most half an ulp of the residual.
        lost = (sent.double() + res.double() - v.double()).abs()
        assert (lost <= res.double().abs() * 2.0**-24).all()
        assert (lost > 0).any()  # so the bound above is what holds, not exactness


@pytest.mark.parametrize("bits", BITS)
def test_stochastic_rounding_is_unbiased(bits):
    # Over 4000 seeds, the mean of the decoded values approaches the input: each draw is off by
    # less than one step, so the mean is within 5 standard errors (step / (2 sqrt(4000))).
    x = _grads(256, seed=7)
    total = torch.zeros(256, dtype=torch.float64)
    seeds = 4000
    for seed in range(seeds):
        q, s = _quantize(x, bits, 32, "cpu", seed=seed)
        out = torch.empty(256)
        ops.unpack_packed(q, s, out, bits, 32)
        total += out.double()
    step = s.repeat_interleave(32).double()
    error = (total / seeds - x.double()).abs()
    assert (error <= 5 * step / (2 * seeds**0.5)).all(), (error / step).max()
    # Rounding to nearest is biased on the same input (a check that the test can fail).
    q, s = _quantize(x, bits, 32, "cpu")
    ops.unpack_packed(q, s, out, bits, 32)
    assert ((out.double() - x.double()).abs() > 5 * step / (2 * seeds**0.5)).any()


@pytest.mark.parametrize("bits", BITS)
def test_rows_apart_hold_what_the_flat_layout_holds(bits):
    # Three rows of 128 codes, each followed by 8 bytes of something else, and their scales
    # in rows of their own: the same codes as one flat call, nothing written between rows.
    world, shard, block = 3, 128, 32
    nbytes = shard * bits // 8
    x, res = _grads(world * shard, seed=1), _grads(world * shard, seed=2) * 1e-2
    res_rows = res.clone()
    flat_q, flat_s = _quantize(x, bits, block, "cpu", residual=res, seed=3)
    wire = torch.full((world, nbytes + 8), 99, dtype=torch.uint8)
    scales = torch.full((world, shard // block + 2), 99.0)
    values, row_scales = wire[:, :nbytes], scales[:, : shard // block]
    ops.quantize_packed(x, values, row_scales, bits, block, 1.0, None, res_rows, 3)
    assert torch.equal(values.reshape(-1), flat_q)
    assert torch.equal(row_scales.reshape(-1), flat_s) and torch.equal(res_rows, res)
    assert (wire[:, nbytes:] == 99).all() and (scales[:, shard // block :] == 99).all()
    summed = torch.empty(shard)
    ops.dequantize_packed(values, row_scales, summed, bits, block)
    rows = torch.empty(world * shard)
    ops.unpack_packed(values, row_scales, rows, bits, block)
    r = rows.view(world, shard)
    assert torch.equal(summed, r[0] + r[1] + r[2])


def test_a_block_with_nan_decodes_to_nan_and_keeps_its_residual():
    x = _grads(96)
    x[40] = float("nan")
    res = torch.full((96,), 0.25)
    flag = torch.zeros(1, dtype=torch.int32)
    q, s = _quantize(x, 4, 32, "cpu", found_nonfinite=flag, residual=res)
    out = torch.empty(96)
    ops.unpack_packed(q, s, out, 4, 32)
    assert flag.item() == 1 and out[32:64].isnan().all() and out[:32].isfinite().all()
    assert (res[32:64] == 0.25).all() and (res[:32] != 0.25).any()


def _bad(**kw):
    args = dict(src=torch.ones(64), dst=torch.empty(32, dtype=torch.uint8), scales=torch.empty(2))
    args.update(kw)
    bits, block = args.pop("bits", 4), args.pop("block", 32)
    return lambda: ops.quantize_packed(args["src"], args["dst"], args["scales"], bits, block)


BAD = [
    (_bad(bits=8), "bits must be 4 or 2, got 8; int8 codes use the int8 ops"),
    # Rows' lengths were counted from bits before bits were checked: a division by zero.
    (_bad(bits=0, dst=torch.empty(2, 16, dtype=torch.uint8)), "bits must be 4 or 2, got 0"),
    (lambda: ops.unpack_packed(torch.empty(2, 16, dtype=torch.uint8), torch.empty(2, 1),
                               torch.empty(64), 0, 32), "bits must be 4 or 2, got 0"),
    (_bad(dst=torch.tensor(0, dtype=torch.uint8)), "must be 1-D or [rows, bytes], got []"),
    (_bad(bits=2, block=6), "block_size must be a multiple of 4 for 2-bit codes"),
    (_bad(dst=torch.empty(32, dtype=torch.int8)), "the quantised tensor must be uint8"),
    (_bad(dst=torch.empty(31, dtype=torch.uint8)), "64 codes of 4 bits take 32 bytes a row"),
    (_bad(scales=torch.empty(3)), "1 row(s) of 64 codes need 2 scales"),
    (_bad(dst=torch.empty(3, 20, dtype=torch.uint8), scales=torch.empty(3, 2)),
     "rows of 40 codes do not hold whole blocks of 32"),
    (lambda: ops.dequantize_packed(torch.empty(32, dtype=torch.uint8), torch.empty(2),
                                   torch.empty(64), 4, 32), "src must have shape [chunks, bytes]"),
    # No row to sum: refused, rather than a read of an empty tensor's codes.
    (lambda: ops.dequantize_packed(torch.empty(0, 32, dtype=torch.uint8), torch.empty(0, 2),
                                   torch.empty(64), 4, 32), "with at least one row"),
]  # fmt: skip


@pytest.mark.parametrize("make, message", BAD)
def test_bad_inputs_raise_clear_errors(make, message):
    with pytest.raises(RuntimeError) as info:
        make()
    assert message in str(info.value)


# The ops on a device against the same ops on the CPU, bit for bit. On the CPU itself these run
# the CPU op twice: what they prove there is that the comparison works.


def _same_bits(got: list, want: list) -> None:
    """Equal tensors, bit for bit, except that any NaN matches any NaN (its payload may differ
    between devices)."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        a, b = a.cpu(), b.cpu()
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if a.is_floating_point():
            nan = torch.isnan(a)
            assert torch.equal(nan, torch.isnan(b)), f"tensor {i}: NaNs differ"
            a, b = a[~nan].view(torch.int32), b[~nan].view(torch.int32)
        differ = (a != b).nonzero()
        assert differ.numel() == 0, f"tensor {i}: {differ.shape[0]} differ, first at {differ[0]}"


def _quantized(x, bits, block, device, residual=None, seed=-1, offset=0):
    """quantize_packed of ``x`` (scale 0.5) on ``device`` into buffers that start ``offset``
    elements into their allocations, then unpack_packed (scale 2.0): every output, on the CPU.
    """
    n = x.numel()
    nbytes, blocks = -(-n * bits // 8), -(-n // block)
    src = torch.empty(n + offset, device=device)[offset:]
    src.copy_(x)
    q = torch.full((nbytes + offset,), 0xA5, dtype=torch.uint8, device=device)[offset:]
    scales = torch.full((blocks + offset,), 7.0, device=device)[offset:]
    flag = torch.full((1,), 5, dtype=torch.int32, device=device)
    res = None if residual is None else residual.to(device, copy=True)
    ops.quantize_packed(src, q, scales, bits, block, 0.5, flag, res, seed)
    out = torch.full((n + offset,), 7.0, device=device)[offset:]
    ops.unpack_packed(q, scales, out, bits, block, 2.0)
    return [q, scales, flag, out] + ([] if res is None else [res])


@pytest.mark.parametrize(
    "device, n", devices_and_lengths(LENGTHS, INT8_BLOCKS_OF_128), indirect=["device"]
)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("feedback, seed", [(False, -1), (True, -1), (True, 9)])
def test_quantize_and_unpack_match_the_cpu_op(device, n, bits, feedback, seed):
    x = _grads(n, seed=bits)
    res = _grads(n, seed=5) * 1e-2 if feedback else None
    for block in (32, 128):
        got = _quantized(x, bits, block, device, res, seed)
        _same_bits(got, _quantized(x, bits, block, CPU, res, seed))
        assert got[2].item() == 0  # the flag: all finite


@pytest.mark.parametrize("device, n", devices_and_lengths([4099], 1 << 20), indirect=["device"])
@pytest.mark.parametrize("bits", BITS)
def test_views_off_alignment_match_the_cpu_op(device, n, bits):
    x, res = _grads(n, seed=3), _grads(n, seed=4) * 1e-2
    for offset in (1, 3, 5):
        got = _quantized(x, bits, 64, device, res, seed=2, offset=offset)
        _same_bits(got, _quantized(x, bits, 64, CPU, res, seed=2, offset=offset))


@pytest.mark.parametrize("bits", BITS)
def test_nonfinite_blocks_match_the_cpu_op(device, bits):
    # A NaN, an inf and a -inf, each in a block of its own, and a block of tiny values.
    x = _grads(1000, seed=6)
    x[40], x[300], x[301], x[700] = float("nan"), float("inf"), 1.0, float("-inf")
    x[512:544] = 1e-38
    res = _grads(1000, seed=7) * 1e-2
    for seed in (-1, 4):
        got = _quantized(x, bits, 32, device, res, seed)
        _same_bits(got, _quantized(x, bits, 32, CPU, res, seed))
        assert got[2].item() == 1 and got[3][32:64].isnan().all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)], indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "chunks, m, block", [(1, 1, 32), (1, 1000, 32), (3, 1000, 32), (3, 1024, 32), (4, 65664, 128)]
)
def test_dequantize_and_unpack_of_any_bytes_match_the_cpu_op(device, bits, chunks, m, block):
    # Every byte value, so every code (the quantiser never writes -8 or -2, but they decode),
    # with random scales, one of them NaN.
    g = torch.Generator().manual_seed(chunks * m + bits)
    row_bytes = -(-m * bits // 8)
    q = torch.randint(0, 256, (chunks, row_bytes), generator=g, dtype=torch.uint8)
    scales = torch.rand(chunks, -(-m // block), generator=g) * 4
    scales.view(-1)[-1] = float("nan")

    def run(dev):
        summed = torch.full((m,), 7.0, device=dev)
        ops.dequantize_packed(q.to(dev), scales.to(dev), summed, bits, block, 0.25)
        rows = torch.full((chunks * m,), 7.0, device=dev)
        if m % block == 0 or chunks == 1:  # rows must hold whole blocks to be unpacked as one
            ops.unpack_packed(q.to(dev), scales.to(dev), rows, bits, block, 0.25)
        return [summed, rows]

    _same_bits(run(device), run(CPU))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)], indirect=True)
@pytest.mark.parametrize("bits", BITS)
def test_rows_apart_match_the_cpu_op(device, bits):
    # One row per rank, each followed by bytes of something else; the scales in rows too.
    world, shard, block = 3, 4096, 32
    nbytes = shard * bits // 8
    x, res = _grads(world * shard, seed=8), _grads(world * shard, seed=9) * 1e-2

    def run(dev):
        wire = torch.full((world, nbytes + 8), 99, dtype=torch.uint8, device=dev)
        scales = torch.full((world, shard // block + 2), 99.0, device=dev)
        values, row_scales = wire[:, :nbytes], scales[:, : shard // block]
        r = res.to(dev, copy=True)
        ops.quantize_packed(x.to(dev), values, row_scales, bits, block, 1.0, None, r, 3)
        summed = torch.empty(shard, device=dev)
        ops.dequantize_packed(values, row_scales, summed, bits, block)
        rows = torch.empty(world * shard, device=dev)
        ops.unpack_packed(values, row_scales, rows, bits, block)
        return [wire, scales, r, summed, rows]

    got = run(device)
    _same_bits(got, run(CPU))
    assert (got[0][:, nbytes:] == 99).all() and (got[1][:, shard // block :] == 99).all()


def test_opcheck_packed_ops(device):
    x = _grads(300, device=device)
    res = torch.zeros(300, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for bits in BITS:
        q = torch.empty(300 * bits // 8, dtype=torch.uint8, device=device)
        scales = torch.empty(-(-300 // 32), device=device)
        torch.library.opcheck(
            torch.ops.fastddp.quantize_packed.default, (x, q, scales, bits, 32, 0.5, flag, res, 1)
        )
        ops.quantize_packed(x, q, scales, bits, 32)
        out = torch.empty(300, device=device)
        torch.library.opcheck(
            torch.ops.fastddp.unpack_packed.default, (q, scales, out, bits, 32, 1.0)
        )
        rows, row_scales = torch.stack([q, q]), torch.stack([scales, scales])
        torch.library.opcheck(
            torch.ops.fastddp.dequantize_packed.default, (rows, row_scales, out, bits, 32, 0.5)
        )


def test_the_comparison_sees_one_bit_and_a_nan():
    a = _grads(100)
    _same_bits([a, a.to(torch.uint8)], [a.clone(), a.to(torch.uint8)])
    b = a.clone()
    b.view(torch.int32)[37] ^= 1
    with pytest.raises(AssertionError, match="tensor 0: 1 differ"):
        _same_bits([a], [b])
    b = a.clone()
    b[5] = float("nan")
    with pytest.raises(AssertionError, match="NaNs differ"):
        _same_bits([a], [b])
    q = torch.arange(10, dtype=torch.uint8)
    with pytest.raises(AssertionError, match="tensor 1: 1 differ"):
        _same_bits([a, q], [a, q.clone().index_fill_(0, torch.tensor([3]), 0)])
