"""The pieces of ``fastddp.testing.restart_worker`` that need no job (its launched jobs are
``tests/launch/test_restarts.py``'s), and its ``collector_paused``, which the workers that
build DDP use (``tests/launch/_ddp_worker.py``, ``tests/diloco/_restart_worker.py``)."""

import gc

import pytest
import torch
from torch import nn

from fastddp.testing import restart_worker


def test_the_collector_is_paused_over_the_block_and_back_after_even_when_it_raises():
    with restart_worker.collector_paused():
        assert not gc.isenabled()
        # What the workers pause it for: the first optimizer imports torch._dynamo.
        torch.optim.SGD(nn.Linear(4, 4).parameters(), lr=0.1)
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="the block's error"), restart_worker.collector_paused():
        raise RuntimeError("the block's error")
    assert gc.isenabled()
    # A caller that had paused it keeps it paused.
    gc.disable()
    try:
        with restart_worker.collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("spec", ["5", "5:x", ":1", "a:b"])
def test_a_bad_kill_is_refused_with_the_form_it_takes(spec):
    with pytest.raises(SystemExit, match=f"--kill '{spec}': expected STEP:RANK"):
        restart_worker._kills([spec])
