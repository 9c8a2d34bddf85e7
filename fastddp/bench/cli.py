"""Benchmarks of fastddp's reductions against plain all-reduce and PyTorch's own hooks."""

import argparse
import os
import shlex
import sys

from fastddp.bench import (
    allreduce,
    cells,
    convergence,
    ddp,
    fsdp,
    hook_cost,
    options,
    peers,
    report,
)
from fastddp.bench.common import add_common_options, count, pretend_nodes, run_everywhere


def _decoder_options(p, width, layers, batch, width_help=None, later=False):
    # The size of the decoder-only transformer (fastddp.bench.models.Decoder) and the batch.
    # later: ddp's, whose options.check refuses them for the mlp and then fills them in.
    width_help = width_help or f"model width (default {width})"
    p.add_argument("--width", type=int, default=width, help=width_help)
    only = "transformer: " if later else ""
    p.add_argument(
        "--layers",
        type=int,
        default=None if later else layers,
        help=f"{only}decoder blocks (default {layers})",
    )
    p.add_argument(
        "--heads", type=int, default=None if later else 8, help=f"{only}attention heads (default 8)"
    )
    p.add_argument("--seq", type=int, default=None if later else 64,
                   help=f"{only}tokens per sequence (default 64)")  # fmt: skip
    p.add_argument(
        "--batch", type=int, default=batch, help=f"batch per rank and step (default {batch})"
    )


def _pretend_option(p):
    nodes = "split the spawned ranks into N nodes by FASTDDP_NODE_ID (not with --link)"
    p.add_argument("--pretend-nodes", type=int, default=0, metavar="N", help=nodes)


def _steps_options(p, steps, warmup):
    p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps})")
    p.add_argument(
        "--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})"
    )


