"""The accumulating, error-feedback, stochastic-rounding and int8 ops against torch references.

The kernels round every fp32 operation separately (no FMA), so plain torch arithmetic in the
same order reproduces them bit for bit; random numbers come from a stateless hash that the
reference below recomputes with numpy.
"""

import math

import numpy as np
import pytest
import torch

from fastddp import ops

from ._grid import _CUDA, INT8_BLOCKS_OF_128, SCALAR, devices_and_lengths

WIRE = [torch.float16, torch.bfloat16]
LENGTHS = [0, 1, 7, 33, 1000, 65537]


def _grads(n, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed * 1000003 + n)
    return (torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)).to(device)


def random_bits(seed: int, n: int) -> torch.Tensor:
    """The 32 random bits the kernels draw for elements 0..n-1 (see fastddp/rounding.h)."""
    with np.errstate(over="ignore"):
        x = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = x + np.uint64(seed) * np.uint64(0xD1B54A32D192ED03)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(29)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(32)
    return torch.from_numpy((x & np.uint64(0xFFFFFFFF)).astype(np.int64))


def _unit(r):
    return (r >> 8).float() * 2.0**-24


def round_ref(v: torch.Tensor, dtype, r=None) -> torch.Tensor:
    """fp32 -> dtype, to nearest even (r None) or stochastically with random bits r."""
    if r is None:
        return v.to(dtype)
    u = v.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    nan = torch.isnan(v)
    if dtype == torch.bfloat16:
        h = ((u + (r & 0xFFFF)) >> 16) & 0xFFFF
        # Overflow as to nearest: past the largest bf16, the largest below halfway, else inf.
        a, sign = u & 0x7FFFFFFF, (u >> 16) & 0x8000
        edge = torch.where(a >= 0x7F7F8000, 0x7F80, 0x7F7F) | sign
        h = torch.where((a > 0x7F7F0000) & (a < 0x7F800000), edge, h)
        h = torch.where(nan, torch.full_like(h, 0x7FC0), h)
    else:
        sign = (u >> 16) & 0x8000
        a = u & 0x7FFFFFFF
        normal = (a - 0x38000000 + (r & 0x1FFF)) >> 13
        top = torch.where(a >= 0x477FF000, 0x7C00, 0x7BFF)  # overflow as to nearest
        normal = torch.where(a >= 0x477FE000, top, normal)
        m = (a.to(torch.int32).view(torch.float32)) * 2.0**24
        whole = torch.floor(m)
        sub = whole.to(torch.int64) + ((m - whole) > _unit(r)).to(torch.int64)
        h = torch.where(a >= 0x38800000, normal, sub)
        h = torch.where(a >= 0x47800000, torch.full_like(h, 0x7C00), h)
        h = torch.where(nan, torch.full_like(h, 0x7E00), h | sign)
    return h.to(torch.int16).view(dtype)


def feedback_ref(v, dtype, residual=None, r=None):
    q = round_ref(v, dtype, r)
    if residual is not None:
        residual.copy_(torch.where(torch.isfinite(q), v - q.float(), residual))
    return q


def _same(a, b):
    nan = torch.isnan(a.float())
    assert torch.equal(nan, torch.isnan(b.float()))
    if a.dtype in WIRE:
        assert torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))
    else:
        assert torch.equal(a[~nan], b[~nan])


