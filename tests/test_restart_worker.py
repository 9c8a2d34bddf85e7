"""The pieces of the restart tests' worker (``fastddp.testing.restart_worker``) that need no
launcher; its launched jobs are ``tests/launch/test_restarts.py``'s."""

import gc

import pytest
from torch import nn

from fastddp.testing import restart_worker

from ._dist import run_ranks


class _Recording(nn.Linear):
    """A layer that notes whether the collector is on whenever its parameters are listed."""

    seen: list[bool] = []

    def named_parameters(self, *args, **kwargs):
        _Recording.seen.append(gc.isenabled())
        return super().named_parameters(*args, **kwargs)


def _build(rank: int, world_size: int) -> tuple[list[bool], bool]:
    _Recording.seen.clear()
    restart_worker.ddp_collector_paused(_Recording(4, 4))
    return list(_Recording.seen), gc.isenabled()


@pytest.mark.multiproc
def test_ddp_is_built_with_the_collector_paused_and_it_comes_back():
    for seen, after in run_ranks(_build, 2):
        # DDP's constructor lists the parameters (to check them across ranks, to bucket them).
        assert seen and not any(seen), seen
        assert after


def test_the_collector_comes_back_when_ddp_raises_and_stays_off_if_it_was():
    # No process group in this process: DDP's constructor raises.
    with pytest.raises(ValueError, match="process group"):
        restart_worker.ddp_collector_paused(nn.Linear(4, 4))
    assert gc.isenabled()
    gc.disable()
    try:
        with pytest.raises(ValueError, match="process group"):
            restart_worker.ddp_collector_paused(nn.Linear(4, 4))
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("spec", ["5", "5:x", ":1", "a:b"])
def test_a_bad_kill_is_refused_with_the_form_it_takes(spec):
    with pytest.raises(SystemExit, match=f"--kill '{spec}': expected STEP:RANK"):
        restart_worker._kills([spec])
