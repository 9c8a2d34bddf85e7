"""Benchmarks of fastddp's reductions against plain all-reduce and PyTorch's own hooks."""

import argparse
import os
import shlex
import sys

from fastddp.bench import allreduce, convergence, ddp, fsdp, hook_cost, options, peers, report
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
    a.add_argument("--min-size", default="64K", help="smallest fp32 message (default 64K)")
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
    c.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo's outer lr (default 0.7)")
    c.add_argument("--outer-momentum", type=float, default=0.9, help="its momentum (default 0.9)")
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
            str(r["wire_bytes"]),
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


def _vs_fp32(r):
    return "-" if r["vs_fp32"] is None else f"{r['vs_fp32']:.2f}x"


def _times(r):
    # The step time columns of the step benchmarks: p50, p90 and the ratio to fp32's p50.
    return [f"{r['p50_ms']:.1f}", f"{r['p90_ms']:.1f}", _vs_fp32(r)]


def _bytes(n):
    """Bytes in MB, or in kB below 0.1 MB (a small model's are not "0.0 MB")."""
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _count(n, what):
    return f"{n} {what}{'' if n == 1 else 's'}"


def _ddp_cells(r):
    exposed = "-" if r["exposed_comm"] is None else f"{100 * r['exposed_comm']:.0f} %"
    return [
        r["mode"] if not r.get("chose") else f"{r['mode']} ({r['chose']})",
        *_times(r),
        exposed,
        _bytes(r["payload_bytes"]),
        _bytes(r["cross_node_bytes"]),
        f"{r['cpu_s_per_step']:.2f} s",
    ]


def _fsdp_cells(r):
    err = "-" if r["grad_rel_err"] is None else f"{r['grad_rel_err']:.2e}"
    vs_hsdp = "-" if r["vs_hsdp"] is None else f"{r['vs_hsdp']:.2f}x"
    link = r["link_bytes_per_step"]
    link = "-" if link is None else _bytes(link)
    sent = [_bytes(r[k]) for k in ("rs_sent_bytes", "ag_sent_bytes")]
    cells = [r["mode"], *_times(r), vs_hsdp, *sent, link, err]
    return [*cells, f"{r['loss']:.4f}"]


def _convergence_cells(r):
    return [
        r["mode"] if not r.get("chose") else f"{r['mode']} ({r['chose']})",
        str(r["steps_to_target"]) if r["reached"] else f"not in {r['steps']}",
        f"{r['seconds_to_target']:.1f} s" if r["reached"] else "-",
        _vs_fp32(r),
        f"{r['final_val_loss']:.3f}",
        _bytes(r["sent_mb"] * 1e6),
    ]


def _hook_cost_cells(r):
    per = "-" if r["per_bucket_us"] is None else f"{r['per_bucket_us']:.1f}"
    vs = "-" if r["vs_torch_fp16"] is None else f"{r['vs_torch_fp16']:.2f}x"
    return [r["mode"], f"{r['step_us']:.0f}", per, vs]


def _millions(rows):
    n = rows[0]["params"]
    # Small models (tests, --params 10) read as counts, not as "0.0M".
    return f"{n / 1e6:.1f}M parameters" if n >= 100_000 else f"{n:,} parameters"


# The step benchmarks: what runs, the start of the table's title (the ranks and the steps
# follow), its columns, and a row's cells.
_STEP_TABLES = {
    "ddp": (
        ddp.run,
        lambda args, rows: f"DDP step, {args.model} of {_millions(rows)}",
        ["mode", "p50 (ms)", "p90 (ms)", "vs fp32", "exposed comm", "payload/step",
         "cross-node/step", "CPU/step"],
        _ddp_cells,
    ),
    "fsdp": (
        fsdp.run,
        lambda args, rows: (
            f"FSDP2 step, decoder {_millions(rows)} (width {args.width}, {args.layers} blocks, "
            f"param dtype {args.param_dtype})"
        ),
        ["mode", "p50 (ms)", "p90 (ms)", "vs fp32", "vs hsdp", "sent/step", "gathers/step",
         "link/step", "grad err", "loss"],
        _fsdp_cells,
    ),
    "convergence": (
        convergence.run,
        lambda args, rows: (
            f"Time to fp32's validation loss after {args.steps} steps (+{100 * args.slack:g} %): "
            f"{rows[0]['target']:.3f}, transformer of {_millions(rows)}"
        ),
        ["mode", "steps to target", "time to target", "vs fp32", "final val loss", "sent/rank"],
        _convergence_cells,
    ),
    "hook-cost": (
        hook_cost.run,
        lambda args, rows: (
            f"Host time per bucket, {rows[0]['buckets']} buckets of Linear({args.width}, "
            f"{args.width}), {args.rounds} rounds of {args.steps} steps"
        ),
        ["mode", "step (us)", "per bucket (us)", "vs torch-fp16"],
        _hook_cost_cells,
    ),
}  # fmt: skip


def _step_job(env, args):
    run, head, columns, cells = _STEP_TABLES[args.what]
    rows = run(env, args)
    if env.rank != 0:
        return rows
    nodes = pretend_nodes(env, args)
    shape = f"{_count(nodes, 'node')} x {_count(env.world_size // nodes, 'rank')}"
    title = f"{head(args, rows)}, {shape}, {env.backend}"
    if args.what in ("ddp", "fsdp"):  # convergence runs to a target, hook-cost in rounds
        title += f", {args.steps} steps after {args.warmup} warm-up"
    report.table(title, columns, [cells(r) for r in rows])
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
