"""Convergence with compressed gradients: a small model trained by DDP on 2 CPU ranks.

A student MLP learns a fixed random teacher MLP (regression, MSE) for a few hundred Adam steps;
each rank draws its own batches from one seed, so every mode sees the same data. Modes: plain
fp32 DDP, and fastddp's hook with the presets ``bf16``, ``bf16-acc`` (bf16 summed in fp32),
``int8`` and ``int8-ef`` (with error feedback), the int8 ones also with coarse blocks (one
scale per 16384 elements). The final loss is the mean over the last 20 steps, and the
evaluation loss is on a held-out set after training.

    python benchmarks/convergence.py --json benchmarks/results/convergence.json \\
        --plot benchmarks/results/convergence.png
"""

import argparse
import json
import sys

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.bench import options, report
from fastddp.bench.models import mlp
from fastddp.testing.spawn import spawn_ranks

# Each mode's preset and the settings it changes; None is plain DDP.
MODES = {
    "fp32": None,
    "bf16": ("bf16", {}),
    "bf16-acc": ("bf16-acc", {}),
    "int8": ("int8", {}),
    "int8-ef": ("int8-ef", {}),
    # Coarse blocks: one scale per 16384 elements, so small gradients next to large ones round
    # to zero; this is where error feedback has something to recover.
    "int8 b16384": ("int8", {"block_size": 16384}),
    "int8-ef b16384": ("int8-ef", {"block_size": 16384}),
}
IN, HIDDEN, OUT = 32, 256, 16


def _net(seed):
    return mlp([IN, HIDDEN, HIDDEN, OUT], nn.Tanh, seed=seed)


def _rank(rank, world, args):
    teacher = _net(1)
    with torch.no_grad():  # a teacher with outputs of order 1, so there is much to learn
        for p in teacher.parameters():
            p.mul_(2.0)
            p.requires_grad_(False)
    held_out = torch.randn(4096, IN, generator=torch.Generator().manual_seed(99))
    results = {}
    for name, mode in MODES.items():
        model = DDP(_net(2))
        state = None
        if mode is not None:
            preset, overrides = mode
            state = fastddp.CompressState.from_preset(preset, **overrides)
            fastddp.register_comm_hook(model, state)
        # Adam: its per-parameter normalisation gives small gradients full-size steps, so a
        # gradient that compression rounds to zero shows as a parameter that stops learning.
        opt = torch.optim.Adam(model.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(1000 + rank)
        losses = []
        for _ in range(args.steps):
            x = torch.randn(args.batch, IN, generator=gen)
            loss = nn.functional.mse_loss(model(x * args.input_scale), teacher(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        with torch.no_grad():
            guess = model.module(held_out * args.input_scale)
            evaluation = nn.functional.mse_loss(guess, teacher(held_out)).item()
        ratio = None
        if state is not None:
            s = state.stats()
            ratio = s["wire_bytes"] / s["fp32_wire_bytes"]
        results[name] = {
            "first": losses[0],
            "losses": losses,
            "eval": evaluation,
            "wire_ratio": ratio,
        }
        del model, opt
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--input-scale",
        type=float,
        default=0.01,
        help="the student sees x * this (default 0.01): its first layer's gradients are that "
        "much smaller than the rest, as with badly scaled features or rare embeddings",
    )
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    if args.steps < 20:
        p.error("--steps must be at least 20: the final loss is the mean of the last 20 steps")
    results = spawn_ranks(_rank, 2, args)[0]  # rank 0's losses
    base = results["fp32"]
    base_final = sum(base["losses"][-20:]) / 20
    print(
        f"{'mode':<20}{'final loss':>12}{'vs fp32':>10}{'eval loss':>12}{'vs fp32':>10}{'bytes':>8}"
    )
    for name, r in results.items():
        final = sum(r["losses"][-20:]) / 20
        r["final"] = final
        ratio = "1" if r["wire_ratio"] is None else f"{r['wire_ratio']:.3f}"
        print(
            f"{name:<20}{final:>12.4e}{final / base_final:>10.3f}{r['eval']:>12.4e}"
            f"{r['eval'] / base['eval']:>10.3f}{ratio:>8}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "batch": args.batch, "lr": args.lr, **results}, f)
    if args.plot:
        title = "DDP on 2 CPU ranks: convergence per gradient compression"
        with report.figure(args.plot, title, "step", "training loss (10-step mean)") as ax:
            for name, r in results.items():
                smooth = torch.tensor(r["losses"]).unfold(0, 10, 1).mean(1)
                ax.plot(range(10, len(r["losses"]) + 1), smooth, label=name)
            ax.set_yscale("log")
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
