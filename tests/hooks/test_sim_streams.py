"""The simulated NCCL's notional streams (``fastddp.testing.sim_streams``).

What a side stream or a completion callback writes is poisoned for the compute stream until it
is ordered after that stream, and a write by the compute stream before then raises
:class:`SimRace`, as the two writes may land in either order on a GPU.
"""

import pytest
import torch
import torch.distributed as dist

from fastddp.testing import nccl_sim
from fastddp.testing.sim_streams import SimRace, SimRuntime

from .._dist import run_ranks

pytestmark = [pytest.mark.nccl_sim, pytest.mark.multiproc, pytest.mark.timeout(120)]


def _side_stream(rank, world):
    runtime = SimRuntime(torch.device("cpu"))
    x = torch.zeros(4)
    with runtime.side():
        x.add_(1)
    assert x.isnan().all(), "the compute stream must not see a side stream's write yet"
    with runtime.side():
        assert torch.equal(x, torch.ones(4)), "a side stream sees its own writes"
        x.add_(1)
    assert runtime.dirty
    runtime.synchronize()
    assert torch.equal(x, torch.full((4,), 2.0)) and not runtime.dirty
    # A write by the compute stream before it is ordered after the side stream's.
    y = torch.zeros(4, dtype=torch.int64)
    with runtime.side():
        y.add_(1)
    y.fill_(5)
    with pytest.raises(SimRace, match="written on a side stream"):
        runtime.synchronize()


def _collectives_and_streams(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    runtime = SimRuntime(torch.device("cpu"))
    # Waited for on the side stream: real there, poisoned for the compute stream until it
    # waits for the collective itself.
    t = torch.full((3,), float(rank + 1))
    work = dist.all_reduce(t, group=sim, async_op=True)
    with runtime.side():
        work.wait()
        assert torch.equal(t, torch.full((3,), 3.0))
    assert t.isnan().all(), "a wait on the side stream lands the output there only"
    work.wait()
    assert torch.equal(t, torch.full((3,), 3.0))
    # Issued on the side stream: waiting for it orders the waiter after what came before it.
    z, u = torch.zeros(2), torch.ones(2)
    with runtime.side():
        z.add_(1)
        work = dist.all_reduce(u, group=sim, async_op=True)
    assert z.isnan().all()
    work.wait()
    assert torch.equal(z, torch.ones(2)) and torch.equal(u, torch.full((2,), 2.0))


def _completion(out, result):
    def callback(fut):
        out.copy_(fut.value()[0])
        result.set_result(out)

    return callback


def _callbacks(rank, world):
    nccl_sim.install()
    sim = dist.new_group(backend=nccl_sim.BACKEND)
    runtime = SimRuntime(torch.device("cpu"))
    # The callback runs at once (the future is complete), its writes land at wait_result.
    t, out, result = torch.full((3,), float(rank + 1)), torch.zeros(3), torch.futures.Future()
    runtime.then(dist.all_reduce(t, group=sim, async_op=True), _completion(out, result))
    assert result.done() and out.isnan().all(), "a reader must wait for the result first"
    runtime.wait_result(result)
    assert torch.equal(out, torch.full((3,), 3.0))
    # A buffer the callback wrote, reused before the reader waited for the result.
    t, out, result = torch.ones(3), torch.zeros(3), torch.futures.Future()
    runtime.then(dist.all_reduce(t, group=sim, async_op=True), _completion(out, result))
    out.zero_()
    with pytest.raises(SimRace, match="written on a side stream"):
        runtime.wait_result(result)
    # synchronize() orders after the side stream only, as on CUDA: a callback's stream is
    # one of torch's pool, which only its result's events reach.
    t, out, result = torch.ones(3), torch.zeros(3), torch.futures.Future()
    runtime.then(dist.all_reduce(t, group=sim, async_op=True), _completion(out, result))
    runtime.synchronize()
    assert out.isnan().all(), "synchronize() must not land a callback's writes"
    runtime.wait_result(result)
    assert torch.equal(out, torch.full((3,), 2.0))


def test_a_side_stream_write_is_hidden_until_the_compute_stream_is_ordered_after_it():
    run_ranks(_side_stream, 1)


def test_a_collective_waited_for_on_the_side_stream_is_real_there_only():
    run_ranks(_collectives_and_streams, 2)


def test_a_callback_write_is_hidden_until_its_result_is_waited_for():
    run_ranks(_callbacks, 2)
