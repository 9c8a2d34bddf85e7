"""Convergence with compressed gradients: a small model trained by DDP on 2 CPU ranks.

A student MLP learns a fixed random teacher MLP (regression, MSE) for a few hundred Adam steps;
each rank draws its own batches from one seed, so every mode sees the same data. Modes: plain
fp32 DDP, and fastddp's hook with bf16, bf16 summed in fp32, and int8 with and without error
feedback. The final loss is the mean over the last 20 steps, and the evaluation loss is on a
held-out set after training.

    python benchmarks/convergence.py --json benchmarks/convergence.json \\
        --plot benchmarks/convergence.png
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
    "fp32 (no hook)": None,
    "bf16": {"dtype": torch.bfloat16},
    "bf16, fp32 sum": {"dtype": torch.bfloat16, "accumulate_dtype": torch.float32},
    "int8": {"dtype": torch.int8},
    "int8 + EF": {"dtype": torch.int8, "error_feedback": True},
    # Coarse blocks: one scale per 16384 elements, so small gradients next to large ones round
    # to zero; this is where error feedback has something to recover.
    "int8 b16384": {"dtype": torch.int8, "block_size": 16384},
    "int8 b16384 + EF": {"dtype": torch.int8, "block_size": 16384, "error_feedback": True},
}
IN, HIDDEN, OUT = 32, 256, 16


def _net(seed):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(IN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, OUT),
    )


def _rank(rank, world, init, args, out):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    teacher = _net(1)
    with torch.no_grad():  # a teacher with outputs of order 1, so there is much to learn
        for p in teacher.parameters():
            p.mul_(2.0)
            p.requires_grad_(False)
    held_out = torch.randn(4096, IN, generator=torch.Generator().manual_seed(99))
    results = {}
    for name, settings in MODES.items():
        model = DDP(_net(2))
        state = None
        if settings is not None:
            state = fastddp.CompressState(**settings)
            model.register_comm_hook(state, fastddp.compress_hook)
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
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    exit_after_shutdown()


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
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        init = f"file://{os.path.join(tmp, 'store')}"
        mp.start_processes(_rank, args=(2, init, args, out), nprocs=2, start_method="spawn")
        with open(out) as f:
            results = json.load(f)
    base = results["fp32 (no hook)"]
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
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, r in results.items():
            smooth = torch.tensor(r["losses"]).unfold(0, 10, 1).mean(1)
            ax.plot(range(10, len(r["losses"]) + 1), smooth, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (10-step mean)")
        ax.set_title("DDP on 2 CPU ranks: convergence per gradient compression")
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return results


if __name__ == "__main__":
    sys.exit(main() and 0)
