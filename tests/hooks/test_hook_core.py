"""The hook core's contracts: collectives per bucket, models sharing a state, buckets that
bypass the hook, rank-local failures, resumes across bucket layouts, checkpoints of another
rank or model. Real processes on Gloo; each test would fail (or hang until its time limit)
without the behaviour it names."""

import copy
import inspect
import os
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
from fastddp.hooks.presets import preset
from fastddp.hooks.slots import SLOT_COUNTERS
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks

# Presets whose reductions differ in their stages: the collective's 16-bit sum, the fp32 sum
# (all-to-all and all-gather), and int8, each with error feedback where there is one.
MODES = ["bf16", "bf16-acc-ef", "int8-ef"]


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


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "mode, expected",
    [("bf16", 1), ("bf16-acc-ef", 2), ("int8-ef", 2), ("int4-ef", 2), ("int2-ef", 2)],
)
def test_one_all_to_all_and_one_all_gather_per_bucket(mode, expected):
    # Block scales travel behind their codes: one all-to-all and one all-gather, not two each.
    run_ranks(_collectives_per_bucket, 2, preset(mode), expected)


class _Net(nn.Module):
    """Layers registered in one order and run in another, so that DDP's rebuilt buckets
    (gradient order) all differ from its first ones (registration order)."""

    def __init__(self, width=24, depth=4, seed=0, bias=True):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=bias) for _ in range(depth))

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


# Per-bucket caps hold for DDP's first layout as well as the rebuilt one. Without them (checked
# by feature, not by torch version) bucket_cap_mb gives the rebuilt layout the same buckets, but
# the first iteration puts every parameter in one: tests that need several buckets from the
# first step on skip.
_BUCKET_CAPS = "bucket_cap_mb_list" in inspect.signature(DDP.__init__).parameters
_needs_bucket_caps = pytest.mark.skipif(
    not _BUCKET_CAPS,
    reason="this torch's DistributedDataParallel has no bucket_cap_mb_list argument",
)


def _ddp(module, cap=0.0015, **kwargs):
    # About one layer per bucket: at least three buckets in either layout.
    if _BUCKET_CAPS:
        return DDP(module, bucket_cap_mb_list=[cap] * 8, **kwargs)
    return DDP(module, bucket_cap_mb=cap, **kwargs)


def _step(model, gen, opt=None, width=24):
    x = torch.randn(8, width, generator=gen)
    if opt is not None:
        opt.zero_grad()
    model(x).square().mean().backward()
    if opt is not None:
        opt.step()


def _grads(model):
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _buckets_add_up(stats):
    # Each bucket's counters keep those of earlier buckets of its index (DDP's rebuild, a
    # resume, another model's retired bucket), and those no bucket took are retired: together
    # they are the state's totals.
    entries = [*stats["buckets"].values(), *stats["retired_buckets"].values()]
    for name in SLOT_COUNTERS:
        total = sum(b[name] for b in entries)
        assert total == stats[name], (name, total, stats[name], stats["buckets"])


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
    _buckets_add_up(state.stats())
    # Loaded into a state of two models again, each bucket index's counters of both models
    # are kept (they were each other's: the second overwrote the first), and go on.
    saved = state.stats()
    loaded = fastddp.CompressState(**(settings or {}))
    loaded.load_state_dict(state.state_dict())
    for name in SLOT_COUNTERS:
        assert loaded.stats()[name] == saved[name], (name, loaded.stats(), saved)
    _buckets_add_up(loaded.stats())
    again = [_ddp(_Net(seed=1)), _ddp(_Net(seed=2))]
    for m in again:
        m.register_comm_hook(loaded, fastddp.compress_hook)
    (again[0](x).square().mean() + again[1](x).abs().mean()).backward()
    assert loaded.stats()["calls"] > saved["calls"]
    _buckets_add_up(loaded.stats())


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", [None, "bf16-acc-ef", "int8-ef"])
@_needs_bucket_caps
def test_two_models_share_one_state(mode):
    run_ranks(_two_models_one_state, 2, None if mode is None else preset(mode), timeout=120)


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


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bf16-acc-ef", "int8-ef"])
@_needs_bucket_caps
def test_hooks_that_skip_or_wait_on_buckets_do_not_hang(mode):
    run_ranks(_hooks_that_bypass_the_pipeline, 2, preset(mode), timeout=120)


