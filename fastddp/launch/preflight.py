"""The preflight: check a launch's configuration and network in seconds, before torchrun runs.

What would otherwise surface as a hang fails here with the fix in the message: a bad
``FASTDDP_PEER_TIMEOUT``, node rank vs nnodes, a loopback master for several nodes, the
master's name, its port (bound on the master node, connected to from the others).
:func:`preflight` decides; :func:`apply` puts its decisions (``--local-addr``, ``--rdzv-conf
is_host=1``, ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``) into the arguments and the
environment, saying each one.
"""

import argparse
import dataclasses
import ipaddress
import os
import socket
import sys
from typing import Optional

from torch.distributed import run as torchrun

from fastddp.cluster import ClusterError
from fastddp.launch import net
from fastddp.launch.net import LaunchError
from fastddp.launch.options import endpoint
from fastddp.watchdog import peer_timeout_from_env

__all__ = ["Decisions", "LaunchError", "apply", "preflight", "say"]

_PREFIX = "fastddp.launch:"


def say(msg: str) -> None:
    """Print one line of the launcher's report to stderr."""
    # One write: the roll call's thread says things too, and lines must not run together.
    sys.stderr.write(f"{_PREFIX} {msg}\n")
    sys.stderr.flush()


def gpus_visible() -> int:
    """Return the number of GPUs this node sees, without initialising CUDA."""
    try:
        import torch

        return torch.cuda.device_count()  # NVML-based: does not initialise CUDA
    except Exception:
        return 0


@dataclasses.dataclass
class Decisions:
    """What the preflight decided, for :func:`apply` to put into the arguments and environment.

    Each setting comes with the line that explains it.
    """

    local_addr: Optional[tuple[str, str]] = None  # (address, why)
    rdzv_conf: Optional[tuple[str, str]] = None  # (extra rendezvous option, why)
    environment: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)  # user settings left alone
    interface: Optional[str] = None  # a one-node launch's loopback interface


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


def _check_ranks(args: argparse.Namespace, static: bool, max_nodes: int) -> None:
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
    gpus = gpus_visible()
    nproc = args.nproc_per_node
    if gpus and nproc.isdigit() and int(nproc) > gpus:
        say(
            f"warning: --nproc-per-node {nproc} exceeds the {gpus} visible GPU(s); NCCL "
            "refuses two ranks on one GPU (use Gloo, or fewer processes)"
        )


def _master(args: argparse.Namespace) -> tuple[str, int]:
    """The rendezvous host and port: the endpoint's (port 29400 if none), else the master's."""
    if args.rdzv_endpoint and args.rdzv_endpoint != "localhost:0":
        return endpoint(args.rdzv_endpoint)
    if args.rdzv_backend == "c10d" and not args.rdzv_endpoint:
        return "localhost", 29400  # where torch's c10d rendezvous goes without an endpoint
    return args.master_addr, int(args.master_port)


def _literal(host: str) -> Optional[str]:
    """``host`` as an address where it is one (or ``localhost``), else None."""
    host = host.strip("[]")
    if host == "localhost":
        return "127.0.0.1"
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def _warn_loopback(host: str, addr: Optional[str], max_nodes: int) -> None:
    if addr is not None and max_nodes > 1 and ipaddress.ip_address(addr).is_loopback:
        say(
            f"warning: the master {host} is a loopback address: nodes on other machines "
            "cannot reach it (fine only when every node runs on this machine)"
        )


