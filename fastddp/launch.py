"""``python -m fastddp.launch``: torchrun, plus cluster detection and a network preflight.

Every torchrun option works as it does in the installed torch (the parser is torchrun's own);
workers are started by ``torch.distributed.run.run``. Before that, fastddp:

1. fills torchrun's defaults from the cluster (Slurm, mpirun, or ``NNODES``/``NODE_RANK``/
   ``NPROC_PER_NODE``/``ADDR``/``PORT``/``MASTER_ADDR``/``MASTER_PORT``); command-line options
   win over the user's ``PET_*`` variables, which win over what was detected;
2. checks, in seconds, what would otherwise surface as a hang: node rank vs nnodes, a loopback
   master for several nodes, the master's name, its port (bound on the master node, connected
   to from the others), and picks the network interface that reaches the master, exporting
   ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` for the workers unless already set;
3. gives the workers of every restarted or re-formed round a fresh store, on every rendezvous,
   so that ``--max-restarts`` and a node that rejoins work every time (see
   :func:`restart_store`).
"""

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import ipaddress
import os
import socket
import struct
import sys
import threading
import time
import uuid
from typing import Optional

from torch.distributed import run as torchrun

from fastddp import _round_store as round_store
from fastddp._loopback import loopback_stores
from fastddp.cluster import ClusterError, launcher_settings

__all__ = ["LaunchError", "build_parser", "main"]

_PREFIX = "fastddp.launch:"


class LaunchError(RuntimeError):
    """A launch that cannot work; the message names the problem and the fix."""