@pytest.mark.parametrize("device, n", devices_and_lengths(LENGTHS, SCALAR), indirect=["device"])
@pytest.mark.parametrize("dtype", WIRE)
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("seed", [-1, 5])
def test_compress_feedback_and_stochastic(device, dtype, n, feedback, seed):
    x = _grads(n, device=device)
    res = _grads(n, seed=1, device=device) * 1e-3 if feedback else None
    res_ref = None if res is None else res.clone()
    out = torch.empty(n, dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.compress(x, out, 0.25, flag, res, seed)
    v = x.cpu() * 0.25
    if res_ref is not None:
        v = v + res_ref.cpu()
    r = None if seed < 0 else random_bits(seed, n)
    res_cpu = None if res_ref is None else res_ref.cpu()
    want = feedback_ref(v, dtype, res_cpu, r)
    _same(out.cpu(), want)
    if res is not None:
        _same(res.cpu(), res_cpu)
    assert flag.item() == int(not torch.isfinite(want.float()).all())


@pytest.mark.parametrize("dtype", WIRE)
def test_stochastic_rounding_is_unbiased(device, dtype):
    # 0.1 lies between two 16-bit neighbours; the mean of many stochastic roundings is 0.1 up
    # to sampling noise, while rounding to nearest is off by a fixed amount.
    n = 200_000
    x = torch.full((n,), 0.1, device=device)
    out = torch.empty(n, dtype=dtype, device=device)
    ops.compress(x, out, 1.0, None, None, 123)
    values = out.float().unique()
    assert len(values) == 2  # only the two neighbours
    step = float(values[1] - values[0])
    mean_err = abs(out.double().mean().item() - 0.1)
    assert mean_err < 0.01 * step, (mean_err, step)
    nearest_err = abs(torch.tensor(0.1).to(dtype).double().item() - 0.1)
    assert mean_err < nearest_err / 10


@pytest.mark.parametrize("dtype", WIRE)
def test_stochastic_rounding_overflows_where_rounding_to_nearest_does(device, dtype):
    # Between the largest 16-bit value and the halfway point past it, rounding to nearest
    # keeps a value finite; rounded up stochastically it became inf, and flagged the step.
    big = torch.finfo(dtype).max
    step = 2.0 ** math.floor(math.log2(big)) * torch.finfo(dtype).eps  # the top binade's
    keeps = [big, big + step / 4, big + step * 0.49]
    overflows = [big + step / 2, big + step * 0.9]
    x = torch.tensor(keeps + overflows, device=device).repeat(4096)
    x = torch.cat([x, -x])
    out = torch.empty(x.numel(), dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.compress(x, out, 1.0, flag, None, 77)
    _same(out.cpu(), x.cpu().to(dtype))  # what rounding to nearest gives, every time
    assert flag.item() == 1
    finite = torch.isfinite(out.float().cpu()).view(2, 4096, 5)
    assert finite[..., :3].all() and not finite[..., 3:].any()


def test_stochastic_rounding_of_fp16_subnormals():
    x = torch.full((100_000,), 3.3e-7)  # between fp16 subnormals 5 * 2^-24 and 6 * 2^-24
    out = torch.empty_like(x, dtype=torch.float16)
    ops.compress(x, out, 1.0, None, None, 9)
    assert set(out.float().unique().mul(2**24).tolist()) == {5.0, 6.0}
    assert abs(out.double().mean().item() - 3.3e-7) < 1e-3 * 2**-24 * 10


@pytest.mark.parametrize("dtype", WIRE)
def test_feedback_keeps_residual_on_overflow(dtype):
    x = torch.tensor([1.0, 7e4, float("nan"), 2.0])
    res = torch.tensor([0.5, 0.25, 0.125, 0.0])
    out = torch.empty(4, dtype=dtype)
    flag = torch.zeros(1, dtype=torch.int32)
    ops.compress(x, out, 1.0, flag, res)
    assert flag.item() == 1
    assert res[2].item() == 0.125  # NaN: residual untouched
    if dtype == torch.float16:
        assert res[1].item() == 0.25  # overflow to inf: residual untouched
    assert torch.isfinite(res).all()


@pytest.mark.parametrize(
    "device, m", devices_and_lengths([0, 1, 33, 4099], SCALAR), indirect=["device"]
)
@pytest.mark.parametrize("chunks", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", WIRE)
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("seed", [-1, 77])
def test_sum_chunks_matches_fp32_reference(device, dtype, chunks, m, feedback, seed):
    src = torch.stack([_grads(m, seed=p) for p in range(chunks)]).to(dtype).to(device)
    res = _grads(m, seed=99).mul(1e-3).to(device) if feedback else None
    res_cpu = None if res is None else res.cpu().clone()
    out = torch.empty(m, dtype=dtype, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.sum_chunks(src, out, 0.5, flag, res, seed)
    acc = src.cpu()[0].float()
    for p in range(1, chunks):
        acc = acc + src.cpu()[p].float()
    v = acc * 0.5
    if res_cpu is not None:
        v = v + res_cpu
    want = feedback_ref(v, dtype, res_cpu, None if seed < 0 else random_bits(seed, m))
    _same(out.cpu(), want)
    if res is not None:
        _same(res.cpu(), res_cpu)
    assert flag.item() == int(not torch.isfinite(want.float()).all())


def test_sum_chunks_rounds_once():
    # Eight ranks each holding 1 + 2^-9: bf16 keeps 7 mantissa bits, so a 16-bit running sum
    # loses every addend's tail, while the fp32 sum rounds only the total (8 + 2^-6, exact).
    src = torch.full((8, 1), 1.0 + 2.0**-7, dtype=torch.bfloat16)
    out = torch.empty(1, dtype=torch.bfloat16)
    ops.sum_chunks(src, out)
    assert out.item() == 8.0 + 8 * 2.0**-7


@pytest.mark.parametrize(
    "device, m", devices_and_lengths([0, 1, 33, 4099], SCALAR), indirect=["device"]
)
@pytest.mark.parametrize("chunks", [1, 3, 8])
@pytest.mark.parametrize("dtype", WIRE)
def test_widen_sum_matches_fp32_reference(device, dtype, chunks, m):
    src = torch.stack([_grads(m, seed=p) for p in range(chunks)]).to(dtype).to(device)
    out = torch.full((m,), float("nan"), device=device)
    ops.widen_sum(src, out, 0.25)
    acc = src.cpu()[0].float()
    for p in range(1, chunks):
        acc = acc + src.cpu()[p].float()
    _same(out.cpu(), acc * 0.25)


def test_widen_sum_does_not_round_the_sum():
    # The same eight addends as above: the fp32 result keeps every addend's tail.
    src = torch.full((8, 1), 1.0 + 2.0**-9, dtype=torch.float16)
    out = torch.empty(1)
    ops.widen_sum(src, out)
    assert out.item() == 8.0 + 8 * 2.0**-9


def block_steps(absmax, qmax):
    """absmax / qmax per block, or the float below it where qmax times it overflows (near
    FLT_MAX), as the kernels store it."""
    step = absmax / qmax
    below = (step.view(torch.int32) - 1).view(torch.float32)
    return torch.where(torch.isinf(step * qmax) & torch.isfinite(absmax), below, step)


def quantize_ref(v, block, r=None):
    n = v.numel()
    nb = (n + block - 1) // block
    padded = torch.zeros(nb * block)
    padded[:n] = v
    bits = (padded.view(torch.int32) & 0x7FFFFFFF).view(nb, block)
    absmax_bits = bits.max(dim=1).values
    bad = absmax_bits >= 0x7F800000
    absmax = absmax_bits.view(torch.float32)
    step = torch.where(bad, torch.full_like(absmax, float("nan")), block_steps(absmax, 127.0))
    # Not `127.0 / absmax`: torch computes a scalar over a tensor as a reciprocal times the
    # scalar, which can be an ulp off the kernels' correctly rounded division.
    inverse = torch.full_like(absmax, 127.0) / absmax
    # All-zero, non-finite and tiny blocks (127 / absmax overflows) quantise to zeros.
    zero = bad | (absmax_bits == 0) | torch.isinf(inverse)
    inverse = torch.where(zero, torch.zeros_like(absmax), inverse)
    x = v * inverse.repeat_interleave(block)[:n]
    if r is None:
        q = torch.round(x)
    else:
        whole = torch.floor(x)
        q = whole + ((x - whole) > _unit(r)).float()
    q = q.clamp(-127, 127)
    q = torch.where(bad.repeat_interleave(block)[:n], torch.zeros_like(q), q)
    return q.to(torch.int8), step, bad


@pytest.mark.parametrize(
    "device, n",
    devices_and_lengths([0, 1, 127, 128, 129, 5000], INT8_BLOCKS_OF_128),
    indirect=["device"],
)
@pytest.mark.parametrize("block", [1, 32, 128, 1000])
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("seed", [-1, 3])
def test_quantize_int8_matches_reference(device, n, block, feedback, seed):
    x = _grads(n, device=device)
    res = _grads(n, seed=2, device=device) * 1e-2 if feedback else None
    res_cpu = None if res is None else res.cpu().clone()
    nb = (n + block - 1) // block
    q = torch.empty(n, dtype=torch.int8, device=device)
    scales = torch.empty(nb, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.quantize_int8(x, q, scales, block, 0.5, flag, res, seed)
    v = x.cpu() * 0.5
    if res_cpu is not None:
        v = v + res_cpu
    want_q, want_step, bad = quantize_ref(v, block, None if seed < 0 else random_bits(seed, n))
    _same(q.cpu(), want_q)
    _same(scales.cpu(), want_step)
    assert flag.item() == int(bad.any())
    unpacked = torch.empty(n, device=device)
    ops.unpack_int8(q, scales, unpacked, block)
    _same(unpacked.cpu(), want_q.float() * want_step.repeat_interleave(block)[:n])
    if res is not None:
        expect = v - want_q.float() * want_step.repeat_interleave(block)[:n]
        _same(res.cpu(), expect)
        # Error feedback keeps exactly what quantisation dropped: at most half a step when
        # rounding to nearest, less than a step when rounding stochastically.
        bound = 0.5001 if seed < 0 else 1.0001
        assert (res.cpu().abs() <= want_step.repeat_interleave(block)[:n] * bound).all()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)], indirect=True)
def test_quantize_int8_divides_once_and_rounds_half_to_even(device):
    # 127 / 73.16361 is 1.7358356 correctly rounded, and -37.157898 times it is exactly -64.5,
    # which rounds to -64; a reciprocal taken first is an ulp larger and gives -65. The
    # reference must divide as the ops do (a length of 3.2 million found this on an H100).
    v = torch.tensor([73.16361236572266, -37.15789794921875])
    q = torch.empty(2, dtype=torch.int8, device=device)
    scales = torch.empty(1, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.quantize_int8((v * 2).to(device), q, scales, 2, 0.5, flag)
    assert q.cpu().tolist() == [127, -64]
    assert quantize_ref(v, 2)[0].tolist() == [127, -64]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)], indirect=True)
