"""Call every fastddp op at several sizes and alignments, and check each against plain torch.

Run under ``compute-sanitizer`` by ``benchmarks/gpu_check.py`` (memcheck, racecheck,
synccheck): sizes around the vector width and the block size, views that start off a 16-byte
boundary, random data (never zeros), with and without the non-finite flag, error feedback and
stochastic rounding. ``--device cpu`` runs the same calls on the CPU kernels (what the tests do
where there is no GPU). Exits non-zero on the first wrong result.

    python benchmarks/gpu_ops_all.py [--device cuda]
"""

import argparse
import sys

import torch

from fastddp import ops

SIZES = (1, 7, 8, 127, 128, 129, 1000, 4099, 65537)
OFFSETS = (0, 1, 3)  # elements: 4, 12 bytes off alignment for fp32
BLOCK = 128


def _data(n, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n + 8, generator=g) * torch.exp(torch.randn(n + 8, generator=g))).to(device)


def _check(what, got, want, tol):
    err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
    bound = tol * (want.double().abs().max().item() if want.numel() else 0.0) + 1e-30
    if not err <= bound:
        raise AssertionError(f"{what}: off by {err:.3e} (bound {bound:.3e})")


def run(device: torch.device) -> int:
    calls = 0
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    for n in SIZES:
        for off in OFFSETS:
            base = _data(n, device, seed=n * 10 + off)
            src = base[off : off + n]
            for dtype, tol in ((torch.float16, 2**-10), (torch.bfloat16, 2**-7)):
                wire = torch.empty(n + 8, dtype=dtype, device=device)[off : off + n]
                ops.compress(src, wire, 0.5, flag)
                _check(f"compress {dtype} n={n} off={off}", wire, (src * 0.5).to(dtype), 0)
                back = torch.empty(n + 8, device=device)[off : off + n]
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
            ops.dequantize_int8(torch.stack([q, q]), torch.stack([scales, scales]), summed, BLOCK)
            _check(f"dequantize_int8 n={n}", summed, 2 * whole, 1e-6)
            calls += 3
    # The non-finite flag: an inf must be reported by every op that can produce one.
    bad = _data(300, device, seed=1)[:300]
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
    args = p.parse_args(argv)
    calls = run(torch.device(args.device))
    print(f"gpu_ops_all: {calls} op calls on {args.device}, all results as expected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
