"""Call every fastddp op at several sizes and alignments, and check each against plain torch.

The ops: compress, decompress, sum_chunks, widen_sum, the int8 codes (quantize_int8,
unpack_int8, dequantize_int8) and the packed 4- and 2-bit codes (quantize_packed,
unpack_packed, dequantize_packed), flat and in rows that lie apart, and requantize of both
(against dequantize then quantize, bit for bit). Run under
``compute-sanitizer`` by ``benchmarks/gpu_check.py`` (memcheck, racecheck, synccheck,
initcheck): sizes around the vector width and the block size, one long enough for three passes
of every grid-stride loop, views that start off a 16-byte boundary, random data (never zeros),
with and without the non-finite flag, error feedback and stochastic rounding. Every buffer
(except the rows apart) is exactly as long as its op needs and a view ends where its allocation
ends, so that memcheck (with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, which gives each tensor its
own ``cudaMalloc``) sees an access one element past the end. ``--device cpu`` runs the same
calls on the CPU kernels (what the tests do where there is no GPU). Exits non-zero on the first
wrong result.

    python benchmarks/gpu_ops_all.py [--device cuda]
"""

import argparse
import sys
from typing import Optional

import torch

from fastddp import ops

SIZES = (1, 7, 8, 127, 128, 129, 1000, 4099, 65537)
OFFSETS = (0, 1, 3)  # elements: 4, 12 bytes off alignment for fp32
BLOCK = 128
PACKED = ((4, 32), (2, 128))  # (bits, block): both code widths, a small and a large block
H100_SMS = 132


def long_size(sms: int) -> int:
    """A length for which every grid-stride loop runs at least 3 passes on ``sms`` SMs.

    ``grid_for`` (csrc/cuda/launch.h) caps the grid at ``8 * sms`` blocks of 256 threads; the
    vectorised compress/decompress move 8 elements a thread, the most of any kernel, so 3 of
    their passes cover ``3 * 8 * sms * 256 * 8`` elements (6,488,064 on an H100). The scalar
    kernels then run 25 passes and quantize_int8 (a warp per block of 128) 7.
    """
    return 3 * 8 * sms * 256 * 8 + 3  # + an odd tail for the scalar loop


def _empty(n, off, dtype, device):
    """``n`` elements starting ``off`` elements into an allocation that ends with them."""
    return torch.empty(n + off, dtype=dtype, device=device)[off:]


def _data(n, off, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n + off, generator=g) * torch.exp(torch.randn(n + off, generator=g))
    return x.to(device)[off:]


def _check(what, got, want, tol):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = tol * (want.double().abs().max().item() if want.numel() else 0.0) + 1e-30
    if not err <= bound:
        raise AssertionError(f"{what}: off by {err:.3e} (bound {bound:.3e})")


