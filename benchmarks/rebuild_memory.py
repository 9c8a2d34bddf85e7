"""Peak host memory added by DDP's bucket rebuild with error feedback (bf16 summed in fp32).

DDP's first step reduces one bucket in model order; it then rebuilds its buckets in gradient
order, and the hook moves every error-feedback residual to its parameter's new bucket. This
runs 2 ranks on Gloo/CPU and reports, per rank, the growth of the peak resident set
(``ru_maxrss``) from after step 1 to after the last step, next to the model's fp32 size.

    .venv/bin/python benchmarks/rebuild_memory.py --params 50000000
"""

import argparse
import json
import os
import resource
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _rank(rank, world, init, params, steps, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    width = 2048
    depth = max(1, params // (width * width))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]))
    state = fastddp.CompressState(accumulate_dtype=torch.float32, error_feedback=True)
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
    everyone = [None] * world
    dist.all_gather_object(everyone, row)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f, indent=2)
    del model
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(
            _rank, args=(2, init, args.params, args.steps, out), nprocs=2, start_method="spawn"
        )
        with open(out) as f:
            rows = json.load(f)
    for r in rows:
        print(
            f"rank {r['rank']}: model {r['model_mb']:.0f} MB fp32; peak RSS after each step "
            f"{', '.join(f'{p:.0f}' for p in r['peaks_mb'])} MB; then on, it grew by "
            f"{r['rebuild_growth_mb']:.0f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
