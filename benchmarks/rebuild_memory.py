"""Peak host memory added by DDP's bucket rebuild with error feedback (preset ``bf16-acc-ef``).

DDP's first step reduces one bucket in model order; it then rebuilds its buckets in gradient
order, and the hook moves every error-feedback residual to its parameter's new bucket. This
runs 2 ranks on Gloo/CPU and reports, per rank, the growth of the peak resident set
(``ru_maxrss``) from after step 1 to after the last step, next to the model's fp32 size.

    .venv/bin/python benchmarks/rebuild_memory.py --params 50000000
"""

import argparse
import resource
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.testing.spawn import spawn_ranks


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rank(rank, world, params, steps):
    width = 2048
    depth = max(1, params // (width * width))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]))
    state = fastddp.CompressState.from_preset("bf16-acc-ef")
    model.register_comm_hook(state, fastddp.compress_hook)
    x = torch.randn(4, width)
    peaks = []
    for _ in range(steps):
        model.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        peaks.append(_peak_mb())
    numel = sum(p.numel() for p in model.parameters())
    row = {"rank": rank, "params": numel, "model_mb": numel * 4 / 2**20, "peaks_mb": peaks}
    row["rebuild_growth_mb"] = peaks[-1] - peaks[0]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    rows = spawn_ranks(_rank, 2, args.params, args.steps)
    for r in rows:
        print(
            f"rank {r['rank']}: model {r['model_mb']:.0f} MB fp32; peak RSS after each step "
            f"{', '.join(f'{p:.0f}' for p in r['peaks_mb'])} MB; then on, it grew by "
            f"{r['rebuild_growth_mb']:.0f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
