"""'Nodes' on one machine: network namespaces joined by rate-limited links.

The nodes hang off one bridge (in a namespace of its own), each by a veth limited to the rate
both ways, as hosts on a switch; :func:`wired_pair` joins two nodes by a userspace wire that
delays and drops packets instead. :func:`start` runs ``python -m fastddp.launch`` in each node,
:func:`kill` loses a node, :func:`drop` and :func:`set_link` break its link. Needs root and
iproute2 (``ip``, ``tc``). Addresses come from 198.18.0.0/15, the range reserved for network
benchmarks. ``python -m fastddp.netns`` is the command-line front (``fastddp/netns.py``).
"""

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Optional

from fastddp.testing.ports import free_port
from fastddp.testing.wire import MTU, Wire, open_tun

__all__ = [
    "Node", "NetnsError", "cores_per_rank", "drop", "dropped", "kill", "nodes", "set_link",
    "spawn", "start", "stop", "two_nodes", "unavailable_reason", "wired_pair",
]  # fmt: skip


class NetnsError(RuntimeError):
    """Namespaces cannot be made here; the message says why."""


class Node(NamedTuple):
    ns: str  # namespace name
    dev: str  # its end of the veth pair
    addr: str  # its IPv4 address


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def unavailable_reason() -> str:
    """Empty when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    probe = f"fdprobe{uuid.uuid4().hex[:6]}"
    try:
        res = _ip("netns", "add", probe, check=False)
        why = f"cannot create a network namespace: {res.stderr.strip()}"
        return why if res.returncode else ""
    finally:  # (also where a signal came while it was made)
        _ip("netns", "del", probe, check=False)


@contextlib.contextmanager
def two_nodes(rate: str = "1gbit") -> Iterator[tuple[Node, Node]]:
    """Yield two :class:`Node` joined by a veth pair limited to ``rate`` each way (tc tbf).

    A random /24 per use keeps parallel runs apart; both namespaces are deleted on exit.
    """
    why = unavailable_reason()
    if why:
        raise NetnsError(why)
    tag = uuid.uuid4().hex[:6]
    net = f"198.{18 + random.randint(0, 1)}.{random.randint(1, 254)}"
    a = Node(f"fda{tag}", f"fva{tag}", f"{net}.1")
    b = Node(f"fdb{tag}", f"fvb{tag}", f"{net}.2")
    try:
        for n in (a, b):
            _ip("netns", "add", n.ns)
        _ip("link", "add", a.dev, "type", "veth", "peer", "name", b.dev)
        for n in (a, b):
            _ip("link", "set", n.dev, "netns", n.ns)
            _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
            _ip("-n", n.ns, "link", "set", "lo", "up")
            _ip("-n", n.ns, "link", "set", n.dev, "up")
            _tbf(n.ns, n.dev, rate)
        yield a, b
    finally:
        for n in (a, b):
            _ip("netns", "del", n.ns, check=False)


@contextlib.contextmanager
def wired_pair(
    delay_ms: float = 20.0, loss: float = 0.0, rate: Optional[str] = None, seed: int = 0
) -> Iterator[tuple[list[Node], Wire]]:
    """Yield two :class:`Node` joined by a wire with ``delay_ms`` each way and ``loss`` %.

    Each node has a TUN device, and this process forwards packets between them (see
    ``fastddp/testing/wire.py``): the stand-in for ``tc netem``, which this kernel lacks. ``rate``
    also limits what each node sends (tc tbf). Yields ``(nodes, wire)``; ``wire.forwarded`` and
    ``wire.dropped`` count packets. Both namespaces are deleted on exit.
    """
    if delay_ms < 0 or not 0 <= loss < 100:
        raise ValueError(
            f"fastddp.netns: delay >= 0 ms and loss in [0, 100) %, got {delay_ms}, {loss}"
        )
    why = unavailable_reason()
    if why:
        raise NetnsError(why)
    if not os.path.exists("/dev/net/tun"):
        raise NetnsError("a delayed link needs /dev/net/tun (TUN devices)")
    tag = uuid.uuid4().hex[:6]
    net = f"198.{18 + random.randint(0, 1)}.{random.randint(1, 254)}"
    made = [Node(f"fw{k}n{tag}", f"ft{k}n{tag}", f"{net}.{k + 1}") for k in (0, 1)]
    fds: list[int] = []
    wire = None
    try:
        for k, n in enumerate(made):
            # Attached here, then moved: the descriptor stays with the device.
            _ip("tuntap", "add", "dev", n.dev, "mode", "tun")
            fds.append(open_tun(n.dev))
            _ip("netns", "add", n.ns)
            _ip("link", "set", n.dev, "netns", n.ns)
            _ip("-n", n.ns, "addr", "add", n.addr, "peer", made[1 - k].addr, "dev", n.dev)
            _ip("-n", n.ns, "link", "set", n.dev, "mtu", str(MTU), "up")
            _ip("-n", n.ns, "link", "set", "lo", "up")
            if rate is not None:
                _tbf(n.ns, n.dev, rate)
        wire = Wire(fds[0], fds[1], delay_ms / 1000.0, loss / 100.0, seed).start()
        yield made, wire
    finally:
        if wire is not None:
            wire.stop()
        else:
            for fd in fds:
                os.close(fd)
        for n in made:
            _ip("netns", "del", n.ns, check=False)
            _ip("link", "del", n.dev, check=False)  # if it never left this namespace


def _tbf(ns: str, dev: str, rate: str) -> None:
    tbf = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate"]
    res = subprocess.run([*tbf, rate, "burst", "512kb", "latency", "100ms"], capture_output=True,
                         text=True, timeout=30)  # fmt: skip
    if res.returncode != 0:
        why = f"tc refused the rate {rate!r} ({res.stderr.strip() or res.returncode})"
        raise NetnsError(f"{why}; give a rate in bits per second: 100mbit, 1gbit")


@contextlib.contextmanager
def nodes(count: int, rate: str = "1gbit") -> Iterator[list[Node]]:
    """Yield ``count`` :class:`Node` on one bridge, each link limited to ``rate`` both ways.

    The bridge lives in a namespace of its own; node ``k`` has address ``.k+1`` of a random
    /24. Every namespace is deleted on exit, also on failure.
    """
    if not 1 <= count <= 200:
        raise ValueError(f"fastddp.netns: between 1 and 200 nodes, got {count}")
    why = unavailable_reason()
    if why:
        raise NetnsError(why)
    tag = uuid.uuid4().hex[:6]
    net = f"198.{18 + random.randint(0, 1)}.{random.randint(1, 254)}"
    hub = f"fdh{tag}"
    made = [hub]
    out = [Node(f"fd{k}n{tag}", f"fv{k}n{tag}", f"{net}.{k + 1}") for k in range(count)]
    try:
        _ip("netns", "add", hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for k, n in enumerate(out):
            port = f"fp{k}n{tag}"
            made.append(n.ns)  # first: a signal may come between the two
            _ip("netns", "add", n.ns)
            _ip("link", "add", n.dev, "type", "veth", "peer", "name", port)
            _ip("link", "set", n.dev, "netns", n.ns)
            _ip("link", "set", port, "netns", hub)
            _ip("-n", hub, "link", "set", port, "master", "br0")
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", n.ns, "addr", "add", f"{n.addr}/24", "dev", n.dev)
            _ip("-n", n.ns, "link", "set", "lo", "up")
            _ip("-n", n.ns, "link", "set", n.dev, "up")
            _tbf(n.ns, n.dev, rate)  # what the node sends
            _tbf(hub, port, rate)  # what it receives
        yield out
    finally:
        for ns in made:
            _ip("netns", "del", ns, check=False)
        for n in out[: len(made)]:  # a pair interrupted before it left this namespace
            _ip("link", "del", n.dev, check=False)


def stop(procs: list) -> None:
    """Stop launchers from :func:`start` (SIGTERM, then SIGKILL), with their workers."""
    # The launchers stop their workers (sessions of their own) on SIGTERM; then SIGKILL.
    for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        for proc in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)


def drop(node: Node, percent: float) -> None:
    """Drop ``percent`` % of the packets ``node`` receives on its link, at random (nftables).

    Loopback is left alone. Needs ``nft`` (package ``nftables``): this kernel has no ``tc
    netem``. :func:`dropped` reads the count."""
    if not 0 < percent <= 100:
        raise ValueError(f"fastddp.netns: loss must be in (0, 100] percent, got {percent}")
    if shutil.which("nft") is None:
        raise NetnsError("packet loss needs nft (the nftables package)")
    # numgen draws 0..9999 per packet: below percent * 100 drops that share (nft refuses 10000).
    share = int(round(percent * 100))
    draw = "" if share >= 10000 else f"numgen random mod 10000 < {share} "
    rules = (
        "add table inet fastddp_loss\n"
        "add chain inet fastddp_loss input { type filter hook input priority 0; }\n"
        f"add rule inet fastddp_loss input iifname {node.dev} {draw}counter drop\n"
    )
    subprocess.run(
        ["ip", "netns", "exec", node.ns, "nft", "-f", "-"],
        input=rules, check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def dropped(node: Node) -> int:
    """Packets :func:`drop` has dropped on ``node`` so far."""
    res = subprocess.run(
        ["ip", "netns", "exec", node.ns, "nft", "list", "table", "inet", "fastddp_loss"],
        check=True, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    words = res.stdout.split()
    return int(words[words.index("packets") + 1])


def set_rate(node: Node, rate: str, burst: str = "512kb") -> None:
    """Change the rate at which ``node`` sends (its link's tc tbf), while a job runs.

    ``burst``: what the token bucket lets through at once after a pause. A transfer smaller
    than that is not slowed at all, so a test that measures a slow rate sets it lower.
    """
    tbf = ["tc", "qdisc", "change", "dev", node.dev, "root", "tbf", "rate", rate]
    tbf += ["burst", burst, "latency", "100ms"]
    cmd = ["ip", "netns", "exec", node.ns, *tbf]
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def set_link(node: Node, up: bool) -> None:
    """Take ``node``'s link down (an outage: nothing in or out) or bring it back up."""
    _ip("-n", node.ns, "link", "set", node.dev, "up" if up else "down")


def spawn(
    made: list[Node],
    rank: int,
    nproc_per_node: str,
    argv: list[str],
    port: int,
    *,
    stdout=None,
    env=None,
    rdzv_id: Optional[str] = None,
    launch_args: Sequence[str] = (),
    logs: Optional[str] = None,
) -> subprocess.Popen:
    """Start ``python -m fastddp.launch ... argv`` for node ``rank`` of ``made``, in its namespace.

    The rendezvous is node 0's ``port``: static (``--node-rank rank``) by default, or with
    ``rdzv_id`` torchrun's elastic c10d rendezvous, which numbers the nodes itself, so that a
    node can leave and join again (give ``--nnodes`` and ``--max-restarts`` in
    ``launch_args``). The launcher gets a session of its own, for :func:`stop`. ``stdout``
    (say ``subprocess.PIPE``) takes its output and errors; by default node 0's are inherited
    and the others' dropped, or written to ``logs``/node<rank>.log. ``env``: the launcher's
    environment (default: this process's)."""
    node = made[rank]
    cmd = ["ip", "netns", "exec", node.ns, sys.executable, "-m", "fastddp.launch"]
    cmd += ["--nproc-per-node", nproc_per_node]
    if rdzv_id is None:
        cmd += ["--nnodes", str(len(made)), "--node-rank", str(rank)]
        cmd += ["--master-addr", made[0].addr, "--master-port", str(port)]
    else:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{made[0].addr}:{port}"]
        cmd += ["--rdzv-id", rdzv_id]
    cmd += [*launch_args, *argv]
    out = stdout if rank == 0 or stdout is not None else subprocess.DEVNULL
    err = subprocess.STDOUT if stdout is not None else out
    with open(os.path.join(logs, f"node{rank}.log") if logs else os.devnull, "w") as log:
        out, err = (log, subprocess.STDOUT) if out is subprocess.DEVNULL else (out, err)
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True,
                                text=True)  # fmt: skip


