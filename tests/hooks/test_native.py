"""The native runner (``fastddp/hooks/native.py``, ``csrc/ddp/native_hook.cpp``): a fixed
mode's planned buckets reduced without Python, bit for bit as the Python path reduces them.

Every preset, flat on 2 and 3 ranks and in two levels on 2 nodes x 2 ranks, registered both
ways (``model.register_comm_hook(state, fastddp.compress_hook)`` and
``fastddp.register_comm_hook``), trains against the same state with the runner off
(``FASTDDP_NATIVE=0``'s setting): every step's gradients and the counters must be equal, and
from the third step on no bucket may reach Python's path. The model's layers run in reverse
registration order, so that DDP's rebuilt buckets all differ from its first ones and every plan
is replaced once.
"""

import contextlib
import copy
import gc
import os
import time
import weakref
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import profile

import fastddp
from fastddp import _extension
from fastddp.hooks import hook as hook_module
from fastddp.hooks import native
from fastddp.hooks.presets import PRESETS
from fastddp.hooks.topology import NODE_ENV
from fastddp.testing import slack

from .._dist import run_ranks
from .test_hook_core import _Net

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]

STEPS = 5


def _train(model, state, steps, rank, reached=None):
    gen = torch.Generator().manual_seed(10 + rank)
    grads = []
    for _ in range(steps):
        if reached is not None:
            reached.append(0)
        model.zero_grad()
        x = torch.randn(8, 24, generator=gen)
        model(x).square().mean().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]).clone())
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return grads


def _counting_python_path(reached):
    # Count the buckets that reach Python's path (compress_hook's _reduce).
    real = hook_module._reduce

    def counted(*args, **kwargs):
        reached[-1] += 1
        return real(*args, **kwargs)

    hook_module._reduce = counted
    return real


def _hooked(base, mode, on, register):
    """A DDP copy of ``base`` with ``mode``'s hook, its native runner ``on`` or off."""
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState.from_preset(mode)
    if not on:
        state._native = state._runner = None
    if register:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    return model, state


def _alike(rank, world, mode, register, nodes):
    if nodes:
        os.environ[NODE_ENV] = f"node{rank // (world // nodes)}"
    base = _Net(depth=5)
    results = []
    for on in (False, True):
        model, state = _hooked(base, mode, on, register)
        reached = []
        real = _counting_python_path(reached)
        try:
            grads = _train(model, state, STEPS, rank, reached)
        finally:
            hook_module._reduce = real
        stats = state.stats()
        results.append((grads, stats, reached, state, state.state_dict()))
    (want, plain, _, _, plain_saved), (got, stats, reached, state, saved) = results
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max().item():.3e}"
    # Every counter, the state's and each bucket's: the runner's runs are counted as Python's.
    counters = [k for k, v in plain.items() if type(v) is int]
    assert {"calls", "fp32_wire_bytes", "nonfinite_events"} <= set(counters), counters
    differ = {k: (stats[k], plain[k]) for k in counters if stats[k] != plain[k]}
    assert not differ, differ
    assert stats["buckets"] == plain["buckets"]
    # state_dict() sees the runner's last reductions: the same residuals.
    for key, bucket in saved["buckets"].items():
        for name in ("residual", "shard_residual"):
            a, b = bucket[name], plain_saved["buckets"][key][name]
            assert (a is None and b is None) or torch.equal(a, b), (key, name)
    assert stats["topology_used"] == ("hierarchical" if nodes else "flat")
    buckets = len(stats["buckets"])
    assert buckets >= 3
    # Steps 0 (one bucket) and 1 (the rebuilt ones) ran in Python; then none did.
    assert reached[0] == 1 and reached[1] == buckets and reached[2:] == [0] * (STEPS - 2), reached
    # One plan per live bucket: the first layout's plan went with its slot.
    assert len(state._runner) == buckets
    # A load drops the plans, and with them the slots' buffers (a plan and its last job held
    # each other, and the buffers, for good).
    # (A collective's callback, which holds its job, may still be ending on Gloo's thread.)
    wires = [weakref.ref(slot.wire) for slot in state._table.slots.values()]
    state.load_state_dict(saved)
    assert len(state._runner) == 0
    deadline = time.monotonic() + slack.guard(10)
    while any(w() is not None for w in wires) and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    assert [w() for w in wires] == [None] * len(wires)


