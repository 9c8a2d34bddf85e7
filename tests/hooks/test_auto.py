"""``CompressState(dtype="auto")``: one candidate is that mode; the plan is made by trial, alike
on every rank; residuals of a candidate left behind are repaid; bad settings are refused."""

import copy
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import auto

from .._dist import run_ranks
from .test_hook_core import _grads, _Net

pytestmark = pytest.mark.timeout(240)

TRIAL = 1 + auto.TRIAL_STEPS  # steps before the plan, per candidate (plus the warm-up)


def _train(model, steps, rank, opt=True):
    gen = torch.Generator().manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if opt else None
    grads = []
    for _ in range(steps):
        model.zero_grad()
        model(torch.randn(8, 24, generator=gen)).square().mean().backward()
        grads.append(_grads(model).clone())
        if optimizer is not None:
            optimizer.step()
    return grads


def _one_candidate(rank, world, name):
    base = _Net(depth=4)
    fixed = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    if name == auto.NONE:
        fixed.register_comm_hook(None, allreduce_hook)
    else:
        fixed.register_comm_hook(fastddp.CompressState.from_preset(name), fastddp.compress_hook)
    chosen = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=[name])
    chosen.register_comm_hook(state, fastddp.compress_hook)
    want, got = _train(fixed, 8, rank), _train(chosen, 8, rank)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name} step {step}: {(a - b).abs().max().item():.3e}"
    assert state.stats()["plan"]["mode"] == name and state.stats()["mode"] == name


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["none", "bf16", "bf16-acc", "int8-ef"])
def test_one_candidate_is_that_mode_bit_for_bit(name):
    run_ranks(_one_candidate, 2, name)


def _plan_alike(rank, world):
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto")
    model.register_comm_hook(state, fastddp.compress_hook)
    modes = []
    for _ in range(4 * auto.TRIAL_STEPS + 3):
        _train(model, 1, rank, opt=False)
        modes.append(state.stats()["mode"])
    # The trial: a warm-up step, then each candidate in allow order.
    trial = [auto.DEFAULT_ALLOW[0]] + [n for n in auto.DEFAULT_ALLOW for _ in range(4)]
    assert modes[: len(trial)] == trial, modes
    plan = state.stats()["plan"]
    assert plan["made_at_step"] == len(trial) and plan["plans"] == 1
    assert set(plan["step_ms"]) == set(auto.DEFAULT_ALLOW)
    assert all(ms > 0 for ms in plan["step_ms"].values())
    fastest = min(plan["step_ms"].values())
    assert plan["step_ms"][plan["mode"]] <= fastest * (1 + auto.PREFER)
    assert modes[len(trial) :] == [plan["mode"]] * (len(modes) - len(trial))
    # Every rank made the same plan from the same (all-reduced) figures.
    mine = torch.tensor([auto.DEFAULT_ALLOW.index(plan["mode"]), *plan["step_ms"].values()])
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    assert all(torch.equal(e, mine) for e in everyone)
    # A resumed state keeps the plan and makes no trial.
    saved = pickle.loads(pickle.dumps(state.state_dict()))
    again = fastddp.CompressState(dtype="auto")
    again.load_state_dict(saved)
    assert again.stats()["plan"]["mode"] == plan["mode"] and again.stats()["mode"] == plan["mode"]


@pytest.mark.multiproc
def test_the_plan_is_made_by_trial_and_alike_on_every_rank():
    run_ranks(_plan_alike, 2)


def _owed_residuals(rank, world):
    # int8 with error feedback first, then plain fp32: what error feedback kept at the switch is
    # added to the next reduction, so the sum of what was applied equals the sum of the true
    # averages (fixed weights: each step's gradient is known).
    base = _Net(depth=4)
    model = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["int8-ef", "none"])
    model.register_comm_hook(state, fastddp.compress_hook)
    plain = DDP(copy.deepcopy(base), bucket_cap_mb=0.002)
    steps = TRIAL + auto.TRIAL_STEPS  # through the int8 block and the fp32 one
    got, want = _train(model, steps, rank, opt=False), _train(plain, steps, rank, opt=False)
    assert state.stats()["mode"] == "none"
    at_switch = TRIAL
    kept = (sum(want[:at_switch]) - sum(got[:at_switch])).abs().max().item()
    assert kept > 1e-6, "int8 rounding left nothing in the residuals: the test shows nothing"
    gap = (sum(want) - sum(got)).abs().max().item()
    assert gap < kept / 100, f"the residuals at the switch were lost: {gap:.3e} (kept {kept:.3e})"


@pytest.mark.multiproc
def test_residuals_of_a_candidate_left_behind_are_repaid():
    run_ranks(_owed_residuals, 2)


def _allow_differs(rank, world):
    model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
    allow = ["none", "bf16"] if rank == 0 else ["none", "int8-ef"]
    model.register_comm_hook(
        fastddp.CompressState(dtype="auto", allow=allow), fastddp.compress_hook
    )
    with pytest.raises(ValueError, match=r"ranks disagree on CompressState\(dtype='auto'"):
        model(torch.ones(2, 24)).sum().backward()
    dist.barrier()


@pytest.mark.multiproc
def test_ranks_that_disagree_on_allow_fail_alike():
    run_ranks(_allow_differs, 2)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(allow=[]), ValueError, "allow is empty"),
        (dict(allow=["bf16", "int9"]), ValueError, r"allow is unknown \['int9'\]"),
        (dict(allow=["bf16", "bf16"]), ValueError, "allow is repeated names"),
        (dict(allow="bf16"), TypeError, "allow must be a list of mode names"),
        (dict(error_feedback=True), ValueError, "error_feedback belongs to a fixed mode"),
        (dict(dtype="fast"), ValueError, "dtype must be a torch.dtype or 'auto'"),
        (dict(alow=["bf16"]), TypeError, "unexpected keyword argument 'alow'"),
    ],
)
def test_bad_auto_settings(kwargs, error, message):
    with pytest.raises(error, match=message):
        fastddp.CompressState(**{"dtype": "auto", **kwargs})


def test_auto_is_refused_by_all_reduce_and_by_another_allow():
    with pytest.raises(ValueError, match="state has dtype='auto'"):
        fastddp.all_reduce(torch.ones(4), state=fastddp.CompressState(dtype="auto"))
    saved = fastddp.CompressState(dtype="auto", allow=["none", "bf16"]).state_dict()
    with pytest.raises(ValueError, match="do not match this state's"):
        fastddp.CompressState(dtype="auto").load_state_dict(saved)
    state = pickle.loads(pickle.dumps(fastddp.CompressState(dtype="auto", allow=["bf16"])))
    assert state.allow == ("bf16",) and "allow=['bf16']" in repr(state)
