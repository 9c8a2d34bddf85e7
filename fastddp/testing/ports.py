"""Free TCP ports for the tests' jobs, taken below the kernel's ephemeral range.

A port the kernel hands out for a bind to port 0 comes from its ephemeral range, from which
every outgoing connection of the suite's other streams takes its local port too. Between the
test closing its probe socket and the job's master binding the port, one of them can take it,
and the launcher's preflight then refuses the port as in use. Below that range the kernel hands
out nothing by itself, so a port found free there stays free unless another test draws it: the
draw is random, and checked by binding it.
"""

import random
import socket
import time

from fastddp.launch.net import ephemeral_range, port_states

__all__ = ["free_port"]

LOWEST = 20000
_draw = random.SystemRandom()  # not the global generator, which tests seed


def _ephemeral_start() -> int:
    return ephemeral_range()[0]


def _span() -> tuple[int, int]:
    """The ports to draw from, ``[low, high)``: from 20000 (or lower, where the ephemeral range
    starts lower) up to the ephemeral range. Where it starts below 2024 there is no room under
    it, and the draw is from 20000-29999, inside it, checked like any other."""
    start = _ephemeral_start()
    low = min(LOWEST, max(1024, start - 10000))
    return (low, start) if start - low >= 1000 else (LOWEST, LOWEST + 10000)


def free_port(tries: int = 200) -> int:
    """A TCP port nothing is bound to now on any address, drawn below the ephemeral range."""
    low, high = _span()
    for _ in range(tries):
        port = _draw.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {low}-{high - 1} after {tries} draws")


def port_in_time_wait(wait: float = 5.0) -> int:
    """A port of the ephemeral range that a closed outgoing connection holds in TIME_WAIT (for
    a minute): bound to no listener, and yet no listener can bind it, SO_REUSEADDR or not."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.socket() as client:
            client.connect(server.getsockname())
            accepted, _ = server.accept()
            port = client.getsockname()[1]
            client.shutdown(socket.SHUT_RDWR)  # this end closes first, so it waits
        accepted.close()
    deadline = time.monotonic() + wait
    while (port_states(port) or {}).get("TIME_WAIT") is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"port {port} did not reach TIME_WAIT: {port_states(port)}")
        time.sleep(0.01)
    return port
