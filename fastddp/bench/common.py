"""What the benchmarks share: rank setup (any launcher, own spawn, or a two-node link), and
fastddp's modes, one per preset."""

import argparse
import json
import math
import os
import sys
from datetime import timedelta

import torch

import fastddp
from fastddp.bench.report import OPTIONS_ENV
from fastddp.distributed import exit_after_shutdown
from fastddp.hooks.presets import PRESETS, preset
from fastddp.testing.pool import RankError
from fastddp.testing.spawn import spawn_ranks

_PREFIX = "fastddp-"
_DELAYED = "-delay"
#: fastddp's benchmark modes: ``fastddp-`` and the name of each of :data:`fastddp.PRESETS`.
FASTDDP_MODES = [_PREFIX + name for name in PRESETS]
#: DDP's modes with one-step delayed reduction (``delay=1``): ``fastddp-<preset>-delay``.
DELAYED_MODES = [mode + _DELAYED for mode in FASTDDP_MODES]
#: DDP's mode that chooses among the default candidates by itself (``dtype="auto"``).
AUTO = _PREFIX + "auto"


def settings_of(mode: str) -> dict:
    """The :class:`~fastddp.CompressState` settings of the benchmark mode ``fastddp-<preset>``
    (``fastddp-<preset>-delay``: with ``delay=1``)."""
    name = mode.removeprefix(_PREFIX)
    if name.endswith(_DELAYED):
        return {**preset(name.removesuffix(_DELAYED)), "delay": 1}
    return preset(name)


def fastddp_state(mode: str, **overrides) -> fastddp.CompressState:
    """A :class:`~fastddp.CompressState` for the benchmark mode ``fastddp-<preset>[-delay]``."""
    return fastddp.CompressState(**{**settings_of(mode), **overrides})


def auto_bytes(stats: dict, numel: int, ring_cross=lambda numel, itemsize: 0):
    """Payload and cross-node bytes per step of the plan ``auto`` made, and what it chose.

    ``stats``: ``CompressState(dtype="auto").stats()`` after its plan; ``numel``: the model's
    gradient elements; ``ring_cross(numel, itemsize)``: the bytes a ring of fp32 sends across
    nodes, for what the plan leaves uncompressed. A mixed plan's figures are the sum of its
    buckets', each from the candidate that reduced it.
    """
    plan = stats["plan"]
    chosen = plan["mode"]
    if chosen == "none":
        return numel * 4, ring_cross(numel, 4), chosen
    if chosen != "mixed":
        own, steps = stats["candidates"][chosen], max(1, stats["steps_in"][chosen])
        return own["payload_bytes"] // steps, own["cross_node_bytes"] // steps, chosen
    payload = cross = 0
    for index, bucket in enumerate(plan["buckets"]):
        n = bucket["numel"]
        if bucket["mode"] == "none":
            payload, cross = payload + n * 4, cross + ring_cross(n, 4)
            continue
        own = stats["candidates"][bucket["mode"]]["buckets"][index]
        payload += own["payload_bytes"] // own["calls"]
        cross += own["cross_node_bytes"] // own["calls"]
    return payload, cross, plan["summary"]


def pretend_nodes(env, args) -> int:
    """The nodes the ranks form: ``--pretend-nodes`` splits this machine's spawned ranks into
    that many (``FASTDDP_NODE_ID``, set here before any state reads it), else the launcher's."""
    pretend = getattr(args, "pretend_nodes", 0)
    if not pretend:
        return env.num_nodes
    os.environ["FASTDDP_NODE_ID"] = f"pretend-node-{env.rank * pretend // env.world_size}"
    return pretend


def pacing_group():
    """A group of its own for the benchmarks' per-step barrier: a barrier on the hooks' group
    would wait for reductions that ``delay=1`` leaves in flight into the next step."""
    return torch.distributed.new_group(backend="gloo")


def run_everywhere(fn, args, argv):
    """Call ``fn(env, args)`` on every rank: under a launcher, over ``--link``, or spawned.

    ``argv`` is the benchmark's own command line, re-used on the two nodes of ``--link``.
    Returns ``fn``'s result on a launched or spawned rank 0 (None elsewhere).
    """
    if "RANK" in os.environ:  # started by a launcher
        backend = "nccl" if args.device == "cuda" else "gloo"
        with fastddp.distributed_session(backend=backend, timeout=timedelta(minutes=10)) as env:
            result = fn(env, args)
        exit_after_shutdown()
        return result
    if args.link:
        return _over_link(args, argv)
    timeout = timedelta(minutes=10)
    try:
        return spawn_ranks(_spawned, args.nproc, fn, args, threads=args.threads, timeout=timeout)[0]
    except RankError as e:
        # SystemExit on the ranks is a benchmark's refusal, the same on every rank: say it alone.
        said = [line for line in str(e).splitlines() if line.startswith("SystemExit: ")]
        if said:
            raise SystemExit(said[0].removeprefix("SystemExit: ")) from None
        raise


