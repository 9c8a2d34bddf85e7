"""Network helpers for the preflight: resolve, list interfaces, route, check and probe ports.

Each check raises :class:`LaunchError` with a message that names the problem and the fix.
"""

import errno
import ipaddress
import socket
import struct
import threading
import time
from typing import Callable, Optional

__all__ = [
    "LaunchError",
    "check_port_free",
    "interfaces",
    "is_local",
    "probe",
    "resolve",
    "route_to",
]


class LaunchError(RuntimeError):
    """A launch that cannot work; the message names the problem and the fix."""


def resolve(host: str, timeout: float) -> str:
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


def interfaces() -> dict[str, str]:
    """Return IPv4 address -> interface name, for the interfaces that are up."""
    import fcntl  # POSIX only: imported here so that importing fastddp works everywhere

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


def route_to(addr: str, port: int) -> tuple[str, Optional[str]]:
    """Return the local address (and its interface) the kernel would use to reach ``addr``."""
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
    return local, interfaces().get(local)


def is_local(addr: str) -> bool:
    """Whether ``addr`` is a loopback address or one of this machine's interfaces (IPv6 ones
    too, which :func:`interfaces` does not list: this machine can bind to them)."""
    ip = ipaddress.ip_address(addr)
    if ip.is_loopback or addr in interfaces():
        return True
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET) as s:
        try:
            s.bind((addr, 0))
        except OSError:
            return False
    return True


def check_port_free(addr: str, port: int) -> None:
    """Raise :class:`LaunchError` if ``port`` is already bound on this node."""
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


# How long a refused connection is waited for: the master's host answers, but node 0's
# launcher may still be importing torch (a minute on a cold shared filesystem).
NOT_STARTED_S = 300.0


def probe(
    addr: str,
    port: int,
    local: str,
    iface: Optional[str],
    deadline: float,
    say: Optional[Callable[[str], None]] = None,
    not_started: float = 0.0,
) -> None:
    """Connect to the master's port until it answers or ``deadline`` seconds pass.

    A refused connection (the host is there, nothing listens yet) is waited for up to
    ``not_started`` seconds if that is longer (:data:`NOT_STARTED_S` for a node waiting for
    node 0), and ``say`` is told why once ``deadline`` has passed. ``local`` and ``iface``
    (this node's side of the route) only go into the error message.
    """
    start = time.monotonic()
    last: Optional[OSError] = None
    told = False
    while True:
        elapsed = time.monotonic() - start
        refused = isinstance(last, ConnectionRefusedError)
        limit = max(deadline, not_started) if refused else deadline
        left = limit - elapsed
        if left <= 0:
            break
        if refused and elapsed >= deadline and not told and say is not None:
            say(
                f"waiting for the master {addr}:{port}: nothing listens there yet (connection "
                f"refused for {elapsed:.0f} s); node 0 may still be starting, or the port is "
                f"wrong. Waiting up to {limit:.0f} s in all"
            )
            told = True
        try:
            with socket.create_connection((addr, port), timeout=min(left, 3.0)):
                return
        except OSError as e:
            last = e
            time.sleep(min(0.5, max(0.0, left)))
    refused = isinstance(last, ConnectionRefusedError)
    if refused:
        why = (
            "nothing listens there (connection refused): node 0 has not started, or the "
            "port is wrong"
        )
    elif isinstance(last, (socket.timeout, TimeoutError)):
        why = "no answer (timed out): a wrong address, a firewall, or node 0 is down"
    else:
        why = f"{last.strerror if last else 'unknown error'}"
    raise LaunchError(
        f"cannot reach the master {addr}:{port} within {limit:.0f} s from this node "
        f"(local address {local}, interface {iface or 'unknown'}): {why}. Check that node 0 runs "
        "the same command, that --master-addr/--master-port (or --rdzv-endpoint) are right, "
        "that this interface is on the master's network, and that no firewall blocks the "
        + ("port" if refused else "port; --preflight-timeout waits longer")
    )
