"""Two network namespaces joined by a rate-limited veth pair: two 'nodes' on one machine."""

import contextlib
import os
import random
import shutil
import subprocess
import uuid

import pytest


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True, timeout=30)


def netns_available() -> str:
    """Empty when namespaces can be made here, else the reason they cannot."""
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
def two_nodes(rate="1gbit"):
    """Yield ``(node_a, node_b)``: dicts with ``ns``, ``addr`` and ``dev`` of each end.

    Addresses come from 198.18.0.0/15 (reserved for network benchmarks), a random /24 per use,
    so that parallel runs do not collide. Both namespaces are deleted on the way out, also when
    the body fails.
    """
    why = netns_available()
    if why:
        pytest.skip(why)
    tag = uuid.uuid4().hex[:6]
    a = {"ns": f"fda{tag}", "dev": f"fva{tag}", "addr": None}
    b = {"ns": f"fdb{tag}", "dev": f"fvb{tag}", "addr": None}
    net = f"198.{18 + random.randint(0, 1)}.{random.randint(1, 254)}"
    a["addr"], b["addr"] = f"{net}.1", f"{net}.2"
    try:
        for n in (a, b):
            _ip("netns", "add", n["ns"])
        _ip("link", "add", a["dev"], "type", "veth", "peer", "name", b["dev"])
        for n in (a, b):
            _ip("link", "set", n["dev"], "netns", n["ns"])
            _ip("-n", n["ns"], "addr", "add", f"{n['addr']}/24", "dev", n["dev"])
            _ip("-n", n["ns"], "link", "set", "lo", "up")
            _ip("-n", n["ns"], "link", "set", n["dev"], "up")
            subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    n["ns"],
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    n["dev"],
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    "512kb",
                    "latency",
                    "100ms",
                ],
                check=True,
                capture_output=True,
                timeout=30,
            )
        yield a, b
    finally:
        for n in (a, b):
            _ip("netns", "del", n["ns"], check=False)


@contextlib.contextmanager
def lonely_node():
    """A namespace with only loopback: nothing outside it can be reached, nor reach it."""
    why = netns_available()
    if why:
        pytest.skip(why)
    ns = f"fdl{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", ns)
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        _ip("netns", "del", ns, check=False)