@pytest.mark.parametrize("register", [False, True], ids=["python-hook", "registered"])
@pytest.mark.parametrize("mode", list(PRESETS))
def test_native_runs_bit_for_bit_as_python(mode, register):
    run_ranks(_alike, 2, mode, register, 0)


@pytest.mark.parametrize("mode", ["bf16", "bf16-acc-ef", "int4-ef"])
def test_native_runs_bit_for_bit_on_three_ranks(mode):
    run_ranks(_alike, 3, mode, False, 0)


@pytest.mark.parametrize("mode", ["bf16", "bf16-acc-ef", "int8-ef"])
def test_native_runs_bit_for_bit_in_two_levels(mode):
    run_ranks(_alike, 4, mode, True, 2)


def _joined(rank, world, mode):
    # DDP's Join: the rank out of inputs first (rank 1) gets its buckets' all-reduces matched
    # with fresh zero buffers, which replace each planned slot's plan. The runs of the plan
    # replaced were lost from the counters there.
    from torch.distributed.algorithms.join import Join

    base = _Net(depth=3)
    results = []
    for on in (False, True):
        model, state = _hooked(base, mode, on, False)
        gen = torch.Generator().manual_seed(rank)
        with Join([model]):
            for _ in range(6 if rank == 0 else 3):
                model.zero_grad()
                model(torch.randn(8, 24, generator=gen)).square().mean().backward()
        stats = state.stats()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((grads, {k: v for k, v in stats.items() if type(v) is int}))
    (want, plain), (got, stats) = results
    assert torch.equal(got, want)
    assert stats == plain, {k: (stats[k], plain[k]) for k in plain if stats[k] != plain[k]}


@pytest.mark.parametrize("mode", ["bf16", "bf16-acc-ef"])
def test_a_joined_rank_counts_every_run(mode):
    run_ranks(_joined, 2, mode)


def _unplanned(rank, world):
    # Stochastic rounding and delay=1 draw something new at every call: no plans.
    for settings in ({"dtype": torch.int8, "stochastic_rounding": True}, {"delay": 1}):
        state = fastddp.CompressState(**settings)
        assert state._runner is None and not native.plannable(state)
    os.environ["FASTDDP_NATIVE"] = "0"
    try:
        assert fastddp.CompressState()._runner is None
    finally:
        del os.environ["FASTDDP_NATIVE"]
    model = DDP(_Net(depth=3), bucket_cap_mb=0.002)
    state = fastddp.CompressState(accumulate_dtype=torch.float32, stochastic_rounding=True)
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, state, 3, rank)
    assert state.stats()["calls"] > 0


def test_settings_that_change_every_call_are_not_planned():
    run_ranks(_unplanned, 2)


# The ops and collectives of one reduction of a planned bucket, by preset: the encode (and,
# summed in fp32, the sum re-encoded in one pass), one non-finite count per encode, the decode.
_OPS_PER_BUCKET = {
    "bf16": {"fastddp::compress": 1, "c10d::allreduce_": 1, "fastddp::decompress": 1},
    "int8-ef": {
        "fastddp::quantize_int8": 1,
        "c10d::alltoall_base_": 1,
        "fastddp::requantize": 1,
        "c10d::_allgather_base_": 1,
        "fastddp::unpack_int8": 1,
    },
}


def _ops_per_bucket(rank, world, mode):
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState.from_preset(mode)
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, state, 3, rank)
    buckets = len(state._runner)
    with profile() as prof:
        _train(model, state, 2, rank)
    seen = Counter(e.name for e in prof.events())
    want = {name: 2 * buckets * n for name, n in _OPS_PER_BUCKET[mode].items()}
    got = {name: seen[name] for name in want}
    assert got == want, (got, want)
    ours = {n for n in seen if n.startswith("fastddp::") or n.startswith("c10d::")}
    assert ours == set(want), ours
    # No host synchronisation: nothing reads a device value on the host (.item()).
    assert seen["aten::_local_scalar_dense"] == 0 and seen["aten::item"] == 0, seen


