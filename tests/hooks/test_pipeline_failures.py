"""Failures the pipeline meets outside a hook call's own stack: a decode that raises in its
completion callback (on CUDA, a ``then`` callback of the last collective's future), and a
collective or decode that fails in a flush (at the end of the backward pass, in
``state.flush()``). Either must fail the state, and the state's native runner with it: the
runner takes its planned buckets before any Python code runs, so a failure it is not told of
lets it go on issuing collectives that the ranks no longer match."""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks.job import Job
from fastddp.hooks.paths import Path
from fastddp.hooks.pipeline import Pipeline
from fastddp.hooks.presets import preset
from fastddp.testing import nccl_sim

from .._dist import run_ranks
from .test_native import _Recorded, _TaggedPath
from .test_nccl_sim import _Net

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(120)]

REFUSED = r"earlier reduction failed on this rank \(RuntimeError: decode failed"


def _step(model, gen):
    model.zero_grad()
    model(torch.randn(8, 24, generator=gen)).square().mean().backward()


@contextlib.contextmanager
def _first_decode_fails():
    """The next decode on the Python path raises (as one running out of memory would)."""
    real, calls = Path.finish, []

    def finish(self, job):
        calls.append(job)
        if len(calls) == 1:
            raise RuntimeError("decode failed")
        real(self, job)

    Path.finish = finish
    try:
        yield calls
    finally:
        Path.finish = real


def _callback_failure(rank, world, mode):
    # Two models share a state: the first's buckets run in the native runner, the second's
    # new ones on the Python path, where the decode of the first (not the last: the flush at
    # the last would see it) fails in its callback, which the simulated NCCL runs at once.
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    torch.manual_seed(0)
    state = fastddp.CompressState(process_group=sim, **preset(mode))
    gen = torch.Generator().manual_seed(rank)
    steady = DDP(_Net(), process_group=sim, bucket_cap_mb=0.002)
    steady.register_comm_hook(state, fastddp.compress_hook)
    for _ in range(3):
        _step(steady, gen)
    assert len(state._runner) > 2
    fresh = DDP(_Net(), process_group=sim, bucket_cap_mb=0.002)
    fresh.register_comm_hook(state, fastddp.compress_hook)
    _step(fresh, gen)  # its first layout; the second (DDP's rebuilt buckets) fails
    with _first_decode_fails() as decoded, pytest.raises(RuntimeError, match="decode failed"):
        _step(fresh, gen)
    assert decoded and decoded[0].result.done()
    with pytest.raises(RuntimeError, match="decode failed"):
        decoded[0].result.wait()  # what DDP waits on
    # The runner refuses as the Python path does, before it issues anything.
    issued = sim.collectives
    with pytest.raises(RuntimeError, match=REFUSED):
        _step(steady, gen)
    assert sim.collectives == issued, "the runner went on after the failure"
    with pytest.raises(RuntimeError, match=REFUSED):
        state.flush()


@pytest.mark.nccl_sim
@pytest.mark.parametrize("mode", ["bf16", "int8-ef"])  # one stage; two (decoded a call later)
def test_a_decode_failing_in_its_callback_stops_the_native_runner(mode):
    run_ranks(_callback_failure, 2, mode)


def _flush_failure(rank, world):
    # A later stage's collective fails in a flush (the end of the backward pass runs one when
    # the last bucket bypasses the hook; state.flush() another).
    inner = dist.new_group([0])
    told = []
    pipeline = Pipeline()
    pipeline.on_fail = lambda why, in_callback=False: told.append((why, in_callback))
    path = _TaggedPath(_Recorded(inner, [], fail_at=1), 2)
    job = Job(path, 0, torch.zeros(1), (dist.group.WORLD,), 1, True, (), None)
    pipeline.submit(lambda: job, is_last=False)
    with pytest.raises(RuntimeError, match="tagged 1 failed"):
        pipeline.flush()
    assert told == [("RuntimeError: the collective tagged 1 failed on this rank", False)], told
    with pytest.raises(RuntimeError, match="an earlier reduction failed on this rank"):
        pipeline.check()


def test_a_failure_in_a_flush_fails_the_state():
    run_ranks(_flush_failure, 1)
