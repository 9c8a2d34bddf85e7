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
    "PortTaken",
    "check_port_free",
    "check_store",
    "ephemeral_range",
    "interfaces",
    "is_local",
    "port_states",
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
    if family == socket.AF_INET6:
        return local, _interfaces6().get(str(ipaddress.ip_address(local.split("%")[0])))
    return local, interfaces().get(local)


def _interfaces6() -> dict[str, str]:
    """IPv6 address -> interface name (Linux's /proc/net/if_inet6; SIOCGIFADDR is IPv4's):
    without it an IPv6 master's interface went unset for Gloo and NCCL."""
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [row.split() for row in f]
    except OSError:
        return {}
    return {str(ipaddress.IPv6Address(int(r[0], 16))): r[-1] for r in rows if len(r) >= 6}


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


class PortTaken(LaunchError):
    """The master's port is bound on this node. ``listened`` is True where a listener holds it,
    False where only connections do (their local end), None where this system does not say."""

    def __init__(self, message: str, listened: Optional[bool]) -> None:
        super().__init__(message)
        self.listened = listened


# The states of /proc/net/tcp, by their hex code, that a socket holding a port can be in.
_TCP_STATES = {
    "01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "04": "FIN_WAIT1",
    "05": "FIN_WAIT2", "06": "TIME_WAIT", "07": "CLOSE", "08": "CLOSE_WAIT", "09": "LAST_ACK",
    "0A": "LISTEN", "0B": "CLOSING",
}  # fmt: skip


def port_states(port: int) -> Optional[dict]:
    """How many of this network namespace's TCP sockets have ``port`` as their local port, by
    state (``{"TIME_WAIT": 3}``); None where the kernel's tables cannot be read (not Linux)."""
    found: dict[str, int] = {}
    read = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and int(fields[1].rsplit(":", 1)[1], 16) == port:
                state = _TCP_STATES.get(fields[3], fields[3])
                found[state] = found.get(state, 0) + 1
    return found if read else None


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections, both ends included."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def check_port_free(addr: str, port: int) -> None:
    """Raise :class:`PortTaken` if ``port`` is already bound on this node."""
    with socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise _taken(port) from None
            raise


def _taken(port: int) -> PortTaken:
    head = f"port {port} on this node (the master) is already in use, so the rendezvous cannot "
    states = port_states(port)
    if not states or "LISTEN" in states:
        return PortTaken(
            head + "listen there. Another job or a leftover process holds it (ss -ltnp "
            f"'sport = :{port}'); choose another with --master-port (or --rdzv-endpoint "
            "host:port)",
            None if not states else True,
        )
    # No listener: connections hold it as their local end, which the kernel gives outgoing
    # connections from its ephemeral range, and a closed one keeps for a minute (TIME_WAIT),
    # where even SO_REUSEADDR may not bind it. Another port there can be taken next time.
    low, high = ephemeral_range()
    held = ", ".join(f"{n} {state}" for state, n in sorted(states.items()))
    if low <= port <= high:
        why = (
            f"it lies in this machine's ephemeral range {low}-{high} "
            "(net.ipv4.ip_local_port_range), from which every outgoing connection takes its "
            "local port, and a closed one keeps it for a minute. Choose a port below "
            f"{low} with --master-port (or --rdzv-endpoint host:port), as torchrun's default "
            "29500 is"
        )
    else:
        why = (
            "closed ones keep it for a minute: choose another with --master-port (or "
            "--rdzv-endpoint host:port), or wait"
        )
    return PortTaken(
        head + f"listen there. No process listens on it: connections of this machine hold it "
        f"as their own end ({held}; ss -tan 'sport = :{port}'), and {why}",
        False,
    )


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
    store: bool = False,
) -> None:
    """Connect to the master's port until it answers or ``deadline`` seconds pass.

    A refused connection (the host is there, nothing listens yet) is waited for up to
    ``not_started`` seconds if that is longer (:data:`NOT_STARTED_S` for a node waiting for
    node 0), and ``say`` is told why once ``deadline`` has passed. ``local`` and ``iface``
    (this node's side of the route) only go into the error message. With ``store``, what
    answers must also answer a store query (:func:`check_store`).
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
            with socket.create_connection((addr, port), timeout=min(left, 3.0)) as conn:
                if store:
                    check_store(conn, f"{addr}:{port}")
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


# c10d's TCPStore protocol, the same for its libuv and its classic server: a client first
# sends VALIDATE (query 0) with this magic number (no reply, a wrong one closes the
# connection), then GETNUMKEYS (query 7), answered with a native int64.
_VALIDATE, _GETNUMKEYS, _STORE_MAGIC = 0, 7, 0x3C85F7CE
STORE_ANSWER_S = 5.0


def check_store(conn: socket.socket, where: str) -> None:
    """Raise :class:`LaunchError` unless ``conn`` is to a ``torch.distributed`` store.

    A port that accepts connections may belong to another program; torchrun's agents would
    then wait on it for ever (a silent one) or fail minutes later. One read-only query tells,
    within :data:`STORE_ANSWER_S` seconds.
    """
    timeout = STORE_ANSWER_S
    conn.settimeout(timeout)
    answer = b""
    try:
        conn.sendall(struct.pack("=BIB", _VALIDATE, _STORE_MAGIC, _GETNUMKEYS))
        while len(answer) < 8:
            more = conn.recv(8 - len(answer))
            if not more:
                break
            answer += more
    except (socket.timeout, TimeoutError):
        why = f"it sent no answer to a store query within {timeout:.0f} s"
    except OSError as e:  # a reset: closed with the query unread
        why = f"it closed the connection at a store query ({e.strerror or e})"
    else:
        keys = struct.unpack("=q", answer)[0] if len(answer) == 8 else -1
        if 0 <= keys < 1 << 32:
            return
        why = (
            f"it answered a store query with {answer[:8]!r}"
            if answer
            else "it closed the connection at a store query"
        )
    raise LaunchError(
        f"{where} accepts connections but is not a torch.distributed store: {why}. Another "
        "program holds that port, or the port is wrong: give node 0's --master-port (or "
        "--rdzv-endpoint host:port), a port no other program uses there, on every node"
    )
