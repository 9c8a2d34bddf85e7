"""``python -m fastddp.bench``'s options checked before any rank starts or any sweep runs, so
that a typo or an output that cannot be written costs seconds, not a sweep."""

import contextlib
import errno
import importlib.util
import json
import math
import os

import torch

from fastddp.bench.common import parse_size
from fastddp.bench.models import Decoder, mlp_width
from fastddp.bench.report import OPTIONS_ENV
from fastddp.netns import MAX_RATE_TEXT, valid_rate

__all__ = ["check", "check_outputs"]


def check_outputs(p, args):
    """Refuse outputs that could not be written, before the sweep rather than after it (the
    benchmark scripts' ``--json``, ``--plot`` and ``--markdown`` too)."""
    # An input of the run: an output of the same name would overwrite it.
    source = getattr(args, "fp32_from", None)
    seen: dict[str, str] = {} if not source else {os.path.realpath(source): "fp32-from"}
    for option in ("json", "plot", "markdown"):
        path = getattr(args, option, None)
        path = None if path is None else str(path)
        if path is not None and not path.strip():
            p.error(f"--{option} needs a file name")
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            p.error(f"--{option} {path}: the folder {folder} does not exist; make it first")
        if os.path.isdir(path):
            p.error(f"--{option} {path} is a folder; name a file in it")
        same = seen.setdefault(os.path.realpath(path), option)
        if same != option:
            p.error(f"--{option} and --{same} name the same file, {path}; name two files")
        _writable(p, option, path)
    plot = getattr(args, "plot", None)
    if plot:
        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install matplotlib)")
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        suffix = os.path.splitext(str(plot))[1].lstrip(".").lower()
        if not suffix:
            # matplotlib would add .png, and write a file none of the checks above looked at.
            p.error(f"--plot {plot}: end the name with the image's suffix ({plot}.png, say)")
        if suffix not in kinds:
            p.error(
                f"--plot {plot}: matplotlib cannot write .{suffix} files; end the name with "
                f"one of .{', .'.join(sorted(kinds))} (.png, say)"
            )


def _writable(p, option: str, path: str) -> None:
    # Opened for appending, as its writer will open it (a read-only file, or root's /proc, that
    # the folder's permissions do not show); a file made only to try is removed.
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        # The folder exists (checked above): ENOENT from one such as /proc, that makes no files.
        why = "its folder takes no new files" if e.errno == errno.ENOENT else e.strerror
        p.error(f"--{option} {path}: cannot be written ({why}); name a file elsewhere")
    if not existed:  # (every rank checks under a launcher: another may have removed it)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


# What fp32's curve depends on, besides the model's size and the ranks.
_CURVE_OPTIONS = ("width", "layers", "heads", "seq", "batch", "steps", "seed", "lr",
                  "eval_every", "val_batches")  # fmt: skip


def _world(args) -> int:
    """The ranks this run will have."""
    if "RANK" in os.environ:
        return int(os.environ.get("WORLD_SIZE", "1"))
    return (args.nodes or 2) * args.nproc_per_node if args.link else args.nproc


def _check_fp32_from(p, args):
    """The earlier run must hold an fp32 row (what ``--json`` of a run with fp32 wrote), of
    the same model, batches and ranks: its curve stands in for the one this run would draw."""
    path = args.fp32_from
    try:
        with open(path) as f:
            data = json.load(f)
        row = next(r for r in data["rows"] if r["mode"] == "fp32" and "curve" in r)
    except OSError as e:
        p.error(f"--fp32-from {path}: {e.strerror}")
    except (ValueError, KeyError, TypeError, StopIteration):
        p.error(
            f"--fp32-from {path}: not the --json of a convergence run with an fp32 row; run "
            "one with fp32 in --modes and --json first"
        )
    then = data.get("options") or {}  # recorded since the JSON carries the options
    params = _decoder_params(args.width, args.heads, args.layers)
    differ = [f"--{k.replace('_', '-')} {then[k]} (here {getattr(args, k)})"
              for k in _CURVE_OPTIONS if k in then and then[k] != getattr(args, k)]  # fmt: skip
    if "steps" not in then and row.get("steps") != args.steps:
        differ.append(f"--steps {row.get('steps')} (here {args.steps})")
    if row.get("params") != params:
        differ.append(f"a model of {row.get('params')} parameters (here {params})")
    if data.get("world_size") != _world(args):
        differ.append(f"{data.get('world_size')} ranks (here {_world(args)})")
    if differ:
        p.error(f"--fp32-from {path} ran with {', '.join(differ)}: its fp32 curve is not this "
                "run's; give the same options, or run fp32 here")  # fmt: skip


