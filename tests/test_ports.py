"""The tests' free ports: below the ephemeral range, and free."""

import socket

from fastddp.testing import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    start = ports._ephemeral_start()
    drawn = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST <= p < max(start, ports.LOWEST + 1000) for p in drawn), drawn
    assert len(drawn) > 1, "the draw is not random"
    port = drawn.pop()
    with socket.socket() as s:
        s.bind(("", port))


def test_a_port_in_use_is_not_drawn(monkeypatch):
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        # A draw that offers the held port first must pass it over.
        offers = iter([taken, taken, taken + 1 if taken + 1 != 65536 else taken - 1])
        monkeypatch.setattr(ports._draw, "randrange", lambda lo, hi: next(offers))
        assert ports.free_port() != taken