@pytest.mark.parametrize("bits, absmax", [(8, 1.0008252859115601), (4, 1.0008854866027832)])
def test_a_code_to_nearest_stays_in_range_where_the_inverse_rounds_up(device, bits, absmax):
    # RN(qmax / absmax) times absmax is qmax plus an ulp for these absmax (found by a search
    # over every float in [1, 8)): rounding to nearest must give qmax again, as it does without
    # a clamp; a code past qmax would wrap (128 is -128 in int8, 8 is -8 in int4).
    qmax = (1 << (bits - 1)) - 1
    x = torch.tensor([absmax, -absmax, absmax, 0.5] * 8, device=device)
    scales = torch.empty(8, device=device)
    out = torch.empty(32, device=device)
    if bits == 8:
        q = torch.empty(32, dtype=torch.int8, device=device)
        ops.quantize_int8(x, q, scales, 4)
        ops.unpack_int8(q, scales, out, 4)
    else:
        q = torch.empty(16, dtype=torch.uint8, device=device)
        ops.quantize_packed(x, q, scales, bits, 4)
        ops.unpack_packed(q, scales, out, bits, 4)
    step = scales.cpu()[0].item()
    assert abs(step * qmax - absmax) <= absmax * 2**-23, (step, absmax)
    want = torch.tensor([qmax, -qmax, qmax, round(0.5 / step)] * 8) * torch.tensor(step)
    assert torch.equal(out.cpu(), want), (out, want)


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_block_at_the_largest_float_stays_finite(bits):
    # 127 * (FLT_MAX / 127) rounds past FLT_MAX: the stored scale must be the float below, or
    # the block decodes to inf and error feedback keeps -inf for good.
    big = torch.finfo(torch.float32).max
    first = torch.tensor([big, 1.0, -2.0, 0.5, -big, 3.0, 0.0, 1e30])
    res = torch.zeros(8)
    flag = torch.zeros(1, dtype=torch.int32)
    out = torch.empty(8)
    for x in (first, first / 4):  # then a step with the residual the first one left
        scales = torch.empty(2)
        if bits == 8:
            q = torch.empty(8, dtype=torch.int8)
            ops.quantize_int8(x, q, scales, 4, 1.0, flag, res)
            ops.unpack_int8(q, scales, out, 4)
        else:
            q = torch.empty(8 * bits // 8, dtype=torch.uint8)
            ops.quantize_packed(x, q, scales, bits, 4, 1.0, flag, res)
            ops.unpack_packed(q, scales, out, bits, 4)
        assert flag.item() == 0
        assert torch.isfinite(out).all() and torch.isfinite(res).all(), (out, res)
        assert out[0].item() > x[0].item() * 0.99 and out[4].item() < x[4].item() * 0.99


def test_quantize_int8_nonfinite_block_dequantises_to_nan():
    x = torch.ones(8)
    x[5] = float("inf")
    q = torch.empty(8, dtype=torch.int8)
    scales = torch.empty(2)
    res = torch.full((8,), 0.25)
    flag = torch.zeros(1, dtype=torch.int32)
    ops.quantize_int8(x, q, scales, 4, 1.0, flag, res)
    assert flag.item() == 1
    out = torch.empty(8)
    ops.dequantize_int8(q.view(1, 8), scales.view(1, 2), out, 4)
    # 1 + 0.25 is exact in the first block's int8 grid; the bad block keeps its residual.
    assert torch.isnan(out[4:]).all() and torch.equal(out[:4], torch.full((4,), 1.25))
    assert torch.equal(res, torch.tensor([0.0] * 4 + [0.25] * 4))


@pytest.mark.parametrize(
    "device, m", devices_and_lengths([0, 1, 128, 1000], SCALAR), indirect=["device"]
)
@pytest.mark.parametrize("chunks", [1, 2, 5])
@pytest.mark.parametrize("block", [1, 64, 128])
def test_dequantize_int8_sums_rows(device, chunks, m, block):
    nb = (m + block - 1) // block
    g = torch.Generator().manual_seed(m + chunks)
    q = torch.randint(-127, 128, (chunks, m), generator=g, dtype=torch.int8)
    scales = torch.rand(chunks, nb, generator=g)
    out = torch.empty(m, device=device)
    ops.dequantize_int8(q.to(device), scales.to(device), out, block, 0.25)
    acc = q[0].float() * scales[0].repeat_interleave(block)[:m]
    for p in range(1, chunks):
        acc = acc + q[p].float() * scales[p].repeat_interleave(block)[:m]
    _same(out.cpu(), acc * 0.25)


def test_quantize_int8_tiny_block_becomes_zeros_and_stays_in_the_residual(device):
    # 127 / 1e-38 overflows fp32: the block must quantise to zeros, not to inf cast to int8.
    x = torch.tensor([1e-38, -2e-38, 5e-39, 0.0, 1.0, -0.5, 0.25, 0.0], device=device)
    q = torch.empty(8, dtype=torch.int8, device=device)
    scales = torch.empty(2, device=device)
    res = torch.zeros(8, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.quantize_int8(x, q, scales, 4, 1.0, flag, res)
    assert flag.item() == 0
    assert torch.equal(q[:4].cpu(), torch.zeros(4, dtype=torch.int8))
    assert torch.equal(res[:4].cpu(), x[:4].cpu())  # nothing lost: it waits in the residual
    assert q[4].item() == 127 and scales[1].item() == pytest.approx(1 / 127)


def _rows(world, shard, block, device):
    """A byte buffer of ``world`` rows ``[shard int8 values | fp32 scales]``, as the hook uses."""
    row = shard + 4 * (shard // block)
    wire = torch.full((world, row), 99, dtype=torch.int8, device=device)
    return wire, wire[:, :shard], wire[:, shard:].view(torch.float32)


@pytest.mark.parametrize("n", [0, 1, 200, 383, 384])
@pytest.mark.parametrize("seed", [-1, 5])
def test_int8_rows_match_the_flat_layout(device, n, seed):
    # quantize_int8 into rows that lie apart (values, then scales, per row) writes exactly what
    # the flat layout holds, element for element, and leaves the rest of the buffer alone.
    world, shard, block = 3, 128, 32
    x = _grads(n, device=device)
    res = _grads(n, seed=4, device=device) * 1e-2
    res_rows = res.clone()
    flat_q = torch.empty(n, dtype=torch.int8, device=device)
    flat_s = torch.empty((n + block - 1) // block, device=device)
    ops.quantize_int8(x, flat_q, flat_s, block, 0.5, None, res, seed)
    wire, values, scales = _rows(world, shard, block, device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    ops.quantize_int8(x, values, scales, block, 0.5, flag, res_rows, seed)
    _same(values.reshape(-1)[:n].cpu(), flat_q.cpu())
    _same(scales.reshape(-1)[: flat_s.numel()].cpu(), flat_s.cpu())
    _same(res_rows.cpu(), res.cpu())
    assert (values.reshape(-1)[n:] == 99).all(), "quantize_int8 wrote past the elements"
    # unpack_int8 is its inverse; dequantize_int8 sums the same rows.
    out = torch.empty(n, device=device)
    ops.unpack_int8(values, scales, out, block)
    want = torch.empty(n, device=device)
    ops.unpack_int8(flat_q, flat_s, want, block)
    _same(out.cpu(), want.cpu())
    ref = flat_q.cpu().float() * flat_s.cpu().repeat_interleave(block)[:n]
    _same(want.cpu(), ref)
    if n == world * shard:
        summed = torch.empty(shard, device=device)
        ops.dequantize_int8(values, scales, summed, block)
        rows = ref.view(world, shard)
        _same(summed.cpu(), rows[0] + rows[1] + rows[2])


def test_int8_round_trip_error_is_within_half_a_step():
    x = _grads(10_000)
    q = torch.empty(10_000, dtype=torch.int8)
    scales = torch.empty(79)
    ops.quantize_int8(x, q, scales, 128, 1.0)
    out = torch.empty(10_000)
    ops.dequantize_int8(q.view(1, -1), scales.view(1, -1), out, 128)
    step = scales.repeat_interleave(128)[:10_000]
    assert ((out - x).abs() <= step * 0.5001).all()


def test_opcheck_accumulating_ops(device):
    x = _grads(300, device=device)
    res = torch.zeros(300, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    wire = torch.empty(300, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.fastddp.compress.default, (x, wire, 0.5, flag, res, 4))
    chunks = torch.randn(3, 100, device=device).to(torch.float16)
    shard = torch.empty(100, dtype=torch.float16, device=device)
    shard_res = torch.zeros(100, device=device)
    torch.library.opcheck(
        torch.ops.fastddp.sum_chunks.default, (chunks, shard, 0.5, flag, shard_res, -1)
    )
    torch.library.opcheck(
        torch.ops.fastddp.widen_sum.default, (chunks, torch.empty(100, device=device), 0.5)
    )
    q = torch.empty(300, dtype=torch.int8, device=device)
    scales = torch.empty(3, device=device)
    torch.library.opcheck(
        torch.ops.fastddp.quantize_int8.default, (x, q, scales, 128, 1.0, flag, res, 1)
    )
    out = torch.empty(100, device=device)
    torch.library.opcheck(
        torch.ops.fastddp.dequantize_int8.default,
        (q.view(3, 100), torch.rand(3, 1, device=device), out, 128, 1.0),
    )
    _, values, row_scales = _rows(3, 128, 64, device)
    torch.library.opcheck(
        torch.ops.fastddp.quantize_int8.default, (x, values, row_scales, 64, 1.0, flag, res, 1)
    )
    torch.library.opcheck(
        torch.ops.fastddp.unpack_int8.default, (values, row_scales, torch.empty_like(x), 64, 1.0)
    )


BAD = [
    (
        lambda: ops.compress(
            torch.ones(4), torch.empty(4, dtype=torch.half), 1, None, torch.zeros(3)
        ),
        "residual has 3 elements but 4 are rounded",
    ),
    (
        lambda: ops.compress(
            torch.ones(4),
            torch.empty(4, dtype=torch.half),
            1,
            None,
            torch.zeros(4, dtype=torch.float64),
        ),
        "residual must be float32, got Double",
    ),
    (
        lambda: ops.sum_chunks(torch.ones(8, dtype=torch.half), torch.empty(8, dtype=torch.half)),
        "src must have shape [chunks, m]",
    ),
    (
        lambda: ops.sum_chunks(
            torch.ones(2, 4, dtype=torch.half), torch.empty(4, dtype=torch.bfloat16)
        ),
        "src and dst must both be float16 or both bfloat16",
    ),
    (
        lambda: ops.sum_chunks(
            torch.ones(2, 4, dtype=torch.half), torch.empty(3, dtype=torch.half)
        ),
        "dst has 3 elements but each chunk has 4",
    ),
    (
        lambda: ops.widen_sum(torch.ones(2, 4, dtype=torch.half), torch.empty(4, dtype=torch.half)),
        "src must be float16 or bfloat16 and dst float32",
    ),
    (
        lambda: ops.widen_sum(torch.ones(2, 4, dtype=torch.half), torch.empty(5)),
        "dst has 5 elements but each chunk has 4",
    ),
    (
        lambda: ops.widen_sum(torch.ones(8, dtype=torch.half), torch.empty(8)),
        "src must have shape [chunks, m]",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(10), torch.empty(10, dtype=torch.int8), torch.empty(1), 8
        ),
        "1 row(s) of 10 int8 values need 2 scales (one per block of 8), got 1",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(10), torch.empty(10, dtype=torch.int8), torch.empty(1), 0
        ),
        "block_size must be between 1 and 2^20 elements, got 0",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(10), torch.empty(10, dtype=torch.uint8), torch.empty(1), 16
        ),
        "the quantised tensor must be int8",
    ),
    (
        lambda: ops.dequantize_int8(
            torch.ones(2, 4, dtype=torch.int8), torch.ones(2), torch.empty(5), 4
        ),
        "dst has 5 elements but each row has 4",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(10), torch.empty(2, 6, dtype=torch.int8), torch.empty(2, 2), 4
        ),
        "rows of 6 int8 values do not hold whole blocks of 4",
    ),
    (
        lambda: ops.unpack_int8(
            torch.empty(2, 8, dtype=torch.int8), torch.empty(2, 2), torch.empty(17), 4
        ),
        "17 elements do not fit in 2 row(s) of 8",
    ),
    (
        lambda: ops.unpack_int8(
            torch.empty(2, 8, dtype=torch.int8)[:, ::2], torch.empty(2, 1), torch.empty(8), 4
        ),
        "each row of the int8 tensor must be contiguous",
    ),
    (
        lambda: ops.unpack_int8(
            torch.empty(2, 2, 4, dtype=torch.int8), torch.empty(4), torch.empty(16), 4
        ),
        "the int8 tensor must be 1-D or [rows, m]",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(8), torch.empty(8, dtype=torch.int8), torch.empty(2, dtype=torch.half), 4
        ),
        "scales must be float32",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(8, dtype=torch.float64), torch.empty(8, dtype=torch.int8), torch.empty(2), 4
        ),
        "the fp32 tensor must be float32, got Double",
    ),
    (
        lambda: ops.quantize_int8(
            torch.ones(9), torch.empty(8, dtype=torch.int8), torch.empty(2), 4
        ),
        "the fp32 tensor has 9 elements but the int8 one has 8",
    ),
    (
        lambda: ops.dequantize_int8(
            torch.ones(2, 4, dtype=torch.int8), torch.ones(2), torch.empty(4, dtype=torch.half), 4
        ),
        "dst must be float32, got Half",
    ),
    (
        # No row to sum: refused, rather than a read of an empty tensor's codes.
        lambda: ops.dequantize_int8(
            torch.empty(0, 8, dtype=torch.int8), torch.empty(0, 2), torch.empty(8), 4
        ),
        "with at least one row",
    ),
]