def preflight(
    args: argparse.Namespace, network: bool = True, checks: bool = True
) -> tuple[dict, Decisions]:
    """Check the configuration and (with ``network``) the network.

    Args:
        args: torchrun's arguments, normalised as ``torch.distributed.run.run`` would.
        network: also resolve the master, find the route and check or probe its port.
        checks: False (``--no-preflight``): check nothing; a one-node launch's sockets are
            still put on loopback (:func:`one_node_sockets`), a setting rather than a check.

    Returns:
        ``(info, decisions)``: what was found (for the summary) and what should be set (for
        :func:`apply`); neither ``args`` nor the environment is changed.

    Raises:
        LaunchError: the launch cannot work; the message says how to fix it.
    """
    if not checks:
        return {}, one_node_sockets(args, check=False)
    # The workers' own settings: a bad one stops every node here, not every worker after
    # seconds of imports (the workers check again, for torchrun).
    try:
        peer_timeout_from_env(os.environ, world=1)
    except ClusterError as e:
        raise LaunchError(f"{e}; set it right or unset it (300 s up to 64 ranks)") from None
    _, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
    info = {"nnodes": args.nnodes}
    decisions = Decisions()
    static = args.rdzv_backend == "static"
    _check_ranks(args, static, max_nodes)
    host, port = _master(args)
    if args.rdzv_endpoint == "localhost:0":  # standalone: one node, a free port
        decisions = one_node_sockets(args)
        info.update(master="localhost (standalone)", interface=decisions.interface)
        return info, decisions
    if not network:
        # A dry run resolves nothing, but a literal loopback master is plain without it.
        _warn_loopback(host, _literal(host), max_nodes)
        info.update(master=f"{host}:{port}", interface="not checked (--dry-run)")
        return info, decisions
    addr = net.resolve(host.strip("[]"), timeout=10.0)
    loopback = ipaddress.ip_address(addr).is_loopback
    is_master = (args.node_rank == 0) if static else net.is_local(addr)
    # A host's own name often resolves to 127.0.1.1 on that host (Debian's /etc/hosts), and to
    # its address on the others (Slurm's node lists are such names): they reach it, but the
    # route to the master here is loopback, where no other node reaches its workers.
    own_name = loopback and is_master and max_nodes > 1 and _literal(host) is None
    if own_name:
        local, iface = _own_interface(host, addr)
        loopback = False  # for the others, it is not
    else:
        _warn_loopback(host, addr, max_nodes)
        local, iface = net.route_to(addr, port)
    if is_master and static:
        _check_owns_master(host, addr)
    hosts = is_master
    if is_master and static:
        net.check_port_free(addr, port)
    elif is_master:
        # c10d: the first launcher on the endpoint's host serves the store and the others on
        # that host join it, so a port in use may be this job's own rendezvous: it must answer.
        try:
            net.check_port_free(addr, port)
        except net.PortTaken as e:
            if e.listened is False:  # only connections' ends: there is no rendezvous to join
                raise
            net.probe(addr, port, local, iface, 2.0, store=True)
            say(f"the rendezvous port {port} is already served on this machine; joining it")
            hosts = False
        else:
            if _must_claim_c10d_host(args, host):
                why = f"the endpoint {host} is an address of this node"
                decisions.rdzv_conf = ("is_host=1", why)
    else:
        # Static and c10d rendezvous are served by a torch.distributed store; others (etcd)
        # by their own servers.
        store = args.rdzv_backend in ("static", "c10d")
        timeout = args.preflight_timeout
        net.probe(addr, port, local, iface, timeout, say, net.NOT_STARTED_S, store=store)
    if hosts and max_nodes > 1:
        # Else the rendezvous host waits in silence until the other nodes come (or its timeout).
        say(
            f"this node hosts the rendezvous at {host}:{port}; the workers start when the other "
            f"nodes join it (each launched with this address, up to {max_nodes - 1} more)"
        )
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
    if iface:
        why = (
            "a loopback master: every node on this machine"
            if loopback
            else "this node's interface to the others"
            if own_name
            else "the interface that reaches the master"
        )
        _interface(decisions, iface, why, multi_node=max_nodes > 1 and not loopback)
    return info, decisions


