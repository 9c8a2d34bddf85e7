"""``python -m fastddp.bench``'s options checked before any rank starts or any sweep runs, so
that a typo or an output that cannot be written costs seconds, not a sweep."""

import importlib.util
import json
import os

import torch

from fastddp.bench.common import parse_size

__all__ = ["check", "check_outputs"]


def check_outputs(p, args):
    """Refuse outputs that could not be written, before the sweep rather than after it."""
    for option in ("json", "plot"):
        path = getattr(args, option, None)
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(folder):
                p.error(f"--{option} {path}: the folder {folder} does not exist; make it first")
            if os.path.isdir(path):
                p.error(f"--{option} {path} is a folder; name a file in it")
            if not os.access(folder, os.W_OK):
                p.error(f"--{option} {path}: the folder {folder} is not writable")
    if getattr(args, "plot", None) and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib (pip install matplotlib)")


def _check_fp32_from(p, path):
    """The earlier run must hold an fp32 row (what ``--json`` of a run with fp32 wrote)."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
        if not any(r["mode"] == "fp32" and "curve" in r for r in rows):
            raise KeyError("fp32")
    except OSError as e:
        p.error(f"--fp32-from {path}: {e.strerror}")
    except (ValueError, KeyError, TypeError):
        p.error(
            f"--fp32-from {path}: not the --json of a convergence run with an fp32 row; run "
            "one with fp32 in --modes and --json first"
        )


def check(p, args):
    """Refuse bad options with ``p.error`` (exit 2) before any rank starts."""
    check_outputs(p, args)
    if args.what == "allreduce":
        if "fp32" not in args.modes and args.plot:
            p.error("--plot compares against fp32: keep fp32 in --modes")
        if args.factor < 2:
            p.error("--factor must be at least 2")
        for option in ("min_size", "max_size"):
            try:
                if parse_size(getattr(args, option)) < 4:
                    raise ValueError
            except ValueError:
                p.error(
                    f"--{option.replace('_', '-')} {getattr(args, option)}: give bytes, or a "
                    "number with K, M or G (64K, 1.5M), of at least 4 bytes"
                )
        if parse_size(args.min_size) > parse_size(args.max_size):
            p.error(f"--min-size {args.min_size} is above --max-size {args.max_size}")
    for name in (
        "nproc", "threads", "nproc_per_node", "nodes", "width", "layers", "heads", "seq",
        "steps", "eval_every", "val_batches", "batch", "rounds",
    ):  # fmt: skip
        value = getattr(args, name, None)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name, low in (("params", 1), ("max_iters", 1), ("warmup", 0), ("min_seconds", 0)):
        value = getattr(args, name, None)
        if value is not None and value < low:
            p.error(f"--{name.replace('_', '-')} must be at least {low}")
    cap = getattr(args, "bucket_cap_mb", None)
    if cap is not None and not 0 < cap < float("inf"):
        p.error("--bucket-cap-mb must be a positive, finite number of MiB")
    if args.what == "convergence":
        if args.pretend_nodes and (args.link or args.nproc % args.pretend_nodes):
            p.error("--pretend-nodes splits the spawned --nproc ranks evenly (not with --link)")
        if args.fp32_probe < 2:
            p.error("--fp32-probe must be at least 2")
        if not args.max_factor >= 1:
            p.error("--max-factor must be at least 1 (a run gets --steps at least)")
        if not args.slack >= 0:
            p.error("--slack must be at least 0 (the target is fp32's loss x (1 + slack))")
        if args.fp32_from:
            _check_fp32_from(p, args.fp32_from)
    if args.nodes is not None and not args.link and "RANK" not in os.environ:
        p.error("--nodes needs --link (the nodes are network namespaces)")
    if args.nproc_per_node != 1 and not args.link and "RANK" not in os.environ:
        p.error("--nproc-per-node needs --link (without it, --nproc ranks on this machine)")
    if args.link is not None and not args.link.strip():
        p.error("--link needs a rate (1gbit, 100mbit, ...)")
    if args.plot and args.what != "allreduce":
        p.error(f"--plot draws the allreduce sweep; {args.what} writes --json")
    if args.what in ("fsdp", "convergence", "hook-cost") and args.topologies != ["auto"]:
        p.error(f"--topologies applies to allreduce and ddp; {args.what} runs each mode once")
    if args.what == "hook-cost" and "fp32" not in args.modes:
        p.error("hook-cost measures each hook against plain DDP: keep fp32 in --modes")
    if len(set(args.modes)) != len(args.modes):
        p.error(f"--modes names a mode twice: {' '.join(args.modes)}")
    transformer = (
        args.what in ("fsdp", "convergence") or getattr(args, "model", "") == "transformer"
    )
    if transformer:
        if (args.width or 512) % args.heads:
            p.error(f"--width {args.width or 512} must be a multiple of --heads {args.heads}")
        if args.seq > 1024:
            p.error("--seq must be at most 1024 (the model's positions)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA device is visible")
