"""Two 'nodes' on one machine: network namespaces joined by a rate-limited veth pair.

``python -m fastddp.netns --rate 1gbit [launch options] script.py [args]`` runs
``python -m fastddp.launch --nnodes 2`` in each namespace, node 0's output on stdout, and
removes the namespaces afterwards, also on failure. Needs root and iproute2 (``ip``, ``tc``).
Addresses come from 198.18.0.0/15, the range reserved for network benchmarks.
"""

import argparse
import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import NamedTuple

__all__ = ["Node", "NetnsError", "two_nodes", "unavailable_reason"]


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
    res = _ip("netns", "add", probe, check=False)
    if res.returncode != 0:
        return f"cannot create a network namespace: {res.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


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
            tbf = [
                "tc",
                "qdisc",
                "add",
                "dev",
                n.dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "512kb",
                "latency",
                "100ms",
            ]
            subprocess.run(
                ["ip", "netns", "exec", n.ns, *tbf], check=True, capture_output=True, timeout=30
            )
        yield a, b
    finally:
        for n in (a, b):
            _ip("netns", "del", n.ns, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m fastddp.netns",
        description=__doc__.splitlines()[0],
        usage="%(prog)s [--rate RATE] [--nproc-per-node N] [launch options] script [args]",
    )
    p.add_argument("--rate", default="1gbit", help="link rate each way, as tc takes it")
    p.add_argument("--nproc-per-node", default="1")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before both are killed")
    args, rest = p.parse_known_args(argv)
    if not rest:
        p.error("give the script (or -m module) to run on both nodes")
    try:
        with two_nodes(args.rate) as (a, b):
            port = _free_port()
            procs = []
            for rank, node in ((1, b), (0, a)):
                cmd = [
                    "ip",
                    "netns",
                    "exec",
                    node.ns,
                    sys.executable,
                    "-m",
                    "fastddp.launch",
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    args.nproc_per_node,
                    "--node-rank",
                    str(rank),
                    "--master-addr",
                    a.addr,
                    "--master-port",
                    str(port),
                    *rest,
                ]
                out = None if rank == 0 else subprocess.DEVNULL
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=out))
            try:
                codes = [proc.wait(timeout=args.timeout) for proc in procs]
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        proc.kill()
    except NetnsError as e:
        print(f"fastddp.netns: {e}", file=sys.stderr)
        return 2
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