def say(msg: str) -> None:
    print(f"{_PREFIX} {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser (its defaults read from ``PET_*`` now), plus fastddp's own options."""
    parser = torchrun.get_args_parser()
    parser.prog = "python -m fastddp.launch"
    parser.description = (
        "torchrun with cluster detection and a network preflight. All torchrun options are "
        "accepted; fastddp's own are listed under 'fastddp'."
    )
    group = parser.add_argument_group("fastddp")
    group.add_argument(
        "--cluster",
        choices=["auto", "none", "slurm", "mpi", "env"],
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
        "--no-preflight", action="store_true", help="skip the network and configuration checks"
    )
    group.add_argument(
        "--preflight-timeout",
        type=float,
        default=float(os.environ.get("FASTDDP_PREFLIGHT_TIMEOUT", "20")),
        help="seconds a non-master node waits to reach the master's port (default: 20)",
    )
    return parser


def _given_on_command_line(argv: list[str]) -> set[str]:
    """The option names (dests) that ``argv`` sets explicitly."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
        action.required = False
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        return set()
    return set(vars(ns))


def _gpus_visible() -> int:
    try:
        import torch

        return torch.cuda.device_count()  # NVML-based: does not initialise CUDA
    except Exception:
        return 0


def _apply_cluster(kind: str, argv: list[str]) -> None:
    """Export detected settings as ``PET_*`` defaults where neither CLI nor user set them."""
    kind, settings = launcher_settings(os.environ, kind, gpus_on_node=_gpus_visible())
    if not settings:
        return
    given = _given_on_command_line(argv)
    for key, (value, source) in settings.items():
        pet = f"PET_{key.upper()}"
        if key in given:
            say(f"{key}: command line wins over {value} from {source}")
        elif pet in os.environ:
            say(f"{key}: {pet}={os.environ[pet]} wins over {value} from {source}")
        else:
            os.environ[pet] = str(value)
            say(f"{key}={value} (from {kind}: {source})")


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    """Apply the same rewrites ``torch.distributed.run.run`` makes before launching."""
    args = argparse.Namespace(**vars(args))
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    if args.standalone or (
        args.rdzv_backend == "static"
        and not args.rdzv_endpoint
        and args.master_port is None
        and max_nodes == 1
    ):
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
        args.rdzv_id = args.rdzv_id if args.rdzv_id != "none" else str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    return args


# ---------------------------------------------------------------------------- network helpers


def _resolve(host: str, timeout: float) -> str:
    """Resolve ``host`` to an address within ``timeout`` seconds (getaddrinfo has no timeout)."""
    result: dict = {}

    def work():
        try:
            result["addr"] = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except OSError as e:
            result["error"] = e

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(timeout)
    if "addr" in result:
        return result["addr"]
    why = result.get("error", f"no answer within {timeout:.0f} s")
    raise LaunchError(
        f"cannot resolve the master address {host!r}: {why}. Use an address or a name that "
        "every node resolves (check /etc/hosts or DNS), e.g. --master-addr 10.0.0.1"
    )


def _interfaces() -> dict[str, str]:
    """IPv4 address -> interface name, for the interfaces that are up."""
    out = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                res = fcntl.ioctl(s.fileno(), 0x8915, req)  # SIOCGIFADDR
            except OSError:
                continue  # no IPv4 address
            out[socket.inet_ntoa(res[20:24])] = name
    return out


def _route_to(addr: str, port: int) -> tuple[str, Optional[str]]:
    """The local address (and its interface) the kernel would use to reach ``addr``."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, port))  # UDP connect sends nothing; it only picks a route
        except OSError as e:
            raise LaunchError(
                f"no route from this node to the master {addr}: {e.strerror}. Check the "
                "address, and that this node has an interface on the master's network "
                "(ip route get " + addr + ")"
            ) from None
        local = s.getsockname()[0]
    return local, _interfaces().get(local)


def _is_local(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback or addr in _interfaces()


def _check_port_free(addr: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise LaunchError(
                    f"port {port} on this node (the master) is already in use, so the "
                    "rendezvous cannot listen there. Another job or a leftover process holds "
                    f"it (ss -ltnp 'sport = :{port}'); choose another with --master-port "
                    "(or --rdzv-endpoint host:port)"
                ) from None
            raise


def _probe(addr: str, port: int, local: str, iface: Optional[str], deadline: float) -> None:
    """Connect to the master's port until it answers or the deadline passes."""
    start = time.monotonic()
    last: Optional[OSError] = None
    while True:
        left = deadline - (time.monotonic() - start)
        if left <= 0:
            break
        try:
            with socket.create_connection((addr, port), timeout=min(left, 3.0)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.5, max(0.0, deadline - (time.monotonic() - start))))
    if isinstance(last, ConnectionRefusedError):
        why = (
            "nothing listens there (connection refused): node 0 has not started, or the "
            "port is wrong"
        )
    elif isinstance(last, (socket.timeout, TimeoutError)):
        why = "no answer (timed out): a wrong address, a firewall, or node 0 is down"
    else:
        why = f"{last.strerror if last else 'unknown error'}"
    raise LaunchError(
        f"cannot reach the master {addr}:{port} within {deadline:.0f} s from this node "
        f"(local address {local}, interface {iface or 'unknown'}): {why}. Check that node 0 runs "
        "the same command, that --master-addr/--master-port (or --rdzv-endpoint) are right, "
        "that this interface is on the master's network, and that no firewall blocks the "
        "port; --preflight-timeout waits longer"
    )


def _must_claim_c10d_host(args: argparse.Namespace, host: str) -> bool:
    """Whether this node must be told to serve the c10d store (torch would not see it).

    torch decides by comparing the endpoint with the host name and the addresses it resolves
    to, so an endpoint on a secondary interface leaves every node a client, each waiting for a
    store that nobody serves.
    """
    if "is_host" in (args.rdzv_conf or ""):
        return False
    try:
        from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname
    except ImportError:  # a torch without the heuristic: say it explicitly
        return True
    return not _matches_machine_hostname(host)


# -------------------------------------------------------------------------------- preflight


@dataclasses.dataclass
class Decisions:
    """What the preflight decided, for :func:`apply` to put into the arguments and environment.

    Each setting comes with the line that explains it.
    """

    local_addr: Optional[tuple[str, str]] = None  # (address, why)
    rdzv_conf: Optional[tuple[str, str]] = None  # (extra rendezvous option, why)
    environment: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # user settings left alone


def apply(args: argparse.Namespace, decisions: Decisions) -> None:
    """Put the preflight's decisions into ``args`` and ``os.environ``, saying each one."""
    for note in decisions.notes:
        say(note)
    if decisions.rdzv_conf is not None:
        extra, why = decisions.rdzv_conf
        args.rdzv_conf = ",".join(filter(None, [args.rdzv_conf, extra]))
        say(f"--rdzv-conf {extra} ({why})")
    if decisions.local_addr is not None:
        args.local_addr, why = decisions.local_addr
        say(f"--local-addr {args.local_addr} ({why})")
    for var, (value, why) in decisions.environment.items():
        os.environ[var] = value
        say(f"{var}={value} ({why})")


def preflight(args: argparse.Namespace, network: bool = True) -> tuple[dict, Decisions]:
    """Check the configuration and (with ``network``) the network.

    Returns what was found (for the summary) and what should be set (for :func:`apply`); it
    changes neither ``args`` nor the environment.
    """
    min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    info = {"nnodes": args.nnodes}
    decisions = Decisions()
    static = args.rdzv_backend == "static"
    if static and not 0 <= args.node_rank < max_nodes:
        raise LaunchError(
            f"--node-rank {args.node_rank} is not valid with --nnodes {args.nnodes}: node "
            f"ranks run from 0 to {max_nodes - 1}, one per node, each used once"
        )
    if not static and args.node_rank != 0:
        say(
            f"warning: --node-rank {args.node_rank} is ignored by the {args.rdzv_backend} "
            "rendezvous, which assigns node ranks itself"
        )
    gpus = _gpus_visible()
    nproc = args.nproc_per_node
    if gpus and nproc.isdigit() and int(nproc) > gpus:
        say(
            f"warning: --nproc-per-node {nproc} exceeds the {gpus} visible GPU(s); NCCL "
            "refuses two ranks on one GPU (use Gloo, or fewer processes)"
        )
    if args.rdzv_endpoint and args.rdzv_endpoint != "localhost:0":
        host, _, port_s = args.rdzv_endpoint.rpartition(":")
        if not host:
            host, port_s = args.rdzv_endpoint, "29400"
        port = int(port_s)
    else:
        host, port = args.master_addr, int(args.master_port)
    if args.rdzv_endpoint == "localhost:0":  # standalone: one node, a free port
        info.update(master="localhost (standalone)", interface="lo")
        return info, decisions
    if not network:
        info.update(master=f"{host}:{port}", interface="not checked (--dry-run)")
        return info, decisions
    addr = _resolve(host.strip("[]"), timeout=10.0)
    loopback = ipaddress.ip_address(addr).is_loopback
    if loopback and max_nodes > 1:
        say(
            f"warning: the master {host} is a loopback address: nodes on other machines "
            "cannot reach it (fine only when every node runs on this machine)"
        )
    local, iface = _route_to(addr, port)
    is_master = (args.node_rank == 0) if static else _is_local(addr)
    if is_master and static:
        _check_port_free(addr, port)
    elif is_master:
        # c10d: the first launcher on the endpoint's host serves the store and the others on
        # that host join it, so a port in use may be this job's own rendezvous: it must answer.
        try:
            _check_port_free(addr, port)
        except LaunchError:
            _probe(addr, port, local, iface, 2.0)
            say(f"the rendezvous port {port} is already served on this machine; joining it")
        else:
            if _must_claim_c10d_host(args, host):
                why = f"the endpoint {host} is an address of this node"
                decisions.rdzv_conf = ("is_host=1", why)
    else:
        _probe(addr, port, local, iface, args.preflight_timeout)
    info.update(
        master=f"{host}:{port}" + (f" ({addr})" if addr != host else ""),
        interface=iface or "unknown",
        local_address=local,
        is_master=is_master,
    )
    if not static and args.local_addr is None and not loopback:
        # The c10d rendezvous tells workers to reach rank 0 at its node's host name, which
        # other nodes often cannot resolve (or resolve to another network); the address that
        # routes to the master is the one they can use.
        decisions.local_addr = (local, "this node's address on the master's network")
    if iface and not loopback:
        for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if var in os.environ:
                decisions.notes.append(
                    f"{var}={os.environ[var]} (yours; the route to the master uses {iface})"
                )
            else:
                decisions.environment[var] = (iface, "the interface that reaches the master")
    return info, decisions


_SHARE_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@dataclasses.dataclass
class StorePlan:
    """How the workers of every rendezvous round get a store without the last round's keys.

    ``fresh``: a new store per rendezvous round (:mod:`fastddp._round_store`, which says why
    this mechanism); ``environment``: variables to set for torch's own handler; ``say``: the
    lines for the launch summary.
    """

    fresh: bool = False
    environment: dict[str, str] = dataclasses.field(default_factory=dict)
    say: list[str] = dataclasses.field(default_factory=list)


def restart_store(args: argparse.Namespace, environ=os.environ) -> StorePlan:
    """Decide how the workers' store survives restarts and membership changes.

    Every round gets a fresh store, served by node 0's launcher, on every rendezvous backend,
    also in a job without ``--max-restarts``: each node decides alone, and nodes that decided
    differently (say, different ``--max-restarts``) would wait for each other's store. A user's
    own ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` wins on the c10d rendezvous (the only one that
    reads it): ``1`` makes rank 0's worker serve a store per attempt, ``0`` keeps torch's shared
    store, whose restarts can read the previous attempt's keys.
    """
    c10d = args.rdzv_backend == "c10d"
    if c10d and _SHARE_VAR in environ:
        value = environ[_SHARE_VAR]
        line = f"restarts: {_SHARE_VAR}={value} is yours, so torch's own workers' store is kept"
        if value != "1":
            line += (
                "; warning: a restarted attempt can read the previous attempt's addresses "
                f"and fail to connect (unset {_SHARE_VAR} to get a fresh store per round)"
            )
        return StorePlan(say=[line])
    plan = StorePlan(fresh=True)
    if c10d:
        # torch's c10d handler must not share its own store: a node that joins a later round
        # would wait for an address that the surviving nodes never publish again.
        plan.environment[_SHARE_VAR] = "1"
    plan.say.append(
        f"restarts: a fresh workers' store for every rendezvous round, served by node 0's "
        f"launcher ({args.rdzv_backend} rendezvous), so that no attempt reads the keys of the "
        "one before"
    )
    return plan


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
        f"nodes {args.nnodes}, {nproc} processes per node, world size {max_nodes * nproc}",
        f"rendezvous {args.rdzv_backend} at {info.get('master')}",
        f"interface {info.get('interface')}  torch {torch.__version__}  NCCL {nccl}",
        "environment " + (" ".join(f"{k}={v}" for k, v in env.items()) or "(none relevant)"),
    ]
    for line in lines:
        say(line)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = build_parser().parse_args(argv)  # fails early, with torchrun's messages
    try:
        _apply_cluster(pre.cluster, argv)
        args = build_parser().parse_args(argv)  # now with the detected defaults
        run_args = _normalise(args)
        info, decisions = ({}, Decisions())
        if not args.no_preflight:
            info, decisions = preflight(run_args, network=not args.dry_run)
    except (ClusterError, LaunchError) as e:
        say(f"error: {e}")
        return 2
    apply(run_args, decisions)
    # One node with a local rendezvous: nothing outside this machine has to reach the stores,
    # so they listen on loopback, and the workers are told so (not this host's name, which
    # may resolve to another interface).
    local = run_args.rdzv_endpoint == "localhost:0"
    if local and run_args.local_addr is None:
        run_args.local_addr = "127.0.0.1"
    plan = restart_store(run_args)
    for var, value in plan.environment.items():
        os.environ[var] = value
    for line in plan.say:
        say(line)
    if not args.no_preflight and info.get("is_master", True):
        _summary(run_args, info)
    config, cmd, cmd_args = torchrun.config_from_args(run_args)
    if plan.fresh:
        round_store.install(config)
    if args.dry_run:
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
        say(
            f"config node_rank={run_args.node_rank} master_addr={run_args.master_addr} "
            f"master_port={run_args.master_port}"
        )
        worker = [cmd if isinstance(cmd, str) else getattr(cmd, "__name__", str(cmd))]
        say("worker command: " + " ".join(worker + list(cmd_args)))
        return 0
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        with loopback_stores() if local else contextlib.nullcontext():
            elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
    except ChildFailedError as e:
        say(f"error: workers failed:\n{e.format_msg()}")
        return 1
    except round_store.RoundStoreError as e:
        say(f"error: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