@pytest.mark.parametrize("flag", [True, np.bool_(False)], ids=["bool", "numpy-bool"])
def test_a_bool_for_an_int_is_refused(flag):
    # torch's schemas take a bool for an int: seed=True would be seed 1 at every call (the
    # same roundings every step), block_size=True a block of 1.
    src, q, scales = torch.ones(8), torch.empty(8, dtype=torch.int8), torch.empty(8)
    with pytest.raises(TypeError, match="quantize_int8: seed must be an int"):
        ops.quantize_int8(src, q, scales, 1, 1.0, None, None, flag)
    with pytest.raises(TypeError, match="compress: seed must be an int"):
        ops.compress(src, torch.empty(8, dtype=torch.half), 1.0, None, None, flag)
    with pytest.raises(TypeError, match="quantize_int8: block_size must be an int"):
        ops.quantize_int8(src, q, scales, flag)
    with pytest.raises(TypeError, match="dequantize_int8: block_size must be an int"):
        ops.dequantize_int8(q.view(1, 8), scales.view(1, 8), src, flag)
    packed = torch.empty(1, 4, dtype=torch.uint8)
    with pytest.raises(TypeError, match="unpack_packed: bits must be an int"):
        ops.unpack_packed(packed, scales[:1].view(1, 1), src, flag, 8)
    ops.quantize_int8(src, q, scales, np.int64(1), 1.0, None, None, np.int64(3))  # numpy's ints