def _stale_pending(rank, world):
    state = fastddp.CompressState.from_preset("bf16-acc")
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


@pytest.mark.multiproc
def test_stale_pending_work_is_finished_with_a_warning():
    run_ranks(_stale_pending, 2)


def _local_failure(rank, world):
    from fastddp.hooks.slots import Slot

    state = fastddp.CompressState(dtype=torch.int8)
    first = torch.full((300,), float(rank + 1))
    fut = _reduce(state, first, 0, is_last=False)
    if rank == 1:
        # This rank runs out of memory allocating the next bucket (as a GPU might).
        def no_memory(*args, **kwargs):
            raise MemoryError("injected: out of memory")

        Slot.give_buffers = no_memory
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


@pytest.mark.multiproc
def test_a_rank_local_failure_still_issues_pending_collectives():
    run_ranks(_local_failure, 2, timeout=60)


def _resumed(build, rank, steps, saved_state=None, again=None):
    """Train ``build()``'s model ``steps`` steps, save model, optimizer and hook state (as
    ``saved_state(state)`` returns it, if given), train ``steps`` more; then build again
    (``again()``, else ``build()``), load the checkpoint and train the same ``steps``: every
    parameter must equal the uninterrupted run's. Returns the resumed state and the saved hook
    state."""
    model, state, opt = build()
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        _step(model, gen, opt)
    hook = state.state_dict() if saved_state is None else saved_state(state)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "hook": hook})
    gen_state = gen.get_state()
    for _ in range(steps):
        _step(model, gen, opt)
    want = [p.detach().clone() for p in model.parameters()]
    model, state, opt = (again or build)()  # after a restart: the first step's initial layout
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["hook"])
    gen.set_state(gen_state)
    for _ in range(steps):
        _step(model, gen, opt)
    for p, w in zip(model.parameters(), want):
        assert torch.equal(p, w), f"resumed run differs by {(p - w).abs().max().item():.3e}"
    return state, saved["hook"]


def _resume_across_layouts(rank, world, settings, nodes=None, one_bucket=False):
    if nodes is not None:  # "nodes" told apart by the override (see test_topology.py)
        os.environ[NODE_ENV] = f"node-{nodes[rank]}"

    def build(cap=0.0015):
        if one_bucket:
            # DDP's first bucket holds the parameters in registration order, its rebuilt one
            # in gradient order: the same here, one parameter a layer run in reverse.
            model = DDP(_Net(depth=5, bias=False), bucket_cap_mb=1000)
        else:
            # (a resume under a larger cap: its first buckets hold a layer and a half, which
            # moves the same-sized weights within and across them)
            model = _ddp(_Net(depth=5), cap)
        state = fastddp.CompressState(**settings)
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def saved_state(state):
        buckets = len(state.stats()["buckets"])
        assert buckets == 1 if one_bucket else buckets >= 3
        return state.state_dict()

    state, _ = _resumed(build, rank, 5, saved_state, lambda: build(0.004))
    assert state.stats()["parked_residuals"] == 0
    _buckets_add_up(state.stats())
    want_path = "flat" if nodes is None else "hierarchical"
    assert state.stats()["topology_used"] == want_path


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bf16-acc-ef"])
@pytest.mark.parametrize("nodes", [None, (0, 0, 1, 1)], ids=["flat", "two-nodes"])
@_needs_bucket_caps
def test_resume_is_exact_when_every_bucket_changes_layout(mode, nodes):
    # Every residual goes back to the rank that rounds its element, on either path. (Block
    # codes cannot be exact here: a block's scale depends on the elements beside it, which a
    # new layout changes; test_topology.py checks that their residuals lose nothing.)
    world = 2 if nodes is None else len(nodes)
    run_ranks(_resume_across_layouts, world, preset(mode), nodes, timeout=150)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["int8-ef", "int4-ef", "int2-ef"])
@pytest.mark.parametrize("nodes", [None, (0, 0, 1, 1)], ids=["flat", "two-nodes"])
def test_block_codes_resume_exactly_in_one_bucket(mode, nodes):
    # One bucket keeps its layout across the restart: both residuals (of the first rounding
    # and of the re-encoded sum) come back to the bit.
    world = 2 if nodes is None else len(nodes)
    run_ranks(_resume_across_layouts, world, preset(mode), nodes, True, timeout=150)


