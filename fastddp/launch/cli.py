"""The command line: torchrun's parser plus fastddp's group, cluster defaults, and :func:`main`.

Every torchrun option works as it does in the installed torch (the parser is torchrun's own);
workers are started by torch's ``elastic_launch``, as ``torch.distributed.run.run`` does.
"""

import argparse
import contextlib
import os
import signal
import sys
from typing import Optional

from torch.distributed import run as torchrun

from fastddp.cluster import ClusterError, VariableError, launcher_settings, unread
from fastddp.launch import failures, options, slurm, stop, store
from fastddp.launch.preflight import LaunchError, apply, gpus_visible, preflight, say

__all__ = ["build_parser", "main"]

_KINDS = ("auto", "none", "slurm", "mpi", "env")  # --cluster


def build_parser() -> argparse.ArgumentParser:
    """Return torchrun's parser (its defaults read from ``PET_*`` now), plus fastddp's options."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m fastddp.launch"
    parser.description = (
        "torchrun with cluster detection and a network preflight. All torchrun options are "
        "accepted; fastddp's own are listed under 'fastddp'."
    )
    group = parser.add_argument_group("fastddp")
    group.add_argument(
        "--cluster",
        choices=_KINDS,
        default=os.environ.get("FASTDDP_CLUSTER", "auto"),
        help="where to read nnodes/node rank/master from (default: auto, or $FASTDDP_CLUSTER)",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved torchrun configuration and worker command, after the "
        "configuration checks but without touching the network; start nothing",
    )
    group.add_argument(
        "--no-preflight",
        action="store_true",
        help="skip the network and configuration checks (a --standalone job's sockets stay on "
        "loopback; the workers still refuse a bad FASTDDP_PEER_TIMEOUT)",
    )
    group.add_argument(
        "--preflight-timeout",
        type=float,
        default=None,
        help="seconds a non-master node waits to reach the master's port (default: 20, or "
        "$FASTDDP_PREFLIGHT_TIMEOUT); a refused connection (the host answers, node 0's "
        "launcher not yet) is waited for up to 300 s",
    )
    options.torchruns_first(parser, group)
    return parser


# What --standalone decides: one node, its own rendezvous.
_ONE_NODE = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint")
_MASTER = {"master_addr", "master_port"}
_ONE_NODE_UNREAD = _MASTER | {"node_rank"}  # a launch of one node: node 0, on loopback


def _apply_cluster(parser: argparse.ArgumentParser, pre: argparse.Namespace, argv: list[str]):
    """Make detected settings the defaults where neither CLI nor user ``PET_*`` set them.

    Returns:
        The settings filled in, by option name, for errors that name one of them.
    """
    if pre.cluster not in _KINDS:  # from FASTDDP_CLUSTER: argparse checks only the command line
        raise ClusterError(
            f"FASTDDP_CLUSTER={pre.cluster!r} is not a cluster kind; set it to one of "
            f"{', '.join(_KINDS)}, or unset it"
        )
    given = options.given_on_command_line(parser, argv)
    elsewhere = given | {k for k in _ONE_NODE if f"PET_{k.upper()}" in os.environ}
    if pre.standalone:
        elsewhere |= set(_ONE_NODE)
    try:
        # The master and node rank first left unread: a launch of one node is node 0 and meets
        # on loopback, at a port the kernel picks, as torchrun's does, whatever the
        # environment names.
        gpus = gpus_visible()
        probe = elsewhere | _ONE_NODE_UNREAD
        kind, settings = launcher_settings(os.environ, pre.cluster, gpus, probe)
        # c10d without an endpoint meets at each node's own localhost:29400: where Slurm or
        # mpirun names the master, the nodes meet there instead.
        meet = kind in ("slurm", "mpi") and pre.rdzv_backend == "c10d"
        meet = meet and not (pre.rdzv_endpoint or pre.standalone)
        # An endpoint stands for the master (which is not read, nor checked: Kubernetes'
        # MASTER_PORT=tcp://IP:PORT is no error), and c10d numbers the nodes itself.
        unused = set()
        if not pre.standalone and (pre.rdzv_endpoint or pre.rdzv_backend != "static"):
            unused = set() if meet else set(_MASTER)
            if pre.rdzv_backend != "static":
                unused.add("node_rank")
        elsewhere |= unused
        nnodes = pre.nnodes
        if "nnodes" not in elsewhere and "nnodes" in settings:
            nnodes = settings["nnodes"].value
        one_node = options.most_nodes(nnodes) == 1 and not elsewhere >= _MASTER
        if not one_node:
            kind, settings = launcher_settings(os.environ, pre.cluster, gpus, elsewhere)
    except VariableError as e:
        raise VariableError(
            f"{e} (set it right, override it on the command line, or pass --cluster none to "
            "read no cluster variables)"
        ) from None
    filled = {}
    meets = _endpoint(pre, elsewhere, settings) if meet and not one_node else None
    for key, (value, source) in settings.items():
        pet = f"PET_{key.upper()}"
        if key in unused and key not in given:
            at = pre.rdzv_endpoint or (meets[0] if meets else "its endpoint")
            rendezvous = f"the {pre.rdzv_backend} rendezvous at {at}"
            say(f"{key}: not used by {rendezvous}; {value} from {source} is not read")
        elif pre.standalone and key in _ONE_NODE:
            # A Slurm allocation of several nodes would leave the one node waiting for more.
            say(f"{key}: --standalone (one node) wins over {value} from {source}")
        elif key in given:
            say(f"{key}: command line wins over {value} from {source}")
        elif pet in os.environ:
            say(f"{key}: {pet}={os.environ[pet]} wins over {value} from {source}")
        elif one_node and key in _ONE_NODE_UNREAD:
            why = "node 0" if key == "node_rank" else "which meets on loopback"
            say(f"{key}: one node, {why}; {value} from {source} is not read")
        elif meets and key in _MASTER:
            continue  # the endpoint's line says it
        else:
            # Only the parser's default: torchrun's parser reads PET_* once, when it is built,
            # and a PET_* exported here would reach the workers (a torchrun started in one
            # would take this job's port).
            parser.set_defaults(**{key: str(value)})
            filled[key] = (value, source)
            say(f"{key}={value} (from {kind}: {source})")
    if meets:
        parser.set_defaults(rdzv_endpoint=meets[0])
        filled["rdzv_endpoint"] = meets
        say(f"rdzv_endpoint={meets[0]} (from {kind}: the master, {meets[1]})")
    if names := unread(os.environ, kind):
        say(
            f"{', '.join(names)}: XTuner's variables are not read under {kind}; give --nnodes, "
            "--node-rank, --nproc-per-node or the master on the command line (or read them "
            "with --cluster env)"
        )
    nodes = settings.get("nnodes")
    detected = "nnodes" in filled
    for line in slurm.check(os.environ, kind, str(nnodes), nodes, pre.standalone, detected):
        say(line)
    return filled


def _endpoint(pre: argparse.Namespace, elsewhere: set, settings: dict) -> Optional[tuple]:
    """The master as a c10d ``--rdzv-endpoint``, and where it came from: each of its host and
    port the command line's (or a ``PET_*``'s) where given, else the detected one. None where
    no host is known."""
    if "master_addr" not in elsewhere and "master_addr" not in settings:
        return None
    parts = []
    for key in ("master_addr", "master_port"):
        if key in elsewhere:
            parts.append((str(getattr(pre, key)), "--" + key.replace("_", "-")))
        elif key in settings:
            parts.append((str(settings[key].value), settings[key].source))
    port = parts[1][0] if len(parts) > 1 else None  # (None: c10d's own, 29400)
    return options.join_endpoint(parts[0][0], port), "; ".join(s for _, s in parts)


def _sources(message: str, filled: dict) -> str:
    """Where the options an error names came from, when the cluster filled them in: the user
    gave no such option, and the fix is to the variable or the command line."""
    named = [
        f"{option} {value} came from {source}"
        for key, (value, source) in filled.items()
        if (option := "--" + key.replace("_", "-")) in message
    ]
    if not named:
        return ""
    return (
        f" ({'; '.join(named)}: set it right, override it on the command line, or pass "
        "--cluster none)"
    )


def _summary(args: argparse.Namespace, info: dict) -> None:
    import torch

    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    nproc = torchrun.determine_local_world_size(args.nproc_per_node)
    nccl = "n/a"
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(("NCCL_", "GLOO_", "FASTDDP_", "MASTER_", "OMP_NUM_THREADS"))
    }
    lines = [
        # This node's count: another node may run more or fewer (torch sums them).
        f"nodes {args.nnodes}, {nproc} worker(s) on this node, world size "
        + (f"{max_nodes * nproc} if every node runs {nproc}" if max_nodes > 1 else str(nproc)),
        f"rendezvous {args.rdzv_backend} at {info.get('master')}",
        f"interface {info.get('interface')}  torch {torch.__version__}  NCCL {nccl}",
        "environment " + (" ".join(f"{k}={v}" for k, v in env.items()) or "(none relevant)"),
    ]
    for line in lines:
        say(line)


def _print_dry_run(args: argparse.Namespace, config, cmd, cmd_args: list[str]) -> None:
    for field in (
        "min_nodes",
        "max_nodes",
        "nproc_per_node",
        "run_id",
        "rdzv_backend",
        "rdzv_endpoint",
        "rdzv_configs",
        "max_restarts",
        "start_method",
        "local_addr",
    ):
        say(f"config {field}={getattr(config, field)!r}")
    if args.rdzv_backend == "static":
        say(
            f"config node_rank={args.node_rank} master_addr={args.master_addr} "
            f"master_port={args.master_port}"
        )
    else:  # the rendezvous at rdzv_endpoint gives node ranks; no master address is used
        say(f"config node_rank assigned by the {args.rdzv_backend} rendezvous")
    worker = [cmd if isinstance(cmd, str) else getattr(cmd, "__name__", str(cmd))]
    say("worker command: " + " ".join(worker + list(cmd_args)))


def main(argv: Optional[list[str]] = None) -> int:
    """Run ``python -m fastddp.launch``; return the exit code.

    Returns:
        0 when the workers finished (or after ``--dry-run``), 1 when they failed, 2 when the
        configuration or the network cannot work. Bad arguments exit 2 from argparse.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    argv, script_args = options.script_apart(parser, argv)
    pre = parser.parse_args(argv)  # fails early, with torchrun's messages
    filled = {}
    try:
        filled = _apply_cluster(parser, pre, argv)
        args = parser.parse_args(argv)  # now with the detected defaults
        if script_args is not None:
            args.training_script_args = script_args
        options.check(args)
        run_args = options.normalise(args)
        checks = not args.no_preflight
        info, decisions = preflight(run_args, network=not args.dry_run, checks=checks)
    except (ClusterError, LaunchError) as e:
        say(f"error: {e}{_sources(str(e), filled)}")
        return 2
    apply(run_args, decisions)
    # One node with a local rendezvous: nothing outside this machine has to reach the stores,
    # so they listen on loopback, and the workers are told so (not this host's name, which
    # may resolve to another interface).
    local = run_args.rdzv_endpoint == "localhost:0"
    if local and run_args.local_addr is None:
        run_args.local_addr = "127.0.0.1"
    plan = store.restart_store(run_args)
    for var, value in plan.environment.items():
        os.environ[var] = value
    for line in plan.say:
        say(line)
    if not args.no_preflight and info.get("is_master", True):
        _summary(run_args, info)
    config, cmd, cmd_args = torchrun.config_from_args(run_args)
    # Without --log-dir, torch makes a folder under /tmp for every launch and leaves it behind.
    made = None if run_args.log_dir else getattr(config.logs_specs, "root_log_dir", None)
    forget = stop.at_stop(lambda: _prune_empty(made)) if made else None
    try:
        return _launch(args, run_args, plan, local, config, cmd, cmd_args)
    finally:
        if made:
            forget()
            _prune_empty(made)