@pytest.mark.parametrize("mode", list(_OPS_PER_BUCKET))
def test_a_planned_bucket_makes_only_its_plan_s_calls(mode):
    run_ranks(_ops_per_bucket, 2, mode)


def _threads(name=None) -> set:
    """The ids of this process's threads (named ``name``, if given)."""
    ids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                if name is None or f.read().strip() == name:
                    ids.add(task)
        except OSError:
            pass  # a thread that ended meanwhile
    return ids


def _plan_holds_its_group_weakly(rank, world):
    # Threads that exist before the group (some of an earlier group may not be named yet)
    # are not the group's.
    before = _threads()
    group = dist.new_group(backend="gloo")
    deadline = time.monotonic() + slack.guard(10)
    while not _threads("pt_gloo_runloop") - before:  # a thread names itself once it runs
        assert time.monotonic() < deadline, "the group's Gloo threads never showed"
        time.sleep(0.01)
    bucket = torch.ones(8)
    runner = _extension.load().NativeRunner()
    runner.add(0, bucket, [([], ("allreduce", group, bucket, None, None, None, None))], [],
               False, True)  # fmt: skip
    # Python lets go of the group: it goes now, its threads joined here, while the plan lives
    # on. (A plan that owned it destroyed it wherever the plan went: dropped in Python, with
    # the GIL held while a Gloo thread waited for the GIL to free a Work, that deadlocked.)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert not _threads("pt_gloo_runloop") - before
    del runner


def test_a_plan_does_not_keep_its_process_group_alive():
    run_ranks(_plan_holds_its_group_weakly, 2)


class _Recorded(dist.ProcessGroup):
    """This rank alone, through a real Gloo group, recording the tag each all-reduce carries
    (its first element: bucket * 10 + stage); the one tagged ``fail_at`` raises instead."""

    def __init__(self, inner, log, fail_at=None):
        super().__init__(inner.rank(), inner.size())
        self.inner, self.log, self.fail_at = inner, log, fail_at

    def getBackendName(self):
        return "recorded"

    def record(self, tag):
        self.log.append(tag)
        if tag == self.fail_at:
            raise RuntimeError(f"the collective tagged {tag} failed on this rank")

    def allreduce(self, tensors, opts=None):
        self.record(int(tensors[0][0].item()))
        return self.inner.allreduce(tensors, opts or dist.AllreduceOptions())


class _TaggedPath:
    """A path of ``stages`` stages, each one all-reduce of a tag, recorded by ``group`` (the
    pipeline issues it on ``group.inner``: ``dist.all_reduce`` takes registered groups only)."""

    def __init__(self, group, stages):
        self.group, self.stages = group, stages

    def stage(self, job, i):
        self.group.record(job.slot * 10 + i)
        tag = torch.tensor([float(job.slot * 10 + i)])
        return ("allreduce", self.group.inner, tag, None, None, None)

    def finish(self, job):
        pass


def _issue_order(rank, world, stages):
    # The runner and the Python pipeline issue a step's stages in one order: each new bucket's
    # first stage, then every pending job's next, newest first (so that the slow link never
    # idles while this thread waits on an older job's collective). And where a new bucket
    # fails, the stages pending before it are still issued, as the other ranks issue them.
    from fastddp.hooks.job import Job
    from fastddp.hooks.pipeline import Pipeline

    inner = dist.new_group([0])
    orders = {}
    for fail_at in (None, 20):
        log = []
        group = _Recorded(inner, log, fail_at)
        pipeline, path = Pipeline(), _TaggedPath(group, stages)
        with contextlib.suppress(RuntimeError):
            for i in range(4):
                job = Job(path, i, torch.zeros(1), (dist.group.WORLD,), 1, True, (), None)
                pipeline.submit(lambda job=job: job, is_last=i == 3)
        orders["python", fail_at] = list(log)
        runner = _extension.load().NativeRunner()

        def hook(state, bucket):
            runner, group, buffers = state
            future = runner.run(bucket)
            if future is not None:
                return future
            tags = [torch.tensor([float(bucket.index() * 10 + s)]) for s in range(stages)]
            plan = [([], ("allreduce", group, t, None, None, None, None)) for t in tags]
            runner.add(bucket.index(), bucket.buffer(), plan, [], False, True)
            buffers.append(bucket.buffer())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        model = DDP(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), bucket_cap_mb=0.004)
        buffers = []
        model.register_comm_hook((runner, group, buffers), hook)
        for _ in range(3):  # planned at the first step, and again after DDP's rebuild
            log.clear()
            with contextlib.suppress(RuntimeError):
                model(torch.ones(2, 32)).sum().backward()
        orders["native", fail_at] = list(log)
        # Dropping the plans waits for their last reductions: after a failure, for none that
        # can no longer finish (the failed bucket's, those set aside to issue after it).
        for buffer in buffers:
            runner.remove(buffer)
        assert len(runner) == 0
    return orders