# The mlp's layers at most: more would take minutes to build and say nothing more.
MAX_MLP_LAYERS = 1024
# The transformer's size options of ``ddp``, and their defaults (None: not given).
_DECODER = {"layers": 8, "heads": 8, "seq": 64}


def _check_ddp_model(p, args):
    """Refuse the options the chosen ``--model`` does not read, then fill in the defaults."""
    given = [k for k in _DECODER if getattr(args, k) is not None]
    if args.model == "mlp" and given:
        p.error(f"--{given[0]} sizes the transformer (--model transformer); the mlp takes "
                "--params and --width")  # fmt: skip
    if args.model == "transformer" and args.params is not None:
        p.error("--params sizes the mlp; the transformer takes --width and --layers")
    # Each model's defaults, and None for the other's options, which --json records as unread.
    if args.model == "transformer":
        args.width = 512 if args.width is None else args.width
        for k, default in _DECODER.items():
            setattr(args, k, default if getattr(args, k) is None else getattr(args, k))
        return
    args.params = 25_000_000 if args.params is None else args.params
    given_width = args.width is not None
    if not given_width and args.params >= 1:  # the width it fits, which --json then records
        args.width = mlp_width(args.params)
    if args.width >= 1 and args.params >= 1:
        layers = round(args.params / (args.width * args.width + args.width))
        if layers > MAX_MLP_LAYERS:
            fix = "give a larger --width" + (", or leave it out" if given_width else "")
            p.error(f"--params {args.params} at --width {args.width} is {layers} layers (at "
                    f"most {MAX_MLP_LAYERS}): {fix}")  # fmt: skip
        if given_width and layers < 1:  # one layer at least: a model far larger than asked
            one = args.width * args.width + args.width
            p.error(f"--params {args.params} is less than half of one layer at --width "
                    f"{args.width} ({one} parameters): give a smaller --width, or leave it "
                    "out")  # fmt: skip


OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}  # DiLoCo's outer step, the paper's settings


def _check_outer(p, args, pretend: int, spawned: bool) -> None:
    """DiLoCo's outer settings, as DiLoCo checks them, and the nodes the periodic modes (DiLoCo,
    post-local SGD) average across: on one node either is DDP with extra steps."""
    periodic = [m for m in args.modes if m.startswith(("diloco-", "postlocal-"))]
    given = [f"--{n.replace('_', '-')}" for n in OUTER if getattr(args, n) is not None]
    if given and not any(m.startswith("diloco-") for m in periodic):
        p.error(f"{given[0]} sets DiLoCo's outer step, and --modes names no diloco mode: "
                "add one (diloco-<preset>-H<n>) or leave it out")  # fmt: skip
    for name, default in OUTER.items():
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if not periodic:
        return
    if not (args.outer_lr > 0 and math.isfinite(args.outer_lr)):
        p.error(f"--outer-lr must be a positive, finite number, got {args.outer_lr}")
    if not 0 <= args.outer_momentum < 1:
        p.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.link and (args.nodes or 2) < 2 or spawned and not args.link and pretend < 2:
        p.error(
            f"{periodic[0]} averages across nodes every H steps, and this run's ranks are one "
            "node, where it is plain DDP: give --pretend-nodes 2 (or --link RATE --nodes 2)"
        )


