"""The cases that sweep every kernel of the CUDA grid emulator against the CPU op.

Sizes are chosen for an emulated device of 1 SM (8 blocks of 256 threads): :func:`sizes` gives
lengths that need at least 3 passes of a grid-stride loop plus every tail from 0 to twice the
vector width. :data:`CHECKS` runs the checks of :mod:`fastddp.testing.emu_checks` on those
sizes and on every layout of rows, and launches every kernel of :data:`KERNELS`.

``python -m fastddp.testing.emu_cases --lib PATH`` runs a quick sweep of every check against
one library and exits 1 on the first failure (the mutation tests run it on defective builds,
through :func:`run_logged` in a process forked from one that has imported torch already).
"""

import argparse
import os
import sys
from typing import Optional

import torch

from fastddp.testing.emu import Emu, EmuError, load
from fastddp.testing.emu_checks import (
    check_compress,
    check_decode_packed,
    check_decompress,
    check_dequantize_int8,
    check_quantize_int8,
    check_quantize_packed,
    check_requantize,
    check_sum_chunks,
    check_unpack_int8,
    check_widen_sum,
)

__all__ = ["CHECKS", "KERNELS", "VEC", "run_all", "sizes"]

VEC = 8  # elements per 16-byte wire access
THREADS = 8 * 256  # an emulated device of 1 SM: 8 blocks of 256 threads


def sizes(per_thread: int, tails=range(0, 2 * VEC + 1)) -> list[int]:
    """Lengths that take 3 grid-stride passes when each thread does ``per_thread`` elements."""
    return [3 * THREADS * per_thread + t for t in tails]


WIRES = (torch.bfloat16, torch.float16)
CHUNK = 4  # elements a lane takes at a time in the vector kernels of the codes


