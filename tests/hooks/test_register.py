"""``fastddp.register_comm_hook``: auto's fp32 plans run in C++, bit for bit as in Python."""

import copy
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import auto
from fastddp.hooks import hook as hook_module

from .._dist import run_ranks
from .test_auto import _train
from .test_hook_core import _Net

pytestmark = pytest.mark.timeout(240)


def _none_in_cpp(rank, world, steps):
    # A step of this model varies from 1 to 10 ms here: no re-plan on noise (this process's
    # setting; a test below re-plans on a real change).
    auto.MARGIN = 100.0
    base = _Net(depth=4)
    python = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    python.register_comm_hook(None, allreduce_hook)
    native = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.register_comm_hook(native, fastddp.CompressState(dtype="auto", allow=["none"]))
    want, got = _train(python, steps, rank), _train(native, steps, rank)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max().item():.3e}"
    stats = state.stats()
    plan = stats["plan"]
    # Every step counted once, whichever side ran it.
    assert stats["step"] == steps - 1 and stats["steps_in"]["none"] == steps, stats
    # The trial's measured turn ran in C++. After the plan one step in CHECK_EVERY runs in
    # Python, to check it; the others in C++.
    assert plan["plans"] == 1 and len(plan["trial_ms"]["none"]) == 1, plan
    after = steps - 1 - plan["made_at_step"]
    assert stats["native_steps"] == 1 + after - after // auto.CHECK_EVERY, (after, stats)
    # The checks read the periods the C++ hook stamped.
    assert plan["last_check_ratio"] > 0, plan


@pytest.mark.multiproc
def test_a_plan_of_none_runs_in_cpp_bit_for_bit():
    run_ranks(_none_in_cpp, 2, 40)


class _Slowed(_Net):
    """From step ``slow_from`` on, every forward sleeps: the step time changes by far more
    than auto's MARGIN."""

    def __init__(self, slow_from):
        super().__init__(depth=4)
        self.slow_from, self.calls = slow_from, 0

    def forward(self, x):
        self.calls += 1
        if self.calls > self.slow_from:
            time.sleep(0.05)
        return super().forward(x)


def _replan_in_cpp(rank, world, slow_from, steps):
    model = DDP(_Slowed(slow_from), bucket_cap_mb=0.002)
    state = fastddp.register_comm_hook(model, fastddp.CompressState(dtype="auto", allow=["none"]))
    _train(model, steps, rank)
    stats = state.stats()
    plan = stats["plan"]
    assert plan["plans"] >= 2, plan
    assert plan["made_at_step"] > slow_from, plan  # the last plan came after the slowdown
    assert stats["native_steps"] > 0 and stats["step"] == steps - 1, stats
    mine = torch.tensor([plan["plans"], plan["made_at_step"]])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(e, everyone[0]) for e in everyone), everyone


@pytest.mark.multiproc
def test_a_slower_step_re_plans_with_the_cpp_hook():
    run_ranks(_replan_in_cpp, 2, 30, 75)


