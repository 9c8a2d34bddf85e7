import pytest
import torch

from fastddp.testing import netns

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
    """Skip the tests of the network-namespace bed, with the reason, where it cannot be built."""
    why = netns.unavailable_reason()
    if why:
        for item in items:
            if item.get_closest_marker("netns"):
                item.add_marker(pytest.mark.skip(reason=why))