def _own_interface(host: str, addr: str) -> tuple[str, str]:
    """The address and interface the other nodes reach this one at, where the master's name,
    this node's own, resolves to the loopback ``addr`` here: the only interface besides
    loopback, else the default route's."""
    others = {a: n for a, n in net.interfaces().items() if not ipaddress.ip_address(a).is_loopback}
    if len(others) == 1:
        (local, iface), how = next(iter(others.items())), "its only interface besides loopback"
    else:
        try:  # (a UDP connect sends nothing; an address of TEST-NET-1 stands for "elsewhere")
            local, iface = net.route_to("192.0.2.1", 9)
        except LaunchError:
            local, iface = "", None
        how = "the interface of its default route"
        if iface is None or ipaddress.ip_address(local).is_loopback:
            shown = ", ".join(f"{n} {a}" for a, n in sorted(others.items())) or "none"
            raise LaunchError(
                f"--master-addr {host} resolves to {addr} on this node, a loopback address, and "
                f"no interface stands out for the other nodes to reach it (interfaces besides "
                f"loopback: {shown}): pass --master-addr as this node's address on the "
                "network the nodes share, or set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME"
            )
    say(
        f"the master {host} resolves to {addr} on this node, as a host's own name often does "
        f"(/etc/hosts), and to this node's address on the others; its workers use {iface} "
        f"({local}), {how}"
    )
    return local, iface


def _check_owns_master(host: str, addr: str) -> None:
    # The static rendezvous makes node rank 0 serve the store at the master address; on a
    # node that does not own it, torch would retry a store there as a client for its timeout.
    if not net.is_local(addr):
        shown = host if host == addr else f"{host} ({addr})"
        raise LaunchError(
            f"--node-rank 0 serves the rendezvous at --master-addr, but {shown} is not an "
            "address of this node: launch node rank 0 on the host that owns it, or give "
            "--master-addr an address of this node (two nodes given --node-rank 0 end here too)"
        )


def _check_gloo_interfaces(value: str, multi_node: bool) -> None:
    # Gloo takes exact names (a comma-separated list); a wrong one fails every worker after
    # its imports, and the other nodes then wait for it in silence.
    names = [n for n in value.split(",") if n]
    known = {name for _, name in socket.if_nameindex()}
    missing = [n for n in names if n not in known]
    if missing:
        raise LaunchError(
            f"GLOO_SOCKET_IFNAME={value}: no interface {', '.join(missing)} on this node (it "
            f"has {', '.join(sorted(known))}); unset it, or name one of these"
        )
    if multi_node and net.interfaces().get("127.0.0.1") in names:
        raise LaunchError(
            f"GLOO_SOCKET_IFNAME={value} is the loopback interface, and the other nodes cannot "
            "reach a worker's address on it; unset it, or name the interface that reaches them"
        )


def one_node_sockets(args: argparse.Namespace, check: bool = True) -> Decisions:
    """For a one-node launch (``--standalone``), the workers' sockets on loopback.

    A setting, not a check: ``--no-preflight`` keeps it (with ``check=False``, a
    ``GLOO_SOCKET_IFNAME`` of the user's is not checked), so that a standalone job listens on
    nothing beyond this machine either way. Other launches get nothing.
    """
    decisions = Decisions()
    if args.rdzv_endpoint == "localhost:0":
        try:
            decisions.interface = net.interfaces().get("127.0.0.1", "lo")
        except OSError:  # (an interface list refused, in a sandbox: --no-preflight's way past)
            decisions.interface = "lo"
        _interface(
            decisions,
            decisions.interface,
            "one node: nothing listens beyond this machine",
            check=check,
        )
    return decisions


def _interface(
    decisions: Decisions, iface: str, why: str, multi_node: bool = False, check: bool = True
) -> None:
    """The workers' Gloo and NCCL sockets on ``iface``, unless the user chose one."""
    if check and "GLOO_SOCKET_IFNAME" in os.environ:
        _check_gloo_interfaces(os.environ["GLOO_SOCKET_IFNAME"], multi_node)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var in os.environ:
            decisions.notes.append(f"{var}={os.environ[var]} (yours; fastddp would use {iface})")
        else:
            decisions.environment[var] = (iface, why)
