"""Train a small GPT-style character model with DDP and fastddp's hook, under any launcher.

    python -m fastddp.launch --standalone --nproc-per-node 2 examples/gpt_train.py --preset auto
    python -m fastddp.netns --nodes 2 --rate 1gbit examples/gpt_train.py --preset auto   # (root)

The model is a decoder-only transformer (causal self-attention and MLP blocks); the text is
Python's own ``argparse`` module source, as printable-ASCII characters, each rank reading its
own windows. ``--preset`` is one of ``fastddp.PRESETS``, ``auto`` (fastddp measures the modes
on this job and keeps the fastest) or ``none`` (plain DDP). Rank 0 prints the loss, then the
median step time over the last half of the steps (with ``auto``, only those after its plan)
and, with ``auto``, what it chose; ``--json`` also writes them (``chose`` is null while
nothing is planned), with ``auto``'s whole plan, every step's time and the median forward,
backward and optimizer times.
"""

import argparse
import json
import os
import statistics
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench.models import Decoder


def corpus() -> torch.Tensor:
    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()
    return torch.tensor([min(max(ord(c), 32), 127) - 32 for c in text], dtype=torch.long)


def _mode(name: str) -> str:
    """One of auto's candidates: "none", or a preset with a path or not ("int8-ef:flat")."""
    mode, colon, path = name.partition(":")
    if (
        mode not in ("none", *fastddp.PRESETS)
        or colon
        and (mode == "none" or path not in ("flat", "hierarchical"))
    ):
        raise argparse.ArgumentTypeError(
            f"{name!r} is no mode; name none or a preset ({', '.join(fastddp.PRESETS)}), a "
            "preset perhaps with a path (int8-ef:flat, int8-ef:hierarchical)"
        )
    return name


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="auto", choices=["none", "auto", *fastddp.PRESETS])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--allow", nargs="+", type=_mode, help="auto's candidates (default: fastddp's)")
    p.add_argument("--json", help="rank 0 writes the summary here")
    args = p.parse_args()
    if args.steps < 1:
        p.error("--steps must be at least 1")
    problem = Decoder.options_problem(args.width, args.layers, args.seq, args.batch)
    if problem:
        p.error(problem)
    if args.allow is not None and len(set(args.allow)) != len(args.allow):
        p.error(f"--allow names one twice: {' '.join(args.allow)}")
    if args.allow is not None and args.preset != "auto":
        p.error(f"--allow names auto's candidates; with --preset {args.preset} it has none")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        p.error(f"--json {args.json}: its folder does not exist; make it first")
    if args.json and os.path.isdir(args.json):
        p.error(f"--json {args.json} is a folder; name a file in it")

    with fastddp.distributed_session() as env:
        torch.manual_seed(0)  # the same initial model on every rank
        model = Decoder(width=args.width, layers=args.layers).to(env.device)
        model = DDP(model, device_ids=[env.device.index] if env.device.type == "cuda" else None)
        state = None
        if args.preset != "none":
            if args.preset == "auto":
                state = fastddp.CompressState(dtype="auto", allow=args.allow)
            else:
                state = fastddp.CompressState.from_preset(args.preset)
            fastddp.register_comm_hook(model, state)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

        data = corpus()
        gen = torch.Generator().manual_seed(1 + env.rank)  # each rank its own windows
        times, phases = [], []  # per step: its time; forward, backward, optimizer (host clock)
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            at = torch.randint(0, len(data) - args.seq - 1, (args.batch, 1), generator=gen)
            windows = data[at + torch.arange(args.seq + 1)].to(env.device)
            loss = Decoder.loss(model(windows[:, :-1]), windows[:, 1:])
            forward = time.perf_counter()
            opt.zero_grad()
            loss.backward()
            backward = time.perf_counter()
            opt.step()
            loss = loss.item()  # waits for the step, on GPU too
            end = time.perf_counter()
            times.append(end - start)
            phases.append((forward - start, backward - forward, end - backward))
            if env.is_main and (step % 20 == 0 or step == args.steps):
                print(f"step {step:4d}  loss {loss:.3f}", flush=True)
        first = len(times) // 2  # the steps timed: the last half, and none of auto's trial
        chose = plan = None
        if args.preset == "auto":
            plan = state.stats()["plan"]
            if plan and plan["trial"]:  # a mixed plan still being tried: none kept yet
                plan = None
            chose = plan["summary"] if plan else None
            if plan:  # (made in the step of that index, which closed the trial)
                first = max(first, min(plan["made_at_step"] + 1, len(times) - 1))
        timed = times[first:]
        if env.is_main:
            ms = statistics.median(timed) * 1e3
            choice = f", chose {chose}" if chose else ""
            if args.preset == "auto" and not plan:
                choice = ", chose nothing yet (the trial needs more --steps)"
            print(
                f"{args.preset}: {env.world_size} rank(s), median step {ms:.1f} ms over the last "
                f"{len(timed)} steps, final loss {loss:.3f}{choice}",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    summary = {"preset": args.preset, "world_size": env.world_size, "chose": chose}
                    summary.update(median_step_ms=ms, final_loss=loss, plan=plan)
                    summary["steps_ms"] = [t * 1e3 for t in times]
                    # Where the time goes, over the same steps (on GPU, forward and backward
                    # are mostly launch time; the wait lands in the optimizer's share).
                    late = phases[first:]
                    summary["phase_ms"] = {
                        name: statistics.median(p[i] for p in late) * 1e3
                        for i, name in enumerate(("forward", "backward", "optimizer"))
                    }
                    json.dump(summary, f)


if __name__ == "__main__":
    main()
    fastddp.distributed.exit_after_shutdown()