def _launch(args, run_args, plan, local, config, cmd, cmd_args) -> int:
    if plan.fresh:
        store.install(config)
    if args.dry_run:
        _print_dry_run(run_args, config, cmd, cmd_args)
        return 0
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        with store.loopback_stores() if local else contextlib.nullcontext():
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        gone = failures.ended(_first_failure(e))  # first: the other nodes stop their workers
        say(f"error: workers failed:\n{e.format_msg()}")
        if gone is not None:
            say(f"error: {gone}")
        return 1
    except store.RoundStoreError as e:
        failures.ended("its next rendezvous round could not form")
        say(f"error: {e}")
        return 1
    except SignalException as e:  # Ctrl-C, or a scheduler's SIGTERM: torch stopped the workers
        if failures.peer_failure() is not None:
            return stop.requested() or 1  # another node failed, and this one stopped (said)
        # Claimed first: stop.py's thread would otherwise end the process a second after the
        # signal, cutting node 0's wait for the others to read its note (failures.ended).
        claimed = isinstance(e, stop.Stopped) and stop.taken()
        failures.ended(f"stopped by {e.sigval.name}", signalled=True)
        if not isinstance(e, stop.Stopped):
            say(f"stopped by {e.sigval.name}; the workers were stopped")
        elif claimed:  # before any worker started (stop.py)
            say(f"stopped by {e.sigval.name}")
        return 128 + int(e.sigval)
    except Exception as e:
        failures.ended(f"its launcher failed ({type(e).__name__}: {e})")
        raise
    finally:
        failures.ended(None)  # (nothing left to say where one of the above did)
    return 0


def _first_failure(e) -> str:
    """What failed on this node, for the others: the first failed rank and how it ended."""
    rank, failure = e.get_first_failure()
    code = failure.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"its rank {rank} was killed by {signal.Signals(-code).name}"
    return f"its rank {rank} exited with {code} (its error is in that node's output)"


def _prune_empty(root: str) -> None:
    """Remove the folders under ``root`` that hold no file, and ``root`` if none is left; a
    worker's error file or redirected log keeps its folders."""
    for folder, _, _ in sorted(os.walk(root), key=lambda w: -len(w[0])):
        with contextlib.suppress(OSError):
            os.rmdir(folder)  # only an empty one goes
