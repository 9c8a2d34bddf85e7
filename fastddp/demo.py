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
``--probe-every`` steps after ``auto``'s trial, the same steps in every row, the gradient a
hook produced is compared with the exact fp32 average at the same weights (plain DDP on a
copy): the "max grad dev" column.
"""

import argparse
import copy
import os
import shlex
import signal
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
from fastddp.cluster import ClusterError
from fastddp.distributed import exit_after_shutdown
from fastddp.netns import MAX_RATE_TEXT, quietly, run_job, valid_rate
from fastddp.testing import netns

# Plain DDP, then fastddp's hook with presets and auto (named as in fastddp.bench).
MODES = ["fp32", "fastddp-bf16", "fastddp-bf16-acc", "fastddp-int8-ef", AUTO]


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _probed(step, args, first):
    """Whether ``step``'s gradient is compared with the exact average: every ``--probe-every``
    steps from ``first`` on."""
    return step >= first and (step - first) % args.probe_every == 0


def _train(mode, args, rank, world, first_probe):
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
    times, losses, deviations, trialing = [], [], {}, []
    for step in range(args.steps):
        x = torch.randn(args.batch, args.inputs, generator=gen)
        with torch.no_grad():
            y = teacher(x) + 0.01 * torch.randn(args.batch, args.outputs, generator=gen)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if state is not None and _probed(step, args, first_probe):
            probe_start = time.perf_counter()
            probe.module.load_state_dict(model.module.state_dict())
            probe.zero_grad()
            nn.functional.mse_loss(probe(x), y).backward()
            exact = _grads(probe)
            dev = (_grads(model) - exact).abs().max() / exact.abs().max()
            deviations[step] = dev.item()
            start += time.perf_counter() - probe_start  # the probe is not part of the step
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
        if mode == AUTO:
            plan = state.stats()["plan"]
            trialing.append(plan is None or plan["trial"])
    numel = sum(p.numel() for p in model.parameters())
    final = torch.stack(losses[-10:]).mean()
    dist.all_reduce(final)
    first = 5 if mode != AUTO else state.trial_steps + 1  # auto: timed after its plan
    # auto plans again where its step time drifts (a loaded machine): a re-trial's steps run
    # every candidate in turn, and the first under the new plan repays their residuals; neither
    # is the plan's step time or gradient.
    retrial = {s for s in range(first, len(trialing)) if trialing[s] or trialing[s - 1]}
    warm = [t for s, t in enumerate(times) if s >= first and s not in retrial] or times[-1:]
    step_ms = torch.tensor([statistics.median(warm) * 1e3])
    dist.all_reduce(step_ms, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
    kept = None if state is None else {s: d for s, d in deviations.items() if s not in retrial}
    dropped = [d for s, d in deviations.items() if s in retrial]
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
        "payload": payload,
        "sent": payload * 2 * (world - 1) / world,
        "final_loss": final.item() / world,
        # By step; None for plain DDP, which is the exact average.
        "deviations": kept,
        # Steps after the first plan in re-trials, all of them, and their deviations' largest.
        "retrial": (len(retrial), max(len(times) - first, 0), max(dropped, default=None)),
        "params": numel,
        "links": links,
    }


_LEVELS = {"intra": "inside the node", "cross": "between nodes", "flat": "over every rank"}
_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "KB"))


def _size_unit(largest):
    """The table's unit of size, ``(bytes, name)``: the largest in which ``largest`` (bytes) is
    at least 1, so that a small model's sizes keep their digits and every row has the same."""
    return next(((scale, name) for scale, name in _UNITS if largest >= scale), (1, "B"))


def _size(n, unit):
    scale, name = unit
    return f"{n / scale:.0f}" if name == "B" else f"{n / scale:.2f}"


def _max_dev(row):
    devs = row["deviations"]
    if devs is None:
        return "exact"
    return f"{max(devs.values()):.2e}" if devs else "n/a"


