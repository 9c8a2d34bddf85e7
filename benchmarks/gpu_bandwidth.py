"""Bandwidth of each fastddp op against device-to-device copies, same run.

For fp32 buckets of 1 MB, 25 MB, 100 MB and 1 GB (random data), every op is timed with CUDA
events (median of several calls) and reported in GB/s counting the bytes it reads and writes.
``ratio_to_copy`` divides that by the GB/s of a copy of the bucket; the target, from 25 MB up:
every op >= 0.85 of it. ``ratio_to_same_bytes`` divides it by the GB/s of a copy that reads and
writes as many bytes as the op does: most ops move a fraction of the bucket (dequantize_int8 a
quarter), and a small copy does not reach a large one's speed either, so this ratio tells a
kernel's own shortfall from its size's.

The ops: compress, decompress, sum_chunks, the int8 codes (quantize, dequantize, unpack,
requantize with error feedback: the int8-ef preset's reduce step) and the packed 4- and 2-bit
codes (``quantize_packed4`` ... ``requantize_packed2``), with blocks of 128. PyTorch's own
``to(dtype).div_()`` + ``copy_`` (what its fp16 hook does) is timed next to compress +
decompress, and each requantize's two-op equivalent (``dequantize+quantize_*``: dequantize
into an fp32 shard, quantize it with error feedback) at its shape, counted with requantize's
bytes so that the two rows' ratios compare their times. ``--device cpu`` runs the same on the
CPU (perf_counter), for testing the script.

    python benchmarks/gpu_bandwidth.py --json bw.json --markdown bw.md
"""

import argparse
import json
import statistics
import sys
import time

import torch

from fastddp import ops
from fastddp.bench import options

SIZES = {"1MB": 1 << 20, "25MB": 25 << 20, "100MB": 100 << 20, "1GB": 1 << 30}
RANKS = 4  # rows summed by sum_chunks, dequantize_int8 and requantize
BLOCK = 128
BITS = (4, 2)  # the packed codes
OPS = (
    "compress",
    "decompress",
    "sum_chunks",
    "quantize_int8",
    "dequantize_int8",
    "unpack_int8",
    "requantize_int8",
    *(
        f"{op}{bits}"
        for bits in BITS
        for op in ("quantize_packed", "dequantize_packed", "unpack_packed", "requantize_packed")
    ),
)
TARGETS = dict.fromkeys(OPS, 0.85)
# Rows timed beside the ops, without a target: what an op replaces or competes with.
# "requantize_int8, 4 a lane": the same work with the rows read 4 bytes off 16-byte alignment,
# which the 4-element-a-lane vector kernel takes rather than the wide one (wide_kernels.cuh);
# it loads each lane's own 4 bytes of a row, as fast there, and writes the row as before.
# (quantize has no such row: a layout the wide kernel refuses also takes the vector kernel off
# its whole steps; run 8 timed it on this layout.)
REFERENCES = (
    *(f"dequantize+quantize_{codes}" for codes in ("int8", *(f"packed{b}" for b in BITS))),
    "requantize_int8, 4 a lane",
    "torch to(bf16).div_ + copy_",
)


def _timer(device):
    if device.type == "cuda":

        def run(fn, iters):
            start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
            for s, e in zip(start, end):
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(start, end))

        return run

    def run_cpu(fn, iters):
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run_cpu