def _spawned(rank, world, fn, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    env = fastddp.DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        node_rank=0,
        num_nodes=1,
        device=torch.device("cpu"),
        backend="gloo",
        master_addr="",
        master_port=0,
        launcher="spawn",
    )
    return fn(env, args)


def _over_link(args, argv):
    from fastddp.testing import netns

    # The nodes' ranks are --nodes x --nproc-per-node: --nproc (ranks to spawn) is not passed
    # on, where the launcher would read it as an abbreviation of its --nproc-per-node.
    rest = drop_option(drop_option(drop_option(argv, "--link"), "--nodes"), "--nproc")
    module = [
        sys.executable,
        "-m",
        "fastddp.netns",
        "--rate",
        args.link,
        "--nodes",
        str(args.nodes or 2),
        "--nproc-per-node",
        str(args.nproc_per_node),
        "-m",
        "fastddp.bench",
        *rest,
    ]
    from fastddp.netns import run_job

    why = netns.unavailable_reason()
    if why:
        raise SystemExit(f"fastddp.bench: --link needs network namespaces: {why}")
    # The nodes record the caller's command and options in --json, not their own (which lack
    # --link, --nodes and --nproc).
    given = {k: v for k, v in vars(args).items() if k != "command"}
    env = {"FASTDDP_BENCH_COMMAND": args.command, OPTIONS_ENV: json.dumps(given, default=str)}
    return run_job(module, env={**os.environ, **env})


def drop_option(argv, name):
    """``argv`` without option ``name`` and its value."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
            continue
        if item == name:
            skip = True
            continue
        if item.startswith(name + "="):
            continue
        out.append(item)
    return out


def fastddp_runs(modes, topologies):
    """``(label, mode, topology)`` per run: fastddp modes once per topology, others once."""
    runs = []
    for mode in modes:
        if mode not in [*FASTDDP_MODES, *DELAYED_MODES, AUTO]:
            runs.append((mode, mode, None))
            continue
        for topo in topologies:
            suffix = {"auto": "", "flat": "/flat", "hierarchical": "/hier"}[topo]
            runs.append((mode + suffix, mode, topo))
    return runs


def parse_size(text):
    """'64K' -> 65536, '256M' -> 268435456, '1G', or plain bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    if text and text[-1] in units:
        return _whole(text[:-1], units[text[-1]])
    return int(text)


def _whole(number: str, unit: int) -> int:
    value = float(number) * unit
    if not math.isfinite(value):
        raise ValueError(f"{number} is not a finite number")
    return int(value)


def count(text):
    """A number of things: '25M' -> 25_000_000, '100K', '1.5G' (powers of ten), or plain."""
    units = {"K": 10**3, "M": 10**6, "G": 10**9}
    text = text.strip().upper()
    if text and text[-1] in units:
        return _whole(text[:-1], units[text[-1]])
    return int(text)


def human(nbytes):
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= size and nbytes % (size // 4 or 1) == 0:
            value = nbytes / size
            return f"{value:g}{unit}"
    return str(nbytes)


def add_common_options(p, nproc=2, *, plot=False, topologies=False):
    """The options every benchmark takes; ``--plot`` and ``--topologies`` are listed only
    where they apply (``plot``, ``topologies``), and refused elsewhere by name."""
    hidden = argparse.SUPPRESS
    # Given or not is what options.check reads (a --link run spawns none): it fills these in.
    p.spawn_defaults = {"nproc": nproc, "threads": 1}
    p.add_argument("--nproc", type=int, help=f"ranks to spawn without a launcher ({nproc})")
    p.add_argument("--threads", type=int, help="torch threads per spawned rank (1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--link",
        metavar="RATE",
        help="run as --nodes nodes, each on a link limited to RATE (e.g. 1gbit; needs root)",
    )
    p.add_argument("--nodes", type=int, help="nodes with --link (default 2)")
    p.add_argument("--nproc-per-node", type=int, help="ranks per node with --link (1)")
    p.add_argument(
        "--topologies",
        nargs="+",
        default=["auto"],
        choices=["auto", "flat", "hierarchical"],
        help="run each fastddp mode with each CompressState topology (default: auto); "
        "modes other than auto are named mode/flat, mode/hier"
        if topologies
        else hidden,
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)" if plot else hidden
    )
