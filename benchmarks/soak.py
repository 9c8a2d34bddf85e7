"""Soak: many steps of the demo model on 2 ranks per hook mode, watching for growth.

Every ``--every`` steps each rank records its resident memory, the hook state's
``allocations`` counter, its open file descriptors and its threads. After the first record
(the warm-up: buckets rebuilt, buffers made) none of them may grow: allocations, descriptors
and threads must stay equal, and resident memory may not rise more than ``--rss-slack-mb``
above its lowest record so far (it moves by a few MB from record to record). Rank 0 prints the
records; the exit status is 1 if any rank saw growth.

    python benchmarks/soak.py --steps 2000 --every 200 --json benchmarks/soak.json
"""

import argparse
import json
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.distributed import exit_after_shutdown

MODES = {
    "bf16": {},
    "fp16": {"dtype": torch.float16},
    "bf16-acc": {"accumulate_dtype": torch.float32},
    "bf16-acc-ef": {"accumulate_dtype": torch.float32, "error_feedback": True},
    "int8": {"dtype": torch.int8},
    "int8-ef-sr": {"dtype": torch.int8, "error_feedback": True, "stochastic_rounding": True},
}
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _sample(state) -> dict:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * _PAGE
    return {
        "rss_mb": rss / 2**20,
        "allocations": state.stats()["allocations"],
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
    }


def _mode(name, args, rank):
    torch.manual_seed(0)
    sizes = [256] + [args.width] * 3 + [64]
    layers = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.GELU()]
    model = DDP(nn.Sequential(*layers[:-1]), bucket_cap_mb=1)
    state = fastddp.CompressState(**MODES[name])
    model.register_comm_hook(state, fastddp.compress_hook)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    records = []
    for step in range(1, args.steps + 1):
        x = torch.randn(32, 256, generator=gen)
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()
        opt.step()
        if step % args.every == 0:
            records.append({"step": step, **_sample(state)})
    return records


def _growth(records, slack_mb) -> list[str]:
    """What grew after the first record. Resident memory moves by a few MB from step to step
    (the allocator returns and takes back large blocks), so it counts as growth only when a
    record stands more than ``slack_mb`` above the lowest one before it."""
    first, problems = records[0], []
    low = first["rss_mb"]
    for r in records[1:]:
        for key in ("allocations", "fds", "threads"):
            if r[key] != first[key]:
                problems.append(f"{key} {first[key]} -> {r[key]} by step {r['step']}")
        if r["rss_mb"] - low > slack_mb:
            problems.append(
                f"resident memory {low:.1f} -> {r['rss_mb']:.1f} MB by step {r['step']}"
            )
        low = min(low, r["rss_mb"])
    return problems


def _rank(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    results = {}
    for name in args.modes:
        records = _mode(name, args, rank)
        results[name] = {"records": records, "problems": _growth(records, args.rss_slack_mb)}
        if rank == 0:
            print(f"{name}: " + "  ".join(
                f"[{r['step']}] {r['rss_mb']:.0f} MB, {r['allocations']} alloc, "
                f"{r['fds']} fds, {r['threads']} threads" for r in records
            ), flush=True)  # fmt: skip
    everyone = [None] * world
    dist.all_gather_object(everyone, results)
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    exit_after_shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--width", type=int, default=1024, help="hidden width (the demo's: 1024)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rss-slack-mb", type=float, default=32.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.every < 1 or args.steps < 2 * args.every:
        p.error("--steps must cover at least two records of --every steps")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "soak.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(_rank, args=(2, init, args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            ranks = json.load(f)
    bad = [
        f"rank {r} {name}: {problem}"
        for r, results in enumerate(ranks)
        for name, result in results.items()
        for problem in result["problems"]
    ]
    print("\n".join(bad) if bad else f"no growth after step {args.every} on any rank")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "every": args.every, "ranks": ranks}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