_WRITTEN = "must be contiguous; it is written in place, and a copy made by .contiguous() would"


@pytest.mark.parametrize(
    "call,message",
    [
        # An input not contiguous: .contiguous() of it does. An output not contiguous: a copy
        # made by .contiguous() would take the result and the tensor given would not.
        (lambda: ops.compress(torch.ones(8)[::2], torch.empty(4, dtype=torch.half)), "the bucket"
         " must be contiguous; pass .contiguous() of it"),
        (lambda: ops.compress(torch.ones(4), torch.empty(8, dtype=torch.half)[::2]),
         f"the wire buffer {_WRITTEN}"),
        (lambda: ops.decompress(torch.ones(4, dtype=torch.half), torch.empty(8)[::2]),
         f"the bucket {_WRITTEN}"),
        (lambda: ops.decompress(torch.ones(4, dtype=torch.half), torch.empty(4, dtype=torch.half)),
         "the fp32 bucket must be float32, got Half; allocate it as float32"),
        (lambda: ops.compress(torch.ones(4), torch.empty(4, dtype=torch.half), 1, None,
                              torch.zeros(8)[::2]), f"residual {_WRITTEN}"),
        (lambda: ops.sum_chunks(torch.ones(4, 2, dtype=torch.half).t(),
                                torch.empty(4, dtype=torch.half)), "src must be contiguous; pass"),
        (lambda: ops.widen_sum(torch.ones(2, 4, dtype=torch.half), torch.empty(8)[::2]),
         f"dst {_WRITTEN}"),
        (lambda: ops.quantize_int8(torch.ones(16)[::2], torch.empty(8, dtype=torch.int8),
                                   torch.empty(2), 4), "the fp32 tensor must be contiguous; pass"),
        (lambda: ops.unpack_int8(torch.ones(8, dtype=torch.int8), torch.ones(2),
                                 torch.empty(16)[::2], 4), f"the fp32 tensor {_WRITTEN}"),
        (lambda: ops.dequantize_int8(torch.ones(2, 4, dtype=torch.int8), torch.ones(2, 1),
                                     torch.empty(8)[::2], 4), f"dst {_WRITTEN}"),
    ],
)  # fmt: skip
def test_a_tensor_not_contiguous_is_named_with_the_fix_for_an_input_or_an_output(call, message):
    with pytest.raises(RuntimeError) as info:
        call()
    assert message in str(info.value)


