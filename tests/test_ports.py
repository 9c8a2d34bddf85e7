"""The tests' free ports: below the ephemeral range, and free."""

import socket

from fastddp.testing import ports


def test_a_free_port_lies_below_the_ephemeral_range_and_binds():
    low, high = ports._span()
    if ports._ephemeral_start() >= 2024:
        assert high == ports._ephemeral_start() and low <= ports.LOWEST
    drawn = {ports.free_port() for _ in range(20)}
    assert all(low <= p < high for p in drawn), (drawn, low, high)
    assert len(drawn) > 1, "the draw is not random"
    with socket.socket() as s:
        s.bind(("", drawn.pop()))


def test_the_span_keeps_below_a_low_ephemeral_range(monkeypatch):
    for start, span in [(32768, (20000, 32768)), (15000, (5000, 15000)), (1024, (20000, 30000))]:
        monkeypatch.setattr(ports, "_ephemeral_start", lambda start=start: start)
        assert ports._span() == span, start


def test_a_port_in_use_is_not_drawn(monkeypatch):
    real = ports._draw.randrange
    with socket.socket() as held:
        held.bind(("", 0))
        taken = held.getsockname()[1]
        # A draw that offers the held port twice must pass it over and draw again.
        offers = iter([taken, taken])
        monkeypatch.setattr(
            ports._draw, "randrange", lambda lo, hi: next(offers, None) or real(lo, hi)
        )
        assert ports.free_port() != taken
        assert next(offers, None) is None, "the held port was not offered"
