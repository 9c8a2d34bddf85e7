"""``CompressState(dtype="auto")`` through what a job does besides plain steps: DDP's Join for
uneven inputs, a state dict loaded mid-trial while the C++ hook runs steps of ``"none"``, and
a state moved to a new model mid-trial. Each makes its plan alike on every rank."""

import gc

import pytest
import torch
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks import auto

from .._dist import run_ranks
from .test_auto import _Chain
from .test_hook_core import _Net

pytestmark = [pytest.mark.multiproc, pytest.mark.timeout(240)]


def _register(model, state, register):
    if register == "fastddp":
        fastddp.register_comm_hook(model, state)
    else:
        model.register_comm_hook(state, fastddp.compress_hook)


def _step(model, gen):
    model.zero_grad()
    model(torch.randn(8, 24, generator=gen)).square().mean().backward()


def _planned(state):
    plan = state.stats()["plan"]
    return None if plan is None or plan["trial"] else plan["mode"]


def _joined(rank, world, register):
    # Rank 0 runs out of inputs first; DDP's Join then runs its hook for every bucket outside
    # autograd, where no graph task tells one step from the next.
    # No re-plan: after a plan made at step 8 (one candidate left after a round), the checks
    # at steps 28 and 38 hold the steps against one measured step, and on a loaded machine a
    # re-plan's trial would still run at the end (the pool puts the constant back).
    auto.MARGIN = float("inf")
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto")
    _register(model, state, register)
    gen = torch.Generator().manual_seed(rank)
    with Join([model]):
        for _ in range(4 if rank == 0 else state.trial_steps + 12):
            _step(model, gen)
    return state.stats()["step"], _planned(state)


@pytest.mark.parametrize("register", ["ddp", "fastddp"])
def test_a_rank_out_of_inputs_under_join_counts_the_steps_as_the_others(register):
    # Counted a step a bucket there, the ranks' trials drifted apart: collectives of other
    # sizes met, and Gloo aborted.
    (step0, plan0), (step1, plan1) = run_ranks(_joined, 2, register)
    assert step0 == step1 and plan0 == plan1 is not None, (step0, step1, plan0, plan1)


def _mixed_joined(rank, world, register):
    # A mode per bucket, the last bucket's ("none") reaching no candidate: int8-ef's stages
    # still pending after it are finished there, on a rank out of inputs too, whose hook runs
    # outside autograd, where no end of the backward pass would finish them (the others then
    # issued stages it never matched, and waited until the group's timeout).
    modes = ["int8-ef", "int8-ef", "none"]
    planned = {"mode": auto.MIXED, "uniform": "int8-ef", "step_ms": {}, "planned_ms": 1e9,
               "made_at_step": 0, "plans": 1,
               "buckets": [{"mode": m, "numel": 0} for m in modes]}  # fmt: skip
    model = DDP(_Chain(), bucket_cap_mb=1)  # three buckets from the second step on
    state = fastddp.CompressState(dtype="auto", allow=["none", "int8-ef"])
    state.load_state_dict({"settings": state.settings(), "plan": planned, "candidates": {}})
    _register(model, state, register)
    gen = torch.Generator().manual_seed(rank)
    with Join([model]):
        for _ in range(2 if rank == 0 else 5):
            model.zero_grad()
            model(torch.randn(8, 256, generator=gen)).square().mean().backward()
    return state.stats()["steps_in"][auto.MIXED]


@pytest.mark.parametrize("register", ["ddp", "fastddp"])
def test_a_rank_out_of_inputs_under_a_mode_per_bucket_finishes_every_stage(register):
    assert run_ranks(_mixed_joined, 2, register) == [5, 5]


def _reloaded_mid_trial(rank, world):
    # Registered with fastddp.register_comm_hook, under a plan of "none" the C++ hook runs the
    # steps between two checks; a state dict of the trial's first step loaded then starts the
    # trial again from its first turn.
    model = DDP(_Net(depth=4), bucket_cap_mb=0.002)
    state = fastddp.CompressState(dtype="auto", allow=["none", "bf16"])
    fastddp.register_comm_hook(model, state)
    gen = torch.Generator().manual_seed(rank)
    _step(model, gen)
    saved = state.state_dict()
    for _ in range(state.trial_steps + 14):
        _step(model, gen)
    assert _planned(state) is not None and state.stats()["native_steps"] > 0
    state.load_state_dict(saved)
    for _ in range(state.trial_steps + 2):
        _step(model, gen)
    return _planned(state)


def test_a_state_dict_loaded_mid_trial_under_the_cpp_hook_trials_again():
    plans = run_ranks(_reloaded_mid_trial, 2)
    assert plans[0] == plans[1] is not None, plans


def _moved_mid_trial(rank, world, register):
    # The state moves to a new model (the old one deleted first) at each of two steps of the
    # trial: under the C++ hook the turns it measured went with the old model.
    plans = []
    for at in (5, 6):
        net, gen = _Net(depth=4), torch.Generator().manual_seed(rank)
        state = fastddp.CompressState(dtype="auto")
        model = DDP(net, bucket_cap_mb=0.002)
        _register(model, state, register)
        for _ in range(at):
            _step(model, gen)
        del model
        gc.collect()
        model = DDP(net, bucket_cap_mb=0.002)
        _register(model, state, register)
        for _ in range(state.trial_steps + 2):
            _step(model, gen)
        plans.append(_planned(state))
        del model
        gc.collect()
    return plans


@pytest.mark.parametrize("register", ["ddp", "fastddp"])
def test_a_state_moved_to_a_new_model_mid_trial_makes_its_plan(register):
    plans = run_ranks(_moved_mid_trial, 2, register)
    assert plans[0] == plans[1] and None not in plans[0], plans
