"""Train one model with plain DDP and with fastddp's hooks; print a comparison.

``python -m fastddp.demo`` (what ``make demo`` runs) shows where compression pays: it runs on two
nodes made of network namespaces joined by a ``--link`` of 1 Gbit/s, one rank each, where this
machine allows namespaces (root), through ``python -m fastddp.netns`` (``--nproc`` ranks on each
node, default 1); elsewhere, or with ``--link none``, on ``--nproc`` local ranks (default 2) over
loopback through ``python -m fastddp.launch
--standalone``, and it says so. Under any torchrun-style launcher it runs as launched. Ranks
talk over Gloo, on the CPU. Modes: plain DDP, fastddp's bf16, bf16 summed in fp32, int8 with
error feedback, and ``auto``, which measures those on the job and keeps the fastest (its row
names its choice and is timed after its plan).

A student MLP learns a fixed random teacher MLP from synthetic data. Every mode starts from
the same weights and sees the same batches, so their losses are directly comparable. Every
``--probe-every`` steps, the gradient a hook produced is compared with the exact fp32 average
at the same weights (plain DDP on a copy): the "max grad dev" column.
"""

import argparse
import copy
import os
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench import report
from fastddp.bench.common import AUTO, FASTDDP_MODES, auto_bytes, drop_option, fastddp_state
from fastddp.bench.models import mlp
from fastddp.distributed import exit_after_shutdown
from fastddp.netns import quietly, run_job, valid_rate
from fastddp.testing import netns

