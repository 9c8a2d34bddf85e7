"""What a Python comm hook costs against DDP's built-in fp32 all-reduce, in one job.

Five DDP copies of ``python -m fastddp.bench ddp``'s MLP take turns, ``--steps`` steps each
for ``--rounds`` rounds (the order reversed every other round): DDP with no hook (its C++
all-reduce), PyTorch's ``allreduce_hook``, ``CompressState(dtype="auto", allow=["none"])`` and
``dtype="auto"`` with its four default candidates, its choice forced to ``"none"``, registered
with ``model.register_comm_hook`` (in Python) and with ``fastddp.register_comm_hook``
(``auto-4-cpp``: the steps of a plan of ``"none"`` in C++). ``allreduce_hook`` shows what any
Python hook costs; the auto rows what ``auto`` adds to a step it runs uncompressed. Run it
under a launcher, on one machine or on namespace nodes:

    python -m fastddp.launch --standalone --nproc-per-node 4 benchmarks/hook_overhead.py
    python -m fastddp.netns --nodes 2 --nproc-per-node 2 --rate 10gbit \\
        benchmarks/hook_overhead.py --json out.json
"""

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench import options
from fastddp.bench.models import mlp
from fastddp.hooks import auto

KINDS = ["builtin", "allreduce_hook", "auto-none", "auto-4-none", "auto-4-cpp"]


def _model(kind: str, width: int, depth: int, cap: float, view: bool):
    model = DDP(mlp([width] * (depth + 1), seed=0), bucket_cap_mb=cap, gradient_as_bucket_view=view)
    state = None
    if kind == "allreduce_hook":
        model.register_comm_hook(None, allreduce_hook)
    elif kind == "auto-4-cpp":  # "none" kept, its steps in C++
        state = fastddp.register_comm_hook(model, fastddp.CompressState(dtype="auto"))
    elif kind != "builtin":
        state = fastddp.CompressState(dtype="auto", allow=["none"] if kind == "auto-none" else None)
        model.register_comm_hook(state, fastddp.compress_hook)
    return model, state


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=6, help="6 layers of 1024: 6.3M parameters")
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument(
        "--bucket-view",
        action="store_true",
        help="DDP(gradient_as_bucket_view=True): gradients live in the buckets, not copied in",
    )
    p.add_argument("--json")
    args = p.parse_args(argv)
    for name in ("rounds", "steps", "width", "depth"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    options.check_outputs(p, args)  # before the runs, not after
    with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=300)) as env:
        torch.set_num_threads(1)
        # "none" first in allow order, kept whatever the trial measures: its step inside auto
        # (no candidate dropped, no run-off of the two fastest).
        auto.PREFER, auto.ELIMINATE = float("inf"), (float("inf"),) * 2
        auto.RUNOFF_ROUNDS = 0
        models = {
            k: _model(k, args.width, args.depth, args.bucket_cap_mb, args.bucket_view)
            for k in KINDS
        }
        gen = torch.Generator().manual_seed(env.rank)
        x = torch.randn(4, args.width, generator=gen)

        def step(model) -> None:
            model.zero_grad()
            model(x).square().mean().backward()

        for model, state in models.values():  # past DDP's first steps and auto's trial
            for _ in range(5 if state is None else state.trial_steps + 5):
                step(model)
            if state is not None:
                assert state.stats()["plan"]["mode"] == "none", state.stats()["plan"]
        times = {k: [] for k in KINDS}
        for r in range(args.rounds):
            for kind in KINDS if r % 2 == 0 else KINDS[::-1]:
                model = models[kind][0]
                dist.barrier()
                for _ in range(args.steps):
                    began = time.perf_counter()
                    step(model)
                    times[kind].append(time.perf_counter() - began)
        mine = torch.tensor([statistics.median(times[k]) for k in KINDS], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
        ms = dict(zip(KINDS, (v * 1e3 for v in mine.tolist())))
        if env.rank == 0:
            for kind in KINDS:
                print(f"{kind:>15}  {ms[kind]:7.2f} ms  {ms[kind] / ms['builtin']:.3f}x")
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"args": vars(args), "world_size": env.world_size, "ms": ms}, f)


if __name__ == "__main__":
    main()