def _parser():
    p = argparse.ArgumentParser(prog="python -m fastddp.bench", description=__doc__)
    names = "{allreduce,ddp,fsdp,convergence,hook-cost}"  # (the message of none given)
    sub = p.add_subparsers(dest="what", required=True, metavar=names)

    p.commands = {}  # each subcommand's parser, for refusals that name its options

    def command(name, module, help):
        p.commands[name] = sub.add_parser(
            name,
            help=help,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        return p.commands[name]

    a = command("allreduce", allreduce, "all-reduce sweep over message sizes, per mode")
    a.add_argument(
        "--min-size",
        default="64K",
        help="smallest fp32 message, in bytes rounded down to whole floats (default 64K)",
    )
    a.add_argument("--max-size", default="256M", help="largest fp32 message (default 256M)")
    a.add_argument("--factor", type=int, default=4, help="size step factor (default 4)")
    a.add_argument("--modes", nargs="+", default=allreduce.MODES, choices=allreduce.CHOICES,
                   help=f"default: {' '.join(allreduce.MODES)}")  # fmt: skip
    a.add_argument("--min-seconds", type=float, default=1.0,
                   help="seconds timed per size and mode, at least (default 1.0)")  # fmt: skip
    a.add_argument("--max-iters", type=int, default=100,
                   help="timed calls per size and mode, at most (default 100)")  # fmt: skip
    _pretend_option(a)
    add_common_options(a, plot=True, topologies=True)
    d = command("ddp", ddp, "DDP step time per hook")
    d.add_argument(
        "--model",
        choices=["mlp", "transformer"],
        default="mlp",
        help="square linear layers (default) or a decoder-only transformer",
    )
    d.add_argument("--params", type=count, help="mlp: parameters (default 25M)")
    width = "layer width (mlp default: 2048 for large models, else fitted; transformer: 512)"
    _decoder_options(d, width=None, layers=8, batch=16, width_help=width, later=True)
    d.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=25.0,
        help="DDP's bucket size in MiB (default 25; PowerSGD on Gloo: one bucket, see "
        "bench/ddp.py)",
    )
    _steps_options(d, steps=30, warmup=5)
    d.add_argument("--modes", nargs="+", default=ddp.MODES, choices=ddp.CHOICES,
                   help=f"default: {' '.join(ddp.MODES)}")  # fmt: skip
    _pretend_option(d)
    add_common_options(d, topologies=True)
    f = command("fsdp", fsdp, "FSDP2 step time per gradient reduction")
    _decoder_options(f, width=512, layers=8, batch=4)
    f.add_argument(
        "--param-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="MixedPrecisionPolicy.param_dtype (all-gathers and compute; default fp32)",
    )
    _steps_options(f, steps=20, warmup=3)
    f.add_argument("--lr", type=float, default=1e-3, help="AdamW's learning rate (default 1e-3)")
    f.add_argument("--modes", nargs="+", default=fsdp.MODES, choices=fsdp.MODES)
    add_common_options(f)
    c = command(
        "convergence", convergence, "time to a target validation loss per method (transformer)"
    )
    _decoder_options(c, width=256, layers=4, batch=8)
    c.add_argument("--steps", type=int, default=300,
                   help="fp32's steps, which set the target (default 300)")  # fmt: skip
    c.add_argument("--eval-every", type=int, default=25,
                   help="steps between validations (default 25)")  # fmt: skip
    c.add_argument("--val-batches", type=int, default=4,
                   help="batches a validation averages (default 4)")  # fmt: skip
    c.add_argument("--lr", type=float, default=3e-3, help="AdamW's learning rate (default 3e-3)")
    c.add_argument("--slack", type=float, default=0.01,
                   help="target = fp32's loss x (1 + slack) (default 0.01)")  # fmt: skip
    c.add_argument("--max-factor", type=float, default=2.0,
                   help="give up after this x --steps (default 2)")  # fmt: skip
    c.add_argument("--seed", type=int, default=0, help="weights' and batches' seed (default 0)")
    c.add_argument("--bucket-cap-mb", type=float, default=25.0, help="as for ddp")
    modes = f"the ddp benchmark's modes, or {', '.join(peers.PATTERNS)}"
    c.add_argument("--modes", nargs="+", default=convergence.MODES, type=peers.mode_name,
                   choices=peers.Choices(ddp.CHOICES), metavar="MODE", help=modes)  # fmt: skip
    # No defaults here: options.check refuses them without a diloco mode, then fills them in.
    c.add_argument("--outer-lr", type=float, help="DiLoCo's outer lr (default 0.7)")
    c.add_argument("--outer-momentum", type=float, help="its momentum (default 0.9)")
    _pretend_option(c)
    fp32 = "fp32's loss curve from this earlier run (same model, steps, seed); here time only "
    fp32 += "--fp32-probe fp32 steps: fp32's time to target is its steps x that step time"
    c.add_argument("--fp32-from", metavar="JSON", help=fp32)
    c.add_argument("--fp32-probe", type=int, help="fp32 steps timed with --fp32-from (10)")
    add_common_options(c)
    h = command("hook-cost", hook_cost, "host time per bucket of each comm hook")
    h.add_argument("--layers", type=int, default=64, help="layers, one bucket each (default 64)")
    h.add_argument("--width", type=int, default=16, help="layer width (default 16)")
    h.add_argument("--batch", type=int, default=4, help="batch per rank and step (default 4)")
    h.add_argument("--steps", type=int, default=5, help="steps per mode and round (default 5)")
    h.add_argument("--rounds", type=int, default=7, help="rounds of turns (default 7)")
    h.add_argument("--modes", nargs="+", default=hook_cost.MODES, choices=hook_cost.CHOICES)
    add_common_options(h, nproc=1)
    return p


def _allreduce_job(env, args):
    progress = None
    bar = None
    if env.rank == 0:
        try:
            from rich.progress import Progress
        except ImportError:
            Progress = None
        if Progress is not None:
            bar = Progress(transient=True)
            bar.start()
            total = len(args.modes) * len(allreduce.message_sizes(args))
            task = bar.add_task("all-reduce sweep", total=total)
            progress = lambda: bar.advance(task)  # noqa: E731
    try:
        _, rows = allreduce.sweep(env, args, progress)
    finally:
        if bar is not None:
            bar.stop()
    if env.rank != 0:
        return rows
    nodes = pretend_nodes(env, args)
    title = f"all-reduce, {env.world_size} ranks, {env.backend} on {env.device.type}" + (
        f", {nodes} nodes" if nodes > 1 else ""
    )
    cols = [
        "size",
        "count",
        "mode",
        "type",
        "time (us)",
        "algbw (GB/s)",
        "wire busbw (GB/s)",
        "payload (B)",
        "cross-node (B, all ranks)",
        "rel err",
        "#wrong",
    ]
    cells = [
        [
            r["size_h"],
            str(r["count"]),
            r["mode"],
            r["type"],
            f"{r['time_us']:.1f}",
            f"{r['algbw_gbs']:.3f}",
            f"{r['busbw_gbs']:.3f}",
            str(r["payload_bytes"]),
            str(r["cross_node_bytes"]),
            "-" if r["rel_err"] is None else f"{r['rel_err']:.2e}",
            "-" if r["wrong"] is None else str(r["wrong"]),
        ]
        for r in rows
    ]
    report.table(title, cols, cells)
    if args.json:
        meta = report.record(args, env, nodes)
        report.write_json(args.json, {"benchmark": "allreduce", **meta, "rows": rows})
    if args.plot:
        report.plot_allreduce(args.plot, rows, title)
    return rows