@pytest.mark.parametrize("make, message", BAD)
def test_bad_inputs_raise_clear_errors(make, message):
    with pytest.raises(RuntimeError) as info:
        make()
    assert message in str(info.value)


def test_codes_ops_refuse_tensors_that_overlap():
    # Views of one buffer are refused where their ranges overlap, and taken where they do not
    # (a wire row is [codes | scales]: a buffer the hooks share).
    buf = torch.randn(264)
    src, codes = buf[:256], torch.empty(256, dtype=torch.int8)
    cases = [
        (lambda: ops.quantize_int8(src, codes, buf[:2], 128), "scales overlaps src"),
        (
            lambda: ops.quantize_int8(src, codes, buf[256:258], 128, residual=torch.empty(256)),
            None,
        ),
        (
            lambda: ops.quantize_int8(
                src, codes, buf[256:258].clone(), 128, residual=buf[:256].clone(), seed=3
            ),
            None,
        ),
        (
            lambda: ops.quantize_int8(
                buf[:128].clone(),
                codes[:128],
                buf[258:259],
                128,
                1.0,
                buf[258:259].view(torch.int32),
            ),
            "scales overlaps found_nonfinite",
        ),
    ]
    rows = torch.randint(-127, 128, (2, 128), dtype=torch.int8)
    scales = torch.rand(130) + 0.5
    raw = torch.zeros(1024, dtype=torch.int8)  # 256 codes, and 256 fp32 over them
    cases += [
        (
            lambda: ops.dequantize_int8(rows, scales[:2].view(2, 1), scales[:128], 128),
            "dst overlaps scales",
        ),
        (lambda: ops.dequantize_int8(rows, scales[:2].view(2, 1), scales[2:130], 128), None),
        (lambda: ops.unpack_int8(rows, scales[:2].view(2, 1), torch.empty(256), 128), None),
        (
            lambda: ops.unpack_int8(raw[:256], scales[:2], raw.view(torch.float32), 128),
            "dst overlaps src",
        ),
    ]
    # Rows spaced apart in one byte buffer (the wire's [codes | scales] rows), where torch's
    # check cannot tell: compared row by row, both ways.
    wire = torch.zeros(2, 12, dtype=torch.uint8)
    spaced, floats = torch.randn(16), torch.zeros(16)
    cases += [
        (
            lambda: ops.quantize_int8(
                spaced, wire[:, :8].view(torch.int8), wire[:, 4:8].view(torch.float32), 8
            ),
            "dst overlaps scales",
        ),
        (
            lambda: ops.quantize_int8(
                spaced, wire[:, :8].view(torch.int8), wire[:, 8:12].view(torch.float32), 8
            ),
            None,
        ),
        (
            lambda: ops.dequantize_int8(
                floats.view(torch.int8).view(2, 32)[:, :8], torch.ones(2, 1), floats[8:16], 8
            ),
            "dst overlaps src",
        ),
    ]
    packed = torch.zeros(2, 64, dtype=torch.uint8)
    cases += [
        (lambda: ops.quantize_packed(src, packed.view(-1), buf[:2], 4, 128), "scales overlaps src"),
        (
            lambda: ops.dequantize_packed(packed, scales[:2].view(2, 1), scales[:128], 4, 128),
            "dst overlaps scales",
        ),
    ]
    for make, message in cases:
        if message is None:
            make()
            continue
        with pytest.raises(RuntimeError, match=message):
            make()


