"""Whether the nodes reach each other where their workers will listen, before those start.

Nodes that reach the rendezvous can still fail to reach each other: the workers listen for
Gloo and NCCL's bootstrap on ports the kernel picks, on the interface of
``GLOO_SOCKET_IFNAME``, and a firewall that lets only the master's port through leaves them
waiting in ``init_process_group`` until its timeout. During the roll call each launcher
listens on a port the kernel picks, on the address its workers will use, and connects to the
ports of the first :data:`PEERS` other nodes that signed in: a connection that gets no answer
(or an unreachable host) ends the launch with the two addresses, in seconds. A refused one is
judged by the roll call: it passes where that launcher has exited (its heartbeat stopped),
and is a firewall that rejects where the launcher still runs, since its port stays open
until it exits.
"""

import os
import socket
import threading
from typing import Callable, Optional

from fastddp.launch import net

__all__ = ["PEERS", "Prober", "listen", "workers_address"]

PEERS = 8  # the nodes each node connects to: enough to see a firewall, few for big jobs
PROBE_S = 5.0  # how long a connection may take
TRIES = 2  # a connection is tried again once before the nodes are called apart
REFUSED = "connection refused, though that launcher runs: a firewall that rejects"
_LISTENING: list[socket.socket] = []  # open until the process exits (see listen())


def workers_address(route: str, environ=os.environ) -> str:
    """The address the workers will listen on: that of ``GLOO_SOCKET_IFNAME`` where it names
    one interface with an IPv4 address, else ``route`` (the one toward the rendezvous)."""
    names = [n for n in environ.get("GLOO_SOCKET_IFNAME", "").split(",") if n]
    if len(names) == 1:
        for address, name in net.interfaces().items():
            if name == names[0]:
                return address
    return route


def listen(address: str) -> int:
    """Listen on ``address`` at a port the kernel picks, and return that port; 0 where no
    socket can be made (the others then do not try this node). The socket stays open until
    the process exits: a node that reads this card after this node's rendezvous still finds
    it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        sock = socket.create_server((address, 0), family=family, backlog=socket.SOMAXCONN)
    except OSError:
        return 0
    _LISTENING.append(sock)
    return sock.getsockname()[1]


class Prober:
    """Connects to other nodes' ports in threads of its own; :attr:`problems` collects what
    failed, as lines that name both nodes.

    Args:
        mine: this node's name and address, for the messages (which the others read too).
        rendezvous: the rendezvous ``host:port``, which both nodes reach.
    """

    def __init__(self, mine: str, rendezvous: str) -> None:
        self._mine = mine
        self._rendezvous = rendezvous
        self._tried = 0
        self._running = 0
        self._lock = threading.Lock()
        self.problems: list[str] = []
        self.refused: dict[int, tuple[str, str, int]] = {}  # key: (name, address, port)

    def probe(self, name: str, address: str, port: int, key: int = 0) -> None:
        """Connect to ``address:port`` (``name``'s), unless :data:`PEERS` nodes were tried; a
        refusal goes into :attr:`refused` under ``key``."""
        if port <= 0 or self._tried >= PEERS:
            return
        self._tried += 1
        with self._lock:
            self._running += 1
        args = (name, address, port, key)
        threading.Thread(target=self._run, args=args, name="fastddp-reach", daemon=True).start()

    def pending(self) -> bool:
        """Whether a connection is still being tried, or a refusal judged."""
        with self._lock:
            return self._running > 0 or bool(self.refused)

    def judge_refused(self, alive: Callable[[int], Optional[bool]]) -> None:
        """Judge the refused connections by ``alive(key)``: whether that launcher runs (None
        while that is not known). A running launcher's port is open: its refusal is a
        firewall's, and a problem."""
        with self._lock:
            refused = dict(self.refused)
        for key, (name, address, port) in refused.items():
            runs = alive(key)
            if runs is None:
                continue
            with self._lock:
                del self.refused[key]
                if runs:
                    self.problems.append(self.problem(name, address, port, REFUSED))

    def _run(self, name: str, address: str, port: int, key: int) -> None:
        why = self._connect(address, port)
        with self._lock:
            self._running -= 1
            if why == REFUSED:
                self.refused[key] = (name, address, port)
            elif why is not None:
                self.problems.append(self.problem(name, address, port, why))

    def problem(self, name: str, address: str, port: int, why: str) -> str:
        """The line that says this node cannot reach ``name``'s ``address:port``."""
        return (
            f"{self._mine} cannot reach {name} on {address}:{port}, a port the "
            f"kernel picked ({why}), though both reach the rendezvous at {self._rendezvous}: "
            "Gloo and NCCL connect every pair of nodes on such ports; let the nodes' "
            "addresses reach each other on every port (a firewall between them?)"
        )

    @staticmethod
    def _connect(address: str, port: int) -> Optional[str]:
        """None once a connection succeeds, :data:`REFUSED` where it is refused, else why
        the last try failed.

        A refusal is the port closed (that launcher has exited: a node started again leaves
        its old card behind), or a firewall that rejects rather than drops.
        """
        why = ""
        for _ in range(TRIES):
            try:
                with socket.create_connection((address, port), timeout=PROBE_S):
                    return None
            except ConnectionRefusedError:
                return REFUSED
            except TimeoutError:
                why = f"no answer within {PROBE_S:g} s"
            except OSError as e:
                why = e.strerror or type(e).__name__
        return why
