"""The hook core's contracts: collectives per bucket, models sharing a state, buckets that
bypass the hook, rank-local failures, resumes across bucket layouts, checkpoints of another
rank or model. Real processes on Gloo; each test would fail (or hang until its time limit)
without the behaviour it names."""

import copy
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import _reduce

from ._dist import run_ranks

MODES = {
    "bf16": {},
    "bf16-fp32acc-ef": {"accumulate_dtype": torch.float32, "error_feedback": True},
    "int8-ef": {"dtype": torch.int8, "error_feedback": True},
}


def _seq(group=None):
    pg = group or dist.group.WORLD
    return pg._get_sequence_number_for_group()


def _state_seq(state):
    # Collectives issued on every group the state uses (on CPU a later stage has its own).
    groups = {id(g or dist.group.WORLD): g for g in state._topology.groups.values()}
    return sum(_seq(g) for g in groups.values())


def _collectives_per_bucket(rank, world, settings, expected):
    state = fastddp.CompressState(**settings)
    buf = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    _reduce(state, buf.clone(), 0).wait()  # the first call also checks the settings
    before = _state_seq(state)
    _reduce(state, buf.clone(), 0).wait()
    count = _state_seq(state) - before
    assert count == expected, f"{count} collectives for one bucket"


@pytest.mark.parametrize(
    "mode, expected",
    [("bf16", 1), ("bf16-fp32acc-ef", 2), ("int8-ef", 2)],
)
def test_one_all_to_all_and_one_all_gather_per_bucket(mode, expected):
    # int8 scales travel behind their values: one all-to-all and one all-gather, not two each.
    run_ranks(_collectives_per_bucket, 2, MODES[mode], expected)


