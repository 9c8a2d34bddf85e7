"""Namespaces for the two-node tests: fastddp.netns, skipping where they cannot be made."""

import contextlib
import uuid

import pytest

from fastddp.testing import netns


@contextlib.contextmanager
def two_nodes(rate="1gbit"):
    """Yield ``(node_a, node_b)`` as dicts with ``ns``, ``dev`` and ``addr``."""
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    with netns.two_nodes(rate) as (a, b):
        yield a._asdict(), b._asdict()


@contextlib.contextmanager
def lonely_node():
    """A namespace with only loopback: nothing outside it can be reached, nor reach it."""
    why = netns.unavailable_reason()
    if why:
        pytest.skip(why)
    ns = f"fdl{uuid.uuid4().hex[:6]}"
    try:
        netns._ip("netns", "add", ns)
        netns._ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        netns._ip("netns", "del", ns, check=False)