class _HeadFirst(nn.Module):
    """A scale declared first and used last, an input layer declared last and used first:
    DDP's rebuilt bucket keeps its first and last parameter, their count and the bucket's size,
    and reverses the middle."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.ones(8))
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 8)
        self.body = nn.Linear(24, 16, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mid(torch.tanh(self.body(x))))) * self.scale


def _middle_reordered(rank, world):
    def build():
        model = DDP(_HeadFirst(), bucket_cap_mb=1000)
        state = fastddp.CompressState.from_preset("bf16-acc-ef")
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    # Saved after DDP's rebuild: the rebuilt bucket's residual is labelled by its own order (a
    # stale slot kept the first layout's, and the resume put residuals on other parameters).
    _resumed(build, rank, 3)


@pytest.mark.multiproc
def test_a_rebuild_that_reorders_a_buckets_middle_gets_a_slot_of_its_order():
    run_ranks(_middle_reordered, 2, timeout=120)


class _Mixed(nn.Module):
    """A bfloat16 layer between two float32 ones: DDP lays each dtype out apart, and a cap
    that cuts every parameter a bucket of its own interleaves them otherwise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.mid, self.last = (nn.Linear(24, 24) for _ in range(3))
        self.mid.bfloat16()

    def forward(self, x):
        x = torch.tanh(self.last(x))
        return self.first(torch.tanh(self.mid(x.bfloat16())).float())


def _mixed_dtypes(rank, world, settings):
    def build(caps=None):
        # The first layout: a bucket a dtype, or a bucket a parameter (about)
        model = DDP(_Mixed()) if caps is None else DDP(_Mixed(), bucket_cap_mb_list=caps)
        state = fastddp.CompressState(**settings)
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    state, _ = _resumed(build, rank, 3, again=lambda: build([0.0001] * 8))
    assert state.stats()["parked_residuals"] == 0


@pytest.mark.multiproc
@pytest.mark.parametrize("delay", [0, 1])
@_needs_bucket_caps
def test_a_model_of_two_dtypes_resumes_under_other_caps(delay):
    # With delay=1 the bfloat16 gradients wait by parameter too.
    run_ranks(_mixed_dtypes, 2, {**preset("bf16-acc-ef"), "delay": delay}, timeout=120)


def _head_replaced(rank, world):
    # Fine-tuning: a new head on the trained body, the same state. The new head takes the keys
    # the old one held, never the live body's (which it took, keyed last to first by a count
    # of the live parameters: a size error, or, of one size, residuals shared).
    for width in (8, 16):
        torch.manual_seed(0)
        model = nn.Sequential()
        model.body, model.head = nn.Linear(16, 16), nn.Linear(16, width)
        state = fastddp.CompressState.from_preset("bf16-acc-ef")
        gen = torch.Generator().manual_seed(rank)
        for _ in range(2):  # the model, then the model with its new head
            ddp = DDP(model)
            ddp.register_comm_hook(state, fastddp.compress_hook)
            for _ in range(2):
                _step(ddp, gen, width=16)
            keys = [state._table.param_keys[p] for p in model.parameters()]
            assert keys == [3, 2, 1, 0], keys  # counted from the model's end, every time
            del ddp
            model.head = nn.Linear(16, width)
        assert state.stats()["parked_residuals"] == 0


@pytest.mark.multiproc
def test_a_new_head_on_a_trained_body_takes_keys_of_its_own():
    run_ranks(_head_replaced, 2)


def _keyed_first_to_last(rank, world):
    def build():
        model = _ddp(_Net(depth=5))
        state = fastddp.CompressState.from_preset("bf16-acc-ef")
        model.register_comm_hook(state, fastddp.compress_hook)
        return model, state, torch.optim.SGD(model.parameters(), lr=0.05)

    def first_to_last():
        model, state, opt = build()
        state._table.forward = True  # as fastddp keyed parameters before state dict version 3
        return model, state, opt

    def as_version_2(state):
        hook = state.state_dict()
        assert hook.pop("key_order") == "first-to-last"
        return {**hook, "version": 2}

    # The same layout: keyed as it was saved, the resume is exact.
    _, saved = _resumed(first_to_last, rank, 3, as_version_2, build)
    # A state that has keyed its parameters last to first cannot place the old keys.
    model, state, opt = build()
    gen = torch.Generator().manual_seed(rank)
    _step(model, gen, opt)
    with pytest.warns(UserWarning, match="before the model's first step"):
        state.load_state_dict(saved)
    with pytest.raises(Exception, match="keys its residuals by parameter in the order"):
        _step(model, gen, opt)