# The options that say which ranks this command starts: a launcher's ranks are its own.
_STARTS_RANKS = ("nproc", "threads", "link", "nodes", "nproc_per_node")


def check(p, args):
    """Refuse bad options with ``p.error`` (exit 2) before any rank starts."""
    if args.plot and args.what != "allreduce":  # (before its name's checks, which would pass)
        p.error(f"--plot draws the allreduce sweep; {args.what} writes --json")
    if "RANK" in os.environ and not os.environ.get(OPTIONS_ENV):  # (a --link node: its caller's)
        given = [n for n in _STARTS_RANKS if getattr(args, n) is not None]
        if given:
            p.error(f"--{given[0].replace('_', '-')} says which ranks this command starts, and "
                    "a launcher started it (RANK is set): its ranks are the launcher's; leave "
                    "the option out, or run without the launcher")  # fmt: skip
    check_outputs(p, args)
    for name, default in p.spawn_defaults.items():
        if args.link and getattr(args, name) is not None:
            p.error(f"--{name} sets the spawned ranks; with --link the nodes' launchers start "
                    "--nodes x --nproc-per-node ranks")  # fmt: skip
        setattr(args, name, default if getattr(args, name) is None else getattr(args, name))
    if args.what == "allreduce":
        if "fp32" not in args.modes and args.plot:
            p.error("--plot compares against fp32: keep fp32 in --modes")
        if args.factor < 2:
            p.error("--factor must be at least 2")
        for option in ("min_size", "max_size"):
            try:
                if parse_size(getattr(args, option)) < 4:
                    raise ValueError
            except (ValueError, OverflowError):
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
    for name in ("lr", "max_factor", "outer_lr", "min_seconds", "slack"):
        value = getattr(args, name, None)
        if value is not None and not math.isfinite(value):
            p.error(f"--{name.replace('_', '-')} must be a finite number")
    if getattr(args, "lr", 1.0) <= 0:
        p.error("--lr must be positive")
    if args.what == "ddp":
        _check_ddp_model(p, args)
    cap = getattr(args, "bucket_cap_mb", None)
    if cap is not None and not 0 < cap < float("inf"):
        p.error("--bucket-cap-mb must be a positive, finite number of MiB")
    pretend = getattr(args, "pretend_nodes", 0)
    spawned = "RANK" not in os.environ
    if pretend < 0:
        p.error("--pretend-nodes must be at least 1 (0, the default: the ranks' own nodes)")
    if pretend and (args.link or spawned and args.nproc % pretend):
        p.error("--pretend-nodes splits the spawned --nproc ranks evenly (not with --link)")
    if pretend and not spawned and _world(args) % pretend:
        p.error(f"--pretend-nodes {pretend} splits the launcher's {_world(args)} ranks "
                "unevenly; give a divisor of WORLD_SIZE")  # fmt: skip
    if args.what == "convergence":
        _check_outer(p, args, pretend, spawned)
        if args.fp32_probe is not None and not args.fp32_from:
            p.error("--fp32-probe times fp32 in place of an earlier run: it needs --fp32-from")
        args.fp32_probe = 10 if args.fp32_probe is None else args.fp32_probe
        if args.fp32_probe < 2:
            p.error("--fp32-probe must be at least 2")
        if not args.max_factor >= 1:
            p.error("--max-factor must be at least 1 (a run gets --steps at least)")
        if not args.slack >= 0:
            p.error("--slack must be at least 0 (the target is fp32's loss x (1 + slack))")
    if args.nodes is not None and not args.link and "RANK" not in os.environ:
        p.error("--nodes needs --link (the nodes are network namespaces)")
    if args.nproc_per_node is not None and not args.link and "RANK" not in os.environ:
        p.error("--nproc-per-node needs --link (without it, --nproc ranks on this machine)")
    args.nproc_per_node = 1 if args.nproc_per_node is None else args.nproc_per_node
    if args.link is not None and not args.link.strip():
        p.error("--link needs a rate (1gbit, 100mbit, ...)")
    if args.link and not valid_rate(args.link):
        p.error(
            f"--link {args.link}: give a positive rate in bits per second, from 8bit to "
            f"{MAX_RATE_TEXT} (1gbit, 100mbit)"
        )
    if args.what in ("fsdp", "convergence", "hook-cost") and args.topologies != ["auto"]:
        p.error(f"--topologies applies to allreduce and ddp; {args.what} runs each mode once")
    if args.topologies != ["auto"] and not any(m.startswith("fastddp-") for m in args.modes):
        p.error("--topologies applies to fastddp's modes, and --modes names none")
    if args.what == "hook-cost" and "fp32" not in args.modes:
        p.error("hook-cost measures each hook against plain DDP: keep fp32 in --modes")
    native = [m for m in args.modes if m.endswith("-native")]
    if native and os.environ.get("FASTDDP_NATIVE", "1") == "0":
        # Their hooks would run in Python, and their rows say the native runner.
        p.error(f"FASTDDP_NATIVE=0 turns the native runner off, which {native[0]} measures; "
                "unset it, or leave the -native modes out")  # fmt: skip
    if args.what == "convergence" and not 0 <= args.seed < 2**31:
        p.error(f"--seed {args.seed}: give a seed from 0 to 2^31 - 1")
    for name in ("modes", "topologies"):
        given = getattr(args, name)
        if len(set(given)) != len(given):
            p.error(f"--{name} names one twice: {' '.join(given)}")
    transformer = (
        args.what in ("fsdp", "convergence") or getattr(args, "model", "") == "transformer"
    )
    if transformer:
        if (args.width or 512) % args.heads:
            p.error(f"--width {args.width or 512} must be a multiple of --heads {args.heads}")
        if args.seq > 1024:
            p.error("--seq must be at most 1024 (the model's positions)")
    if args.what == "convergence" and args.fp32_from:
        _check_fp32_from(p, args)
    if spawned:  # the whole job on this machine (a launcher's nodes could judge apart)
        _check_memory(p, args)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but no CUDA device is visible")
    if args.device == "cuda" and spawned and not args.link:
        p.error(
            "--device cuda runs one rank per GPU under a launcher: python -m fastddp.launch "
            "--standalone --nproc-per-node N -m fastddp.bench ... (spawned ranks run on the CPU)"
        )