def _print_table(rows, args, world, first_probe):
    base = rows[0]["step_ms"]
    where = os.environ.get("FASTDDP_DEMO_LINK")
    where = f"2 nodes joined by a {where} link" if where else "one machine (loopback)"
    n = rows[0]["params"]
    params = f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"  # (a small model's: not "0.00M")
    head = (
        f"{world} ranks (Gloo, CPU) on {where}, {params} parameters, {args.steps} steps, "
        f"batch {args.batch} per rank"
    )
    unit = _size_unit(max(r["payload"] for r in rows))
    cols = [
        "mode",
        "step ms",
        "vs fp32",
        f"payload {unit[1]}/step",
        f"sent {unit[1]}/rank/step",
        "final loss",
        "max grad dev",
    ]
    cells = [
        [
            r["mode"],
            f"{r['step_ms']:.1f}",
            f"{r['step_ms'] / base:.2f}x",
            _size(r["payload"], unit),
            _size(r["sent"], unit),
            f"{r['final_loss']:.4e}",
            _max_dev(r),
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
        retried, after, dev = r["retrial"]
        if retried:
            there = "" if dev is None else f"; their gradients deviated up to {dev:.2e}"
            print(
                f"{r['mode']}: {retried} of its {after} steps after its plan ran in re-trials "
                "(its step time moved at two checks in a row, as on a loaded machine), left "
                f"out of its step ms and max grad dev{there}"
            )
    unprobed = "" if args.steps > first_probe else "; n/a: no such step, give more --steps"
    print(
        "payload: the all-reduce message; sent: payload x 2(n-1)/n, what a ring sends per rank.\n"
        "max grad dev: max |hook gradient - exact fp32 average| / max |exact|, same weights, "
        f"every {args.probe_every} steps after the first {first_probe} (auto's trial), the same "
        f"steps in every row{unprobed}."
    )


def _run(rank, world, args):
    torch.set_num_threads(args.threads)
    # Every row's gradient is probed on the same steps, none of them in auto's trial (where it
    # runs every candidate, not its choice): from the step by which it has its plan.
    first_probe = fastddp.CompressState(dtype="auto").trial_steps + 1
    rows = [_train(mode, args, rank, world, first_probe) for mode in MODES]
    if rank == 0:
        _print_table(rows, args, world, first_probe)
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
        p.error(f"--link {args.link}: give a rate in bits per second, from 8bit to "
                f"{MAX_RATE_TEXT} (1gbit, 100mbit), or none")  # fmt: skip
    if "RANK" in os.environ:  # started by a launcher
        return _as_launched(args)
    return _relaunch(args, sys.argv[1:] if argv is None else list(argv))


def _end_rank(signum, frame):
    exit_after_shutdown(128 + signum)


def _as_launched(args) -> int:
    """Run this process as one rank of a job a launcher started."""
    # A launcher that stops its workers (Ctrl-C, or a rank failed) says so itself; a rank ends
    # at once and silently. (quietly's handler printed a line per rank, and a traceback where
    # the launcher's SIGTERM came while its SIGINT was still pending.)
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(signum) != signal.SIG_IGN:  # (nohup's SIGHUP stays ignored)
            signal.signal(signum, _end_rank)
    try:
        # Gloo on CPU even where GPUs exist: this demo compares the CPU paths.
        with fastddp.distributed_session(backend="gloo", timeout=timedelta(seconds=120)) as env:
            _run(env.rank, env.world_size, args)
    except ClusterError as error:
        print(_stray_launch(error, os.environ), file=sys.stderr)
        return 2
    exit_after_shutdown()


def _stray_launch(error, env) -> str:
    """Why a launch that ``RANK`` describes cannot start, and the fix: most often a ``RANK``
    left in the shell, where the demo is meant to start its ranks itself."""
    given = " ".join(f"{k}={env[k]}" for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in env)
    return (
        f"fastddp.demo: the environment sets {given}, so the demo ran as one rank of a job "
        f"that a launcher started, and that job cannot start: {error}. To run the demo on its "
        "own (it starts its ranks itself), unset RANK: `unset RANK`, or `env -u RANK python -m "
        "fastddp.demo`; under a launcher, let the launcher set RANK, WORLD_SIZE, LOCAL_RANK, "
        "MASTER_ADDR and MASTER_PORT."
    )


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
            print(_loopback_note(why, args.link, argv, os.geteuid() == 0), flush=True)
        cmd = [sys.executable, "-m", "fastddp.launch", "--standalone"]
        cmd += ["--nproc-per-node", str(args.nproc or 2)]
    # The ranks' own demo runs as given, less what chose where they run (the launcher would
    # read --nproc as an abbreviation of its --nproc-per-node).
    inner = drop_option(drop_option(argv, "--nproc"), "--link")
    return run_job([*cmd, "-m", "fastddp.demo", *inner], env=env)


def _loopback_note(why, link, argv, root) -> str:
    """The line that says why the demo runs on loopback although ``--link`` asked for a link,
    and the command (``argv``: the user's own options) that runs it over that link."""
    command = shlex.join(["python", "-m", "fastddp.demo", *argv])
    make = f'make demo DEMO_ARGS="{shlex.join(argv)}"' if argv else "make demo"
    how = "where that is fixed" if root else "as root"
    return (
        f"fastddp.demo: on loopback, since {why}; {how}, `{command}` (`{make}`) runs it on "
        f"two nodes joined by a {link} link, where compression pays; `--link none` runs on "
        "loopback without this note"
    )


if __name__ == "__main__":
    sys.exit(quietly(main, "fastddp.demo"))