@pytest.mark.multiproc
@_needs_bucket_caps
def test_state_dicts_of_version_2_keep_their_key_order():
    run_ranks(_keyed_first_to_last, 2, timeout=120)


def _wrong_checkpoints(rank, world):
    settings = preset("bf16-acc-ef")
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    model.register_comm_hook(state, fastddp.compress_hook)
    gen = torch.Generator().manual_seed(rank)
    for step in range(3):
        if step == 2:
            older = state.state_dict()  # the save before
        _step(model, gen)
    mine = state.state_dict()
    assert (mine["rank"], mine["world_size"]) == (rank, world)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)

    # Rank 1's file of the save before (a save cut short there): its residuals of step 2
    # would be added again, and rank 0's lost. Refused on every rank, at the first step.
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    state.load_state_dict(older if rank == 1 else mine)
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="given residuals saved at different steps") as info:
        _step(model, gen)
    calls = mine["counters"]["calls"]
    assert f"rank 0: saved after {calls} reductions" in str(info.value), info.value
    assert f"rank 1: saved after {older['counters']['calls']} reductions" in str(info.value)

    # Each rank loads its neighbour's residuals: refused on every rank, at the first step.
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    state.load_state_dict(everyone[(rank + 1) % world])
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="was given another rank's residuals") as info:
        _step(model, gen)
    assert "rank 0 loaded the state dict of rank 1 of 2" in str(info.value)

    # Another model's checkpoint on rank 1 alone: refused on every rank at the handshake, where
    # rank 1 alone would raise when its first bucket takes the residuals, rank 0 left waiting.
    model = _ddp(_Net(width=20))
    state = fastddp.CompressState(**settings)
    model.register_comm_hook(state, fastddp.compress_hook)
    for _ in range(2):
        _step(model, gen, width=20)
    other = state.state_dict()
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    state.load_state_dict(other if rank == 1 else mine)
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="residuals for other tensors on some ranks") as info:
        _step(model, gen)
    assert "rank 0: residuals for 8 tensor(s), 2400 elements" in str(info.value)
    assert "rank 1: residuals for 8 tensor(s), 1680 elements" in str(info.value)

    # A checkpoint loaded on rank 0 alone (rank 1's file missing, say): rank 0 would move its
    # residuals in collectives that rank 1 skips. Refused on every rank.
    model = _ddp(_Net())
    state = fastddp.CompressState(**settings)
    if rank == 0:
        state.load_state_dict(mine)
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="residuals for other tensors on some ranks") as info:
        _step(model, gen)
    assert "rank 1: none" in str(info.value)

    # A checkpoint of a model with other parameter sizes: refused, not silently misapplied.
    model = _ddp(_Net(width=20))
    state = fastddp.CompressState(**settings)
    state.load_state_dict(mine)
    model.register_comm_hook(state, fastddp.compress_hook)
    with pytest.raises(Exception, match="belong to other tensors: a checkpoint of another model"):
        _step(model, gen, width=20)


@pytest.mark.multiproc
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


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", MODES)
def test_futures_complete_on_the_hook_thread(mode):
    run_ranks(_completion_thread, 2, preset(mode))


# -- resuming at another world size ------------------------------------------------------------

_N = 3001  # not a multiple of any world size: shards are padded


