"""Accuracy of the compressed all-reduce against an fp64 sum, at 2, 4 and 8 CPU ranks.

With ``--nodes N`` the ranks of each world are split into N nodes (``FASTDDP_NODE_ID``; the
links do not matter for accuracy) and every mode runs twice: flat, and with
``topology="hierarchical"`` (rows marked ``[2-level]``: fp32 inside the node, the codec
across nodes).

Each rank holds a gradient-like vector: 64 "layers" whose magnitudes span four decades, each
the sum of a component shared by all ranks and a per-rank one. Every preset of
:data:`fastddp.PRESETS` (a row per name) averages it with ``fastddp.all_reduce`` over Gloo; the
error is the relative L2 distance to the fp64 average. The presets with error feedback
(``-ef``) average the same gradient over 32 steps with one state, which shows what error
feedback buys over time (the single-step error of a rounding cannot go below one rounding of
the result). FSDP2's reduce-scatter rows are named as in ``python -m fastddp.bench fsdp``.

    python benchmarks/accuracy.py --json benchmarks/results/accuracy.json \\
        --plot benchmarks/results/accuracy.png
    python benchmarks/accuracy.py --worlds 8 --nodes 4   # 4 nodes x 2 ranks, flat and 2-level
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import fastddp
from fastddp.bench import options, report
from fastddp.bench.fsdp import WIRES as FSDP_WIRES
from fastddp.testing.spawn import spawn_ranks

# One step per preset without error feedback; the presets with it, over STEPS steps.
MODES = [name for name, settings in fastddp.PRESETS.items() if not settings.get("error_feedback")]
EF_MODES = [name for name, settings in fastddp.PRESETS.items() if settings.get("error_feedback")]
LAYERS, WIDTH, STEPS = 64, 16384, 32
# torch 2.13 renamed reduce_scatter_tensor (now deprecated); older releases have only that.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gradient(rank: int, trial: int) -> torch.Tensor:
    shared = torch.Generator().manual_seed(1000 + trial)
    own = torch.Generator().manual_seed(10_000 * (trial + 1) + rank)
    scales = 10 ** (torch.rand(LAYERS, 1, generator=shared) * 4 - 4)  # 1e-4 .. 1
    common = torch.randn(LAYERS, WIDTH, generator=shared)
    noise = torch.randn(LAYERS, WIDTH, generator=own)
    return ((common + noise) * scales).reshape(-1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def _states(modes, nodes):
    """``(label, state)``: a new state of each preset flat, and with several nodes two-level."""
    for name in modes:
        yield name, fastddp.CompressState.from_preset(name, topology="flat")
        if nodes > 1:
            two_level = fastddp.CompressState.from_preset(name, topology="hierarchical")
            yield f"{name} [2-level]", two_level


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
    for mode, wire in FSDP_WIRES.items():
        ours = torch.empty(chunk)
        CompressedReduceScatter(wire)(ours, g, dist.group.WORLD, dist.ReduceOp.AVG)
        outs[f"FSDP2 reduce-scatter, {mode}"] = ours
    errors = {}
    for name, out in outs.items():
        sums = torch.tensor([(out.double() - mine).square().sum(), mine.square().sum()])
        dist.all_reduce(sums)
        errors[name] = (sums[0] / sums[1]).sqrt().item()
    return errors


def _rank(rank, world, trials, nodes):
    os.environ["FASTDDP_NODE_ID"] = f"node-{rank * nodes // world}"
    results = {}
    for trial in range(trials):
        g = gradient(rank, trial)
        parts = [torch.empty_like(g) for _ in range(world)]
        dist.all_gather(parts, g)
        want = torch.stack(parts).double().mean(0)
        for name, state in _states(MODES, nodes):
            buf = g.clone()
            fastddp.all_reduce(buf, state=state)
            results.setdefault(name, []).append(rel_err(buf, want))
        for name, err in _fsdp_errors(g, want, rank, world).items():
            results.setdefault(name, []).append(err)
        for name, state in _states(EF_MODES, nodes):
            total = torch.zeros_like(g, dtype=torch.float64)
            for _ in range(STEPS):
                buf = g.clone()
                fastddp.all_reduce(buf, state=state)
                total += buf
            results.setdefault(f"{name}, mean of {STEPS} steps", []).append(
                rel_err(total / STEPS, want)
            )
            if trial == 0 and name == "int8-ef":
                s = state.stats()
                results["int8 wire bytes / fp32"] = [s["wire_bytes"] / s["fp32_wire_bytes"]]
    return {k: sum(v) / len(v) for k, v in results.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--nodes", type=int, default=1, help="nodes per world (must divide it)")
    p.add_argument("--json")
    p.add_argument("--plot")
    args = p.parse_args(argv)
    options.check_outputs(p, args)  # before the runs, not after
    if args.trials < 1 or min(args.worlds) < 1:
        p.error("--trials and every --worlds must be at least 1")
    for world in args.worlds:
        if args.nodes < 1 or world % args.nodes:
            p.error(f"--nodes {args.nodes} does not divide a world of {world} ranks")
    # Every rank measures the same errors (of the same averages): rank 0's are the table's.
    table = {w: spawn_ranks(_rank, w, args.trials, args.nodes)[0] for w in args.worlds}
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
        title, x, y = "fastddp.all_reduce accuracy", "ranks (Gloo, CPU)", "relative L2 error"
        with report.figure(args.plot, title, x, f"{y} vs fp64 average", legend_size=7) as ax:
            for name in names:
                if "wire bytes" in name:
                    continue
                errs = [table[w][name] for w in args.worlds]
                ax.plot(args.worlds, errs, marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(args.worlds, [str(w) for w in args.worlds])
    return table


if __name__ == "__main__":
    sys.exit(main() and 0)
