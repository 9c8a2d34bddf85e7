import gc

import pytest
import torch

from fastddp.testing import netns, slack

# Each stream ends with its costliest tests by CPU time, its own and its launched jobs'; pytester
# runs a session inside a test.
pytest_plugins = ["fastddp.testing.cpu_report", "pytester"]

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


def pytest_collection_modifyitems(config, items):
    """Skip the tests of the network-namespace bed, with the reason, where it cannot be built;
    scale every test's time limit to this machine's cores (``fastddp.testing.slack``)."""
    bed = [item for item in items if item.get_closest_marker("netns")]
    why = netns.unavailable_reason() if bed else None  # the probe makes and removes a namespace
    if why:
        for item in bed:
            item.add_marker(pytest.mark.skip(reason=why))
    scale = slack.factor()
    if scale > 1.0:
        default = float(config.getini("timeout") or 0)
        for item in items:
            mark = item.get_closest_marker("timeout")
            limit = default
            if mark is not None:
                limit = float(mark.args[0] if mark.args else mark.kwargs.get("timeout", default))
            if limit > 0:
                # Prepended, so that it is the item's closest timeout mark.
                item.add_marker(pytest.mark.timeout(limit * scale), append=False)


@pytest.fixture(scope="module")
def two_nodes():
    """One pair of namespace nodes on a 1 Gbit/s bridge, for every two-node job of a module."""
    with netns.nodes(2, "1gbit") as made:
        yield made


@pytest.fixture(autouse=True)
def _ranks_of_their_own(request):
    """CUDA tests spawn their ranks for themselves: CUDA initialised in a rank stays there."""
    from . import _dist

    _dist.own_processes = request.node.get_closest_marker("cuda") is not None
    yield
    _dist.own_processes = False


def pytest_sessionfinish(session, exitstatus):
    from . import _dist

    _dist.close_pools()


def pytest_unconfigure(config):
    # The last cycle collection of a session's interpreter walks torch's objects and every
    # test's: 0.8 CPU s of a short session. Frozen, they are left out of it.
    gc.freeze()