def _decoder_params(width: int, heads: int, layers: int) -> int:
    """The transformer's parameter count, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        return sum(t.numel() for t in Decoder(width=width, heads=heads, layers=layers).parameters())


def _available_bytes() -> int:
    """This machine's memory available to new processes (Linux); 0 where it cannot be read."""
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def _check_memory(p, args) -> None:
    """Refuse a size no rank could hold (64G for 64M): what each rank must hold at the least
    (the message, or the model and its gradients in fp32), times the ranks on this machine
    (every one of a spawned or ``--link`` run), against its available memory. A run that fits
    may still need more."""
    if args.what == "allreduce":
        what, per_rank = f"--max-size {args.max_size}", parse_size(args.max_size)
    elif args.what == "hook-cost":
        what = f"--width {args.width} --layers {args.layers}"
        per_rank = 2 * 4 * args.layers * (args.width + 1) * args.width  # weights, grads
    else:
        if args.what == "ddp" and args.model == "mlp":
            what, params = f"--params {args.params}", args.params
        else:
            what = f"--width {args.width or 512} --layers {args.layers}"
            params = _decoder_params(args.width or 512, args.heads, args.layers)
        shards = _world(args) if args.what == "fsdp" else 1
        per_rank = 2 * 4 * params // shards  # parameters and gradients, in fp32
    ranks = _world(args)
    need, have = per_rank * ranks, _available_bytes()
    if have and need > have:
        p.error(f"{what}: the {ranks} rank(s) on this machine would hold at least "
                f"{need / 1e9:.1f} GB, and it has {have / 1e9:.1f} GB available; give a "
                "smaller size")  # fmt: skip
