"""``CompressState(delay=1)``: each step applies the gradient reduced during the previous step.

Checked against the same state without delay, bit for bit and shifted by one step, through
DDP's bucket rebuild; resumed exactly from a state dict; refused where it cannot apply.
"""

import copy
import os
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastddp
from fastddp.hooks.presets import preset
from fastddp.hooks.topology import NODE_ENV

from .._dist import run_ranks
from .test_hook_core import (
    _ddp,
    _grads,
    _needs_bucket_caps,
    _Net,
    _resume_across_layouts,
    _step,
)

pytestmark = pytest.mark.timeout(240)


def _shifted_by_one_step(rank, world, mode, nodes):
    if nodes is not None:
        os.environ[NODE_ENV] = f"node-{nodes[rank]}"
    base = _Net(depth=5)
    models, states = [], []
    for delay in (0, 1):
        model = _ddp(copy.deepcopy(base))
        state = fastddp.CompressState.from_preset(mode, delay=delay)
        model.register_comm_hook(state, fastddp.compress_hook)
        models.append(model)
        states.append(state)
    gen = torch.Generator().manual_seed(rank)
    previous = None
    for step in range(4):  # DDP lays its buckets out anew after the first
        x = torch.randn(8, 24, generator=gen)
        got = []
        for model in models:  # same weights, same batch: only the delay differs
            model.zero_grad()
            model(x).square().mean().backward()
            got.append(_grads(model))
        now, delayed = got
        if previous is None:
            assert torch.equal(delayed, torch.zeros_like(delayed)), "the first step is not zero"
        else:
            assert torch.equal(delayed, previous), (
                f"step {step}: delayed gradient differs from the previous step's by "
                f"{(delayed - previous).abs().max().item():.3e}"
            )
        previous = now
    assert len(states[1].stats()["buckets"]) >= 3
    want = "flat" if nodes is None else "hierarchical"
    assert states[1].stats()["topology_used"] == want
    # What is in waiting is the last step's reduction, saved by parameter.
    saved = states[1].state_dict()["delayed"]
    keys = states[1]._table.param_keys
    in_waiting = torch.cat([saved[keys[p]].reshape(-1) for p in models[1].parameters()])
    assert torch.equal(in_waiting, previous)


# Every codec flat; the two-level path with one 16-bit and one packed codec (the paths differ
# in their stages, not per codec).
CASES = [(m, None) for m in ("bf16", "bf16-acc-ef", "int8-ef", "int4-ef", "int2-ef")]
CASES += [(m, (0, 0, 1, 1)) for m in ("bf16-acc-ef", "int4-ef")]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "mode, nodes", CASES, ids=[f"{m}-{'flat' if n is None else 'two-nodes'}" for m, n in CASES]
)
@_needs_bucket_caps
def test_delay_applies_the_previous_steps_reduction_bit_for_bit(mode, nodes):
    world = 2 if nodes is None else len(nodes)
    run_ranks(_shifted_by_one_step, world, mode, nodes, timeout=200)


@pytest.mark.multiproc
@pytest.mark.parametrize("mode, one_bucket", [("bf16-acc-ef", False), ("int4-ef", True)])
@_needs_bucket_caps
def test_delay_resumes_exactly(mode, one_bucket):
    # The gradient in waiting at the checkpoint is applied by the resumed run's first step.
    run_ranks(_resume_across_layouts, 2, {**preset(mode), "delay": 1}, None, one_bucket)


def _refused(rank, world):
    state = fastddp.CompressState(delay=1)
    with pytest.raises(ValueError, match="delay=1, which only DDP's compress_hook applies"):
        fastddp.all_reduce(torch.ones(4), state=state)
    unused = DDP(_Net(depth=2), find_unused_parameters=True)
    with pytest.raises(ValueError, match="with find_unused_parameters=True use delay=0"):
        fastddp.register_comm_hook(unused, state)
    model = DDP(_Net(depth=2), bucket_cap_mb=0.01)
    model.register_comm_hook(fastddp.CompressState(delay=rank % 2), fastddp.compress_hook)
    with pytest.raises(Exception) as info:
        model(torch.ones(2, 24)).sum().backward()
    text = str(info.value)
    assert "ranks disagree on the compression settings" in text, text
    assert "rank 0: dtype=bfloat16" in text and "delay=0" in text and "delay=1" in text, text

    # Gradients in waiting of another model on rank 1, then on rank 0 alone: every rank raises
    # at the handshake, where rank 1 alone would raise when its bucket takes them up (or, with
    # none loaded, add zeros where rank 0 adds the step before the checkpoint).
    gen = torch.Generator().manual_seed(rank)
    saved = {}
    for width in (24, 20):
        model = _ddp(_Net(width=width))
        state = fastddp.CompressState(delay=1)
        model.register_comm_hook(state, fastddp.compress_hook)
        for _ in range(2):
            _step(model, gen, width=width)
        saved[width] = state.state_dict()
    for loaded, what, rank_1 in [
        (saved[20], "saved buckets", "rank 1: saved buckets for 8 tensor(s), 1680 elements"),
        (None, "delayed gradients (delay=1)", "rank 1: none"),
    ]:
        model = _ddp(_Net())
        state = fastddp.CompressState(delay=1)
        if rank == 0 or loaded is not None:
            state.load_state_dict(saved[24] if rank == 0 else loaded)
        model.register_comm_hook(state, fastddp.compress_hook)
        with pytest.raises(Exception, match=re.escape(f"given {what} for other tensors")) as info:
            _step(model, gen)
        text = str(info.value)
        assert f"rank 0: {what.split(' (')[0]} for 8 tensor(s), 2400 elements" in text, text
        assert rank_1 in text, text
    dist.barrier()


@pytest.mark.multiproc
def test_ranks_that_disagree_on_delay_fail_alike():
    run_ranks(_refused, 2)


@pytest.mark.parametrize("delay", [2, -1, True, 1.0, "1"])
def test_bad_delay(delay):
    with pytest.raises(ValueError, match="delay must be 0 .* or 1"):
        fastddp.CompressState(delay=delay)


def test_saved_delay_must_match():
    saved = fastddp.CompressState(delay=1).state_dict()
    with pytest.raises(ValueError, match="saved delay 1 does not match this state's 0"):
        fastddp.CompressState().load_state_dict(saved)


def test_discard_feedback_leaves_a_loaded_state_dict_as_it_was():
    # The gradients in waiting of a loaded state dict are its own tensors: dropped, not zeroed.
    saved = fastddp.CompressState(delay=1).state_dict()
    saved["delayed"] = {0: torch.ones(4)}
    state = fastddp.CompressState(delay=1)
    state.load_state_dict(saved)
    state.discard_feedback()
    assert torch.equal(saved["delayed"][0], torch.ones(4))
    assert not state._delayed.parked