def cores_per_rank(nodes: int, nproc_per_node: str) -> int:
    """This machine's cores over the ranks of ``nodes`` nodes (1 at least; 1 where
    ``nproc_per_node`` is not a number, such as torchrun's ``auto``)."""
    try:
        ranks = nodes * int(nproc_per_node)
    except ValueError:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(ranks, 1))


def start(
    made: list[Node],
    nproc_per_node: str,
    argv: list[str],
    stdout=None,
    env=None,
    started: Optional[list] = None,
    **rendezvous,
) -> list:
    """Start :func:`spawn` on every node, on a free port; the launchers, node 0's last.

    ``rendezvous``: ``rdzv_id`` and ``launch_args``, as for :func:`spawn`. The nodes share
    this machine's cores, so each rank is given its share of them as ``OMP_NUM_THREADS``
    unless ``env`` sets it: otherwise every rank of a one-rank node would run as many torch
    threads as the machine has cores (torchrun sets 1 only for several ranks of a node), and
    the ranks' compute would slow down each other's.
    """
    env = dict(os.environ if env is None else env)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(cores_per_rank(len(made), nproc_per_node))
    port, started = free_port(), [] if started is None else started  # (the caller's, if given)
    for rank in reversed(range(len(made))):  # (each kept at once: an interrupt stops them too)
        started.append(spawn(made, rank, nproc_per_node, argv, port, stdout=stdout, env=env,
                             **rendezvous))  # fmt: skip
    return started


def kill(node: Node, timeout: float = 30.0) -> int:
    """SIGKILL every process in ``node``'s namespace, as a lost node; how many there were.

    The launcher's workers have sessions of their own, so stopping the launcher's process
    group would leave them running.
    """
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = {int(p) for p in _ip("netns", "pids", node.ns).stdout.split()}
        if not pids:
            return len(killed)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed |= pids
        time.sleep(0.05)
    raise NetnsError(f"processes in namespace {node.ns} survived SIGKILL for {timeout:.0f} s")