def _registration(rank, world):
    with pytest.raises(TypeError, match="must be a DistributedDataParallel"):
        fastddp.register_comm_hook(_Net(), fastddp.CompressState(dtype="auto"))
    model = DDP(_Net(), bucket_cap_mb=0.002)
    with pytest.raises(TypeError, match="register on the DDP model before torch.compile"):
        fastddp.register_comm_hook(torch.compile(model), None)
    with pytest.raises(TypeError, match="must be a fastddp.CompressState"):
        fastddp.register_comm_hook(model, {"dtype": "auto"})
    with pytest.raises(
        TypeError, match=r"got str; 'bf16' is a preset: fastddp.CompressState.from_preset\('bf16'\)"
    ):
        fastddp.register_comm_hook(model, "bf16")
    # DDP over this rank alone (as inside a node under DiLoCo): a state on the default group
    # would average every rank's gradients into it.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    inside = DDP(_Net(), bucket_cap_mb=0.002, process_group=alone)
    want = rf"DDP reduces over ranks \[{rank}\], but the state reduces over the default group"
    for state in (None, fastddp.CompressState.from_preset("int8-ef")):
        with pytest.raises(ValueError, match=want + r" \(ranks \[0, 1\]\)"):
            fastddp.register_comm_hook(inside, state)
    other = dist.new_group([0, 1])
    with pytest.raises(ValueError, match="but the state reduces over its process group"):
        fastddp.register_comm_hook(inside, fastddp.CompressState(process_group=other))
    # The same ranks in another group object are the model's ranks.
    fastddp.register_comm_hook(DDP(_Net()), fastddp.CompressState(process_group=other))
    fastddp.register_comm_hook(
        inside, fastddp.CompressState.from_preset("int8", process_group=alone)
    )
    state = fastddp.register_comm_hook(model, fastddp.CompressState(dtype="auto"))
    with pytest.raises(RuntimeError, match="can only be called once"):
        fastddp.register_comm_hook(model, fastddp.CompressState(dtype="auto"))
    assert [s for _, s in model._comm_hooks] == [state]  # the refused one is not kept
    with pytest.raises(RuntimeError, match="registered on another model, which still exists"):
        fastddp.register_comm_hook(DDP(_Net(), bucket_cap_mb=0.002), state)
    with pytest.raises(RuntimeError, match="already registered on this model; DDP takes one"):
        fastddp.register_comm_hook(model, state)
    _moved(rank)
    # A fixed mode is DDP's own registration of compress_hook.
    base = _Net()
    fixed = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    fixed.register_comm_hook(fastddp.CompressState.from_preset("bf16"), fastddp.compress_hook)
    through = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    fastddp.register_comm_hook(through, fastddp.CompressState.from_preset("bf16"))
    for a, b in zip(_train(fixed, 4, rank), _train(through, 4, rank)):
        assert torch.equal(a, b)
    # No state: compress_hook's default one, returned, its buckets run natively.
    by_default = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    default = fastddp.register_comm_hook(by_default)
    assert default is hook_module._default_state and default.dtype == torch.bfloat16
    _train(by_default, 3, rank)
    assert len(default._runner) > 0 and default.stats()["calls"] > 0


def _moved(rank):
    # Once its model is deleted, an auto state moves to the module re-wrapped in a new DDP
    # (other buckets), and goes on bit for bit as DDP's own all-reduce would.
    base = _Net(depth=4)
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    state = fastddp.CompressState(dtype="auto", allow=["none"])
    want, got = [], []
    for cap in (0.002, 0.004):
        reference = DDP(plain, bucket_cap_mb=cap)
        reference.register_comm_hook(None, allreduce_hook)
        model = DDP(ours, bucket_cap_mb=cap)
        assert fastddp.register_comm_hook(model, state) is state
        want += _train(reference, 4, rank)
        got += _train(model, 4, rank)
        del model, reference
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step}: {(a - b).abs().max().item():.3e}"
    assert state.stats()["steps_in"]["none"] == 8, state.stats()


@pytest.mark.multiproc
def test_registration_refuses_what_it_cannot_take():
    run_ranks(_registration, 2)


def _registered_unlike(rank, world):
    model = DDP(_Net(), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto")
    if rank == 0:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    # The turns of "none" run in another order with the C++ hook: the ranks would issue other
    # collectives. Every rank raises at its first step.
    with pytest.raises(ValueError, match="register every rank's hook alike"):
        _train(model, 1, rank)


@pytest.mark.multiproc
def test_ranks_registered_unlike_fail_alike():
    run_ranks(_registered_unlike, 2)


def _none_in_cpp_on_cuda(rank, world, backend, steps):
    # The C++ steps on CUDA buckets: on NCCL (world size 1, its future complete when enqueued:
    # the reducer orders the copy-out by the future's events) and on Gloo with CUDA tensors.
    group = dist.new_group(list(range(world)), backend=backend)
    auto.MARGIN = 100.0  # no re-plan on noise
    torch.cuda.set_device(0)
    base = _Net(depth=4).cuda()
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.002, process_group=group)
    native = DDP(copy.deepcopy(base), bucket_cap_mb=0.002, process_group=group)
    state = fastddp.CompressState(dtype="auto", allow=["none"], process_group=group)
    fastddp.register_comm_hook(native, state)
    gen = torch.Generator().manual_seed(rank)
    for step in range(steps):
        x = torch.randn(8, 24, generator=gen).cuda()
        grads = []
        for model in (plain, native):
            model.zero_grad()
            model(x).square().mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        # DDP without a hook divides while copying into the bucket, the C++ hook after: the
        # same division of the same values.
        assert torch.equal(grads[1], grads[0]), f"step {step}"
    assert state.stats()["native_steps"] > 0
    dist.destroy_process_group(group)


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend, world", [("nccl", 1), ("gloo", 2)])
def test_a_plan_of_none_runs_in_cpp_on_cuda(backend, world):
    run_ranks(_none_in_cpp_on_cuda, world, backend, 30)


