"""quantize_packed, dequantize_packed and unpack_packed (int4 and int2) against torch references.

The reference rounds v * (qmax / absmax) to nearest even, or up with probability equal to the
dropped fraction (the same stateless random bits as the kernels), so the codes must match bit for
bit. The CUDA kernels are checked against these CPU ops on the grid emulator (test_emu.py).
"""

import pytest
import torch

from fastddp import ops

from .test_accum_ops import _grads, _unit, random_bits

BITS = [4, 2]
LENGTHS = [1, 2, 3, 31, 129, 1000, 65537]


def _qmax(bits):
    return (1 << (bits - 1)) - 1


def _reference(v, bits, block, seed=-1):
    """(codes, scales) of fp32 ``v``, as the kernels compute them."""
    n, qmax = v.numel(), _qmax(bits)
    padded = torch.nn.functional.pad(v, (0, -n % block)).view(-1, block)
    absmax = padded.abs().amax(1)
    scales = absmax / qmax
    inverse = torch.where(absmax > 0, qmax / absmax, torch.zeros_like(absmax))
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
    (_bad(bits=2, block=6), "block_size must be a multiple of 4 for 2-bit codes"),
    (_bad(dst=torch.empty(32, dtype=torch.int8)), "the quantised tensor must be uint8"),
    (_bad(dst=torch.empty(31, dtype=torch.uint8)), "64 codes of 4 bits take 32 bytes a row"),
    (_bad(scales=torch.empty(3)), "1 row(s) of 64 codes need 2 scales"),
    (_bad(dst=torch.empty(3, 20, dtype=torch.uint8), scales=torch.empty(3, 2)),
     "rows of 40 codes do not hold whole blocks of 32"),
    (lambda: ops.dequantize_packed(torch.empty(32, dtype=torch.uint8), torch.empty(2),
                                   torch.empty(64), 4, 32), "src must have shape [chunks, bytes]"),
]  # fmt: skip


@pytest.mark.parametrize("make, message", BAD)
def test_bad_inputs_raise_clear_errors(make, message):
    with pytest.raises(RuntimeError) as info:
        make()
    assert message in str(info.value)
