"""Accuracy of the compressed all-reduce against an fp64 sum, at 2, 4 and 8 CPU ranks.

With ``--nodes N`` the ranks of each world are split into N nodes (``FASTDDP_NODE_ID``; the
links do not matter for accuracy) and every mode runs twice: flat, and with
``topology="hierarchical"`` (rows marked ``[2-level]``: fp32 inside the node, the codec
across nodes).

Each rank holds a gradient-like vector: 64 "layers" whose magnitudes span four decades, each
the sum of a component shared by all ranks and a per-rank one. Every mode averages it with
``fastddp.all_reduce`` over Gloo; the error is the relative L2 distance to the fp64 average.
The error-feedback rows average the same gradient over 32 steps with one state, which shows
what error feedback buys over time (the single-step error of a rounding cannot go below one
rounding of the result).

    python benchmarks/accuracy.py --json benchmarks/accuracy.json --plot benchmarks/accuracy.png
    python benchmarks/accuracy.py --worlds 8 --nodes 4   # 4 nodes x 2 ranks, flat and 2-level
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

import fastddp
from fastddp.distributed import exit_after_shutdown

ACC = {"accumulate_dtype": torch.float32}
PLAIN = {"accumulate_dtype": None}
MODES = {
    "bf16 (16-bit ring sum)": {"dtype": torch.bfloat16, **PLAIN},
    "bf16, fp32 sum": {"dtype": torch.bfloat16, **ACC},
    "fp16 (16-bit ring sum)": {"dtype": torch.float16, **PLAIN},
    "fp16, fp32 sum": {"dtype": torch.float16, **ACC},
    "int8 (block 128)": {"dtype": torch.int8},
}
EF_MODES = {
    "bf16, fp32 sum + EF": {"dtype": torch.bfloat16, "error_feedback": True, **ACC},
    "int8 + EF": {"dtype": torch.int8, "error_feedback": True},
}
LAYERS, WIDTH, STEPS = 64, 16384, 32
# torch 2.13 renamed reduce_scatter_tensor (now deprecated); older releases have only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# FSDP2's reduce-scatter, each rank's result shard against the fp64 average's shard.
FSDP_WIRES = {"bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def gradient(rank: int, trial: int) -> torch.Tensor:
    shared = torch.Generator().manual_seed(1000 + trial)
    own = torch.Generator().manual_seed(10_000 * (trial + 1) + rank)
    scales = 10 ** (torch.rand(LAYERS, 1, generator=shared) * 4 - 4)  # 1e-4 .. 1
    common = torch.randn(LAYERS, WIDTH, generator=shared)
    noise = torch.randn(LAYERS, WIDTH, generator=own)
    return ((common + noise) * scales).reshape(-1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _variants(modes, nodes):
    """Each mode flat, and with several nodes also two-level."""
    out = {}
    for name, settings in modes.items():
        out[name] = {**settings, "topology": "flat"}
        if nodes > 1:
            out[f"{name} [2-level]"] = {**settings, "topology": "hierarchical"}
    return out


def _fsdp_errors(g, want, rank, world):
    """FSDP2's reduce-scatter of ``g`` (averaging): its default in bf16 (``reduce_dtype=
    torch.bfloat16``) and fastddp's, the relative L2 error over all ranks' shards."""
    from fastddp.fsdp import CompressedReduceScatter

    chunk = g.numel() // world
    mine = want[rank * chunk : (rank + 1) * chunk]
    outs = {}
    theirs = torch.empty(chunk, dtype=torch.bfloat16)
    _reduce_scatter(theirs, g.bfloat16(), op=dist.ReduceOp.AVG)
    outs["FSDP2 reduce-scatter, torch bf16 reduce_dtype"] = theirs
    for name, wire in FSDP_WIRES.items():
        ours = torch.empty(chunk)
        CompressedReduceScatter(wire)(ours, g, dist.group.WORLD, dist.ReduceOp.AVG)
        outs[f"FSDP2 reduce-scatter, fastddp {name}"] = ours
    errors = {}
    for name, out in outs.items():
        sums = torch.tensor([(out.double() - mine).square().sum(), mine.square().sum()])
        dist.all_reduce(sums)
        errors[name] = (sums[0] / sums[1]).sqrt().item()
    return errors


def _rank(rank, world, init, trials, out, nodes):
    torch.set_num_threads(1)
    os.environ["FASTDDP_NODE_ID"] = f"node-{rank * nodes // world}"
    dist.init_process_group(
        "gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(minutes=5)
    )
    results = {}
    for trial in range(trials):
        g = gradient(rank, trial)
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        want = torch.stack(parts).double().mean(0)
        for name, settings in _variants(MODES, nodes).items():
            buf = g.clone()
            fastddp.all_reduce(buf, **settings)
            results.setdefault(name, []).append(rel_err(buf, want))
        for name, err in _fsdp_errors(g, want, rank, world).items():
            results.setdefault(name, []).append(err)
        for name, settings in _variants(EF_MODES, nodes).items():
            state = fastddp.CompressState(**settings)
            total = torch.zeros_like(g, dtype=torch.float64)
            for _ in range(STEPS):
                buf = g.clone()
                fastddp.all_reduce(buf, state=state)
                total += buf
            results.setdefault(f"{name}, mean of {STEPS} steps", []).append(
                rel_err(total / STEPS, want)
            )
            if trial == 0 and name == "int8 + EF":
                s = state.stats()
                results["int8 wire bytes / fp32"] = [s["wire_bytes"] / s["fp32_wire_bytes"]]
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({k: sum(v) / len(v) for k, v in results.items()}, f)
    exit_after_shutdown()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nodes", type=int, default=1, help="nodes per world (must divide it)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    for world in args.worlds:
        if args.nodes < 1 or world % args.nodes:
            p.error(f"--nodes {args.nodes} does not divide a world of {world} ranks")
    table = {}
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            out = os.path.join(tmp, f"{world}.json")
            init = f"file://{os.path.join(tmp, f'store{world}')}"
            mp.start_processes(
                _rank,
                args=(world, init, args.trials, out, args.nodes),
                nprocs=world,
                start_method="spawn",
            )
            with open(out) as f:
                table[world] = json.load(f)
    names = list(table[args.worlds[0]])
    head = f"{'mode':<52}" + "".join(f"{f'{w} ranks':>12}" for w in args.worlds)
    print(head)
    for name in names:
        print(f"{name:<52}" + "".join(f"{table[w][name]:>12.3e}" for w in args.worlds))
    if args.json:
        with open(args.json, "w") as f:
            meta = {"worlds": args.worlds, "nodes": args.nodes, "trials": args.trials}
            json.dump({**meta, "rel_err": table}, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name in names:
            if "wire bytes" in name:
                continue
            ax.plot(args.worlds, [table[w][name] for w in args.worlds], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(args.worlds, [str(w) for w in args.worlds])
        ax.set_xlabel("ranks (Gloo, CPU)")
        ax.set_ylabel("relative L2 error vs fp64 average")
        ax.set_title("fastddp.all_reduce accuracy")
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return table


if __name__ == "__main__":
    sys.exit(main() and 0)