def test_residual_overlapping_the_data_is_refused():
    x = torch.ones(8)
    with pytest.raises(RuntimeError, match="residual overlaps the data in memory"):
        ops.compress(x, torch.empty(8, dtype=torch.bfloat16), 1.0, None, x)
    chunks = torch.ones(2, 4, dtype=torch.half)
    with pytest.raises(RuntimeError, match="dst overlaps src in memory"):
        ops.sum_chunks(chunks, chunks[0])
    # Outputs in one buffer: the rounding would write the wire over the residual it reads.
    buf = torch.ones(16)
    wire = buf.view(torch.bfloat16)[:8]
    with pytest.raises(RuntimeError, match="dst overlaps residual in memory"):
        ops.compress(x, wire, 1.0, None, buf[:8])
    with pytest.raises(RuntimeError, match="dst overlaps found_nonfinite in memory"):
        ops.compress(x, wire, 1.0, buf[:1].view(torch.int32))
    with pytest.raises(RuntimeError, match="residual overlaps the data in memory"):
        ops.sum_chunks(chunks, wire[:4].view(torch.half), 1.0, None, buf[:4])
    with pytest.raises(RuntimeError, match="residual overlaps src in memory"):
        ops.sum_chunks(buf.view(torch.half)[:8].view(2, 4), torch.empty(4, dtype=torch.half),
                       1.0, None, buf[:4])  # fmt: skip
    # Apart in one buffer is fine: the wire in floats 0-3, the flag in 4, the residual in 8-15.
    ops.compress(x, wire, 1.0, buf[4:5].view(torch.int32), buf[8:16])


def test_a_meta_tensor_beside_real_ones_is_refused():
    # The call goes to the ops' fake kernels, not to the device checks of the kernels: the
    # CPU outputs were left as they were, without a word.
    x, meta = torch.randn(8), torch.zeros(1, dtype=torch.int32, device="meta")
    with pytest.raises(RuntimeError, match="the tensors are on cpu, meta; allocate them on one"):
        ops.compress(x, torch.empty(8, dtype=torch.bfloat16), 1.0, meta)
    with pytest.raises(RuntimeError, match="fastddp.quantize_int8: the tensors are on cpu, meta"):
        ops.quantize_int8(x, torch.empty(8, dtype=torch.int8), torch.empty(1, device="meta"), 8)
    with pytest.raises(RuntimeError, match="fastddp.unpack_packed: the tensors are on cpu, meta"):
        ops.unpack_packed(torch.empty(4, dtype=torch.uint8), torch.empty(1, device="meta"), x, 4, 8)