def _grad(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(_N, generator=gen) * torch.logspace(-3, 1, _N)


def _owed(saved: dict) -> torch.Tensor:
    """What one rank's saved residuals still owe the average, element by element."""
    owed = torch.zeros(_N + 4096)
    for b in saved["buckets"].values():
        assert b["params"] == [[0, _N]]
        if b["residual"] is not None:
            owed[:_N] += b["residual"][:_N]
        if b["shard_residual"] is not None:
            lo = b["shard_offset"]
            owed[lo : lo + b["shard_residual"].numel()] += b["shard_residual"]
    carry = saved["carry"]
    for part in carry["stage1"].values():
        owed[:_N] += part
    for pieces in carry["stage2"].values():
        for offset, piece in pieces:
            owed[offset : offset + piece.numel()] += piece
    return owed[:_N]


def _train_phase(rank, world, settings, steps, path, resume):
    """Average ``_grad`` over ``steps``; save this rank's state and what was delivered."""
    state = fastddp.CompressState(**settings)
    if resume is not None:
        saved = torch.load(resume)
        state.load_state_dict(fastddp.CompressState.reshard(saved["states"], world)[rank])
    delivered = torch.zeros(_N)
    for step in steps:
        x = _grad(rank, step)
        fastddp.all_reduce(x, state=state)
        delivered += x
    everyone = [None] * world
    dist.all_gather_object(everyone, state.state_dict())
    if rank == 0:
        torch.save({"states": everyone, "delivered": delivered}, path)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bf16-acc-ef", "int8-ef", "int4-ef"])
@pytest.mark.parametrize("worlds", [(4, 2), (2, 3)])
def test_residuals_resharded_to_another_world_size_are_not_lost(mode, worlds, tmp_path):
    # Error feedback's invariant: what was delivered plus what the residuals owe equals the
    # sum of the true averages. It must survive a resume at another world size.
    old, new = worlds
    first, second = range(0, 6), range(6, 10)
    run_ranks(_train_phase, old, preset(mode), first, tmp_path / "a.pt", None, timeout=120)
    a = torch.load(tmp_path / "a.pt")
    run_ranks(_train_phase, new, preset(mode), second, tmp_path / "b.pt", tmp_path / "a.pt")
    b = torch.load(tmp_path / "b.pt")
    truth = sum(torch.stack([_grad(r, t) for r in range(old)]).double().mean(0) for t in first)
    truth += sum(torch.stack([_grad(r, t) for r in range(new)]).double().mean(0) for t in second)
    owed_a = sum(_owed(sd) for sd in a["states"]).double()
    owed_b = sum(_owed(sd) for sd in b["states"]).double()
    scale = truth.abs() + 1e-3
    # The residuals at the resize are far above fp32's rounding: losing them would show.
    assert (owed_a.abs() / scale).max() > 1e-3
    gap = (a["delivered"].double() + b["delivered"].double() + owed_b - truth).abs() / scale
    assert gap.max() < 1e-4, f"{gap.max():.2e} of the gradient lost at the resize"
    resharded = fastddp.CompressState.reshard(a["states"], new)
    assert [(sd["rank"], sd["world_size"]) for sd in resharded] == [(r, new) for r in range(new)]
    assert torch.allclose(sum(_owed(sd) for sd in resharded).double(), owed_a, atol=1e-6)


@pytest.mark.multiproc
def test_a_state_saved_right_after_a_load_reshards(tmp_path):
    # A job resumed and preempted before its first step saves what it loaded (its residuals
    # parked, no bucket yet); that must reshard like any other save.
    mode = preset("int8-ef")
    run_ranks(_train_phase, 2, mode, range(0, 6), tmp_path / "a.pt", None, timeout=120)
    run_ranks(_train_phase, 2, mode, range(6, 6), tmp_path / "b.pt", tmp_path / "a.pt")
    run_ranks(_train_phase, 3, mode, range(6, 10), tmp_path / "c.pt", tmp_path / "b.pt")
    a, b, c = (torch.load(tmp_path / f"{x}.pt") for x in "abc")
    owed = [sum(_owed(sd) for sd in x["states"]).double() for x in (a, b, c)]
    assert torch.equal(owed[0], owed[1]) and owed[0].abs().max() > 0
    truth = sum(torch.stack([_grad(r, t) for r in range(2)]).double().mean(0) for t in range(6))
    truth += sum(
        torch.stack([_grad(r, t) for r in range(3)]).double().mean(0) for t in range(6, 10)
    )
    gap = (a["delivered"].double() + c["delivered"].double() + owed[2] - truth).abs()
    assert (gap / (truth.abs() + 1e-3)).max() < 1e-4


def _load_unresharded(rank, world, settings, path):
    saved = torch.load(path)["states"]
    state = fastddp.CompressState(**settings)
    state.load_state_dict(saved[rank])
    x = _grad(rank, 0)
    if not settings.get("error_feedback"):
        fastddp.all_reduce(x, state=state)  # nothing per rank in it: any world size takes it
        assert state.stats()["calls"] == saved[rank]["counters"]["calls"] + 1
        return
    with pytest.raises(ValueError, match="saved by a job of 4 ranks, and this job has 2") as info:
        fastddp.all_reduce(x, state=state)
    assert "CompressState.reshard(saved, 2)" in str(info.value)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["bf16", "int8-ef"])
