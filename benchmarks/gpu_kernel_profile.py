"""Each op's kernels once, between ``cudaProfilerStart`` and ``Stop``, for Nsight Compute.

The same buckets as ``gpu_bandwidth.py``; each op is called twice before the profiled window
(allocation and first-launch costs stay out of it), then once inside it. Run under ``ncu
--profile-from-start off``, which then sees exactly one launch of each op's kernels::

    ncu --clock-control none --profile-from-start off --set full -o kernels \\
        python3 benchmarks/gpu_kernel_profile.py --size 100MB
    ncu --import kernels.ncu-rep --page details > kernels.txt

``--device cpu`` calls the same ops on the CPU, without a window, for testing the script.
"""

import argparse
import sys

import gpu_bandwidth
import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--size", default="100MB", choices=list(gpu_bandwidth.SIZES))
    p.add_argument("--ops", nargs="+", default=list(gpu_bandwidth.OPS), help="ops to profile")
    args = p.parse_args(argv)
    unknown = set(args.ops) - set(gpu_bandwidth.OPS)
    if unknown:
        p.error(f"unknown ops {sorted(unknown)}; choose from {list(gpu_bandwidth.OPS)}")
    device = torch.device(args.device)
    cases = gpu_bandwidth.cases(device, gpu_bandwidth.SIZES[args.size])
    calls = [cases[op][0] for op in ["copy (d2d)", *args.ops]]
    for call in calls:
        call()
        call()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for call in calls:
        call()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print(f"profiled once each at {args.size}: copy (d2d), {', '.join(args.ops)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
