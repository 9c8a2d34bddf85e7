"""Soak: many steps of the demo model on 2 ranks per hook mode, watching for growth.

Every ``--every`` steps each rank records its resident memory, the hook state's
``allocations`` counter, its open file descriptors and its threads. After the first record
(the warm-up: buckets rebuilt, buffers made) none of them may grow: allocations, descriptors
and threads must stay equal, and resident memory may not rise more than ``--rss-slack-mb``
above its lowest record so far (it moves by a few MB from record to record). Rank 0 prints the
records; the exit status is 1 if any rank saw growth.

    python benchmarks/soak.py --steps 2000 --every 200 --json benchmarks/results/soak.json
"""

import argparse
import json
import os
import sys

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench import options
from fastddp.bench.models import mlp
from fastddp.testing.spawn import spawn_ranks

# Each mode's preset and the settings it changes: every preset, and int8 with error feedback
# and stochastic rounding (which keeps a random state).
MODES = {name: (name, {}) for name in fastddp.PRESETS}
MODES["int8-ef+sr"] = ("int8-ef", {"stochastic_rounding": True})
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
    model = DDP(mlp([256] + [args.width] * 3 + [64], seed=0), bucket_cap_mb=1)
    preset, overrides = MODES[name]
    state = fastddp.CompressState.from_preset(preset, **overrides)
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


def _rank(rank, world, args):
    results = {}
    for name in args.modes:
        records = _mode(name, args, rank)
        results[name] = {"records": records, "problems": _growth(records, args.rss_slack_mb)}
        if rank == 0:
            print(f"{name}: " + "  ".join(
                f"[{r['step']}] {r['rss_mb']:.0f} MB, {r['allocations']} alloc, "
                f"{r['fds']} fds, {r['threads']} threads" for r in records
            ), flush=True)  # fmt: skip
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=200)
    p.add_argument("--width", type=int, default=1024, help="hidden width (the demo's: 1024)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--rss-slack-mb", type=float, default=32.0)
    p.add_argument("--json")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    if args.every < 1 or args.steps < 2 * args.every:
        p.error("--steps must cover at least two records of --every steps")
    ranks = spawn_ranks(_rank, 2, args)
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