class _Net(nn.Module):
    """Layers registered in one order and run in another, so that DDP's rebuilt buckets
    (gradient order) all differ from its first ones (registration order)."""

    def __init__(self, width=24, depth=4, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _ddp(module, **kwargs):
    # About one layer per bucket: at least three buckets in either layout.
    return DDP(module, bucket_cap_mb_list=[0.0015] * 8, **kwargs)


def _step(model, gen, opt=None, width=24):
    x = torch.randn(8, width, generator=gen)
    if opt is not None:
        opt.zero_grad()
    model(x).square().mean().backward()
    if opt is not None:
        opt.step()


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _two_models_one_state(rank, world, settings):
    plain_a, plain_b = _ddp(_Net(seed=1)), _ddp(_Net(seed=2))
    hooked_a, hooked_b = _ddp(_Net(seed=1)), _ddp(_Net(seed=2))
    state = None if settings is None else fastddp.CompressState(**settings)
    for m in (hooked_a, hooked_b):
        m.register_comm_hook(state, fastddp.compress_hook)
    if state is None:
        state = fastddp.hooks.hook._default_state = fastddp.CompressState()
    gen = torch.Generator().manual_seed(rank)
    allocations = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sharing is supported: no warning
        for _ in range(4):
            x = torch.randn(8, 24, generator=gen)
            for a, b in ((plain_a, plain_b), (hooked_a, hooked_b)):
                a.zero_grad()
                b.zero_grad()
                (a(x).square().mean() + b(x).abs().mean()).backward()  # one backward, two models
            for plain, hooked in ((plain_a, hooked_a), (plain_b, hooked_b)):
                want, got = _grads(plain), _grads(hooked)
                err = (got - want).abs().max().item()
                assert err <= 2**-5 * want.abs().max().item(), err
            allocations.append(state.stats()["allocations"])
    # Each model keeps its own buffers: no reallocation once both have rebuilt their buckets.
    assert allocations[1] == allocations[-1], allocations
    assert len(state.stats()["buckets"]) >= 6


@pytest.mark.parametrize("mode", [None, "bf16-fp32acc-ef", "int8-ef"])
def test_two_models_share_one_state(mode):
    run_ranks(_two_models_one_state, 2, None if mode is None else MODES[mode], timeout=120)


def _partial_hook(state, bucket):
    # Only even buckets are compressed; the rest, the last one included, go to PyTorch's hook.
    if bucket.index() % 2 == 0:
        return fastddp.compress_hook(state, bucket)
    return default_hooks.allreduce_hook(None, bucket)


def _waiting_hook(state, bucket):
    fut = fastddp.compress_hook(state, bucket)
    state.flush()  # the documented way to wait on the future inside a hook
    fut.wait()
    return fut


def _hooks_that_bypass_the_pipeline(rank, world, settings):
    for hook in (_partial_hook, _waiting_hook):
        plain, hooked = _ddp(_Net()), _ddp(_Net())
        state = fastddp.CompressState(**settings)
        hooked.register_comm_hook(state, hook)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            x = torch.randn(8, 24, generator=gen)
            for m in (plain, hooked):
                m.zero_grad()
                m(x).square().mean().backward()
            want, got = _grads(plain), _grads(hooked)
            assert (got - want).abs().max() <= 2**-5 * want.abs().max()
        assert state.stats()["calls"] > 0


@pytest.mark.parametrize("mode", ["bf16-fp32acc-ef", "int8-ef"])
def test_hooks_that_skip_or_wait_on_buckets_do_not_hang(mode):
    run_ranks(_hooks_that_bypass_the_pipeline, 2, MODES[mode], timeout=120)


def _stale_pending(rank, world):
    state = fastddp.CompressState(accumulate_dtype=torch.float32)
    a = torch.full((100,), float(rank + 1))
    fut = _reduce(state, a, 0, is_last=False)
    assert not fut.done()  # its all-gather waits for the next bucket
    # The same bucket again, as in a new step whose previous last bucket never came.
    with pytest.warns(UserWarning, match="previous reduction still had pending stages"):
        fut2 = _reduce(state, torch.full((100,), 2.0 * (rank + 1)), 0, is_last=True)
    torch.testing.assert_close(fut.wait(), torch.full((100,), 1.5))
    torch.testing.assert_close(fut2.wait(), torch.full((100,), 3.0))
    # flush() finishes pending work on demand.
    fut3 = _reduce(state, torch.full((100,), float(rank)), 1, is_last=False)
    state.flush()
    assert fut3.done()
    torch.testing.assert_close(fut3.wait(), torch.full((100,), 0.5))


def test_stale_pending_work_is_finished_with_a_warning():
    run_ranks(_stale_pending, 2)


def _local_failure(rank, world):
    import fastddp.hooks.state as state_module

    state = fastddp.CompressState(dtype=torch.int8)
    first = torch.full((300,), float(rank + 1))
    fut = _reduce(state, first, 0, is_last=False)
    if rank == 1:
        # This rank runs out of memory allocating the next bucket (as a GPU might).
        def no_memory(*args, **kwargs):
            raise MemoryError("injected: out of memory")

        state_module.allocate = no_memory
        with pytest.raises(MemoryError, match="injected"):
            _reduce(state, torch.ones(50), 1, is_last=True)
        for _ in range(2):  # every later call refuses, with the same clear error
            with pytest.raises(RuntimeError, match="an earlier reduction failed on this rank"):
                _reduce(state, torch.ones(50), 1)
    else:
        # The other rank's next bucket is empty: it issues no collective of its own, only the
        # pending all-gather of bucket 0, which rank 1 must issue before failing.
        _reduce(state, torch.ones(0), 1, is_last=True)
        torch.testing.assert_close(fut.wait(), torch.full((300,), 1.5), rtol=0, atol=0.02)


def test_a_rank_local_failure_still_issues_pending_collectives():
    run_ranks(_local_failure, 2, timeout=60)


def _resume_across_layouts(rank, world, settings):
    def build():
        model = _ddp(_Net(depth=5))
        state = fastddp.CompressState(**settings)
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    model, state, opt = build()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        _step(model, gen, opt)
    assert len(state.stats()["buckets"]) >= 3
    saved = copy.deepcopy(
        {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    )
    gen_state = gen.get_state()
    for _ in range(5):
        _step(model, gen, opt)
    want = [p.detach().clone() for p in model.parameters()]

    model, state, opt = build()  # after a restart: the first step uses the initial layout
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    gen.set_state(gen_state)
    for _ in range(5):
        _step(model, gen, opt)
    assert state.stats()["parked_residuals"] == 0
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p, w), f"resumed run differs by {(p - w).abs().max().item():.3e}"


@pytest.mark.parametrize("mode", ["bf16-fp32acc-ef"])
def test_resume_is_exact_when_every_bucket_changes_layout(mode):
    run_ranks(_resume_across_layouts, 2, MODES[mode], timeout=120)


def _wrong_checkpoints(rank, world):
    settings = MODES["bf16-fp32acc-ef"]
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    model.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        _step(model, gen)
    mine = state.state_dict()
    assert (mine["rank"], mine["world_size"]) == (rank, world)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    # Each rank loads its neighbour's residuals: refused on every rank, at the first step.
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    state.load_state_dict(everyone[(rank + 1) % world])
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="was given another rank's residuals") as info:
        _step(model, gen)
    assert "rank 0 loaded the state dict of rank 1 of 2" in str(info.value)

    # A checkpoint of a model with other parameter sizes: refused, not silently misapplied.
    model = _ddp(_Net(width=20))
    state = fastddp.CompressState(**settings)
    state.load_state_dict(mine)
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="the checkpoint belongs to another model"):
        _step(model, gen, width=20)


def test_checkpoints_of_another_rank_or_model_are_refused():
    run_ranks(_wrong_checkpoints, 2, timeout=120)


def _completion_thread(rank, world, settings):
    # Whatever waits on the hook's future runs where the future completes. fastddp completes
    # CPU futures on the thread that calls the hook, never on a Gloo thread, so nothing of
    # fastddp's is left for a Gloo thread to run while the interpreter exits.
    seen = set()

    def recording_hook(state, bucket):
        def note(fut):
            seen.add(threading.get_ident())
            return fut.value()

        return fastddp.compress_hook(state, bucket).then(note)

    model = _ddp(_Net())
    model.register_comm_hook(fastddp.CompressState(**settings), recording_hook)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        _step(model, gen)
    assert seen == {threading.get_ident()}, f"completed on threads {seen}"


@pytest.mark.parametrize("mode", list(MODES))
def test_futures_complete_on_the_hook_thread(mode):
    run_ranks(_completion_thread, 2, MODES[mode])