# The step benchmarks: what runs, the start of the table's title (the ranks and the steps
# follow), its columns, and a row's cells.
_STEP_TABLES = {
    "ddp": (
        ddp.run,
        lambda args, rows: f"DDP step, {args.model} of {cells.millions(rows)}",
        ["mode", "p50 (ms)", "p90 (ms)", "vs fp32", "exposed comm", "payload/step",
         "cross-node/step", "CPU/step"],
        cells.ddp,
    ),
    "fsdp": (
        fsdp.run,
        lambda args, rows: (
            f"FSDP2 step, decoder {cells.millions(rows)} (width {args.width}, {args.layers} "
            f"blocks, param dtype {args.param_dtype})"
        ),
        ["mode", "p50 (ms)", "p90 (ms)", "vs fp32", "vs hsdp", "sent/step", "gathers/step",
         "link/step", "grad err", "loss"],
        cells.fsdp,
    ),
    "convergence": (
        convergence.run,
        lambda args, rows: (
            f"Time to fp32's validation loss after {args.steps} steps (+{100 * args.slack:g} %): "
            f"{rows[0]['target']:.3f}, transformer of {cells.millions(rows)}"
        ),
        ["mode", "steps to target", "time to target", "vs fp32", "final val loss", "wire/rank",
         "across nodes/rank"],  # fmt: skip
        cells.convergence,
    ),
    "hook-cost": (
        hook_cost.run,
        lambda args, rows: (
            f"Host time per bucket, {rows[0]['buckets']} buckets of Linear({args.width}, "
            f"{args.width}), {args.rounds} rounds of {args.steps} steps"
        ),
        ["mode", "step (us)", "per bucket (us)", "vs torch-fp16"],
        cells.hook_cost,
    ),
}  # fmt: skip


def _step_job(env, args):
    run, head, columns, cells_of = _STEP_TABLES[args.what]
    rows = run(env, args)
    if env.rank != 0:
        return rows
    nodes = pretend_nodes(env, args)
    shape = f"{cells.plural(nodes, 'node')} x {cells.plural(env.world_size // nodes, 'rank')}"
    title = f"{head(args, rows)}, {shape}, {env.backend}"
    if args.what in ("ddp", "fsdp"):  # convergence runs to a target, hook-cost in rounds
        title += f", {args.steps} steps after {args.warmup} warm-up"
    report.table(title, columns, [cells_of(r) for r in rows])
    if args.json:  # what ran where, then the table's rows
        meta = report.record(args, env, nodes)
        extra = {"model": args.model} if args.what == "ddp" else {}
        report.write_json(args.json, {"benchmark": args.what, **meta, **extra, "rows": rows})
    return rows


_JOBS = {"allreduce": _allreduce_job, **dict.fromkeys(_STEP_TABLES, _step_job)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _parser()
    args, unknown = p.parse_known_args(argv)
    # Refusals print the subcommand's usage, whose options they name (an option another
    # benchmark takes, too: the top level's usage would list none).
    if unknown:
        p.commands[args.what].error(f"unrecognized arguments: {' '.join(unknown)}")
    options.check(p.commands[args.what], args)
    # The command as typed (a --link run's nodes get it from their caller), for --json.
    typed = "python -m fastddp.bench " + shlex.join(argv)
    args.command = os.environ.get("FASTDDP_BENCH_COMMAND") or typed
    job = _JOBS[args.what]
    result = run_everywhere(job, args, argv)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
