"""Per-bucket CPU work of fastddp's fp16 hook against PyTorch's, in one process.

    FASTDDP_STREAM_MIN_BYTES=0 python benchmarks/hook_ab.py 25000000             # streaming on
    FASTDDP_STREAM_MIN_BYTES=999999999999 python benchmarks/hook_ab.py 25000000  # off

Prints three repeats of "fastddp ms / torch ms = ratio" (medians of 60 calls each).
"""

import sys
import time

import torch

import fastddp


def median_seconds(fn, rounds=60):
    for _ in range(5):
        fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[rounds // 2]


def main(nbytes):
    n = nbytes // 4
    x = torch.randn(n)
    wire = torch.empty(n, dtype=torch.float16)
    out = torch.empty(n)
    flag = torch.zeros(1, dtype=torch.int32)

    def ours():
        fastddp.ops.compress(x, wire, 0.5, flag)
        fastddp.ops.decompress(wire, out, 1.0)

    def theirs():
        out.copy_(x.to(torch.float16).div_(2))

    rows = [(median_seconds(ours), median_seconds(theirs)) for _ in range(3)]
    print(" ".join(f"{a * 1e3:.2f}/{b * 1e3:.2f}={a / b:.2f}" for a, b in rows))


if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    if len(sys.argv) > 2 or len(sys.argv) == 2 and not sys.argv[1].isdigit():
        sys.exit(__doc__)  # (its one argument: the bucket's bytes)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 25_000_000)