def _codes_n(block: int, tail: int = 5, unroll: int = 2) -> int:
    """A length that takes 3 passes of the codes' vector kernels and ends in a short block: a
    warp takes ``unroll`` runs of 128 elements a step (quantize 2, unpack 4, dequantize 4),
    or a block of more."""
    return 3 * THREADS * CHUNK * max(unroll, block // 128) + tail


# The layouts of the codes: (rows, pad, offset): one row; rows 16 bytes apart (aligned); rows
# 4 bytes apart (the codecs' layout, rows not 16-byte aligned); fp32 one element into its
# buffer (the scalar kernels).
LAYOUTS = ((1, 16, False), (3, 16, False), (3, 4, False), (1, 16, True))

# (name, function, argument tuples) for a quick sweep: every op and variant, a few sizes, every
# vector kernel and every scalar one.
CHECKS = [
    ("compress", check_compress,
     [(n, dt, v, off, True) for dt in WIRES for v in ("plain", "flag", "ef", "sr", "ef-sr")
      for off in (False, True) for n in sizes(VEC, (1, 9))]),
    ("decompress", check_decompress,
     [(n, dt, off) for dt in WIRES for off in (False, True) for n in sizes(VEC, (3, 15))]),
    # m % 8 == 0: every row aligns at the same element (a vector body after a head); else the
    # rows cannot align together (all scalar).
    ("sum_chunks", check_sum_chunks,
     # Rows are read four at a time: 1 and 3 rows are one short group, 6 a whole group and a
     # short one.
     [(m, dt, c, v, off) for dt in WIRES for c in (1, 3, 6) for v in ("plain", "ef", "sr")
      for m, off in ((sizes(VEC, (8,))[0], True), (sizes(VEC, (5,))[0], False))]),
    ("widen_sum", check_widen_sum,
     [(m, dt, c, off) for dt in WIRES for c in (2, 5)
      for m, off in ((sizes(VEC, (8,))[0], True), (sizes(VEC, (7,))[0], False))]),
    # Blocks of 32 (a quarter warp), 100 (the scalar kernel), 256 (a warp, 2 chunks a lane).
    # First (a sweep stops at its first failure, and a defect of the shared scales' extremes
    # shows in these alone), the extreme blocks: zero, tiny, FLT_MAX, inf, NaN.
    # The extremes go to the wide kernel (one row, aligned) and to the vector kernel (rows 4
    # bytes apart), whose lanes share a block's scale and inverse (step_values).
    # Then blocks of 16 (a lane each) with error feedback, extremes in whole steps: the wide
    # kernel's lanes store residuals in pairs, each pair's two blocks bad or not on their own.
    ("quantize_int8", check_quantize_int8,
     [(_codes_n(32), 32, v, r, pad, False, False, True) for v in ("plain", "sr")
      for r, pad in ((1, 16), (3, 4))]
     + [(_codes_n(16), 16, "ef", 1, 16, False, False, True)]
     + [(_codes_n(b), b, v, r, pad, off) for b in (32, 100, 256)
        for v in ("plain", "ef", "sr", "ef-sr") for r, pad, off in LAYOUTS]),
    ("dequantize_int8", check_dequantize_int8,
     [(_codes_n(b, b, 4), b, 3, pad, off) for b in (32, 100)
      for pad, off in ((16, False), (4, False), (16, True))]),
    ("unpack_int8", check_unpack_int8,
     [(_codes_n(b, 7, 4), b, r, pad, off) for b in (32, 100) for r, pad, off in LAYOUTS]),
    # Blocks of 32 and 128 (the wide kernel where rows lie a lane's 16 codes apart, 8 or 4
    # bytes, else the vector one), 6 for int4 and 12 for int2 (scalar); int2 rows 2 bytes
    # apart (vector).
    # And, first (a sweep stops at its first failure, and a defect of the lanes' groups shows
    # in this case alone), int2 rows of 32 codes past a group of 64 (a group of lanes
    # straddles rows' starts) 8 bytes apart, so that a row of codes starts 16-byte aligned:
    # groups align to the lanes (the wide kernel), then the same rows for the vector kernel at
    # blocks of 8 (72 codes more, so that rows of whole blocks of 8 are as long).
    ("quantize_packed", check_quantize_packed,
     [(2, _codes_n(32), 32, "plain", 3, 8, False), (2, _codes_n(32) + 72, 8, "plain", 3, 8, False)]
     + [(bits, _codes_n(b), b, v, r, pad, off) for bits in (4, 2) for b in (32, 128, 6 * (6 - bits))
        for v in ("plain", "ef", "sr", "ef-sr") for r, pad, off in LAYOUTS]
     + [(2, _codes_n(b), b, v, 3, 2, False) for b in (32, 128)
        for v in ("plain", "ef", "sr", "ef-sr")]
     + [(bits, _codes_n(b), b, v, 1, 16, False, False, True) for bits in (4, 2)
        for b, v in ((32, "plain"), (16, "ef"))]),
    ("dequantize_packed", check_decode_packed,
     [("dequantize", bits, _codes_n(b, b, 4), b, 3, pad, off) for bits in (4, 2)
      for b in (32, 128, 6 * (6 - bits)) for pad, off in ((16, False), (4, False), (16, True))]
     # 5 rows: a second batch of the whole step's rows (4 at a time), part past the last row
     + [("dequantize", bits, _codes_n(32, 32, 4), 32, 5, 16, False) for bits in (4, 2)]),
    ("unpack_packed", check_decode_packed,
     [("unpack", 2, _codes_n(32, 7, 4), 32, 3, 8, False)]
     + [("unpack", bits, _codes_n(b, 7, 4), b, r, pad, off) for bits in (4, 2)
        for b in (32, 128, 6 * (6 - bits)) for r, pad, off in LAYOUTS]),
    # Rows of codes summed and quantised again: first (the planted defects show there) 3 rows
    # (a pair, then a lone row) and a few blocks' scales inf or NaN; every mode of the vector
    # kernels of each width; the scalar kernels (blocks of 100, 6 and 12), fp32 one element into its
    # buffer (scalar too), 2 rows 4 bytes apart (int8: vector; a row's codes stay 4-byte
    # aligned), a warp-long block (256), one row, rows of 2 mod 4 codes (vector: rows line up
    # by column).
    ("requantize", check_requantize,
     [(bits, _codes_n(32, 4), 32, "ef", 3, 16, False, True) for bits in (8, 4, 2)]
     + [(bits, _codes_n(32, 4), 32, v, 3) for bits in (8, 4, 2) for v in ("plain", "sr", "ef-sr")]
     + [(bits, _codes_n(32, 7), b, "ef", 3) for bits, b in ((8, 100), (4, 6), (2, 12))]
     + [(8, _codes_n(32), 32, "ef", 3, 16, True), (8, _codes_n(32, 4), 32, "plain", 2, 4),
        (8, _codes_n(256, 4), 256, "ef", 3), (4, _codes_n(32), 32, "plain", 1),
        (4, _codes_n(32, 2), 32, "ef", 3, 15)]
     # int8 rows 16-byte aligned apart (the wide kernel): whole lanes in every mode; 5 rows
     # (a second batch of loads, part past the last row) with a lane's last 9 codes alone; a
     # 4-code tail.
     + [(8, _codes_n(32, 0), 32, v, 3) for v in ("plain", "ef", "sr", "ef-sr")]
     + [(8, _codes_n(128, 9), 128, "ef-sr", 5, 7), (8, _codes_n(32, 4), 512, "ef", 2, 12)]
     # int4 and int2 rows a lane's codes (8, 4 bytes) apart: the same, and scales inf or NaN
     + [(bits, _codes_n(32, 0), 32, v, 3) for bits in (4, 2) for v in ("plain", "ef", "sr")]
     + [(bits, _codes_n(128, 9), 128, "ef-sr", 5, pad) for bits, pad in ((4, 3), (2, 1))]
     + [(bits, _codes_n(128, 9), 128, "ef", 2, pad, False, True)
        for bits, pad in ((4, 3), (2, 1))]),
]  # fmt: skip

# Every kernel of csrc/cuda (by name and bits), which the checks of CHECKS must launch.
KERNELS = frozenset(
    ["compress_kernel", "compress_feedback_kernel", "decompress_kernel", "sum_chunks_kernel",
     "widen_sum_kernel", "quantize_int8_kernel", "dequantize_kernel", "unpack_kernel"]
    + [f"quantize_vec_kernel<{bits}, {feedback}, {stochastic}>" for bits in (8, 4, 2)
       for feedback in ("false", "true") for stochastic in ("false", "true")]
    + [f"{k}<{bits}>" for k in ("dequantize_vec_kernel", "unpack_vec_kernel")
       for bits in (8, 4, 2)]
    + [f"{k}<{bits}>" for k in ("quantize_packed_kernel", "dequantize_kernel", "unpack_kernel")
       for bits in (4, 2)]
    # requantize's instances: the vector kernel with and without error feedback for each width
    # (one instance rounds either way), and the scalar ones
    + [f"quantize_vec_kernel<{bits}, {feedback}, false, summed>" for bits in (8, 4, 2)
       for feedback in ("false", "true")]
    + ["quantize_int8_kernel<8, summed>", "quantize_packed_kernel<4, summed>",
       "quantize_packed_kernel<2, summed>"]
    # the wide kernel of each width, for quantize in every mode and requantize with and
    # without feedback
    + [f"quantize_wide_kernel<{bits}, {feedback}, {stochastic}>" for bits in (8, 4, 2)
       for feedback in ("false", "true") for stochastic in ("false", "true")]
    + [f"quantize_wide_kernel<{bits}, {feedback}, false, summed>" for bits in (8, 4, 2)
       for feedback in ("false", "true")]
)  # fmt: skip


def run_all(emu: Emu, only: Optional[str] = None) -> set[str]:
    """Every check of :data:`CHECKS` (or those of one op); raises on the first failure.
    Returns the kernels they launched."""
    emu.launched()
    for name, check, cases in CHECKS:
        if only in (None, name):
            for args in cases:
                check(emu, *args)
    return emu.launched()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", help="the emulator library (default: build csrc)")
    p.add_argument("--op", help="only this op's checks")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        emu = load(args.lib, sms=1, seed=args.seed)
        names = {name for name, _, _ in CHECKS}
        if args.op is not None and (args.op not in names or not emu.has(args.op)):
            print(f"--op {args.op}: not an op of {sorted(names)} in this library", file=sys.stderr)
            return 2  # not a failed check: the mutation tests tell the two apart
        launched = run_all(emu, args.op)
    except (AssertionError, EmuError) as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    if args.op is None and launched != KERNELS:
        print(f"FAILED: kernels not run: {sorted(KERNELS - launched)}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


def run_logged(lib: str, op: str, log: str) -> None:
    """:func:`main` on ``lib``'s ``op`` checks with everything it writes, the sanitizers'
    reports too, sent to the file ``log``; the process exits with main's status."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.exit(main(["--lib", lib, "--op", op]))


if __name__ == "__main__":
    sys.exit(main())