def test_native_issues_stages_in_the_python_order():
    orders = run_ranks(_issue_order, 1, 3)[0]
    newest_first = [0, 10, 1, 20, 11, 2, 30, 21, 12, 31, 22, 32]
    assert orders["python", None] == orders["native", None] == newest_first, orders
    assert orders["python", 20] == orders["native", 20] == [0, 10, 1, 20, 11, 2], orders


def test_a_failure_on_the_python_path_stops_the_runner_too():
    # A bucket reduced on the Python path (a first or rebuilt one) that fails leaves the ranks'
    # collectives out of step: the planned buckets must refuse further work too, as Python's.
    state = fastddp.CompressState()
    assert state._runner is not None
    state._runner.flush()
    state._pipeline._fail(RuntimeError("out of memory, say"))
    with pytest.raises(RuntimeError, match=r"earlier reduction failed on this rank \(Runtime"):
        state._runner.flush()


def _tensors(calls, collective):
    found = [a for _, args, kwargs in calls for a in (*args, *kwargs.values())]
    found += list(collective)
    return [t for t in found if isinstance(t, torch.Tensor)]


def _later_stages_use_held_tensors(rank, world, mode, nodes):
    # The runner records no stream use itself: a later stage runs on the side stream (the
    # pipeline's, native.py hands it over) and uses only the slot's buffers, which the Python
    # path's reduction that made the plan held on that stream (Path.stage: slot.hold) before
    # the runner's first run. A tensor of its own there (made on the compute stream when the
    # plan is made) would go back to the allocator, at the plan's end, unheld.
    if nodes:
        os.environ[NODE_ENV] = f"node{rank // (world // nodes)}"
    made = []
    real = native.Native.plan

    def plan(self, job, make_job, state):
        real(self, job, make_job, state)
        template = make_job((-1,) * len(job.path.seed_stages))
        for i in range(1, job.path.stages):
            made.append((job.slot, i, _tensors(*job.path.stage_calls(template, i))))

    native.Native.plan = plan
    try:
        model, state = _hooked(_Net(depth=4), mode, True, False)
        _train(model, state, 3, rank)
    finally:
        native.Native.plan = real
    made = [m for m in made if m[0].plan is not None]  # (the first layout's slots retired)
    for slot, i, tensors in made:
        assert slot.held, f"{slot.path.name}: planned before its buffers were held"
        held = {t.untyped_storage().data_ptr() for t in slot.tensors()}
        alien = [tuple(t.shape) for t in tensors if t.untyped_storage().data_ptr() not in held]
        assert not alien, f"{slot.path.name} stage {i} uses tensors no slot holds: {alien}"
    return len(made)


@pytest.mark.parametrize("mode", [m for m in PRESETS if m not in ("fp16", "bf16")])
def test_later_stages_of_a_plan_use_only_held_buffers(mode):
    assert min(run_ranks(_later_stages_use_held_tensors, 2, mode, 0)) > 0


@pytest.mark.parametrize("mode", ["bf16", "int8-ef", "int2-ef"])
def test_later_stages_of_a_two_level_plan_use_only_held_buffers(mode):
    assert min(run_ranks(_later_stages_use_held_tensors, 4, mode, 2)) > 0