def measure(device, sizes, iters):
    """One row per (size, op): seconds, bytes moved, GB/s and the ratio to the copy."""
    timed = _timer(device)
    rows = []
    for label, nbytes in sizes.items():
        rows += _one_size(device, label, nbytes, timed, iters)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def cases(device, nbytes):
    """``op -> (call, bytes moved)`` over an fp32 bucket of ``nbytes``, the copy first."""
    n = nbytes // 4
    m = -(-n // RANKS)
    g = torch.Generator(device=device).manual_seed(0)
    src = torch.randn(n, generator=g, device=device)
    dst = torch.empty_like(src)
    wire = torch.empty(n, dtype=torch.bfloat16, device=device)
    rows16 = torch.randn(RANKS, m, generator=g, device=device).to(torch.bfloat16)
    out16 = torch.empty(m, dtype=torch.bfloat16, device=device)
    q = torch.empty(n, dtype=torch.int8, device=device)
    scales = torch.empty(-(-n // BLOCK), device=device)
    q_rows = torch.randint(-127, 128, (RANKS, m), generator=g, device=device).to(torch.int8)
    s_rows = torch.rand(RANKS, -(-m // BLOCK), generator=g, device=device)
    summed = torch.empty(m, device=device)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    residual = torch.zeros(m, device=device)
    q_out, s_out = torch.empty(m, dtype=torch.int8, device=device), torch.empty_like(s_rows[0])
    # The same rows 4 bytes off 16-byte alignment (each of them): the vector kernel's layout.
    q_rows4 = torch.empty(RANKS, m + 4, dtype=torch.int8, device=device)[:, 4:]
    q_rows4.copy_(q_rows)

    def int8_pair():
        ops.dequantize_int8(q_rows, s_rows, summed, BLOCK, 0.25)
        ops.quantize_int8(summed, q_out, s_out, BLOCK, 1.0, flag, residual)

    requantize_bytes = RANKS * m + 4 * s_rows.numel() + m + 4 * s_out.numel() + 8 * m
    table = {
        "copy (d2d)": (lambda: dst.copy_(src), 8 * n),
        "compress": (lambda: ops.compress(src, wire, 0.25, flag), 6 * n),
        "decompress": (lambda: ops.decompress(wire, dst, 1.0), 6 * n),
        "sum_chunks": (lambda: ops.sum_chunks(rows16, out16, 1.0, flag), 2 * RANKS * m + 2 * m),
        "quantize_int8": (
            lambda: ops.quantize_int8(src, q, scales, BLOCK, 1.0, flag),
            4 * n + n + 4 * scales.numel(),
        ),
        "dequantize_int8": (
            lambda: ops.dequantize_int8(q_rows, s_rows, summed, BLOCK),
            RANKS * m + 4 * s_rows.numel() + 4 * m,
        ),
        "unpack_int8": (lambda: ops.unpack_int8(q, scales, dst, BLOCK), n + 4 * n),
        # the rows and their scales read; one row and its scales written; the residual both
        "requantize_int8": (
            lambda: ops.requantize(q_rows, s_rows, q_out, s_out, 8, BLOCK, 0.25, flag, residual),
            requantize_bytes,
        ),
        "dequantize+quantize_int8": (int8_pair, requantize_bytes),
        "requantize_int8, 4 a lane": (
            lambda: ops.requantize(q_rows4, s_rows, q_out, s_out, 8, BLOCK, 0.25, flag, residual),
            requantize_bytes,
        ),
        **_packed_cases(src, dst, m, g, device),
        # read fp32, write bf16; div_ in place; read bf16, write fp32
        "torch to(bf16).div_ + copy_": (
            lambda: dst.copy_(src.to(torch.bfloat16).div_(RANKS)),
            (4 + 2) * n + (2 + 2) * n + (2 + 4) * n,
        ),
    }
    return {op: table[op] for op in ("copy (d2d)", *OPS, *REFERENCES)}


def _one_size(device, label, nbytes, timed, iters):
    cases_ = cases(device, nbytes)
    assert set(OPS) <= set(cases_), set(OPS) - set(cases_)
    k = iters if nbytes < (256 << 20) else max(3, iters // 4)

    def seconds_of(fn):
        for _ in range(2):
            fn()  # warm-up
        return timed(fn, k)

    # One pair of buffers for every same-bytes copy: the largest op's half, sliced.
    half = max(moved for _, moved in cases_.values()) // 2
    src_b, dst_b = (torch.empty(half, dtype=torch.uint8, device=device) for _ in range(2))
    same_bytes = {}  # bytes moved -> that copy's GB/s; ops of equal bytes share one timing

    def copy_of(moved):
        if moved not in same_bytes:
            h = moved // 2
            same_bytes[moved] = 2 * h / seconds_of(lambda: dst_b[:h].copy_(src_b[:h])) / 1e9
        return same_bytes[moved]

    rows, copy_gbs = [], None
    for op, (fn, moved) in cases_.items():
        seconds = seconds_of(fn)
        gbs = moved / seconds / 1e9
        if op == "copy (d2d)":
            copy_gbs = gbs
            same_bytes[moved] = gbs  # the bucket's copy is its own same-bytes copy
        target = TARGETS.get(op) if nbytes >= (25 << 20) else None
        ratio = gbs / copy_gbs
        rows.append(
            {
                "size": label,
                "op": op,
                "time_us": seconds * 1e6,
                "bytes_moved": moved,
                "gbs": gbs,
                "ratio_to_copy": ratio,
                "ratio_to_same_bytes": gbs / copy_of(moved),
                "target": target,
                "meets_target": None if target is None else ratio >= target,
            }
        )
    return rows


def _packed_cases(src, dst, m, g, device):
    """``name -> (call, bytes moved)`` for the packed ops over the same buckets as int8."""
    n, cases = src.numel(), {}
    for bits in BITS:
        nbytes, row_bytes = -(-n * bits // 8), -(-m * bits // 8)
        q = torch.empty(nbytes, dtype=torch.uint8, device=device)
        scales = torch.empty(-(-n // BLOCK), device=device)
        q_rows = torch.randint(0, 256, (RANKS, row_bytes), generator=g, device=device)
        q_rows = q_rows.to(torch.uint8)
        s_rows = torch.rand(RANKS, -(-m // BLOCK), generator=g, device=device)
        summed = torch.empty(m, device=device)
        q_out, s_out = torch.empty(row_bytes, dtype=torch.uint8, device=device), s_rows[0].clone()
        residual = torch.zeros(row_bytes * 8 // bits, device=device)

        def quantize(q=q, scales=scales, bits=bits):
            ops.quantize_packed(src, q, scales, bits, BLOCK)

        def dequantize(q_rows=q_rows, s_rows=s_rows, summed=summed, bits=bits):
            ops.dequantize_packed(q_rows, s_rows, summed, bits, BLOCK)

        def unpack(q=q, scales=scales, bits=bits):
            ops.unpack_packed(q, scales, dst, bits, BLOCK)

        def requantize(q_rows=q_rows, s_rows=s_rows, out=(q_out, s_out, residual), bits=bits):
            ops.requantize(q_rows, s_rows, out[0], out[1], bits, BLOCK, 0.25, None, out[2])

        wide = torch.empty(residual.numel(), device=device)  # the pair's fp32 shard

        def pair(q_rows=q_rows, s_rows=s_rows, out=(q_out, s_out, residual, wide), bits=bits):
            ops.dequantize_packed(q_rows, s_rows, out[3], bits, BLOCK, 0.25)
            ops.quantize_packed(out[3], out[0], out[1], bits, BLOCK, 1.0, None, out[2])

        cases[f"quantize_packed{bits}"] = (quantize, 4 * n + nbytes + 4 * scales.numel())
        cases[f"dequantize_packed{bits}"] = (
            dequantize,
            RANKS * row_bytes + 4 * s_rows.numel() + 4 * m,
        )
        cases[f"unpack_packed{bits}"] = (unpack, nbytes + 4 * scales.numel() + 4 * n)
        moved = (RANKS + 1) * row_bytes + 4 * (s_rows.numel() + s_out.numel())
        cases[f"requantize_packed{bits}"] = (requantize, moved + 8 * residual.numel())
        cases[f"dequantize+quantize_packed{bits}"] = (pair, moved + 8 * residual.numel())
    return cases


def markdown(rows):
    lines = [
        "| size | op | time (us) | GB/s | vs copy | vs a copy of its bytes | target |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        target = (
            ""
            if r["target"] is None
            else f">= {r['target']}: " + ("met" if r["meets_target"] else "MISSED")
        )
        lines.append(
            f"| {r['size']} | {r['op']} | {r['time_us']:.1f} | {r['gbs']:.1f} | "
            f"{r['ratio_to_copy']:.2f} | {r['ratio_to_same_bytes']:.2f} | {target} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), help=f"of {list(SIZES)}")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--json")
    p.add_argument("--markdown")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    unknown = [s for s in args.sizes if s not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    device = torch.device(args.device)
    rows = measure(device, {s: SIZES[s] for s in args.sizes}, args.iters)
    table = markdown(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