# Plain DDP, then fastddp's hook with presets and auto (named as in fastddp.bench).
MODES = ["fp32", "fastddp-bf16", "fastddp-bf16-acc", "fastddp-int8-ef", AUTO]


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _train(mode, args, rank, world):
    sizes = [args.inputs] + [args.width] * args.depth + [args.outputs]
    teacher = mlp(sizes, seed=1)
    model = DDP(mlp(sizes, seed=2))
    probe = DDP(copy.deepcopy(model.module))  # plain DDP at the same weights, for deviations
    state = None
    if mode in FASTDDP_MODES:
        state = fastddp_state(mode)
    elif mode == AUTO:
        state = fastddp.CompressState(dtype="auto")
    if state is not None:
        fastddp.register_comm_hook(model, state)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own shard, same per mode
    times, losses, deviation = [], [], 0.0
    for step in range(args.steps):
        x = torch.randn(args.batch, args.inputs, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.01 * torch.randn(args.batch, args.outputs, generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if state is not None and step % args.probe_every == 0:
            probe_start = time.perf_counter()
            probe.module.load_state_dict(model.module.state_dict())
            probe.zero_grad()
            nn.functional.mse_loss(probe(x), y).backward()
            exact = _grads(probe)
            dev = (_grads(model) - exact).abs().max() / exact.abs().max()
            deviation = max(deviation, dev.item())
            start += time.perf_counter() - probe_start  # the probe is not part of the step
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    numel = sum(p.numel() for p in model.parameters())
    final = torch.stack(losses[-10:]).mean()
    dist.all_reduce(final)
    first = 5 if mode != AUTO else state.trial_steps + 1  # auto: timed after its plan
    warm = times[min(first, len(times) - 1) :]
    step_ms = torch.tensor([statistics.median(warm) * 1e3])
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    label, links = mode, {}
    if state is None:
        payload = numel * 4
    elif mode == AUTO:
        s = state.stats()
        if s["plan"]:
            payload, _, chosen = auto_bytes(s, numel)
            links = s["plan"]["links"]
        else:
            payload, chosen = numel * 4, "none (no plan yet: more --steps)"
        label = f"{mode} ({chosen})"
    else:
        s = state.stats()
        payload = s["payload_bytes"] // args.steps
        assert s["nonfinite_events"] == 0, "fp16 overflowed in the demo"
    return {
        "mode": label,
        "step_ms": step_ms.item(),
        "payload_mb": payload / 1e6,
        "wire_mb": payload * 2 * (world - 1) / world / 1e6,
        "final_loss": final.item() / world,
        "max_dev": deviation if state is not None else 0.0,
        "params": numel,
        "links": links,
    }


_LEVELS = {"intra": "inside the node", "cross": "between nodes", "flat": "over every rank"}


def _print_table(rows, args, world):
    base = rows[0]["step_ms"]
    where = os.environ.get("FASTDDP_DEMO_LINK")
    where = f"2 nodes joined by a {where} link" if where else "one machine (loopback)"
    head = (
        f"{world} ranks (Gloo, CPU) on {where}, {rows[0]['params'] / 1e6:.2f}M parameters, "
        f"{args.steps} steps, batch {args.batch} per rank"
    )
    cols = [
        "mode",
        "step ms",
        "vs fp32",
        "payload MB/step",
        "sent MB/rank/step",
        "final loss",
        "max grad dev",
    ]
    cells = [
        [
            r["mode"],
            f"{r['step_ms']:.1f}",
            f"{r['step_ms'] / base:.2f}x",
            f"{r['payload_mb']:.2f}",
            f"{r['wire_mb']:.2f}",
            f"{r['final_loss']:.4e}",
            "exact" if r["max_dev"] == 0 else f"{r['max_dev']:.2e}",
        ]
        for r in rows
    ]
    report.table(head, cols, cells)
    for r in rows:
        if r["links"]:
            got = ", ".join(
                f"{_LEVELS[level]} {v['MBps']:.0f} MB/s ({v['MBps'] * 8e-3:.2f} Gbit/s)"
                for level, v in r["links"].items()
            )
            print(f"{r['mode']}: its trial's collectives got {got}")
    print(
        "payload: the all-reduce message; sent: payload x 2(n-1)/n, what a ring sends per rank.\n"
        "max grad dev: max |hook gradient - exact fp32 average| / max |exact|, same weights."
    )


def _run(rank, world, args):
    torch.set_num_threads(args.threads)
    rows = [_train(mode, args, rank, world) for mode in MODES]
    if rank == 0:
        _print_table(rows, args, world)
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fastddp.demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--nproc",
        type=int,
        help="ranks on each of the two namespace nodes (default 1), or on loopback (default 2)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps a mode (%(default)s)")
    p.add_argument("--batch", type=int, default=64, help="samples a rank a step (%(default)s)")
    p.add_argument("--width", type=int, default=1024, help="hidden layers' width (%(default)s)")
    p.add_argument("--depth", type=int, default=3, help="hidden layers (%(default)s)")
    p.add_argument("--inputs", type=int, default=256, help="input features (%(default)s)")
    p.add_argument("--outputs", type=int, default=64, help="output features (%(default)s)")
    p.add_argument("--lr", type=float, default=3e-4, help="Adam's learning rate (%(default)s)")
    p.add_argument(
        "--probe-every",
        type=int,
        default=25,
        help="steps between checks of a hook's gradient against the exact fp32 average "
        "(%(default)s)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (%(default)s)")
    p.add_argument(
        "--link",
        default="1gbit",
        help="rate of the link between two namespace nodes, in bits per second (default 1gbit); "
        "'none': local ranks on loopback",
    )
    args = p.parse_args(argv)
    for name in (
        "steps",
        "batch",
        "width",
        "depth",
        "inputs",
        "outputs",
        "probe_every",
        "threads",
    ):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.nproc is not None and args.nproc < 1:
        p.error("--nproc must be at least 1")
    if args.link != "none" and not valid_rate(args.link):
        p.error(f"--link {args.link}: give a rate in bits per second, at least 8bit (1gbit, "
                "100mbit), or none")  # fmt: skip
    if "RANK" in os.environ:  # started by a launcher
        # Gloo on CPU even where GPUs exist: this demo compares the CPU paths.
        timeout = timedelta(seconds=120)
        with fastddp.distributed_session(backend="gloo", timeout=timeout) as env:
            _run(env.rank, env.world_size, args)
        exit_after_shutdown()
    return _relaunch(args, sys.argv[1:] if argv is None else list(argv))


def _relaunch(args, argv) -> int:
    """Run the demo's ranks on two namespace nodes over ``--link``, or locally over loopback."""
    me = [sys.executable, "-m", "fastddp.netns"]
    why = "--link none" if args.link == "none" else netns.unavailable_reason()
    env = dict(os.environ)
    env.pop("FASTDDP_DEMO_LINK", None)  # set here alone, for the ranks of a run over a link
    if not why:
        cmd = [*me, "--nodes", "2", f"--rate={args.link}", "--nproc-per-node", str(args.nproc or 1)]
        env["FASTDDP_DEMO_LINK"] = args.link
    else:
        if args.link != "none":
            print(
                f"fastddp.demo: on loopback, since {why}; as root, `make demo` runs it on two "
                f"nodes joined by a {args.link} link, where compression pays",
                flush=True,
            )
        cmd = [sys.executable, "-m", "fastddp.launch", "--standalone"]
        cmd += ["--nproc-per-node", str(args.nproc or 2)]
    # The ranks' own demo runs as given, less what chose where they run (the launcher would
    # read --nproc as an abbreviation of its --nproc-per-node).
    inner = drop_option(drop_option(argv, "--nproc"), "--link")
    return run_job([*cmd, "-m", "fastddp.demo", *inner], env=env)


if __name__ == "__main__":
    sys.exit(quietly(main, "fastddp.demo"))