def _checks_on_cuda_wait_for_nothing(rank, world):
    # On NCCL the checks of a plan synchronize no stream with the host: a tensor made from a
    # Python list, or read with .item(), would wait for every kernel queued before it.
    from torch.profiler import ProfilerActivity, profile, record_function

    group = dist.new_group([0], backend="nccl")
    auto.MARGIN = float("inf")
    torch.cuda.set_device(0)
    model = DDP(_Net(depth=2).cuda(), bucket_cap_mb=0.002, process_group=group)
    state = fastddp.CompressState(dtype="auto", allow=["none", "bf16"], process_group=group)
    model.register_comm_hook(state, fastddp.compress_hook)
    x = torch.randn(8, 24, device="cuda")
    for _ in range(state.trial_steps + 1):
        model(x).square().mean().backward()
    assert state._plan is not None and not state._plan["trial"], state._plan
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=activities) as prof, record_function("steps"):
        for _ in range(2 * auto.CHECK_EVERY + 1):
            model(x).square().mean().backward()
    assert state._plan["last_check_ratio"] > 0, state._plan
    # Only the steps count: the profiler synchronizes the device itself when it stops.
    events = prof.events()
    steps = next(e.time_range for e in events if e.name == "steps")
    waits = [
        e.name
        for e in events
        if ("Synchronize" in e.name or e.name == "aten::item")
        and steps.start <= e.time_range.start <= steps.end
    ]
    assert waits == [], waits
    dist.destroy_process_group(group)


@pytest.mark.cuda
@pytest.mark.multiproc
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_checks_of_a_plan_make_no_host_wait_on_nccl():
    run_ranks(_checks_on_cuda_wait_for_nothing, 1)


def _checks_wait_for_nothing(rank, world, cpp):
    # Under a plan, the steps (checks of the plan included) read no device value on the host:
    # on a GPU that read would wait for every kernel queued before the step's first bucket.
    from collections import Counter

    from torch.profiler import profile

    auto.MARGIN = float("inf")  # (no re-plan on noise: the checks run, and judge nothing)
    model = DDP(_Net(depth=2), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none", "bf16"])
    if cpp:
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, state.trial_steps + 1, rank, opt=False)
    assert state._plan is not None and not state._plan["trial"], state._plan
    with profile() as prof:
        _train(model, 2 * auto.CHECK_EVERY + 1, rank, opt=False)
    assert state._plan["last_check_ratio"] > 0, state._plan  # a check was judged in there
    seen = Counter(e.name for e in prof.events())
    assert seen["aten::_local_scalar_dense"] == 0 and seen["aten::item"] == 0, seen


@pytest.mark.multiproc
@pytest.mark.parametrize("cpp", [False, True], ids=["python", "register_comm_hook"])
def test_the_checks_of_a_plan_make_no_host_wait(cpp):
    run_ranks(_checks_wait_for_nothing, 2, cpp)


def _strikes(rank, world):
    # The plan is held against the step every CHECK_EVERY steps: one check off by more than
    # MARGIN is noise, two in a row start a trial, an on-plan check in between forgives. Each
    # check's figure is all-reduced in the background and judged at the next check.
    model = DDP(_Net(depth=2), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none"])
    model.register_comm_hook(state, fastddp.compress_hook)
    _train(model, auto.TRIAL_ROUNDS + 2, rank)
    assert state._plan is not None and not state._plan["trial"], state._plan
    planned = state._plan["planned_ms"] / 1e3
    off, on = [planned * (1 + 2 * auto.MARGIN)] * 5, [planned] * 5
    checks = ((off, False), (on, False), (off, False), (off, False), (on, True))
    for periods, trial in checks:
        state._recent = list(periods)
        state._check_plan(torch.device("cpu"))
        assert state._plan["trial"] is trial, (periods[0] / planned, state._checks.strikes)
    assert state._plan["last_check_ratio"] == pytest.approx(1 + 2 * auto.MARGIN)


@pytest.mark.multiproc
def test_a_trial_starts_at_the_second_check_off_the_plan_in_a_row():
    run_ranks(_strikes, 2)