def _requantized(rows, row_scales, bits, block, flag, what) -> int:
    """requantize of ``rows`` against their dequantized sum quantized, with error feedback and
    stochastic rounding: the same bits. The op calls made."""
    device, m = rows.device, rows.shape[1] * (8 // bits if bits < 8 else 1)  # whole bytes
    summed = torch.empty(m, device=device)
    if bits == 8:
        ops.dequantize_int8(rows, row_scales, summed, block)
    else:
        ops.dequantize_packed(rows, row_scales, summed, bits, block)
    outs = []
    for fused in (True, False):
        q = torch.empty(rows.shape[1], dtype=rows.dtype, device=device)
        scales = torch.empty(row_scales.shape[1], device=device)
        residual = torch.full((m,), 1e-3, device=device)
        if fused:
            ops.requantize(rows, row_scales, q, scales, bits, block, 1.0, flag, residual, 9)
        elif bits == 8:
            ops.quantize_int8(summed, q, scales, block, 1.0, flag, residual, 9)
        else:
            ops.quantize_packed(summed, q, scales, bits, block, 1.0, flag, residual, 9)
        outs.append((q.view(torch.uint8), scales, residual))
    for got, want in zip(*outs):
        if not torch.equal(got, want):
            raise AssertionError(f"requantize {what}: not the bits of dequantize, quantize")
    return 4


def _packed(src, n, off, bits, block, flag, device) -> int:
    """quantize_packed, unpack_packed and dequantize_packed on ``n`` codes; the op calls made.

    The packed bytes and the scales start ``off`` elements into their allocations too, so that
    a kernel which assumes an aligned start is seen.
    """
    nbytes, blocks = -(-n * bits // 8), -(-n // block)
    q = _empty(nbytes, off, torch.uint8, device)
    scales = _empty(blocks, off, torch.float32, device)
    residual = torch.zeros(n, device=device)
    ops.quantize_packed(src, q, scales, bits, block, 1.0, flag, residual, 5)
    whole = _empty(n, off, torch.float32, device)
    ops.unpack_packed(q, scales, whole, bits, block)
    # With error feedback, what was sent plus what is owed is the input.
    _check(f"quantize+unpack packed{bits} n={n} off={off}", whole + residual, src, 1e-6)
    summed = torch.empty(n, device=device)
    rows, row_scales = torch.stack([q, q]), torch.stack([scales, scales])
    ops.dequantize_packed(rows, row_scales, summed, bits, block, 0.5)
    _check(f"dequantize_packed{bits} n={n}", summed, whole, 0)
    calls = _requantized(rows, row_scales, bits, block, flag, f"packed{bits} n={n}")
    ops.quantize_packed(src, q, scales, bits, block)  # to nearest, no residual
    ops.unpack_packed(q, scales, whole, bits, block)
    step = scales.repeat_interleave(block)[:n]
    if not bool(((whole - src).abs() <= step * 0.5001).all()):
        raise AssertionError(f"quantize_packed{bits} n={n} off={off}: off by more than a half step")
    return 6 + calls


def _rows_apart(device, flag) -> int:
    """The int8 and packed codes written as rows of a wider buffer (one row per rank, scales
    beside them): nothing may be written between the rows. The op calls made."""
    world, shard, pad = 3, 4096, 16
    src = _data(world * shard, 0, device, seed=17)
    calls = 0
    for bits, block in ((8, 128), *PACKED):
        nbytes = shard * bits // 8
        wire = torch.full((world, nbytes + pad), 99, dtype=torch.uint8, device=device)
        scales = torch.full((world, shard // block + 1), 7.0, device=device)
        values, row_scales = wire[:, :nbytes], scales[:, : shard // block]
        back = torch.empty(world * shard, device=device)
        summed = torch.empty(shard, device=device)
        if bits == 8:
            codes = values.view(torch.int8)
            ops.quantize_int8(src, codes, row_scales, block, 1.0, flag)
            ops.unpack_int8(codes, row_scales, back, block)
            ops.dequantize_int8(codes, row_scales, summed, block)
        else:
            ops.quantize_packed(src, values, row_scales, bits, block, 1.0, flag)
            ops.unpack_packed(values, row_scales, back, bits, block)
            ops.dequantize_packed(values, row_scales, summed, bits, block)
        if not (bool((wire[:, nbytes:] == 99).all()) and bool((scales[:, -1] == 7.0).all())):
            raise AssertionError(f"{bits}-bit rows: written between the rows")
        step = row_scales.reshape(-1).repeat_interleave(block)
        if not bool(((back - src).abs() <= step * 0.5001).all()):
            raise AssertionError(f"{bits}-bit rows: off by more than a half step")
        _check(f"{bits}-bit rows summed", summed, back.view(world, shard).sum(0), 1e-6)
        rows = values.view(torch.int8) if bits == 8 else values
        calls += 3 + _requantized(rows, row_scales, bits, block, flag, f"{bits}-bit rows")
    return calls


def run(device: torch.device, sms: Optional[int] = None) -> int:
    calls = 0
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    # The long size aligned (16-byte accesses) and not (the scalar loop), for the device's SMs.
    # The CPU runs the same calls at the length an H100 needs, unless told another count.
    if sms is None:
        sms = H100_SMS
        if device.type == "cuda":
            sms = torch.cuda.get_device_properties(device).multi_processor_count
    cases = [(n, off) for n in SIZES for off in OFFSETS]
    cases += [(long_size(sms), 0), (long_size(sms), 1)]
    for n, off in cases:
        src = _data(n, off, device, seed=n * 10 + off)
        for dtype, tol in ((torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
            wire = _empty(n, off, dtype, device)
            ops.compress(src, wire, 0.5, flag)
            _check(f"compress {dtype} n={n} off={off}", wire, (src * 0.5).to(dtype), 0)
            back = _empty(n, off, torch.float32, device)
            ops.decompress(wire, back, 2.0)
            _check(f"decompress {dtype} n={n} off={off}", back, src, tol)
            residual = torch.zeros(n, device=device)
            ops.compress(src, wire, 0.5, flag, residual, 7)
            _check(f"compress+ef+sr {dtype} n={n}", wire.float() + residual, src * 0.5, 1e-6)
            rows = torch.stack([src, -src * 0.5, src * 0.25]).to(dtype).contiguous()
            out = torch.empty(n, dtype=dtype, device=device)
            ops.sum_chunks(rows, out, 1.0, flag)
            _check(f"sum_chunks {dtype} n={n}", out, rows.float().sum(0), tol)
            wide = torch.empty(n, device=device)
            ops.widen_sum(rows, wide, 1.0)
            _check(f"widen_sum {dtype} n={n}", wide, rows.float().sum(0), 1e-6)
            calls += 6
        blocks = -(-n // BLOCK)
        q = torch.empty(n, dtype=torch.int8, device=device)
        scales = torch.empty(blocks, device=device)
        residual = torch.zeros(n, device=device)
        ops.quantize_int8(src, q, scales, BLOCK, 1.0, flag, residual, 3)
        whole = torch.empty(n, device=device)
        ops.unpack_int8(q, scales, whole, BLOCK)
        _check(f"quantize+unpack int8 n={n} off={off}", whole + residual, src, 1e-6)
        summed = torch.empty(n, device=device)
        rows, row_scales = torch.stack([q, q]), torch.stack([scales, scales])
        ops.dequantize_int8(rows, row_scales, summed, BLOCK)
        _check(f"dequantize_int8 n={n}", summed, 2 * whole, 1e-6)
        calls += 3 + _requantized(rows, row_scales, 8, BLOCK, flag, f"int8 n={n}")
        for bits, block in PACKED:
            calls += _packed(src, n, off, bits, block, flag, device)
    calls += _rows_apart(device, flag)
    # The non-finite flag: an inf must be reported by every op that can produce one.
    bad = _data(300, 0, device, seed=1)
    bad[123] = float("inf")
    ops.compress(bad, torch.empty(300, dtype=torch.float16, device=device), 1.0, flag)
    if int(flag.item()) != 1:
        raise AssertionError("compress: an inf was not flagged")
    calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--sms",
        type=int,
        help="the SMs whose long length to run (default: the GPU's; on the CPU an H100's, 132)",
    )
    args = p.parse_args(argv)
    if args.sms is not None and args.sms < 1:
        p.error(f"--sms must be at least 1, got {args.sms}")
    calls = run(torch.device(args.device), args.sms)
    print(f"gpu_ops_all: {calls} op calls on {args.device}, all results as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