def test_a_state_of_another_world_size_needs_reshard_only_with_residuals(mode, tmp_path):
    run_ranks(_train_phase, 4, preset(mode), range(2), tmp_path / "a.pt", None, timeout=120)
    run_ranks(_load_unresharded, 2, preset(mode), tmp_path / "a.pt")


def test_reshard_refuses_what_is_not_one_jobs_state_dicts():
    def saved(rank, world, **settings):
        return {"rank": rank, "world_size": world, "settings": settings, "counters": {},
                "buckets": {}, "carry": None}  # fmt: skip

    full = [saved(r, 3) for r in range(3)]
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        fastddp.CompressState.reshard(full, 0)
    with pytest.raises(ValueError, match="got none"):
        fastddp.CompressState.reshard([], 2)
    for what in (None, full[0], "state.pt"):  # (None met len() in a TypeError of its own)
        with pytest.raises(TypeError, match="give a list of the state dicts of every rank"):
            fastddp.CompressState.reshard(what, 2)
    with pytest.raises(ValueError, match=r"saved by a job of 3 ranks, and 2 were given"):
        fastddp.CompressState.reshard([full[0], full[2]], 2)
    with pytest.raises(ValueError, match="saved before any process group, so they name no"):
        fastddp.CompressState.reshard([saved(None, None)], 2)
    with pytest.raises(ValueError, match=r"entry 1 was saved by rank 2 of 3; give the 3"):
        fastddp.CompressState.reshard([full[0], full[2], full[1]], 2)
    with pytest.raises(ValueError, match="not one job's state dicts"):
        fastddp.CompressState.reshard([*full[:2], saved(2, 3, dtype="int8")], 2)
    with pytest.raises(TypeError, match="entry 0 is not a CompressState.state_dict"):
        fastddp.CompressState.reshard([torch.zeros(2)], 1)
    assert [sd["rank"] for sd in fastddp.CompressState.reshard(full, 5)] == list(range(5))
    # Residuals of one parameter with two sizes: two models' states, not one job's.
    two = [saved(r, 2) for r in range(2)]
    for sd, n in zip(two, (4, 5)):
        sd["carry"] = {"stage1": {0: torch.zeros(n)}, "stage2": {}, "moved": [0],
                       "sizes": {0: n}, "replicated": {}}  # fmt: skip
    with pytest.raises(ValueError, match="parameter 0 has 5 elements in one rank's residuals"):
        fastddp.CompressState.reshard(two, 1)


class _OneParam(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.p = nn.Parameter(torch.zeros(n))

    def forward(self, g):
        return (self.p * g).sum()  # the gradient of p is g


def _version_one_checkpoint(rank, world, topology):
    # A version-1 state dict held the fp32 sum's residuals (stage 2) whole, the same on every
    # rank: loaded, they are owed once, not once per rank. With zero gradients the first
    # reduction hands back exactly what was owed (values exact in bf16).
    n = 512
    owed = torch.arange(n, dtype=torch.float32) / 4 - 64
    saved = fastddp.CompressState.from_preset("bf16-acc-ef").state_dict()
    for key in ("version", "rank", "world_size"):
        saved.pop(key, None)
    saved["buckets"] = {}
    saved["carry"] = {"stage1": {}, "stage2": {0: owed.clone()}}
    model = DDP(_OneParam(n))
    state = fastddp.CompressState.from_preset("bf16-acc-ef", topology=topology)
    state.load_state_dict(saved)
    model.register_comm_hook(state, fastddp.compress_hook)
    model(torch.zeros(n)).backward()
    got = model.module.p.grad
    assert torch.equal(got, owed), f"rank {rank}: {(got / owed)[owed != 0].unique().tolist()}"


@pytest.mark.multiproc
@pytest.mark.parametrize("topology", ["flat", "hierarchical"])
def test_a_version_one_checkpoint_owes_its_fp32_residuals_once(topology):
    if topology == "flat":
        run_ranks(_version_one_checkpoint, 2, topology)
    else:  # two nodes of two ranks
        run_ranks(_version_one_checkpoint, 4, topology, nodes=[0, 0, 1, 1])
